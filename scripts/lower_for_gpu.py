"""GPU readiness without a GPU: lower every attention kernel (Pallas Triton and Pallas Mosaic GPU)
and the engine's jitted forward for CUDA with an abstract H100 and/or A100, verify the kernel
modules, and check that the step updates the KV pool in place (the donated pool aliased to the output).

    JAX_PLATFORMS=cpu python scripts/lower_for_gpu.py [--device h100|a100|all]   # exit 1 on any failure

An A100 (sm_80) has no Mosaic GPU (wgmma/TMA are sm_90+): its cases lower Triton everywhere, and
check that attention_backend='mosaic' is refused there with an error that says why.

Lowering runs each backend's compiler front half: Mosaic GPU's layout inference and MLIR verifier
(for sm_90), and Triton's lowering, whose serialized module is parsed back here and verified.
Nothing runs on a GPU: a kernel that lowers can still fail to compile or compute wrong numbers
there (scripts/gpu_check.sh does that part on a lent GPU). CI runs this under the GPU machines'
jax (see .ci/run), next to the Mosaic kernels' interpret-mode tests.
"""

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec, use_abstract_mesh

# This checkout's jpaged, not one the interpreter has installed (the jax 0.11.2 venv's is /work/main's).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jpaged  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from jpaged.models.layers import Attention  # noqa: E402
from jpaged.models.stacked import Unrollable  # noqa: E402
from jpaged.parallel.sharding import TP_AXIS  # noqa: E402
from jpaged.runner import step_functions  # noqa: E402
from jpaged.runner.input_batch import layout_of  # noqa: E402
from jpaged.spec_decode.draft_ahead import draft_ahead  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# device_kind as CUDA reports it (jax reads the architecture from it); num_cores: SMs.
DEVICES = {"h100": AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"),
           "a100": AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="gpu")}
KERNEL_CALLS = {"__gpu$xla.gpu.triton": "pallas", "mosaic_gpu_v2": "mosaic"}


def mesh_for(device: str) -> AbstractMesh:
    """A one-device mesh shaped as the engine's tensor-parallel one, on the abstract GPU."""
    return AbstractMesh((1,), (TP_AXIS,), (AxisType.Auto,), abstract_device=DEVICES[device])


MESH = mesh_for("h100")  # the device being lowered for (main sets it per --device)


@contextlib.contextmanager
def abstract_gpu():
    """Trace and lower as if for the abstract GPU (kernel selection and Pallas lowering read it)."""
    with use_abstract_mesh(MESH):
        yield


def lower_for_cuda(fn, *args, donate_argnums=()):
    """jit(fn) lowered for CUDA on the abstract GPU; args are ShapeDtypeStructs (or arrays)."""
    with abstract_gpu():
        return jax.jit(fn, donate_argnums=donate_argnums).trace(*args).lower(lowering_platforms=("cuda",))


def _verify_triton(backend_config) -> None:
    """Parse the serialized Triton module back and run the MLIR verifier on it."""
    from jax._src.lib import triton  # noqa: F401 (the dialect's Python bindings)
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect

    with ir.Context() as ctx, ir.Location.unknown():
        dialect.register_dialect(ctx)
        module = ir.Module.parse(backend_config["ir"].value_bytes)
        if not module.operation.verify():
            raise RuntimeError("the Triton module does not verify")


def kernel_calls(lowered) -> list[str]:
    """Kernel families of the lowered module's custom calls ("pallas", "mosaic"), each verified.
    Mosaic GPU verifies its module while lowering; Triton's is verified here."""
    found = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call":
            target = op.attributes["call_target_name"].value
            if target in KERNEL_CALLS:
                if KERNEL_CALLS[target] == "pallas":
                    _verify_triton(op.attributes["mhlo.backend_config"])
                found.append(KERNEL_CALLS[target])
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child)

    visit(lowered.compiler_ir("stablehlo").operation)
    return found


