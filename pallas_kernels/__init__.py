"""Paged attention kernels and KV cache ops for jpaged (imports jax only).

Layouts (one pair of arrays per layer):
  k_pages, v_pages  [num_kv_heads, num_pages, page_size, head_dim]
  slot              page * page_size + offset
  block_tables      int32[num_seqs, max_blocks]; logical block b of sequence s
                    lives in page block_tables[s, b]. Entries past a
                    sequence's length may hold anything (-1, huge): they are
                    clamped and never read out of bounds.
  context_lens      int32[num_seqs]: tokens in the sequence's pages
                    (0 = padding row -> zeros out).
GQA/MQA: num_heads % num_kv_heads == 0; query head h uses kv head
h // (num_heads // num_kv_heads).

Ops:
  paged_attention           decode, one query token per sequence
  ragged_paged_attention    prefill / chunked prefill / prefix hits: the new
                            tokens of many sequences packed along q's axis 0,
                            sequence i owning q[query_start_loc[i]:
                            query_start_loc[i+1]]. Their K/V are already in
                            the pages (write_kv first), so they are the last
                            q_len_i of context_lens[i] tokens and new token j
                            sits at position context_lens[i] - q_len_i + j,
                            attending causally to positions <= its own.
                            Rows past query_start_loc[-1] are padding (zeros).
  write_kv, copy_blocks     cache updates (XLA scatter on all backends).

Both attention ops take sliding_window (None, an int or a traced int32
scalar: a query at position p sees keys in (p - w, p]) and logits_soft_cap
(None or a float c: scores -> c * tanh(score / c), Gemma 2); the Triton
kernels and the XLA twins implement them, the Mosaic kernels not yet.
ragged_paged_attention also takes key_limits (None or int32[num_tokens]):
query t at position p sees keys up to max(p, key_limits[t]) (and after
p - w), so a span of tokens can attend to each other both ways (Gemma 3's
image tokens; vLLM's mm_prefix_range); None compiles the causal kernels as
before. Those keys must be in the pages already (the scheduler keeps such a
span in one chunk). Triton, the XLA twins and the batch-invariant attention
take them; Mosaic does not ("auto" runs Triton for such calls).

`v_transposed` (both ops, write_kv): V pages stored [num_kv_heads, num_pages, head_dim, page_size],
a variant layout for fp8 pages (issue 66; cache_ops.py): the XLA twins and Triton kernels take it
for any page dtype, Mosaic for decode over fp8 pages of a multiple of 32 keys ("auto" runs Triton
for the rest). The engine's with kv_cache_v_transposed (EngineConfig), off by default.

Backends (`backend` kwarg, the engine's attention_backend):
  "pallas"  Pallas kernels lowered through Triton (decode.py, prefill.py): any CUDA GPU.
  "mosaic"  Pallas kernels lowered through Mosaic GPU (mosaic.py): TMA + wgmma, sm_90+.
  "xla"     the XLA twins (xla.py): every platform.
  "auto"    "xla" off a GPU; on a GPU the family a GPU run measured faster for the phase
            (decode or prefill) and the KV pages' dtype (choice.py: on sm_90, Mosaic for prefill
            over 16-bit pages, Triton for the rest; Triton on every other GPU and wherever
            Mosaic cannot take the call).
`interpret`: None -> Pallas kernels compile for a GPU and run in interpret mode elsewhere;
True / False force it. The Triton and Mosaic modules are imported on first use, so
`import pallas_kernels` survives a jax that no longer ships one of them.
"""

import functools

import jax

from pallas_kernels import choice
from pallas_kernels.cache_ops import as_dtype, copy_blocks, write_kv
from pallas_kernels.targets import gpu_device, targets_gpu
from pallas_kernels.xla import paged_attention_xla, ragged_paged_attention_xla

__all__ = [
    "BACKENDS",
    "gpu_device",
    "targets_gpu",
    "kernel_family",
    "call_family",
    "check_supported",
    "paged_attention",
    "ragged_paged_attention",
    "write_kv",
    "copy_blocks",
    "paged_attention_xla",
    "ragged_paged_attention_xla",
]

