"""Malformed checkpoints are refused at start-up, with one line naming the file, field or tensor.

A tiny random Llama (transformers) and the llm-compressor checkpoints of tests/data, copied and
corrupted here: config.json's quantization_config of the wrong type, safetensors files truncated
or with a bad header or overlapping or inconsistent offsets, FIFOs and links to /dev/zero in place
of files, NaN / infinite / zero / negative / huge weight and KV cache scales, NaN weights.
Offline each is a ValueError; `jpaged generate` and `jpaged serve` print one line and exit 2.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import hf_reference
import jpaged
from jpaged.file_safety import safetensors_header
from jpaged.models.loader import ST_DTYPES, _read_tensors
from jpaged.quantization.formats import quantization_of
from jpaged.quantization.scheme import check_scales

SEED = 20261125
DATA = os.path.join(os.path.dirname(__file__), "data")
LIMITS = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, enforce_eager=True)
ST_NAMES = {np.dtype(v): k for k, v in ST_DTYPES.items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_reference.save_random_llama(tmp_path_factory.mktemp("base"), SEED)


def read_tensors(path) -> dict:
    """Every tensor of a .safetensors file (fp8 ones too, which safetensors.numpy cannot read)."""
    return dict(_read_tensors(str(path), safetensors_header(str(path), str(path))))


def write_tensors(path, tensors: dict, edit_header=None):
    """A .safetensors file written byte by byte (fp8 included); `edit_header` may corrupt the header."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": ST_NAMES[data.dtype], "shape": list(data.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        chunks.append(data.tobytes())
        offset += data.nbytes
    if edit_header:
        edit_header(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(chunks))


def copy(src, tmp_path, name) -> str:
    path = tmp_path / name
    shutil.copytree(src, path)
    return str(path)


def edit_config(path, edit):
    file = os.path.join(path, "config.json")
    config = json.load(open(file))
    edit(config)
    json.dump(config, open(file, "w"))


def edit_tensors(path, edit, edit_header=None):
    file = os.path.join(path, "model.safetensors")
    tensors = read_tensors(file)
    edit(tensors)
    write_tensors(file, tensors, edit_header)


def replace_file(path, name, make):
    file = os.path.join(path, name)
    os.remove(file)
    make(file)


def truncate(path):
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[:len(data) // 2])


def bad_header(path):
    file = os.path.join(path, "model.safetensors")
    data = bytearray(open(file, "rb").read())
    data[8:28] = b"x" * 20
    open(file, "wb").write(bytes(data))


def overlap(header):
    first, second = sorted(header)[:2]
    size = header[first]["data_offsets"][1] - header[first]["data_offsets"][0]
    header[second]["data_offsets"] = [header[first]["data_offsets"][0] + 4, header[first]["data_offsets"][0] + 4 + size]
    header[second]["shape"], header[second]["dtype"] = header[first]["shape"], header[first]["dtype"]


def inconsistent(header):
    name = sorted(header)[0]
    header[name]["shape"] = [header[name]["shape"][0] * 2] + header[name]["shape"][1:]


def huge_header_length(path):
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))


def deep_json(file):
    open(file, "w").write("[" * 100_000 + "]" * 100_000)