def kernel_cases(families_here=("pallas", "mosaic")):
    """(label, function, abstract args): decode and ragged prefill for each kernel family, over
    dtypes, GQA ratios, page sizes and head_dims each family takes (fp8 pages: widened in registers)."""
    def shapes(*specs):
        return [jax.ShapeDtypeStruct(s, t) for s, t in specs]

    def decode(dtype, heads, kv_heads, head_dim, page, seqs=5, width=40, page_dtype=None):
        pages = ((kv_heads, 300, page, head_dim), page_dtype or dtype)
        return shapes(((seqs, heads, head_dim), dtype), pages, pages, ((seqs, width), jnp.int32), ((seqs,), jnp.int32))

    def prefill(dtype, heads, kv_heads, head_dim, page, tokens=200, seqs=5, width=40, page_dtype=None):
        _, k, v, tables, lens = decode(dtype, heads, kv_heads, head_dim, page, seqs, width, page_dtype)
        return [jax.ShapeDtypeStruct((tokens, heads, head_dim), dtype), k, v, tables, lens,
                jax.ShapeDtypeStruct((seqs + 1,), jnp.int32)]

    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2  # fp8 KV cache pages (kv_cache_dtype)
    families = {
        "pallas": [(bf16, 32, 8, 128, 16, None), (f32, 24, 8, 80, 16, None), (f16, 8, 1, 64, 64, None),
                   (bf16, 32, 8, 128, 16, e4m3), (bf16, 16, 2, 64, 32, e5m2), (f16, 8, 1, 80, 16, e4m3)],
        "mosaic": [(bf16, 32, 8, 128, 16, None), (bf16, 32, 8, 64, 128, None), (f16, 16, 2, 64, 8, None),
                   (bf16, 32, 8, 128, 16, e4m3), (bf16, 16, 2, 64, 64, e5m2), (f16, 8, 1, 128, 8, e4m3)],
    }
    for backend, configs in families.items():
        if backend not in families_here:
            continue
        for dtype, heads, kv_heads, head_dim, page, page_dtype in configs:
            pages = f" pages={jnp.dtype(page_dtype).name}" if page_dtype else ""
            label = f"{backend} {jnp.dtype(dtype).name}{pages} heads={heads}/{kv_heads} d={head_dim} page={page}"
            yield (f"decode {label}", functools.partial(pk.paged_attention, backend=backend), backend,
                   decode(dtype, heads, kv_heads, head_dim, page, page_dtype=page_dtype))
            yield (f"prefill {label}", functools.partial(pk.ragged_paged_attention, backend=backend), backend,
                   prefill(dtype, heads, kv_heads, head_dim, page, page_dtype=page_dtype))
    if "pallas" in families_here:  # per-query key limits (Gemma 3's images): the Triton kernel (Mosaic has none)
        for dtype, heads, kv_heads, head_dim, page in ((bf16, 32, 8, 128, 16), (bf16, 8, 4, 256, 16), (f32, 8, 4, 64, 16)):
            args = prefill(dtype, heads, kv_heads, head_dim, page)
            yield (f"prefill pallas key_limits {jnp.dtype(dtype).name} heads={heads}/{kv_heads} d={head_dim} "
                   f"page={page}", functools.partial(_with_key_limits, backend="pallas"), "pallas",
                   args + [jax.ShapeDtypeStruct((args[0].shape[0],), jnp.int32)])

    # bench_kernels' variants (issue 66): Triton's depths, Mosaic's 2/SM, diagonal masks, 128-key blocks, 2 wgs;
    # fp8 V pages stored transposed (v_transposed: Triton decode and prefill, Mosaic decode at pages of 32+)
    from pallas_kernels import decode as triton, mosaic, mosaic_wide, prefill as triton_prefill
    variants = [("decode", triton.paged_attention_pallas, dict(num_stages=n), None) for n in (2, 3)] + [
        ("decode", mosaic.paged_attention_mosaic, dict(share_smem=True, mask_diagonal_only=True), t) for t in (None, e4m3)]
    variants += [("prefill", mosaic.ragged_paged_attention_mosaic, dict(block_keys=k, mask_diagonal_only=d), t)
                 for k, d, t in ((None, True, None), (128, False, None), (128, True, e4m3))] + [
        ("prefill", mosaic_wide.ragged_paged_attention_mosaic_wide, dict(block_keys=k), None) for k in (None, 128)]
    variants += [("decode", triton.paged_attention_pallas, dict(v_transposed=True, peel_tail=p), t)
                 for p, t in ((True, e4m3), (False, e5m2))] + [
        ("prefill", triton_prefill.ragged_paged_attention_pallas, dict(v_transposed=True), e4m3)] + [
        ("decode", mosaic.paged_attention_mosaic, dict(v_transposed=True, share_smem=s), t) for s, t in ((0, e4m3), (1, e5m2))]
    for phase, fn, options, page_dtype in variants:
        backend = "pallas" if fn.__name__.endswith("_pallas") else "mosaic"
        page = 32 if backend == "mosaic" and options.get("v_transposed") else 16
        if backend in families_here:
            args = (decode if phase == "decode" else prefill)(bf16, 32, 8, 128, page, page_dtype=page_dtype)
            if options.get("v_transposed"):  # V pages [kv heads, pages, head_dim, page_size]
                args[2] = jax.ShapeDtypeStruct(args[2].shape[:2] + args[2].shape[:1:-1], args[2].dtype)
            yield (f"{phase} {backend}{options} pages={jnp.dtype(page_dtype or bf16).name} heads=32/8 d=128 page={page}",
                   functools.partial(fn, **options), backend, args)


