"""Start-up attacks of issue 38 (scripts/stress_server.py --startup-attacks; no server needed).

`jpaged generate` (and `jpaged serve` for a few) is started on malformed checkpoints built in a
temporary directory from the built-in tiny model saved as a Hugging Face directory (and, for
weight scales, from the fp8 llm-compressor checkpoint in tests/data): truncated safetensors, a
bad header, overlapping or inconsistent offsets, quantization_config as a string and as a list,
NaN / inf / 3e38 / 0 / negative weight scales, a FIFO for config.json, a /dev/zero tokenizer, a
NaN weight, and speculative configs out of bounds. Each must exit 2 with exactly one `error:`
line on stderr and no traceback, within the timeout (a FIFO must not block).

Also here: tiny PEFT adapters (random, rank 4) for the LoRA churn (--lora-churn tiny).
"""

import concurrent.futures
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8_CHECKPOINT = os.path.join(ROOT, "tests", "data", "llmcompressor-fp8-tensor")


def save_tiny(path: str) -> str:
    """The built-in tiny model as a Hugging Face directory (config.json, model.safetensors, tokenizer)."""
    import safetensors.numpy

    from jpaged.models import tiny

    os.makedirs(path, exist_ok=True)
    config = tiny.tiny_config()
    config.save_pretrained(path)
    safetensors.numpy.save_file(dict(tiny.tiny_weights(config)), os.path.join(path, "model.safetensors"),
                                metadata={"format": "pt"})
    tiny.tiny_tokenizer().save_pretrained(path)
    return path


def make_tiny_adapters(root: str, n: int = 3, rank: int = 4) -> list[str]:
    """n random PEFT LoRA adapters for the tiny model (q/v projections, different seeds), whose
    greedy texts differ from each other's."""
    import safetensors.numpy

    from jpaged.models import tiny

    config = tiny.tiny_config()
    e, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    paths = []
    for i in range(n):
        rng = np.random.default_rng(1000 + i)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, out in (("q_proj", q), ("v_proj", kv)):
                key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, e)) / np.sqrt(e)).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, rank))).astype(np.float32)
        path = os.path.join(root, f"tiny-lora-{i}")
        os.makedirs(path, exist_ok=True)
        safetensors.numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
                       "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}, f)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------- breaking a checkpoint
