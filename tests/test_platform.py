"""The GPU path cannot fail silently: the `device` option, the kernels each attention_backend
picks, fp32 matmul precision in the compiled step, and the start-up log line."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jpaged
import pallas_kernels as pk
from jpaged.config import ATTENTION_BACKENDS, EngineConfig

ENGINE = dict(max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=16, enforce_eager=True)
CHECKOUT = Path(__file__).parents[1]

# The device tests hold on either machine. Where jax's default backend is the GPU (scripts/gpu_check.sh
# runs this file there), a CPU-only case runs in a new process: `device='cpu'` cannot run in a process
# whose jax already runs on the GPU, and `device='cuda'` cannot fail for want of a CUDA backend there.


def _env(**changes) -> dict:
    """This process's environment with `changes` (None: removed), the checkout first on PYTHONPATH and
    no pytest-xdist worker variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _rerun_on_cpu(test_name: str):
    """This file's test `test_name` in a pytest process with JAX_PLATFORMS=cpu: its CPU case."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"tests/test_platform.py::{test_name}"], cwd=CHECKOUT, env=_env(JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, (done.stdout + done.stderr)[-3000:]


def test_device_cuda_without_gpu_is_a_clear_error():
    """device='cuda' where jax has no CUDA backend is a clear error, not an engine on the CPU; on a
    GPU, it runs there (and the error is checked in a process with JAX_PLATFORMS=cpu)."""
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match=r"device='cuda'.*CUDA"):
            jpaged.LLM("tiny", device="cuda", **ENGINE)
        return
    llm = jpaged.LLM("tiny", device="cuda", **ENGINE)
    out = llm.generate([[1, 2, 3]], jpaged.SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and llm.llm_engine.devices[0].platform == "gpu"
    del llm
    _rerun_on_cpu("test_device_cuda_without_gpu_is_a_clear_error")


def test_device_option_checked():
    """device='cpu' runs on the CPU, and keeps jax off a GPU when it comes first in the process
    (devices.select); once jax runs on the GPU it is a clear error instead."""
    with pytest.raises(ValueError, match="device='tpu'"):
        EngineConfig(device="tpu")
    if jax.default_backend() == "cpu":
        llm = jpaged.LLM("tiny", device="cpu", **ENGINE)
        out = llm.generate([[1, 2, 3]], jpaged.SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        return
    with pytest.raises(RuntimeError, match=r"device='cpu' but jax already runs on 'gpu': set JAX_PLATFORMS=cpu"):
        jpaged.LLM("tiny", device="cpu", **ENGINE)
    script = ("import jax, jpaged\n"
              f"llm = jpaged.LLM('tiny', device='cpu', **{ENGINE!r})\n"
              "out = llm.generate([[1, 2, 3]], jpaged.SamplingParams(max_tokens=2), use_tqdm=False)\n"
              "print('result', len(out[0].outputs[0].token_ids), jax.default_backend(),\n"
              "      llm.llm_engine.devices[0].platform)\n")
    done = subprocess.run([sys.executable, "-c", script], env=_env(JAX_PLATFORMS=None), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result 2 cpu cpu" in done.stdout, done.stdout


def test_kernel_family_names_match_the_config():
    assert pk.BACKENDS == ATTENTION_BACKENDS
    on_gpu = jax.default_backend() == "gpu"
    assert pk.kernel_family("auto") == ("pallas" if on_gpu else "xla")
    for name in ("pallas", "mosaic", "xla"):
        assert pk.kernel_family(name) == name
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        pk.kernel_family("triton")


def test_startup_log_names_backend_device_kernels_and_pool(caplog):
    with caplog.at_level(logging.INFO, logger="jpaged"):
        jpaged.LLM("tiny", attention_backend="xla", **ENGINE)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("jpaged: tiny")]
    assert len(lines) == 1, lines
    device = jax.devices()[0].device_kind
    assert f"on {jax.default_backend()} ({device} x" in lines[0]
    assert "attention 'xla' -> XLA" in lines[0]
    assert re.search(r"KV pool: 16 device blocks \([0-9.]+ MiB\)", lines[0])


def _dot_lines(dtype: str) -> list[str]:
    llm = jpaged.LLM("tiny", dtype=dtype, attention_backend="xla", **ENGINE)
    runner = llm.llm_engine.runner
    text = runner._lower(("forward", 16)).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def test_fp32_matmuls_run_at_highest_precision():
    """No TF32 for fp32 models on NVIDIA GPUs: every matmul of the fp32 step asks for HIGHEST;
    a bf16 step keeps the default for its projections."""
    f32 = _dot_lines("float32")
    assert f32 and all("HIGHEST" in line for line in f32), [line for line in f32 if "HIGHEST" not in line][:3]
    bf16 = _dot_lines("bfloat16")
    assert any("HIGHEST" not in line for line in bf16)


def test_import_survives_a_jax_without_the_triton_backend(tmp_path):
    """The Triton module is imported on first use: with it gone (as a future jax removes it),
    `import jpaged` and the XLA kernels still work."""
    script = tmp_path / "no_triton.py"
    script.write_text(
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'jax.experimental.pallas.triton':\n"
        "            raise ImportError('no Triton backend in this jax')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import jax.numpy as jnp, jpaged, pallas_kernels as pk\n"
        "out = pk.paged_attention(jnp.ones((1, 2, 8)), jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 4, 8)),\n"
        "                         jnp.zeros((1, 2), jnp.int32), jnp.array([3]), backend='auto')\n"
        "assert float(out.sum()) == 16.0\n"
        "try:\n"
        "    pk.paged_attention(jnp.ones((1, 2, 8)), jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 4, 8)),\n"
        "                       jnp.zeros((1, 2), jnp.int32), jnp.array([3]), backend='pallas')\n"
        "except ImportError as e:\n"
        "    print('pallas:', e)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pallas: no Triton backend in this jax" in done.stdout


def test_gpu_check_devices_step_runs_on_cpu(capsys):
    """scripts/gpu_check.sh's backend step, with the device it asserts set to the CPU (on a GPU machine:
    in a process with JAX_PLATFORMS=cpu, the step itself runs on the GPU there)."""
    import importlib.util

    if jax.default_backend() != "cpu":
        _rerun_on_cpu("test_gpu_check_devices_step_runs_on_cpu")
        return

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parents[1] / "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["devices", "--device", "cpu"]) == 0
    assert "generated 8 tokens on cpu" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="device='cuda'"):
        gpu_check.main(["devices", "--device", "cuda"])


@pytest.mark.parametrize("device_kind,cc,mosaic", [("NVIDIA A100-SXM4-80GB", 8.0, False),
                                                    ("NVIDIA L40S", 8.9, False),
                                                    ("NVIDIA H100 80GB HBM3", 9.0, True),
                                                    ("NVIDIA H200", 9.0, True)])
def test_backend_per_gpu_generation(device_kind, cc, mosaic):
    """On an abstract GPU (what lowering without one sees): 'auto' runs Triton everywhere and the
    start-up line says why and that jax deprecates it; Mosaic runs on sm_90+ and is refused below
    with the reason and what to use; e4m3 pages are read as bytes below sm_89 only."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    from pallas_kernels.targets import e4m3_as_bits

    device = AbstractDevice(device_kind=device_kind, num_cores=100, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("tp",), (AxisType.Auto,), abstract_device=device)):
        assert pk.gpu_device() == (device_kind, cc)
        assert pk.kernel_family("auto") == "pallas"
        reason = pk.backend_reason("auto")
        assert ("Mosaic GPU needs sm_90+" in reason) == (not mosaic) and "deprecates it since 0.11" in reason
        assert e4m3_as_bits() == (cc < 8.9)
        if mosaic:
            assert pk.kernel_family("mosaic") == "mosaic"
        else:
            with pytest.raises(ValueError, match=rf"needs an sm_90\+ GPU.*sm_{int(cc * 10)}.*'pallas'"):
                pk.kernel_family("mosaic")
    unknown = AbstractDevice(device_kind="NVIDIA Z9000", num_cores=1, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("tp",), (AxisType.Auto,), abstract_device=unknown)):
        with pytest.raises(ValueError, match="unknown abstract GPU 'NVIDIA Z9000'"):
            pk.gpu_device()