def _with_key_limits(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, key_limits, backend):
    return pk.ragged_paged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                                     key_limits=key_limits, backend=backend)


def auto_cases(compute_capability):
    """attention_backend="auto" per phase and page dtype: the family pallas_kernels/choice.py's
    measurements pick for this GPU (on sm_90: Mosaic for prefill over bf16 pages, Triton else)."""
    from pallas_kernels import choice

    for page_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        for phase, fn, args in (
                ("decode", pk.paged_attention, next(kernel_cases(("pallas",)))[3]),
                ("prefill", pk.ragged_paged_attention, list(kernel_cases(("pallas",)))[1][3])):
            pages = jax.ShapeDtypeStruct(args[1].shape, page_dtype)
            args = [args[0], pages, pages, *args[3:]]
            yield (f"{phase} auto pages={jnp.dtype(page_dtype).name}", functools.partial(fn, backend="auto"),
                   choice.auto_family(compute_capability, phase, page_dtype), args)
    # Key limits (Gemma 3's images): Mosaic cannot take them, so auto runs Triton even where it picks Mosaic.
    args = list(kernel_cases(("pallas",)))[1][3]
    yield ("prefill auto key_limits pages=bfloat16", functools.partial(_with_key_limits, backend="auto"),
           choice.auto_family(compute_capability, "prefill", jnp.bfloat16, mosaic_takes_it=False),
           args + [jax.ShapeDtypeStruct((args[0].shape[0],), jnp.int32)])


def _abstract_model(runner):
    """A runner's model, its attention's shard_map on the abstract mesh instead of the CPU's, and
    its state, KV pool, last_tokens and block table as shapes only (no CPU placement). An EAGLE head's runner:
    its state is (its own, the target's modules it calls)."""
    strip = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    head = hasattr(runner, "loaded_shared")
    model = nnx.merge(runner.graphdef, runner.state, *((runner.loaded_shared,) if head else ()))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Attention):
            node.ops = dataclasses.replace(node.ops, mesh=MESH)
        elif isinstance(node, Unrollable):  # as the loader builds it on a GPU (stacked.unroll_layers_on_gpu)
            node.unroll = True
    graphdef, *states = nnx.split(model, runner.owned, ...) if head else nnx.split(model)
    state = jax.tree.map(strip, tuple(states) if head else states[0])
    # A GPU's pool holds its dtype (the CPU's holds raw bits: KVCache.raw_of).
    pages = jax.ShapeDtypeStruct(runner.kv_cache.k_pages.shape, runner.kv_cache.dtype)
    kv_cache = jax.tree.map(strip, runner.kv_cache).replace(k_pages=pages, v_pages=pages, raw_of=None)
    return graphdef, state, kv_cache, (strip(runner.last_tokens), strip(runner.block_table))


_ENGINES = {}


