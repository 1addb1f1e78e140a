"""The GPU path cannot fail silently: the `device` option, the kernels each attention_backend
picks, fp32 matmul precision in the compiled step, and the start-up log line."""

import logging
import re

import jax
import jax.numpy as jnp
import pytest

import jpaged
import pallas_kernels as pk
from jpaged.config import ATTENTION_BACKENDS, EngineConfig

ENGINE = dict(max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=16, enforce_eager=True)


def test_device_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"device='cuda'.*CUDA"):
        jpaged.LLM("tiny", device="cuda", **ENGINE)


def test_device_option_checked():
    with pytest.raises(ValueError, match="device='tpu'"):
        EngineConfig(device="tpu")
    llm = jpaged.LLM("tiny", device="cpu", **ENGINE)
    out = llm.generate([[1, 2, 3]], jpaged.SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


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
    assert re.search(r"KV pool: 16 device blocks \([0-9.]+ GiB\)", lines[0])


def _dot_lines(dtype: str) -> list[str]:
    llm = jpaged.LLM("tiny", dtype=dtype, attention_backend="xla", **ENGINE)
    runner = llm.llm_engine.runner
    text = runner._lower(("forward", False, 16, 2)).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def test_fp32_matmuls_run_at_highest_precision():
    """No TF32 for fp32 models on NVIDIA GPUs: every matmul of the fp32 step asks for HIGHEST;
    a bf16 step keeps the default for its projections."""
    f32 = _dot_lines("float32")
    assert f32 and all("HIGHEST" in line for line in f32), [line for line in f32 if "HIGHEST" not in line][:3]
    bf16 = _dot_lines("bfloat16")
    assert any("HIGHEST" not in line for line in bf16)
