"""Make tests/data/llmcompressor-fp8-kv: a tiny random Llama (the tiny model's byte tokenizer and
vocabulary) whose FP8 KV cache scales llm-compressor calibrated, saved in its compressed-tensors
format (config.json's quantization_config.kv_cache_scheme, self_attn.k_scale / v_scale tensors).
The test of jpaged's reading of real checkpoints' scales loads it (tests/test_kv_cache_dtype.py).

Needs llmcompressor (and torch), which jpaged's tests do not install; run it in its own venv:
  python -m venv /tmp/lc && /tmp/lc/bin/pip install llmcompressor
  python -c "from jpaged.models.tiny import tiny_tokenizer; tiny_tokenizer().save_pretrained('/tmp/tok')"
  /tmp/lc/bin/python scripts/make_fp8_kv_checkpoint.py /tmp/tok tests/data/llmcompressor-fp8-kv
"""

import sys
import tempfile
from importlib.util import find_spec

if find_spec("llmcompressor") is None:  # not an extra of jpaged: its pins clash with the tests' torch
    sys.exit("error: scripts/make_fp8_kv_checkpoint.py needs llmcompressor, in a virtualenv of its own: "
             "python -m venv /tmp/lc && /tmp/lc/bin/pip install llmcompressor (then run it with /tmp/lc/bin/python)")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
"""


def main(tokenizer_dir: str, out: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    generator = torch.Generator().manual_seed(1)
    calibration = Dataset.from_dict({"input_ids": [torch.randint(0, 259, (48,), generator=generator).tolist()
                                                   for _ in range(16)]})
    calibration = calibration.map(lambda x: {"attention_mask": [1] * len(x["input_ids"])})
    with tempfile.TemporaryDirectory() as base:  # oneshot wants a model it can load by path
        LlamaForCausalLM(config).save_pretrained(base)
        tokenizer.save_pretrained(base)
        model = oneshot(model=base, processor=tokenizer, dataset=calibration, recipe=RECIPE, max_seq_length=48,
                        num_calibration_samples=16)
        model.save_pretrained(out, save_compressed=True)
        tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