def engine(model, **kwargs):
    """jpaged.LLM(model, **kwargs), built once per arguments: --device all lowers each for both GPUs
    (the engines are device-agnostic; only their abstract copies take the mesh)."""
    key = (model, repr(sorted(kwargs.items())))
    if key not in _ENGINES:
        _ENGINES[key] = jpaged.LLM(model, **kwargs)
    return _ENGINES[key]


def forward_cases(families_here=("pallas", "mosaic")):
    """The engine's forward (tiny model in bf16, tensor parallelism off) per kernel family, for a
    decode bucket and a mixed (prefill) bucket, and its 4-step decode loop (multi-step), lowered
    with the KV pool donated as the engine does. Returns (label, lowered-or-exception thunk, backend)."""
    # (backend, kv_cache_dtype, speculative decoding): with drafts, the forward of a verification
    # step samples a row per token, more rows than max_num_seqs (no multi-step with it); a draft
    # model adds its K/V-only forward and its 3 decode steps after the step (draft_ahead.py).
    seen = set()
    for backend, kv_cache_dtype, spec in (("pallas", "auto", None), ("mosaic", "auto", None),
                                          ("pallas", "fp8", None), ("mosaic", "fp8", None), ("pallas", "auto", "ngram"),
                                          ("mosaic", "auto", "draft_model"), ("pallas", "auto", "eagle3"),
                                          ("pallas", "auto", "eagle"),  # (the test heads: head_dim 32, Triton only)
                                          ("mosaic", "auto", "lora"),
                                          ("mosaic", "auto", "weights:fp8"), ("pallas", "auto", "weights:int8"),
                                          ("pallas", "auto", "weights:w8a8"), ("pallas", "auto", "weights:w4a16-asym")):
        if backend not in families_here:  # an A100: every case on Triton (mosaic's cases too, once)
            backend = families_here[0]
            if (backend, kv_cache_dtype, spec) in seen:
                continue
        seen.add((backend, kv_cache_dtype, spec))
        lora = spec == "lora"  # 4 LoRA slots of rank 16 in every projection, a slot per token
        # Quantized weights: fp8 / int8 on the fly, or llm-compressor's checkpoints (tests/data).
        weights = spec.removeprefix("weights:") if spec and spec.startswith("weights:") else None
        spec = None if lora or weights else spec
        config = {"method": spec, "num_speculative_tokens": 3, **({"model": "tiny"} if spec == "draft_model" else
                                                                  {"model": eagle_head(3)} if spec == "eagle3" else
                                                                  {"model": eagle_head(1)} if spec == "eagle" else {})}
        model = "tiny" if weights in (None, "fp8", "int8") else os.path.join(ROOT, "tests", "data",
                                                                              f"llmcompressor-{weights}")
        llm = engine(model, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8,
                         num_gpu_blocks_override=64, attention_backend=backend, num_scheduler_steps=1 if spec else 4,
                         kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=kv_cache_dtype != "auto",
                         speculative_config=config if spec else None, enable_lora=lora, max_loras=4,
                         quantization=weights if weights in ("fp8", "int8") else None)
        backend_label = backend if kv_cache_dtype == "auto" else f"{backend} kv_cache_dtype={kv_cache_dtype}"
        backend_label += " LoRA" if lora else ""
        backend_label += f" weights {weights}" if weights else ""
        if spec:
            backend_label += f" speculative {spec} (verification: 32 tokens, 32 sampled rows)"
        runner = llm.llm_engine.runner
        graphdef, state, kv_cache, last_tokens = _abstract_model(runner)
        # 8 tokens of 8 sequence rows: the decode kernel alone (a decode step, known to the host) and
        # the ragged one (a mixed step); 64 tokens: the ragged kernel.
        for tokens, decode in ((32, False),) if spec else ((8, True), (8, False), (64, False)):
            layout = layout_of(runner._abstract_inputs(tokens))
            forward = functools.partial(step_functions.forward, graphdef, PartitionSpec(), layout=layout,
                                        return_hidden=runner.hidden_layers or False, decode=decode)
            packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
            label = f"forward {backend_label} {'decode' if decode else 'mixed'} tokens={tokens}"
            yield label, (lambda f=forward, a=(state, kv_cache, packed, *last_tokens):
                          lower_for_cuda(f, *a, donate_argnums=(1,))), backend
        if spec:
            assert runner._abstract_inputs(32).logits_indices.shape == (32,)  # a row per token
        if spec == "draft_model":  # the draft's K/V-only forward over that step, and its drafts after it
            draft = runner.proposer.runner  # the draft model's runner, owned by its proposer
            graphdef, state, kv_cache, (_, block_table) = _abstract_model(draft)
            layout = layout_of(draft._abstract_inputs(32))
            forward_kv = functools.partial(step_functions.forward_kv, graphdef, layout=layout)
            packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
            yield f"draft model K/V forward {backend} tokens=32", (
                lambda f=forward_kv, a=(state, kv_cache, packed, *last_tokens):
                lower_for_cuda(f, *a, donate_argnums=(1,))), backend
            layout = layout_of(draft._ahead_host_inputs(8))  # (draft_ahead.py: 8 rows, 3 decode steps)
            ahead = functools.partial(draft_ahead, graphdef, PartitionSpec(), layout=layout, **draft.ahead_options)
            i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
            args = (state, kv_cache, i32((draft.max_rows,)), block_table, i32((layout.size,)))
            yield f"draft model drafts after the step {backend} seqs=8 steps=3", (
                lambda f=ahead, a=args: lower_for_cuda(f, *a, donate_argnums=(1,))), backend
            continue
        elif spec in ("eagle3", "eagle"):  # the head over that step (its pages), and its 3-draft chain
            yield from eagle_cases(runner.proposer.runner, backend, "EAGLE-3" if spec == "eagle3" else "EAGLE-1")
            continue
        elif spec:
            continue
        else:
            steps, label = 4, f"multi-step decode {backend_label} tokens=8 steps=4"
        layout = layout_of(runner._abstract_multi_step_inputs(8))
        multi_step = functools.partial(step_functions.multi_step, graphdef, PartitionSpec(), layout=layout,
                                       num_steps=steps)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        yield label, (lambda f=multi_step, a=(state, kv_cache, packed, *last_tokens):
                      lower_for_cuda(f, *a, donate_argnums=(1, 3))), backend