def _read(file):
    with open(file, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(file, header, body):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def _edit_header(path, edit):
    file = os.path.join(path, "model.safetensors")
    header, body = _read(file)
    edit({k: v for k, v in header.items() if k != "__metadata__"})
    _write(file, header, body)


def _poke(path, name, value, index=0):
    """The `index`th value of tensor `name` (F32) set to `value`, in place."""
    file = os.path.join(path, "model.safetensors")
    header, body = _read(file)
    assert header[name]["dtype"] == "F32", header[name]
    start = header[name]["data_offsets"][0] + 4 * index
    body = body[:start] + np.float32(value).tobytes() + body[start + 4:]
    _write(file, header, body)


def _truncate(path):
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:len(data) // 2])


def _bad_header(path):
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = bytearray(f.read())
    data[8:28] = b"x" * 20
    with open(file, "wb") as f:
        f.write(bytes(data))


def _overlap(header):
    first, second = sorted(header)[:2]
    start, end = header[first]["data_offsets"]
    header[second].update(data_offsets=[start + 4, end + 4], shape=header[first]["shape"],
                          dtype=header[first]["dtype"])


def _inconsistent(header):
    name = sorted(header)[0]
    header[name]["shape"] = [header[name]["shape"][0] * 2] + header[name]["shape"][1:]


def _config(path, **change):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(change)
    with open(file, "w") as f:
        json.dump(config, f)


def _replace(path, name, make):
    os.remove(os.path.join(path, name))
    make(os.path.join(path, name))


SCALE = "model.layers.1.mlp.up_proj.weight_scale"
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# case: (base checkpoint: "tiny" or "fp8", how it is broken, extra command-line arguments)
CASES = {
    "truncated safetensors": ("tiny", _truncate, []),
    "bad header": ("tiny", _bad_header, []),
    "overlapping offsets": ("tiny", lambda p: _edit_header(p, _overlap), []),
    "inconsistent offsets": ("tiny", lambda p: _edit_header(p, _inconsistent), []),
    "quantization_config string": ("tiny", lambda p: _config(p, quantization_config="fp8"), []),
    "quantization_config list": ("tiny", lambda p: _config(p, quantization_config=[1, 2]), []),
    **{f"weight scale {kind}": ("fp8", lambda p, v=value: _poke(p, SCALE, v), [])
       for kind, value in (("NaN", np.nan), ("inf", np.inf), ("3e38", 3e38), ("0", 0.0), ("negative", -1.0))},
    "config.json a FIFO": ("tiny", lambda p: _replace(p, "config.json", os.mkfifo), []),
    "tokenizer.json /dev/zero": ("tiny", lambda p: _replace(p, "tokenizer.json", lambda f: os.symlink("/dev/zero", f)),
                                 []),
    "NaN weight": ("tiny", lambda p: _poke(p, "model.layers.1.self_attn.q_proj.weight", np.nan, 7), []),
    "num_speculative_tokens 10^6": ("tiny", None, ["--speculative-config", json.dumps(
        {**NGRAM, "num_speculative_tokens": 10**6})]),
    "prompt_lookup_max 10^9": ("tiny", None, ["--speculative-config", json.dumps(
        {**NGRAM, "prompt_lookup_max": 10**9})]),
}
SERVE_CASES = ("truncated safetensors", "quantization_config list", "config.json a FIFO", "num_speculative_tokens 10^6")


def run_case(command: list[str], timeout: float) -> dict:
    """A start-up: exit 2 with one `error:` line on stderr and no traceback, within the timeout."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else \
            (e.stderr or "")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    ok = code == 2 and len(errors) == 1 and "Traceback" not in err
    return {"ok": ok, "code": code, "seconds": time.monotonic() - start, "error": errors[0] if errors else "",
            "errors": len(errors), "traceback": "Traceback" in err, "tail": err.strip().splitlines()[-3:]}


def startup_attacks(workers: int = 2, timeout: float = 240.0, serve: bool = True) -> tuple[int, int]:
    """Every case with `jpaged generate` (and SERVE_CASES with `jpaged serve --port 0` too): prints
    one line per case; (start-ups that passed, start-ups)."""
    import tempfile

    root = tempfile.mkdtemp(prefix="jpaged-startup-")
    base = save_tiny(os.path.join(root, "tiny"))
    jobs = []
    for case, (source, breaks, extra) in CASES.items():
        if breaks is None:
            model = "tiny"
        else:
            if source == "fp8" and not os.path.isdir(FP8_CHECKPOINT):
                print(f"  {case:32s} skipped: {FP8_CHECKPOINT} missing")
                continue
            model = os.path.join(root, case.replace(" ", "-").replace("/", "_"))
            shutil.copytree(base if source == "tiny" else FP8_CHECKPOINT, model)
            breaks(model)
        cli = [sys.executable, "-m", "serving.cli"]
        jobs.append((case, "generate", cli + ["generate", "--model", model, "--max-model-len", "64", "--max-tokens",
                                              "2", *extra]))
        if serve and case in SERVE_CASES:
            jobs.append((case, "serve", cli + ["serve", model, "--port", "0", "--max-model-len", "64", *extra]))
    print(f"start-up attacks: {len(jobs)} start-ups over {len(CASES)} malformed checkpoints and configs "
          f"(built under {root})", flush=True)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(run_case, command, timeout): (case, how) for case, how, command in jobs}
        for future in concurrent.futures.as_completed(futures):
            case, how = futures[future]
            r = future.result()
            failed += not r["ok"]
            verdict = "ok  " if r["ok"] else "FAIL"
            detail = r["error"][:150] if r["ok"] else f"{r['errors']} error lines, traceback {r['traceback']}: " \
                                                      f"{' | '.join(r['tail'])[:300]}"
            print(f"  {verdict} {case:28s} {how:8s} exit {r['code']} in {r['seconds']:5.1f} s: {detail}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    print(f"start-up attacks: {len(jobs) - failed}/{len(jobs)} exited 2 with one error line and no traceback")
    return len(jobs) - failed, len(jobs)
