"""attention_backend="auto" by measurement (pallas_kernels/choice.py): the family per compute
capability, phase and KV page dtype, on abstract GPUs (what lowering without a GPU sees), and the
kernels a traced call really contains."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import pallas_kernels as pk
from pallas_kernels import choice

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
GPUS = [("NVIDIA A100-SXM4-80GB", 8.0), ("NVIDIA A10", 8.6), ("NVIDIA L4", 8.9), ("NVIDIA H100 80GB HBM3", 9.0),
        ("NVIDIA H200", 9.0), ("NVIDIA GH200 480GB", 9.0), ("NVIDIA B200", 10.0)]


def on(device_kind):
    device = AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu")
    return use_abstract_mesh(AbstractMesh((1,), ("tp",), (AxisType.Auto,), abstract_device=device))


def shapes(dtype=BF16, page_dtype=None, heads=32, kv_heads=8, head_dim=128, tokens=64):
    q = jax.ShapeDtypeStruct((tokens, heads, head_dim), dtype)
    pages = jax.ShapeDtypeStruct((kv_heads, 64, 16, head_dim), page_dtype or dtype)
    return q, pages


def test_the_table_says_where_and_when_it_was_measured():
    assert choice.MEASURED_ON["date"] == "2026-11-28" and "H200" in choice.MEASURED_ON["gpu"]
    assert choice.MEASURED_ON["jax"].startswith("0.11.2")
    for (phase, pages), runs in choice.MEASURED.items():
        assert phase in choice.PHASES and pages in choice.PAGES
        assert set(runs) <= {"pallas", "mosaic"}
        for points in runs.values():
            assert all(us > 0 for us in points.values())


def test_measured_choice_is_the_smaller_sum_of_times():
    # decode, 16-bit pages: Mosaic wins batch 8, Triton batch 64; by time (3,352 vs 3,422 us) Triton.
    assert choice.measured_choice("decode", "16-bit") == "pallas"
    assert choice.measured_choice("decode", "fp8") == "pallas"
    assert choice.measured_choice("prefill", "16-bit") == "mosaic"
    assert choice.measured_choice("prefill", "fp8") == choice.UNMEASURED == "pallas"
    with pytest.raises(ValueError, match="phase 'verify'"):
        choice.measured_choice("verify", "fp8")


def test_measured_choice_follows_the_table(monkeypatch):
    """Change the figures and the choice follows: it is computed, not written down."""
    table = dict(choice.MEASURED)
    table[("decode", "16-bit")] = {"pallas": {(8, 4096): 2.0, (64, 4096): 9.0}, "mosaic": {(8, 4096): 1.0,
                                                                                             (64, 4096): 8.0}}
    table[("prefill", "16-bit")] = {"pallas": {(1, 2048): 1.0}, "mosaic": {(1, 2048): 3.0, (1, 8192): 0.1}}
    monkeypatch.setattr(choice, "MEASURED", table)
    assert choice.measured_choice("decode", "16-bit") == "mosaic"
    assert choice.measured_choice("prefill", "16-bit") == "pallas"  # only points both families have count


@pytest.mark.parametrize("kind, cc", GPUS)
@pytest.mark.parametrize("page_dtype", [BF16, F16, E4M3, E5M2])
def test_auto_family_per_compute_capability_phase_and_dtype(kind, cc, page_dtype):
    fp8 = jnp.dtype(page_dtype).itemsize == 1
    hopper = 9.0 <= cc < 10.0
    assert choice.auto_family(cc, "decode", page_dtype) == "pallas"
    assert choice.auto_family(cc, "prefill", page_dtype) == ("mosaic" if hopper and not fp8 else "pallas")
    assert choice.auto_family(cc, "prefill", page_dtype, mosaic_takes_it=False) == "pallas"


@pytest.mark.parametrize("kind, cc", GPUS)
def test_call_family_on_abstract_gpus(kind, cc):
    hopper = 9.0 <= cc < 10.0
    with on(kind):
        assert pk.gpu_device() == (kind, cc)
        q, pages = shapes()
        assert pk.call_family("auto", "decode", q, pages) == "pallas"
        assert pk.call_family("auto", "prefill", q, pages) == ("mosaic" if hopper else "pallas")
        # fp8 pages (typed, or raw bytes naming their dtype): Triton in both phases
        q8, pages8 = shapes(page_dtype=E4M3)
        assert pk.call_family("auto", "prefill", q8, pages8) == "pallas"
        raw = jax.ShapeDtypeStruct(pages.shape, jnp.uint8)
        assert pk.call_family("auto", "prefill", q, raw, kv_dtype=E4M3) == "pallas"
        # what Mosaic cannot take runs on Triton: f32 q, head_dim 80, > 64 heads per kv head, masks
        for q_, pages_ in (shapes(F32), shapes(head_dim=80), shapes(heads=128, kv_heads=1)):
            assert pk.call_family("auto", "prefill", q_, pages_) == "pallas"
        assert pk.call_family("auto", "prefill", q, pages, sliding_window=128) == "pallas"
        assert pk.call_family("auto", "prefill", q, pages, logits_soft_cap=50.0) == "pallas"
        limits = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)  # per-query key limits (Gemma 3's images)
        assert pk.call_family("auto", "prefill", q, pages, key_limits=limits) == "pallas"
        with pytest.raises(ValueError, match="key limits" if cc >= 9.0 else "sm_90"):
            pk.call_family("mosaic", "prefill", q, pages, key_limits=limits)
        assert pk.call_family("auto", "prefill", *shapes(F16)) == ("mosaic" if hopper else "pallas")
        # explicit backends are what they say
        assert pk.call_family("pallas", "prefill", q, pages) == "pallas"
        assert pk.call_family("xla", "decode", q, pages) == "xla"
        assert pk.kernel_family("auto") == "pallas"
        reason = pk.backend_reason("auto")
        assert ("by measurement" in reason) == hopper and "deprecates it since 0.11" in reason


def test_call_family_off_gpu_is_xla():
    if jax.default_backend() == "gpu":
        pytest.skip("runs on a CPU")
    q, pages = shapes()
    assert pk.call_family("auto", "prefill", q, pages) == "xla"
    assert pk.call_family("pallas", "prefill", q, pages) == "pallas"


def _families(fn, *args):
    """The kernel families in fn's jaxpr: "mosaic" where Mosaic GPU's wgmma appears, "pallas" where
    a Triton kernel of this project (a pallas_call named jpaged_*) does."""
    text = str(jax.make_jaxpr(fn)(*args))
    found = set()
    if "wgmma" in text:
        found.add("mosaic")
    if re.search(r"name=jpaged_(decode|ragged_prefill)\b", text):
        found.add("pallas")
    return found


def test_traced_calls_contain_the_chosen_kernels():
    """On an abstract H100, auto's decode traces the Triton decode kernel and its prefill the
    Mosaic one (16-bit pages) or the Triton one (fp8 pages)."""
    q, pages = shapes(tokens=64)
    dq = jax.ShapeDtypeStruct((4, 32, 128), BF16)
    tables = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    starts = jax.ShapeDtypeStruct((5,), jnp.int32)
    with on("NVIDIA H100 80GB HBM3"):
        decode = _families(lambda *a: pk.paged_attention(*a, backend="auto"), dq, pages, pages, tables, lens)
        prefill = _families(lambda *a: pk.ragged_paged_attention(*a, backend="auto"), q, pages, pages, tables,
                                lens, starts)
        _, pages8 = shapes(page_dtype=E4M3)
        prefill8 = _families(lambda *a: pk.ragged_paged_attention(*a, backend="auto"), q, pages8, pages8,
                                 tables, lens, starts)
        limits = jax.ShapeDtypeStruct((64,), jnp.int32)
        bidirectional = _families(lambda *a: pk.ragged_paged_attention(*a[:-1], key_limits=a[-1], backend="auto"),
                                  q, pages, pages, tables, lens, starts, limits)
    assert decode == {"pallas"} and prefill == {"mosaic"} and prefill8 == {"pallas"}, (decode, prefill, prefill8)
    assert bidirectional == {"pallas"}, bidirectional  # Mosaic has no key limits: Triton takes the call


def test_auto_lowers_for_h100_and_a100_to_the_chosen_kernels():
    """scripts/lower_for_gpu.py's auto cases (CI's readiness job compiles them under jax 0.11.2):
    lowered for CUDA, each module holds the chosen family's kernel and only it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("lower_for_gpu", Path(__file__).parents[1] / "scripts/lower_for_gpu.py")
    lower = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lower)
    chosen = {}
    for device, cc in (("h100", 9.0), ("a100", 8.0)):
        lower.MESH = lower.mesh_for(device)
        for label, fn, family, args in lower.auto_cases(cc):
            assert lower.kernel_calls(lower.lower_for_cuda(fn, *args)) == [family], (device, label)
            chosen[device, label] = family
    assert chosen["h100", "prefill auto pages=bfloat16"] == "mosaic"
    assert sum(family == "mosaic" for family in chosen.values()) == 1