def key_limit_cases(families_here=("pallas", "mosaic")):
    """The engine's forward with per-token key limits, as a model whose image tokens attend to each
    other both ways (`is_mm_prefix_lm`, Gemma 3) compiles it: the tiny model's steps given the
    key_limits input (mixed steps of 8 and 64 tokens; the 4-step decode loop), on Triton."""
    backend = "pallas"
    llm = engine("tiny", dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8,
                 num_gpu_blocks_override=64, attention_backend=backend, num_scheduler_steps=4, kv_cache_dtype="auto",
                 calculate_kv_scales=False, speculative_config=None, enable_lora=False, max_loras=4,
                 quantization=None)
    runner = llm.llm_engine.runner
    graphdef, state, kv_cache, last_tokens = _abstract_model(runner)
    runner.mm_prefix = True  # (what the runner of such a model says: its step inputs carry the limits)
    try:
        layouts = {tokens: layout_of(runner._abstract_inputs(tokens)) for tokens in (8, 64)}
        multi = layout_of(runner._abstract_multi_step_inputs(8))
    finally:
        runner.mm_prefix = False
    for tokens, layout in layouts.items():
        forward = functools.partial(step_functions.forward, graphdef, PartitionSpec(), layout=layout)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        yield (f"forward {backend} key_limits mixed tokens={tokens}",
               lambda f=forward, a=(state, kv_cache, packed, *last_tokens): lower_for_cuda(f, *a, donate_argnums=(1,)),
               backend)
    multi_step = functools.partial(step_functions.multi_step, graphdef, PartitionSpec(), layout=multi, num_steps=4)
    packed = jax.ShapeDtypeStruct((multi.size,), jnp.int32)
    yield (f"multi-step decode {backend} key_limits tokens=8 steps=4",
           lambda f=multi_step, a=(state, kv_cache, packed, *last_tokens): lower_for_cuda(f, *a, donate_argnums=(1, 3)),
           backend)


