"""runner="pooling" offline: embeddings equal sentence-transformers' `encode` (cosine >= 0.9999)
for BERT (mean), XLM-RoBERTa (CLS), a Qwen3 decoder (last token) and ModernBERT (mean; its local
and global layers to 3e-6); cross-encoder scores within
1e-4 of CrossEncoder.predict; the packing, Matryoshka dimensions, truncation and bad inputs."""

import os
import sys

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pooling_checkpoints import TEXTS, make_causal_reranker, make_cross_encoder, make_embedder  # noqa: E402

EMBEDDERS = [("bert", "mean"), ("xlm-roberta", "cls"), ("qwen3", "lasttoken"), ("modernbert", "mean")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pooling"))


@pytest.fixture(scope="module")
def embedders(root):
    import jpaged

    made = {}
    for kind, pooling in EMBEDDERS:
        path = make_embedder(root, kind, pooling)
        made[kind] = (path, jpaged.LLM(path, runner="pooling"))
    return made


@pytest.mark.parametrize("kind", [k for k, _ in EMBEDDERS])
def test_embed_matches_sentence_transformers(embedders, kind):
    from sentence_transformers import SentenceTransformer

    path, llm = embedders[kind]
    rng = np.random.default_rng()
    texts = [TEXTS[i] for i in rng.permutation(len(TEXTS))] + [" ".join(rng.choice(TEXTS, 3))]
    outs = llm.embed(texts)
    ours = np.array([o.outputs.embedding for o in outs])
    ref = SentenceTransformer(path, device="cpu").encode(texts)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)  # the checkpoint's Normalize
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok(texts[0])["input_ids"]
    # Token ids in, the same embedding out; one input alone, the same as packed among others.
    before = llm.stats()
    again = llm.embed([tok(t)["input_ids"] for t in texts[:2]])
    np.testing.assert_allclose([o.outputs.embedding for o in again], ours[:2], atol=1e-5)
    after = llm.stats()  # a pooling LLM's stats: what it has pooled
    assert after["num_requests"] - before["num_requests"] == 2
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in again)


def test_modernbert_local_and_global_layers(root):
    """ModernBERT's layers differ: global ones attend to all keys with one rotary theta, local ones
    to keys within 4 positions with another. Unnormalized mean embeddings within 3e-6 of
    sentence-transformers' (measured: 4e-7; a wrong window gives 1e-3, the global theta on the
    local layers 1.5e-5), on texts up to 68 tokens."""
    from sentence_transformers import SentenceTransformer

    import jpaged

    path = make_embedder(root, "modernbert", "mean", normalize=False)
    llm = jpaged.LLM(path, runner="pooling")
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    ref = SentenceTransformer(path, device="cpu").encode(TEXTS)
    print("max |jpaged - sentence-transformers|:", np.abs(ours - ref).max(), "longest input:",
          max(len(llm.get_tokenizer()(t)["input_ids"]) for t in TEXTS))
    np.testing.assert_allclose(ours, ref, atol=3e-6)


def test_score_of_an_embedder_is_cosine(embedders):
    _, llm = embedders["bert"]
    scores = llm.score("hello world", ["hello world", "the cat sat on the mat"])
    e = np.array([o.outputs.embedding for o in llm.embed(["hello world", "the cat sat on the mat"])])
    np.testing.assert_allclose([s.outputs.score for s in scores], [1.0, e[0] @ e[1]], atol=1e-5)


@pytest.mark.parametrize("kind, extra", [("bert", {}), ("xlm-roberta", {}), ("modernbert", {"classifier_pooling": "cls"}),
                                         ("modernbert", {"classifier_pooling": "mean"})],
                         ids=["bert", "xlm-roberta", "modernbert-cls", "modernbert-mean"])
def test_rerank_matches_cross_encoder(root, kind, extra):
    import jpaged
    from sentence_transformers import CrossEncoder

    path = make_cross_encoder(root, kind, **extra)
    llm = jpaged.LLM(path, runner="pooling")
    query, docs = "capital of france", TEXTS
    scores = [o.outputs.score for o in llm.score(query, docs)]
    ref = CrossEncoder(path, device="cpu").predict([(query, d) for d in docs])
    np.testing.assert_allclose(scores, ref, atol=1e-4)
    probs = llm.classify(docs[:2])
    assert len(probs[0].outputs.probs) == 1 and 0 < probs[0].outputs.probs[0] < 1
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("hello")


QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_reranker_from_causal_lm(root, tied):
    """vLLM's hf_overrides for Qwen3-Reranker: a causal LM scores a pair by its last token's
    softmax over [no, yes], yes's share; against transformers' logits, within 1e-4. With
    classifier_from_token alone, one label per token (the LM head's rows)."""
    import torch
    import transformers

    import jpaged

    path = make_causal_reranker(root, tied)
    query, docs = "capital of france", TEXTS
    llm = jpaged.LLM(path, runner="pooling", hf_overrides=QWEN3_RERANKER)
    scores = [o.outputs.score for o in llm.score(query, docs)]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    ref, rows = [], []
    with torch.no_grad():
        for d in docs:
            logits = model(torch.tensor([tok(query, d)["input_ids"]])).logits[0, -1].double()
            ref.append(torch.softmax(logits[[no, yes]], -1)[1].item())
            rows.append(logits[[no, yes]].numpy())
    print("scores:", np.round(scores, 4))
    assert np.ptp(ref) > 1e-3  # the check can fail: the scores differ from document to document (by 100x its tolerance)
    np.testing.assert_allclose(scores, ref, atol=1e-4)
    # "auto" takes the override's architecture as a pooling model, and two labels without the flag.
    two = jpaged.LLM(path, hf_overrides={k: v for k, v in QWEN3_RERANKER.items() if k != "is_original_qwen3_reranker"})
    probs = [o.outputs.probs for o in two.classify([tok.decode(tok(query, d)["input_ids"], skip_special_tokens=True)
                                                     for d in docs[:1]])]
    assert len(probs[0]) == 2
    logits = np.asarray(two.llm_engine.run([two.llm_engine.tokenize(query, docs[0])], "LAST", head=True))[0]
    np.testing.assert_allclose(logits, rows[0], atol=1e-4)


@pytest.mark.parametrize("overrides, match", [
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "maybe yes"]}, "not one"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": "yes"}, "list of token strings"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["yes"],
      "is_original_qwen3_reranker": True}, "two tokens"),
    ("{not json", "hf_overrides is not valid JSON"),
])
def test_qwen3_reranker_bad_overrides(root, overrides, match):
    import jpaged

    with pytest.raises(ValueError, match=match):
        jpaged.LLM(make_causal_reranker(root, True), runner="pooling", hf_overrides=overrides)


def test_pooling_types_and_reward(embedders):
    """ALL pooling (per token) agrees with CLS / LAST / MEAN of the same hidden states."""
    _, llm = embedders["bert"]
    engine = llm.llm_engine
    inputs = [engine.tokenize(t) for t in TEXTS[:3]]
    every = engine.run(inputs, "ALL")
    for kind, pick in (("CLS", lambda h: h[0]), ("LAST", lambda h: h[-1]), ("MEAN", lambda h: h.mean(0))):
        np.testing.assert_allclose(engine.run(inputs, kind), [pick(h) for h in every], atol=1e-5)
    rewards = llm.reward(TEXTS[:2])
    assert rewards[0].outputs.data.shape == (len(inputs[0].token_ids), engine.hidden_size)


def test_matryoshka_dimensions(root):
    import jpaged

    path = make_embedder(root, "bert", "cls", normalize=False, matryoshka_dimensions=[8, 16, 32])
    llm = jpaged.LLM(path, runner="pooling")
    full = np.array(llm.embed(TEXTS[:2], normalize=False)[0].outputs.embedding)
    short = np.array(llm.embed(TEXTS[:2], dimensions=16, normalize=True)[0].outputs.embedding)
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("hello", dimensions=12)


def test_bad_inputs_and_truncation(embedders):
    _, llm = embedders["bert"]
    engine = llm.llm_engine
    long_ids = engine.tokenize(" ".join(["hello"] * 200)).token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([long_ids])
    kept = llm.embed([long_ids], truncate_prompt_tokens=20)[0]
    assert kept.prompt_token_ids == long_ids[-20:]
    np.testing.assert_allclose(kept.outputs.embedding, llm.embed([long_ids[-20:]])[0].outputs.embedding, atol=1e-6)
    for bad, field in (([], "prompts"), ([[]], "prompts"), ([[1, 10 ** 6]], "token ids"), ([[1, -1]], "token ids")):
        with pytest.raises(ValueError, match=field):
            llm.embed(bad)
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("hello", dimensions=8)
    with pytest.raises(ValueError, match="classification model"):
        llm.classify("hello")