# name: (how the checkpoint is broken, what the error must say)
MALFORMED = {
    "quantization_config string": (lambda p: edit_config(p, lambda c: c.update(quantization_config="fp8")),
                                   r"config\.json: quantization_config must be a JSON object, got str"),
    "quantization_config list": (lambda p: edit_config(p, lambda c: c.update(quantization_config=[1, 2])),
                                 r"config\.json: quantization_config must be a JSON object, got list"),
    "truncated": (truncate, r"model\.safetensors: tensor .* past the file's \d+ data bytes \(truncated\)"),
    "bad header": (bad_header, r"model\.safetensors \(header\): not valid JSON"),
    "overlapping offsets": (lambda p: edit_tensors(p, lambda t: None, overlap), r"model\.safetensors: .* overlap"),
    "inconsistent offsets": (lambda p: edit_tensors(p, lambda t: None, inconsistent),
                             r"model\.safetensors: tensor .* spans \d+ bytes; dtype F32 and shape"),
    "header length": (huge_header_length, r"model\.safetensors: header length \d+ does not fit the file"),
    "fifo weights": (lambda p: replace_file(p, "model.safetensors", os.mkfifo), r"model\.safetensors: not a regular"),
    "fifo config": (lambda p: replace_file(p, "config.json", os.mkfifo), r"config\.json: not a regular file"),
    "tokenizer is /dev/zero": (lambda p: replace_file(p, "tokenizer.json", lambda f: os.symlink("/dev/zero", f)),
                               r"tokenizer\.json: not a regular file"),
    "deep config": (lambda p: replace_file(p, "config.json", deep_json), r"config\.json: JSON nested deeper"),
    "index outside": (lambda p: open(os.path.join(p, "model.safetensors.index.json"), "w").write(
        json.dumps({"weight_map": {"lm_head.weight": "../../etc/passwd"}})), r"index\.json: weight_map names"),
    "index not an object": (lambda p: open(os.path.join(p, "model.safetensors.index.json"), "w").write("[1]"),
                            r"index\.json: weight_map must be a JSON object"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_a_value_error(base, tmp_path, case):
    breaks, message = MALFORMED[case]
    path = copy(base, tmp_path, "broken")
    breaks(path)
    with pytest.raises(ValueError, match=message) as e:
        jpaged.LLM(path, **LIMITS)
    print(case, "->", e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["quantization_config string", "quantization_config list", "truncated",
                                  "bad header", "overlapping offsets", "inconsistent offsets"])
def test_generate_prints_one_line_and_exits_2(base, tmp_path, capsys, case):
    from serving import cli

    breaks, message = MALFORMED[case]
    path = copy(base, tmp_path, "broken")
    breaks(path)
    assert cli.main(["generate", "--model", path, "--max-model-len", "64", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert __import__("re").search(message, err[0]), err


def test_serve_prints_one_line_and_exits_2(base, tmp_path):
    path = copy(base, tmp_path, "truncated")
    truncate(path)
    proc = subprocess.run([sys.executable, "-m", "serving.cli", "serve", path, "--port", "0", "--max-model-len", "64"],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("INFO", "WARNING"))]
    print(proc.stderr)
    assert proc.returncode == 2
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}/model.safetensors: tensor "), lines
    assert "Traceback" not in proc.stderr


BAD_SCALES = {"nan": (np.nan, "not finite"), "inf": (np.inf, "not finite"), "huge": (3e38, "larger than"),
              "zero": (0.0, "not > 0"), "negative": (-1.0, "not > 0")}


@pytest.mark.parametrize("kind", list(BAD_SCALES))
@pytest.mark.parametrize("scheme", ["fp8-tensor", "w8a16"])
def test_bad_weight_scales_name_the_tensor(tmp_path, scheme, kind):
    value, problem = BAD_SCALES[kind]
    path = copy(os.path.join(DATA, f"llmcompressor-{scheme}"), tmp_path, scheme)
    name = "model.layers.1.mlp.up_proj.weight_scale"

    def poison(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].reshape(-1)[-1] = value
    edit_tensors(path, poison)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has scale .* at \(.*\): {problem}") as e:
        jpaged.LLM(path, **LIMITS)
    print(e.value)


def test_bad_awq_scales_and_zero_points(base, tmp_path):
    from test_quantization import write_packed_checkpoint

    path = str(tmp_path / "awq")
    write_packed_checkpoint(base, path, "awq")
    good = read_tensors(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.scales"
    for value, problem in ((np.nan, "not finite"), (-0.5, "not > 0"), (1e4, "larger than")):
        # float16 scales: 1e4 x 15 (int4 with zero points) overflows float16's 65504
        tensors = {**good, name: good[name].copy()}
        tensors[name][0, 0] = value
        write_tensors(os.path.join(path, "model.safetensors"), tensors)
        with pytest.raises(ValueError, match=rf"tensor '{name}' has scale .*{problem}"):
            jpaged.LLM(path, **{**LIMITS, "dtype": "float16"})
    tensors = {**good, name: good[name].astype(np.int32)}  # integer scales
    write_tensors(os.path.join(path, "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype int32; scales are floating point"):
        jpaged.LLM(path, **LIMITS)


@pytest.mark.parametrize("value, problem", [(np.nan, "not finite"), (3e38, "larger than"), (0.0, "not > 0")])
def test_bad_kv_cache_scales_name_the_tensor(tmp_path, value, problem):
    path = copy(os.path.join(DATA, "llmcompressor-fp8-kv"), tmp_path, "kv")
    name = "model.layers.1.self_attn.k_scale"
    edit_tensors(path, lambda t: t.update({name: np.full(t[name].shape, value, np.float32)}))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has scale .*{problem}"):
        jpaged.LLM(path, **LIMITS, kv_cache_dtype="fp8")


def test_nan_weights_name_the_tensor(base, tmp_path):
    path = copy(base, tmp_path, "nan")
    name = "model.layers.1.self_attn.q_proj.weight"
    for value in (np.nan, -np.inf):
        edit_tensors(path, lambda t: t[name].__setitem__((3, 5), value))
        with pytest.raises(ValueError, match=rf"tensor '{name}' holds NaN or infinite values"):
            jpaged.LLM(path, **LIMITS)
    # fp8 values: 0x7F is e4m3fn's NaN
    path = copy(os.path.join(DATA, "llmcompressor-fp8-tensor"), tmp_path, "fp8-nan")
    name = "model.layers.0.mlp.down_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].view(np.uint8)[1, 2] = 0x7F
    edit_tensors(path, poison)
    assert np.isnan(read_tensors(os.path.join(path, "model.safetensors"))[name].astype(np.float32)).any()
    with pytest.raises(ValueError, match=rf"tensor '{name}' holds NaN or infinite values"):
        jpaged.LLM(path, **LIMITS)


def test_check_scales_bounds():
    check_scales("s", np.array([1e-3, 1.0, 7e35], np.float32), 448.0, np.float32)  # 448 * 7e35 < 3.4e38
    for scale, dtype, problem in ((3e38, np.float32, "larger than 7.6e\\+35"), (1e30, np.float16, "larger than 146"),
                                  (1e-30, np.float16, "rounds to 0 in float16")):
        with pytest.raises(ValueError, match=rf"tensor 's' has scale .* at \(1,\): {problem}"):
            check_scales("s", np.array([1.0, scale], np.float32), 448.0, dtype)


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "compressed-tensors", "config_groups": [1]}, "config_groups must be a JSON object"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": "x"}}, "config_groups.g must be a JSON object"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": "Linear", "weights": {}}}},
     "config_groups.g.targets must be a list of strings"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": [8]}}},
     "config_groups.g.weights must be a JSON object"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "format": "int-quantized",
      "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": "32"}}}}, "group_size >= 1"),
    ({"quant_method": "compressed-tensors", "ignore": "lm_head", "config_groups": {"g": {
        "targets": ["Linear"], "format": "float-quantized", "weights": {"num_bits": 8, "type": "float",
                                                                         "strategy": "tensor"}}}},
     "ignore must be a list of strings"),
    ({"quant_method": "awq", "bits": 4, "group_size": "128"}, "group_size must be an integer"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "modules_to_not_convert": 7},
     "modules_to_not_convert must be a list of strings"),
    ({"quant_method": ["awq"]}, "quant_method="),
])
def test_quantization_config_field_types(qc, field):
    config = type("Config", (), {"quantization_config": qc})()
    with pytest.raises(ValueError, match=field):
        quantization_of(config, None)
    with pytest.raises(ValueError, match="must be a JSON object, got str"):
        quantization_of(type("Config", (), {"quantization_config": "fp8"})(), None)