def pooling_cases():
    """The pooling runner's packed forward (jpaged/pooling/engine.py, XLA attention inside each
    input, no KV pages): a BERT encoder with its cross-encoder head, and a decoder embedder
    (the tiny Llama) pooling its last tokens, in bf16, 4 rows of 128 tokens."""
    import transformers

    from jpaged.models import tiny
    from jpaged.models.bert import BertForSequenceClassification
    from jpaged.pooling import engine as pooling_engine
    from jpaged.pooling.decoder import LlamaForEmbedding
    from jpaged.pooling.packed import NoPages, PackedAttentionOps

    strip = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    bert = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=256, max_position_embeddings=512, num_labels=1)
    rows, row_len, seqs = 4, 128, 16
    tokens = jax.ShapeDtypeStruct((rows * row_len,), jnp.int32)
    per_seq = jax.ShapeDtypeStruct((seqs,), jnp.int32)
    for label, make, cfg, pooling, head in (
            ("BERT cross-encoder (CLS, classifier head)", BertForSequenceClassification, bert, "CLS", True),
            ("BERT encoder (MEAN)", BertForSequenceClassification, bert, "MEAN", False),
            ("decoder embedder (tiny Llama, LAST)", LlamaForEmbedding, tiny.tiny_config(), "LAST", False)):
        model = nnx.eval_shape(lambda: make(cfg, dtype=jnp.bfloat16, ops=PackedAttentionOps(causal=True)))
        graphdef, state = nnx.split(model)
        forward = functools.partial(pooling_engine._forward, graphdef, NoPages.of(cfg.num_hidden_layers),
                                    num_rows=rows, row_len=row_len, num_seqs=seqs, pooling=pooling, head=head)
        yield f"pooling forward {label} rows={rows} row_len={row_len}", (
            lambda f=forward, a=(jax.tree.map(strip, state), tokens, tokens, tokens, tokens, per_seq, per_seq):
            lower_for_cuda(f, *a))


def invariant_cases():
    """The engine's forward in batch_invariant mode (its XLA attention and row-tiled matmuls on
    every platform: the Pallas kernels are refused with it), a decode and a mixed bucket."""
    llm = engine("tiny", dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=8,
                     num_gpu_blocks_override=64, batch_invariant=True)
    runner = llm.llm_engine.runner
    graphdef, state, kv_cache, last_tokens = _abstract_model(runner)
    for tokens in (8, 64):
        layout = layout_of(runner._abstract_inputs(tokens))
        forward = functools.partial(step_functions.forward, graphdef, PartitionSpec(), layout=layout)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        yield f"forward batch_invariant (XLA attention) tokens={tokens}", (
            lambda f=forward, a=(state, kv_cache, packed, *last_tokens): lower_for_cuda(f, *a, donate_argnums=(1,)))


def check_mosaic_refused() -> None:
    """On a GPU below sm_90, attention_backend='mosaic' is a ValueError that says why and what to use."""
    q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 300, 16, 128), jnp.bfloat16)
    with abstract_gpu():
        assert pk.kernel_family("auto") == "pallas"
        try:
            pk.check_supported(q, pages, backend="mosaic")
        except ValueError as e:
            if "sm_90" not in str(e) or "'pallas'" not in str(e):
                raise RuntimeError(f"the refusal does not say why and what to use: {e}") from e
            return
    raise RuntimeError("attention_backend='mosaic' was accepted")


@functools.cache
def eagle_head(version: int = 3) -> str:
    """A random EAGLE-3 (or EAGLE-1/2) head for the tiny model, in the public layout
    (tests/eagle3_head.py)."""
    import pathlib
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import eagle3_head
    from jpaged.models import tiny

    write = eagle3_head.write_head if version == 3 else eagle3_head.write_eagle_head
    return write(pathlib.Path(tempfile.mkdtemp()) / "head", tiny.tiny_config())


