"""Quantized weights against independent references.

- llm-compressor's own checkpoints (tests/data/llmcompressor-*, made by
  scripts/make_quantized_checkpoints.py): greedy tokens equal HF transformers reading the same
  checkpoint through compressed-tensors (FP8 dynamic / per tensor, int8 W8A16 / W8A8, int4 W4A16
  in 32-column groups); the asymmetric W4A16 one, which this transformers cannot load, against a
  float model built from a numpy unpacking written here.
- fp8 / int8 on the fly: against transformers running weights quantized in float64 numpy.
- AWQ and GPTQ: packed here by numpy (AutoAWQ's and GPTQ's layouts), unpacked by jpaged, and
  the model against transformers running the dequantized weights.
- tensor parallelism (2 CPU devices), the server's --quantization, and bad checkpoints.
"""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_reference
import jpaged
from jpaged.quantization.formats import AWQ, GPTQ, quantization_of

SEED = 20261124
VOCAB = hf_reference.VOCAB
DATA = os.path.join(os.path.dirname(__file__), "data")
LIMITS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True)
STEPS = 12
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompts():
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    return [rng.integers(3, VOCAB, n).tolist() for n in (5, 17, 33)]


def hf_greedy(model, steps=STEPS):
    return hf_reference.hf_greedy(model, prompts(), steps)


def jpaged_greedy(model, steps=STEPS, **kwargs):
    llm = jpaged.LLM(model, **{**LIMITS, **kwargs})
    sp = jpaged.SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)], llm


def linear_dtypes(llm) -> set[str]:
    from flax import nnx

    from jpaged.models.layers import Linear

    runner = llm.llm_engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    return {str(node.kernel.dtype) for _, node in nnx.iter_graph(model) if isinstance(node, Linear)
            and "vocab" not in node.kernel.logical_axes}


@pytest.mark.parametrize("scheme,stored", [("fp8-dynamic", "float8_e4m3fn"), ("fp8-tensor", "float8_e4m3fn"),
                                           ("w8a16", "int8"), ("w8a8", "int8"), ("w4a16", "uint8")])
def test_llmcompressor_checkpoints_equal_transformers(scheme, stored):
    import torch
    import transformers

    path = os.path.join(DATA, f"llmcompressor-{scheme}")
    expected = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    got, llm = jpaged_greedy(path)
    assert got == expected
    assert linear_dtypes(llm) == {stored}  # kept in 8 (4: two per byte) bits, not dequantized at load


