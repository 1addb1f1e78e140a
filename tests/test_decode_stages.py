"""The Triton decode kernel's pipelining depth per grid (issue 66): 3 stages for 16-bit pages on
sm_90 when the grid fits one wave of 2 programs per SM (an H200 measured 8% faster at 8 x 32k, 256
programs, and 7% slower at 64 x 32k, 512 programs), 2 otherwise and off sm_90, 3 for fp8 pages. The
rule, then what the lowered kernel carries for an abstract Hopper GPU (no GPU needed), then the
numbers at both depths against the float64 reference in interpret mode."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
from test_kernels import INTERPRET, attend, check_close, gather_seq, make_cache, rng

from pallas_kernels import decode
from pallas_kernels.decode import decode_stages, paged_attention_pallas

H200 = ("NVIDIA H200", 9.0)


def test_rule():
    assert decode_stages(256, 2, H200, 132) == 3  # 8 x 32k: 8 seqs x 8 kv heads x 4 splits
    assert decode_stages(264, 2, H200, 132) == 3  # one wave of 2 programs per SM
    assert decode_stages(265, 2, H200, 132) == 2
    assert decode_stages(512, 2, H200, 132) == 2  # 64 x 32k
    assert decode_stages(512, 1, H200, 132) == 3  # fp8 pages: always 3
    assert decode_stages(200, 2, H200, 114) == 3 and decode_stages(240, 2, H200, 114) == 2  # an H100 PCIe
    assert decode_stages(256, 2, H200, None) == 3  # SM count unknown: an H100/H200 SXM's 132
    assert decode_stages(64, 2, ("NVIDIA A100-SXM4-80GB", 8.0), 108) == 2  # unmeasured there: the default
    assert decode_stages(64, 2, ("NVIDIA B200", 10.0), 148) == 2
    assert decode_stages(64, 2, None, None) == decode.STAGES  # off a GPU (interpret mode)
    assert decode_stages(64, 1, None, None) == decode.FP8_STAGES


@pytest.mark.parametrize("device, num_cores", [("NVIDIA H100 80GB HBM3", 132), ("NVIDIA A100-SXM4-80GB", 108)])
def test_lowered_kernel_carries_the_grids_depth(device, num_cores):
    """Lowered for CUDA on an abstract GPU (its SM count from the device): the Triton call's
    num_stages follows the grid at the bench's four points (32/8 heads, head_dim 128, page 16)."""
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind=device, num_cores=num_cores, platform="gpu"))
    hopper = "H100" in device
    expected = {(8, 4096, "bf16"): 3 if hopper else 2, (8, 32768, "bf16"): 3 if hopper else 2,
                (64, 4096, "bf16"): 2, (64, 32768, "bf16"): 2, (64, 32768, "e5m2"): 3}
    for (batch, context, pages), stages in expected.items():
        dtype = jnp.bfloat16 if pages == "bf16" else jnp.float8_e5m2  # e5m2: converts natively on sm_80 too
        q = jax.ShapeDtypeStruct((batch, 32, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((8, batch * context // 16, 16, 128), dtype)
        tables = jax.ShapeDtypeStruct((batch, context // 16), jnp.int32)
        lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
        with use_abstract_mesh(mesh):
            text = jax.jit(lambda *a: paged_attention_pallas(*a)).trace(q, kv, kv, tables, lens).lower(
                lowering_platforms=("cuda",)).as_text()
        assert re.findall(r"num_stages = (\d+)", text) == [str(stages)], (device, batch, context, pages)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_both_depths_compute_the_same(num_stages):
    """Forced depths (bench_kernels' variants) against the float64 reference on poisoned bf16 pages:
    contexts on and off the 64-key block, split-K forced and automatic."""
    page, heads, kv_heads, head_dim = 16, 8, 2, 128
    lens = [1, 63, 64, 65, 0, 20 * page + 3]
    print(f"lens {lens}")
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.bfloat16)
    q64 = np.asarray(q, np.float64)
    tables_np = np.asarray(tables)
    ref = np.stack([attend(q64[s], gather_seq(k64, tables_np[s], n), gather_seq(v64, tables_np[s], n),
                           1 / np.sqrt(head_dim)) for s, n in enumerate(lens)])
    for splits in (None, 2):
        out = paged_attention_pallas(q, k, v, tables, jnp.asarray(lens, jnp.int32), num_splits=splits,
                                     interpret=INTERPRET, num_stages=num_stages)
        check_close(out, ref, "bf16", f"stages={num_stages} splits={splits}")