def eagle_cases(eagle, backend, name):
    """An EAGLE head's pass over a target step (its pages) and its 3-draft chain (eagle_ahead.py)."""
    from jpaged.spec_decode import eagle as eagle_module
    from jpaged.spec_decode import eagle_ahead

    graphdef, (state, shared), kv_cache, (_, block_table) = _abstract_model(eagle)
    layout = layout_of(eagle._abstract_inputs(32))
    fill = functools.partial(eagle_module.fill, graphdef, layout=layout, max_rows=eagle.max_rows)
    hidden = (jax.ShapeDtypeStruct((32, eagle.aux_width), jnp.bfloat16), jax.ShapeDtypeStruct((32,), jnp.int32))
    args = (state, shared, kv_cache, jax.ShapeDtypeStruct((layout.size,), jnp.int32), hidden,
            jax.ShapeDtypeStruct((eagle.output_sizes(32)[0],), jnp.int32), block_table)
    yield f"{name} head over a step {backend} tokens=32", (
        lambda f=fill, a=args: lower_for_cuda(f, *a, donate_argnums=(2,))), backend
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), eagle.rows)
    chain = functools.partial(eagle_ahead.chain_ahead, graphdef, num_steps=eagle.num_chain_steps,
                              block_size=eagle.block_size, scratch_base=eagle.scratch_base,
                              blocks_per_seq=eagle.blocks_per_seq)
    k = eagle.num_chain_steps + 1
    args = (state, shared, kv_cache, rows, block_table, i32((8,)), i32((8, k + 1)), i32((8, k)), i32((8,)), i32((8,)))
    yield f"{name} draft chain after the step {backend} seqs=8 drafts={k}", (
        lambda f=chain, a=args: lower_for_cuda(f, *a, donate_argnums=(2,))), backend


def main() -> int:
    global MESH
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=(*DEVICES, "all"), default="all",
                        help="the abstract GPU(s) to lower for (default: all)")
    devices = list(DEVICES) if (which := parser.parse_args().device) == "all" else [which]
    failures = 0

    def run(label, lower, verify):  # every case is reported, then the exit status says whether any failed
        nonlocal failures
        start = time.perf_counter()
        try:
            print(f"ok    {label}: {verify(lower())} ({time.perf_counter() - start:.1f} s)")
        except Exception as e:
            failures += 1
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:2000]}")

    def kernels(backend, expect_aliases=0):  # the family's kernels only; the KV pool donated
        def verify(lowered):
            calls = kernel_calls(lowered)
            if not calls or set(calls) != {backend}:
                raise RuntimeError(f"expected {backend} kernels, found {calls or 'none'}")
            aliases = lowered.as_text().count("tf.aliasing_output")
            if aliases < expect_aliases:
                raise RuntimeError(f"the KV pool is not donated: {aliases} aliased outputs, expected {expect_aliases}")
            return f"{len(calls)} {backend} kernel(s) verified" + (
                f"; KV pool aliased ({aliases} buffers)" if expect_aliases else "")
        return verify

    def xla_only(lowered):  # no kernels expected
        if kernel_calls(lowered):
            raise RuntimeError(f"expected XLA only, found kernels {kernel_calls(lowered)}")
        if "stablehlo.dot_general" not in lowered.as_text():
            raise RuntimeError("no matmul in the lowered forward")
        return "lowered"

    for device in devices:
        MESH = mesh_for(device)
        # sm_90+ lowers both kernel families; below it, Triton only (and Mosaic must be refused).
        with abstract_gpu():
            families = ("pallas", "mosaic") if pk.gpu_device()[1] >= 9.0 else ("pallas",)
        print(f"jax {jax.__version__}, Python {sys.version.split()[0]}: lowering for CUDA on "
              f"{DEVICES[device].device_kind} ({'/'.join(families)} kernels)")
        if families == ("pallas",):
            run("attention_backend='mosaic' below sm_90", check_mosaic_refused,
                lambda _: "refused, with the reason and 'pallas' named")
        for label, fn, backend, args in kernel_cases(families):
            run(label, functools.partial(lower_for_cuda, fn, *args), kernels(backend))
        with abstract_gpu():
            compute_capability = pk.gpu_device()[1]
        for label, fn, backend, args in auto_cases(compute_capability):
            run(label, functools.partial(lower_for_cuda, fn, *args), kernels(backend))
        for label, lower, backend in (*forward_cases(families), *key_limit_cases(families)):
            run(label, lower, kernels(backend, expect_aliases=2))  # k_pages and v_pages
        for label, lower in (*invariant_cases(), *pooling_cases()):
            run(label, lower, xla_only)
    print("all lowered" if not failures else f"{failures} case(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