def unpack_dense(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32, undone value by value: value i of a row starts at bit
    i * bits of the row's bit string (words little-endian), stored + 2^(bits-1)."""
    raw = words.astype("<i4").tobytes()
    rows = np.frombuffer(raw, np.uint8).reshape(words.shape[0], -1)
    bitrows = np.unpackbits(rows, axis=1, bitorder="little")
    values = np.zeros((words.shape[0], n), np.int64)
    for i in range(n):
        for b in range(bits):
            values[:, i] |= bitrows[:, i * bits + b].astype(np.int64) << b
    return values - (1 << (bits - 1))


def float_model_from(path, weights: dict):
    """transformers' Llama for `path`'s config without its quantization_config, holding `weights`."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in weights.items()}, strict=False)
    return model


def test_llmcompressor_asymmetric_w4a16_equals_numpy_unpacking():
    path = os.path.join(DATA, "llmcompressor-w4a16-asym")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    weights = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight":
            weights[name] = t
        elif leaf == "weight_packed":
            out, n_in = tensors[f"{module}.weight_shape"]
            q = unpack_dense(t, 4, n_in)
            scale = tensors[f"{module}.weight_scale"]
            zero = unpack_dense(tensors[f"{module}.weight_zero_point"].T, 4, out).T
            group = n_in // scale.shape[1]
            weights[f"{module}.weight"] = (q - np.repeat(zero, group, 1)) * np.repeat(scale, group, 1)
    expected = hf_greedy(float_model_from(path, weights))
    got, llm = jpaged_greedy(path)
    assert got == expected
    assert linear_dtypes(llm) == {"uint8"}


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    """A tiny random float32 Llama written by transformers."""
    return hf_reference.save_random_llama(tmp_path_factory.mktemp("float"), SEED)


def fake_quantized(w: np.ndarray, method: str) -> np.ndarray:
    """[out, in] weight quantized per output channel in float64 and back."""
    w = w.astype(np.float64)
    qmax = 448.0 if method == "fp8" else 127.0
    scale = np.abs(w).max(axis=1, keepdims=True) / qmax
    scale32 = scale.astype(np.float32).astype(np.float64)
    if method == "fp8":
        q = (w / scale32).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        q = np.clip(np.rint(w / scale32), -127, 127)
    return q * scale32


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_on_the_fly_quantization_equals_transformers_on_quantized_weights(float_checkpoint, method):
    tensors = load_file(os.path.join(float_checkpoint, "model.safetensors"))
    weights = {k: fake_quantized(v, method) if k.split(".")[-2] in LINEARS else v for k, v in tensors.items()}
    expected = hf_greedy(float_model_from(float_checkpoint, weights))
    got, llm = jpaged_greedy(float_checkpoint, quantization=method)
    assert got == expected
    assert linear_dtypes(llm) == {"float8_e4m3fn" if method == "fp8" else "int8"}
    float_bytes = jpaged_greedy(float_checkpoint, steps=1)[1].llm_engine.stats()["model_memory_bytes"]
    n_weights = sum(v.size for k, v in tensors.items() if k.split(".")[-2] in LINEARS)
    # Each Linear's 4 bytes per weight became 1 (plus one scale per output channel).
    saved = float_bytes - llm.llm_engine.stats()["model_memory_bytes"]
    assert 2.9 * n_weights < saved < 3 * n_weights


def quantize_groups(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit, groups of `group` columns: (q [out, in] in 0..15, zero [out, G], scale [out, G])."""
    out, n_in = w.shape
    g = w.reshape(out, n_in // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scale = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    zero = np.clip(np.rint(-lo / scale), 0, 15).astype(np.int64)
    q = np.clip(np.rint(g / scale[..., None]) + zero[..., None], 0, 15).astype(np.int64).reshape(out, n_in)
    return q, zero, scale


def pack_awq(q_in_out: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packing: [rows, cols] -> int32 [rows, cols / 8], word nibble i holding column
    8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    rows, cols = q_in_out.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for j in range(cols // 8):
        for i, c in enumerate(order):
            words[:, j] |= q_in_out[:, 8 * j + c].astype(np.uint32) << (4 * i)
    return words.view(np.int32)


def pack_gptq_rows(q: np.ndarray) -> np.ndarray:
    """GPTQ's packing along the first axis: word [r, c] holds rows 8r .. 8r+7 of column c, lowest nibble first."""
    words = np.zeros((q.shape[0] // 8, q.shape[1]), np.uint32)
    for k in range(8):
        words |= q[k::8].astype(np.uint32) << (4 * k)
    return words.view(np.int32)


def write_packed_checkpoint(float_checkpoint, path, method: str, group: int = 32, sym: bool = False):
    """`float_checkpoint` quantized (4 bits, groups) and packed as AWQ or GPTQ (v1: zeros stored - 1).
    Returns the dequantized float weights ({name: [out, in]}) the packed ones stand for."""
    shutil.copytree(float_checkpoint, path)
    tensors = load_file(os.path.join(float_checkpoint, "model.safetensors"))
    packed, dequantized = {}, {}
    for name, w in tensors.items():
        module, leaf = name.rsplit(".", 1)
        if module.rsplit(".", 1)[-1] not in LINEARS:
            packed[name] = dequantized[name] = w
            continue
        q, zero, scale = quantize_groups(w, group)
        if sym:
            zero = np.full_like(zero, 8)
            q = np.clip(np.rint(w.reshape(zero.shape + (group,)) / scale[..., None]) + 8, 0, 15).reshape(w.shape)
            q = q.astype(np.int64)
        dequantized[name] = ((q.reshape(zero.shape + (group,)) - zero[..., None]) * scale[..., None]).reshape(w.shape)
        if method == "awq":
            packed.update({f"{module}.qweight": pack_awq(q.T), f"{module}.qzeros": pack_awq(zero.T),
                           f"{module}.scales": scale.T.astype(np.float16)})
        else:
            packed.update({f"{module}.qweight": pack_gptq_rows(q.T), f"{module}.qzeros": pack_nibbles_last(zero.T - 1),
                           f"{module}.scales": scale.T.astype(np.float16),
                           f"{module}.g_idx": (np.arange(w.shape[1]) // group).astype(np.int32)})
    os.remove(os.path.join(path, "model.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in packed.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
         "checkpoint_format": "gptq"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized


def pack_nibbles_last(z: np.ndarray) -> np.ndarray:
    """GPTQ's qzeros: along the last axis, 8 per word, lowest nibble first (values mod 16)."""
    words = np.zeros(z.shape[:-1] + (z.shape[-1] // 8,), np.uint32)
    for k in range(8):
        words |= (z[..., k::8] & 0xF).astype(np.uint32) << (4 * k)
    return words.view(np.int32)


@pytest.mark.parametrize("method,sym", [("awq", False), ("gptq", False), ("gptq", True)])
def test_awq_and_gptq_packing_and_model(float_checkpoint, tmp_path, method, sym):
    path = str(tmp_path / method)
    dequantized = write_packed_checkpoint(float_checkpoint, path, method, sym=sym)
    # The reader's unpacking of one module, against the values packed above.
    tensors = load_file(os.path.join(path, "model.safetensors"))
    module = "model.layers.1.self_attn.o_proj"
    quant = quantization_of(type("C", (), {"quantization_config": json.load(open(f"{path}/config.json"))[
        "quantization_config"]})(), None)
    reader = AWQ if method == "awq" else GPTQ
    found = {leaf: tensors[f"{module}.{leaf}"] for leaf in reader.leaves if f"{module}.{leaf}" in tensors}
    qt = reader.read(module, found, quant.scheme_for(module), quant.config)
    zero = 0 if qt.zero is None else np.repeat(qt.zero, 32, 1)
    np.testing.assert_allclose((qt.values - zero) * np.repeat(qt.scale, 32, 1), dequantized[f"{module}.weight"],
                               rtol=0, atol=1e-6)
    expected = hf_greedy(float_model_from(path, dequantized))
    got, llm = jpaged_greedy(path)
    assert got == expected
    assert linear_dtypes(llm) == {"uint8"}


def test_tensor_parallel_equals_one_device(float_checkpoint):
    """Weights, scales and zero points split by the same rules on a 2-device mesh."""
    for kwargs in ({"model": os.path.join(DATA, "llmcompressor-w4a16-asym")},
                   {"model": float_checkpoint, "quantization": "int8"}):
        one = jpaged_greedy(**kwargs)[0]
        assert jpaged_greedy(**kwargs, tensor_parallel_size=2)[0] == one, kwargs


def test_bad_quantization_is_a_clear_error(float_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        jpaged.LLM("tiny", quantization="int3")
    with pytest.raises(ValueError, match="already quantized"):
        jpaged.LLM(os.path.join(DATA, "llmcompressor-w8a16"), quantization="fp8", **LIMITS)

    def variant(name, edit_config=None, edit_tensors=None):
        path = tmp_path / name
        shutil.copytree(os.path.join(DATA, "llmcompressor-w4a16"), path)
        if edit_config:
            config = json.load(open(path / "config.json"))
            edit_config(config["quantization_config"])
            json.dump(config, open(path / "config.json", "w"))
        if edit_tensors:
            tensors = load_file(str(path / "model.safetensors"))
            edit_tensors(tensors)
            save_file(tensors, str(path / "model.safetensors"))
        return str(path)

    cases = {
        "bitsandbytes": (lambda c: c.update(quant_method="bitsandbytes"), None),
        "format": (lambda c: c["config_groups"]["group_0"].update(format="marlin-24"), None),
        "num_bits": (lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=3), None),
        "incomplete": (None, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale")),
        "groups": (None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale":
                                            t["model.layers.0.mlp.up_proj.weight_scale"][:, :1]})),
    }
    for name, (edit_config, edit_tensors) in cases.items():
        with pytest.raises(ValueError, match=name if name != "incomplete" else "incomplete") as e:
            jpaged.LLM(variant(name, edit_config, edit_tensors), **LIMITS)
        print(name, e.value)


def test_server_quantization_flag(float_checkpoint):
    import openai

    from test_server import Server

    sp = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = jpaged.LLM(float_checkpoint, quantization="fp8", **LIMITS)
    expected = [o.outputs[0].text for o in offline.generate(prompts(), sp, use_tqdm=False)]
    server = Server("--model", float_checkpoint, "--quantization", "fp8", "--dtype", "float32", "--max-model-len",
                    "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--enforce-eager")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        for prompt, text in zip(prompts(), expected):
            response = client.completions.create(model=float_checkpoint, prompt=prompt, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert response.choices[0].text == text
    finally:
        assert server.stop() == 0
