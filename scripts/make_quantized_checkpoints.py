"""Make quantized checkpoints with the real tool, llm-compressor, in its compressed-tensors format.

  tiny: a tiny random Llama (the tiny model's byte tokenizer and vocabulary) per scheme, into
        tests/data/llmcompressor-<scheme>/ (committed: the tests read them, and transformers with
        compressed-tensors is their reference).
  smollm2: SmolLM2-135M-Instruct (scripts/make_smollm2.py) per scheme, into
        ~/.cache/jpaged/smollm2-135m-instruct-<scheme>/ (scripts/quantization_accuracy.py measures them).

Needs llmcompressor (and torch), which jpaged's tests do not install; run it in its own venv:
  python -m venv /tmp/lc && /tmp/lc/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  /tmp/lc/bin/pip install llmcompressor
  python -c "from jpaged.models.tiny import tiny_tokenizer; tiny_tokenizer().save_pretrained('/tmp/tok')"
  /tmp/lc/bin/python scripts/make_quantized_checkpoints.py tiny /tmp/tok tests/data
  /tmp/lc/bin/python scripts/make_quantized_checkpoints.py smollm2 ~/.cache/jpaged/smollm2-135m-instruct ~/.cache/jpaged
"""

import os
import sys
import tempfile
from importlib.util import find_spec

if find_spec("llmcompressor") is None:  # not an extra of jpaged: its pins clash with the tests' torch
    sys.exit("error: scripts/make_quantized_checkpoints.py needs llmcompressor, in a virtualenv of its own: "
             "python -m venv /tmp/lc && /tmp/lc/bin/pip install llmcompressor (then run it with /tmp/lc/bin/python)")

import torch  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402


def int_weights(bits: int, group_size: int | None, symmetric: bool = True) -> QuantizationArgs:
    strategy = "group" if group_size else "channel"
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)


def schemes(group_size: int) -> dict:
    """Scheme name -> QuantizationModifier arguments: llm-compressor's presets, the 4-bit ones with
    `group_size` columns per scale (SmolLM2's 576 columns are not a multiple of the presets' 128)."""
    def groups(**kwargs):
        return {"config_groups": {"group_0": QuantizationScheme(targets=["Linear"], **kwargs)}}
    return {
        "fp8-dynamic": {"scheme": "FP8_DYNAMIC"},
        "fp8-tensor": groups(
            weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor")),
        # llm-compressor's W8A16 preset is 128-column groups; per channel is what vLLM users ship.
        "w8a16": groups(weights=int_weights(8, None)),
        "w8a8": {"scheme": "W8A8"},
        "w4a16": groups(weights=int_weights(4, group_size)),
        "w4a16-asym": groups(weights=int_weights(4, group_size, symmetric=False)),
        "w4a16-gptq": {"gptq": True, **groups(weights=int_weights(4, group_size))},
    }


def calibration_texts(n: int = 128, chars: int = 2000) -> list[str]:
    """English prose that ships with Python (pydoc's help topics), cut in `n` pieces: GPTQ's
    calibration data, offline and unrelated to what scripts/quantization_accuracy.py measures."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return [text[i * chars:(i + 1) * chars] for i in range(n)]


def quantize(base: str, out: str, modifier_args: dict):
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(base)
    if modifier_args.pop("gptq", False):  # GPTQ: calibrated on text, error-compensating rounding
        from datasets import Dataset
        from llmcompressor.modifiers.gptq import GPTQModifier
        data = Dataset.from_dict({"text": calibration_texts()})
        data = data.map(lambda x: tokenizer(x["text"], max_length=512, truncation=True), remove_columns=["text"])
        oneshot(model=model, dataset=data, recipe=GPTQModifier(targets="Linear", ignore=["lm_head"], **modifier_args),
                max_seq_length=512, num_calibration_samples=len(data))
    else:  # weight-only and dynamic schemes need no data: round-to-nearest on min/max
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", ignore=["lm_head"], **modifier_args))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def main(kind: str, source: str, out_dir: str):
    if kind == "tiny":
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=False, dtype="float32")
        with tempfile.TemporaryDirectory() as base:
            model = LlamaForCausalLM(config)
            with torch.no_grad():  # sharper logits: greedy choices far apart, stable across float orders
                model.lm_head.weight.mul_(8)
            model.save_pretrained(base)
            AutoTokenizer.from_pretrained(source).save_pretrained(base)
            # 32-column groups: o_proj's group spans two 16-wide heads.
            for name, args in schemes(32).items():
                if name == "w4a16-gptq":
                    continue  # the packing is W4A16's; calibration adds nothing a random model shows
                if not os.path.exists(os.path.join(out_dir, f"llmcompressor-{name}", "config.json")):
                    quantize(base, os.path.join(out_dir, f"llmcompressor-{name}"), args)
    elif kind == "smollm2":
        for name, args in schemes(64).items():
            if not os.path.exists(os.path.join(out_dir, f"smollm2-135m-instruct-{name}", "config.json")):
                quantize(source, os.path.join(out_dir, f"smollm2-135m-instruct-{name}"), args)
    else:
        raise SystemExit(f"unknown kind {kind!r}: tiny or smollm2")


if __name__ == "__main__":
    main(*sys.argv[1:4])