def test_pooling_runs_through_the_scheduler_in_budgeted_steps(embedders):
    """A small step budget: the inputs run FCFS over several scheduler steps (each whole, each
    step within max_num_batched_tokens = max_model_len = 128 and 8 seats), with the same embeddings as one
    engine that takes them all in one step."""
    import jpaged

    path, llm = embedders["bert"]
    rng = np.random.default_rng()
    texts = [TEXTS[i] for i in rng.integers(0, len(TEXTS), 24)]
    small = jpaged.LLM(path, runner="pooling", max_model_len=128, max_num_batched_tokens=128, max_num_seqs=8)
    engine = small.llm_engine
    assert engine.scheduler.max_num_batched_tokens == 128
    lengths = [len(engine.tokenize(t).token_ids) for t in texts]
    before = engine.stats()["num_steps"]
    ours = np.array([o.outputs.embedding for o in small.embed(texts)])
    steps = engine.stats()["num_steps"] - before
    assert steps >= max(-(-sum(lengths) // 128), -(-len(texts) // 8)) and steps > 1, (steps, lengths)
    np.testing.assert_allclose(ours, [o.outputs.embedding for o in llm.embed(texts)], atol=1e-5)
    assert not engine.has_unfinished_requests()


def test_server_loop_packs_concurrent_requests_and_drops_cancelled_ones(embedders):
    """serving/pooling.py's AsyncPoolingEngine: calls that arrive together run in one step;
    a call whose client left is aborted in the scheduler, and the others still finish."""
    import asyncio

    from serving.pooling import AsyncPoolingEngine

    _, llm = embedders["bert"]
    engine = llm.llm_engine
    inputs = [engine.tokenize(t) for t in TEXTS]
    alone = engine.run(inputs, "MEAN")
    server = AsyncPoolingEngine(engine)

    async def main():
        with server._cond:  # the engine's thread waits: every call below is queued before its next step
            tasks = [asyncio.ensure_future(server.run([inp], "MEAN")) for inp in inputs]
            await asyncio.sleep(0)  # each call is queued
            tasks[2].cancel()
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        steps = engine.num_steps
        got = asyncio.run(main())
        assert engine.num_steps - steps == 1
        assert isinstance(got[2], asyncio.CancelledError)
        for k, out in enumerate(got):
            if k != 2:
                np.testing.assert_allclose(out[0], alone[k], atol=1e-5)
        assert not engine.has_unfinished_requests() and not server._owner
    finally:
        server.shutdown()


def test_packing_never_pads_to_the_longest():
    from jpaged.pooling.packed import pack

    lengths = [300, 5, 7, 120, 16, 16, 3, 500]
    batches = pack(lengths, max_model_len=512, max_tokens=1024)
    placed = sorted(i for _, _, rows in batches for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    for row_len, num_rows, rows in batches:
        assert len(rows) <= num_rows and num_rows * row_len <= max(1024, row_len)
        assert all(sum(lengths[i] for i in row) <= row_len for row in rows)
    # The short inputs share rows instead of each taking a row of the longest's length.
    assert sum(num_rows * row_len for row_len, num_rows, _ in batches) < len(lengths) * 512


def test_generation_llm_refuses_pooling_methods(shared_llm):
    import jpaged

    with pytest.raises(ValueError, match="runner='pooling'"):
        shared_llm("tiny", enforce_eager=True).embed("hello")
    with pytest.raises(ValueError, match="generation model"):
        jpaged.LLM("tiny", runner="pooling")


@pytest.mark.slow
def test_smollm2_last_token_embedding_matches_transformers(smollm2_checkpoint):
    """A causal LM converted to an embedder: the last token's final hidden state, as transformers'."""
    import torch
    from transformers import AutoModel

    import jpaged

    llm = jpaged.LLM(smollm2_checkpoint, runner="pooling", convert="embed", max_model_len=256)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, " * 3]
    ours = np.array([o.outputs.embedding for o in llm.embed(texts, normalize=False)])
    model = AutoModel.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    with torch.no_grad():
        ref = np.array([model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1].numpy() for t in texts])
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_decoder_sequence_classifier_matches_transformers(root):
    """Qwen2ForSequenceClassification: the `score` head over the last token, as transformers."""
    import torch
    import transformers

    import jpaged
    from pooling_checkpoints import _tokenizer

    torch.manual_seed(2)
    path = os.path.join(root, "qwen2-classifier")
    tok = _tokenizer(path, roberta=False)
    cfg = transformers.Qwen2Config(vocab_size=len(tok.get_vocab()), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   max_position_embeddings=256, num_labels=3, pad_token_id=0)
    model = transformers.Qwen2ForSequenceClassification(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    llm = jpaged.LLM(path)  # runner "auto": a sequence classifier is a pooling model
    outs = llm.classify(TEXTS)
    probs = np.array([o.outputs.probs for o in outs])
    with torch.no_grad():  # the same token ids (AutoTokenizer reads this directory its own way)
        ref = np.array([torch.softmax(model(torch.tensor([o.prompt_token_ids])).logits[0], -1).numpy()
                        for o in outs])
    np.testing.assert_allclose(probs, ref, atol=1e-5)