BACKENDS = ("auto", "pallas", "mosaic", "xla")


def kernel_family(backend: str = "auto") -> str:
    """The kernels `backend` runs here: "pallas" (Triton), "mosaic" or "xla". For "auto" on a GPU
    this is "pallas", the family every call can fall back to; which family each call runs is
    `call_family`'s (on sm_90, Mosaic for some)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if targets_gpu() else "xla"
    gpu = gpu_device() if backend == "mosaic" else None
    if gpu is not None and gpu[1] < 9.0:
        kind, cc = gpu
        raise ValueError(f"attention_backend='mosaic' needs an sm_90+ GPU (Hopper or newer): Mosaic GPU's "
                         f"kernels are built on wgmma and TMA, which {kind} (sm_{int(cc * 10)}) does not have. "
                         "Use 'pallas' (Pallas' Triton kernels, any CUDA GPU) or 'auto'")
    return backend


def backend_reason(backend: str = "auto") -> str:
    """Why `backend` runs the kernels it does, for the start-up log (one line)."""
    family = kernel_family(backend)
    if family != "pallas" or not targets_gpu():
        return ""
    gpu = gpu_device()
    why = ("Mosaic GPU needs sm_90+" if gpu and gpu[1] < 9.0 else
           choice.describe_auto() if backend == "auto" and gpu and 9.0 <= gpu[1] < 10.0 else
           "'auto' keeps Triton: Mosaic was measured on sm_90 only" if backend == "auto" else "asked for")
    # jax >= 0.11 warns at every Triton compile; said once here instead (silenced in decode.py / prefill.py).
    return (f"Pallas' Triton backend ({why}); jax deprecates it since 0.11, jpaged's plan for its "
            "removal: docs/PERF.md, GPU checklist")


def check_supported(q, k_pages, backend: str = "auto") -> None:
    """ValueError, naming attention_backend, when `backend`'s kernels cannot take queries and pages
    of these shapes and dtypes (ShapeDtypeStructs suffice: the engine asks at start-up)."""
    if kernel_family(backend) == "mosaic":
        from pallas_kernels.mosaic import check_supported as mosaic_check

        mosaic_check(q, k_pages)


def _interpret(interpret) -> bool:
    return not targets_gpu() if interpret is None else bool(interpret)


def _mosaic_takes(q, k_pages, sliding_window, logits_soft_cap, key_limits=None, v_pages=None) -> bool:
    """v_pages: given for a decode call over transposed V pages (None: the standard layout)."""
    if sliding_window is not None or logits_soft_cap is not None or key_limits is not None:
        return False
    try:
        from pallas_kernels.mosaic import check_supported as mosaic_check, check_v_transposed

        mosaic_check(q, k_pages)
        if v_pages is not None:
            check_v_transposed(k_pages, v_pages)
    except (ImportError, ValueError):  # a jax without Mosaic GPU, or a call it cannot take
        return False
    return True


def call_family(backend: str, phase: str, q, k_pages, kv_dtype=None, sliding_window=None,
                logits_soft_cap=None, key_limits=None, v_pages=None) -> str:
    """The family one call runs: `backend`'s, except "auto" on a GPU, which runs the family
    choice.py's measurements pick for `phase` ("decode" or "prefill") and the pages' dtype
    (`kv_dtype` for raw pools) where Mosaic takes the call, Triton otherwise. `v_pages`: given
    when they are transposed (v_transposed)."""
    family = kernel_family(backend)
    if family == "mosaic" and v_pages is not None and phase == "prefill":
        raise ValueError("attention_backend='mosaic' has no prefill over transposed V pages yet: use 'pallas'")
    if family == "mosaic" and (sliding_window is not None or logits_soft_cap is not None):
        raise ValueError("attention_backend='mosaic' has no sliding window or logit soft-capping yet: use 'pallas'")
    if family == "mosaic" and key_limits is not None:
        raise ValueError("attention_backend='mosaic' has no per-query key limits (bidirectional image tokens) yet: "
                         "use 'pallas'")
    if backend != "auto" or family != "pallas":
        return family
    gpu = gpu_device()
    if gpu is None:  # interpret=True on a CPU with a GPU-less trace: Triton, as before
        return family
    page_dtype = k_pages.dtype if kv_dtype is None else kv_dtype
    if choice.auto_family(gpu[1], phase, page_dtype) != "mosaic" or (v_pages is not None and phase == "prefill"):
        return family
    return "mosaic" if _mosaic_takes(q, k_pages, sliding_window, logits_soft_cap, key_limits, v_pages) else family


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits", "backend", "logits_soft_cap",
                                             "kv_dtype", "v_transposed"))
def paged_attention(q, k_pages, v_pages, block_tables, context_lens, *, scale=None, interpret=None, num_splits=None,
                    backend="auto", sliding_window=None, logits_soft_cap=None, kv_dtype=None, v_transposed=False):
    """Decode attention over paged K/V.

    q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]
    (q's dtype). Sequence s attends to tokens [0, context_lens[s]) of its
    pages. scale defaults to 1/sqrt(head_dim). num_splits (Pallas kernels)
    forces the number of split-K partitions; None picks it from the shapes.
    kv_dtype: the pages hold that dtype's raw bits (write_kv; jpaged's pools on a CPU).
    v_transposed: v_pages are [num_kv_heads, num_pages, head_dim, page_size] (module docstring).
    """
    family = call_family(backend, "decode", q, k_pages, kv_dtype, sliding_window, logits_soft_cap,
                         v_pages=v_pages if v_transposed else None)
    masking = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap) if family != "mosaic" else {}
    if v_transposed:
        masking["v_transposed"] = True
    if family == "xla":
        return paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, scale=scale, kv_dtype=kv_dtype,
                                   **masking)
    # The Pallas kernels read typed pages (whole-pool views: raw pools exist only on a CPU, where
    # these kernels run in interpret mode, for tests).
    k_pages, v_pages = as_dtype(k_pages, kv_dtype), as_dtype(v_pages, kv_dtype)
    if family == "mosaic":
        from pallas_kernels.mosaic import paged_attention_mosaic as kernel
    else:
        from pallas_kernels.decode import paged_attention_pallas as kernel
    return kernel(q, k_pages, v_pages, block_tables, context_lens, scale=scale, num_splits=num_splits,
                  interpret=_interpret(interpret), **masking)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "backend", "logits_soft_cap", "kv_dtype",
                                             "v_transposed"))
def ragged_paged_attention(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None, interpret=None, backend="auto",
    sliding_window=None, logits_soft_cap=None, kv_dtype=None, key_limits=None, v_transposed=False
):
    """Causal attention of packed new tokens over paged K/V.

    q [num_tokens, num_heads, head_dim] -> same shape (q's dtype);
    query_start_loc int32[num_seqs + 1], nondecreasing; key_limits None or
    int32[num_tokens] (each query's last key when past its own). See module docstring.
    """
    family = call_family(backend, "prefill", q, k_pages, kv_dtype, sliding_window, logits_soft_cap, key_limits,
                         v_pages if v_transposed else None)
    masking = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap) if family != "mosaic" else {}
    if v_transposed:  # (call_family keeps such calls off Mosaic)
        masking["v_transposed"] = True
    if key_limits is not None:  # (call_family keeps such calls off Mosaic)
        masking["key_limits"] = key_limits
    if family == "xla":
        return ragged_paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, scale=scale,
                                          kv_dtype=kv_dtype, **masking)
    k_pages, v_pages = as_dtype(k_pages, kv_dtype), as_dtype(v_pages, kv_dtype)
    if family == "mosaic":
        from pallas_kernels.mosaic import ragged_paged_attention_mosaic as kernel
    else:
        from pallas_kernels.prefill import ragged_paged_attention_pallas as kernel
    return kernel(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, scale=scale,
                  interpret=_interpret(interpret), **masking)
