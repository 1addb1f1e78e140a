"""The built-in `tiny` model and its byte-level tokenizer."""

import numpy as np

import jpaged
from jpaged.models import tiny
from test_models import prompt_logits


def test_tiny_weights_are_deterministic_and_small():
    cfg = tiny.tiny_config()
    first = dict(tiny.tiny_weights(cfg))
    second = dict(tiny.tiny_weights(cfg))
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    num_params = sum(w.size for w in first.values())
    assert 1_000_000 < num_params < 10_000_000


def test_tiny_engine_config_is_tiny_config():
    """The engine loads `tiny` with tiny_engine_config() (transformers' base config class: LlamaConfig
    would import transformers' model registry): the same values as LlamaConfig's for every field,
    whatever transformers' version adds. use_cache is a generation option, which the base class
    leaves to the generation config."""
    expected, got = tiny.tiny_config().to_dict(), tiny.tiny_engine_config().to_dict()
    differ = {k: (v, got.get(k)) for k, v in expected.items()
              if k not in ("transformers_version", "use_cache") and got.get(k) != v}
    assert differ == {}
    assert got["model_type"] == "llama" and got["architectures"] == ["LlamaForCausalLM"]


def test_tiny_tokenizer_bytes_specials_and_chat_template():
    tok = tiny.tiny_tokenizer()
    text = "héllo, wörld — 你好 🚀"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256 and tok.eos_token_id == 257
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_tiny_greedy_is_decisive_and_generates_text():
    llm = jpaged.LLM("tiny", enforce_eager=True, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    rng = np.random.default_rng()
    for _ in range(3):
        ids = [256] + rng.integers(0, 256, size=rng.integers(5, 60)).tolist()
        top2 = np.sort(prompt_logits(llm, ids), axis=-1)[:, -2:]
        # The winner leads the runner-up by a wide margin at (almost) every position.
        assert np.median(top2[:, 1] - top2[:, 0]) > 0.5
    out = llm.generate("Hello, my name is", jpaged.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == tiny.tiny_tokenizer().encode("Hello, my name is")
    again = llm.generate("Hello, my name is", jpaged.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
