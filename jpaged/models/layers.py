"""Building blocks shared by every model: linear layers with logical axis names, norms,
rotary embeddings, MLPs and the one paged attention layer (the scanned stack of decoder layers:
stacked.py).

Every weight is an `nnx.Param` carrying `logical_axes` (names such as "embed", "q_heads",
"kv_heads", "mlp", "vocab"); tensor parallelism maps those names to mesh axes by rule.
Modules are built abstractly (`nnx.eval_shape`) and filled by the loader, so their
constructors never initialise real weights. Each module that owns weights describes how
Hugging Face stores them (`hf_weights`), which is all the loader needs to know.
"""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.blocks import NO_WINDOW
from jpaged.models.batch_invariant import mean_last, row_tiled_dot, separate
from jpaged.models.forward_context import get_forward_context
from jpaged.parallel.sharding import kv_head_replicas, tp_size


class WeightTarget(NamedTuple):
    """Where one Hugging Face tensor (of `hf_shape`) goes: `convert` maps it to `param`'s layout
    (to one slice `layer` of it when the param is stacked over layers, and to slice `expert` of
    that when experts are stacked too)."""

    param: nnx.Param
    hf_shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray]
    layer: int | None = None
    expert: int | None = None


HFWeights = dict[str, list[WeightTarget]]


def fused_rows(*parts: list[WeightTarget]) -> list[WeightTarget]:
    """Targets of one checkpoint tensor that stacks several [out, ...] tensors along its first axis
    (Phi-3's qkv_proj, gate_up_proj): each part converts its own rows."""
    total = sum(t.hf_shape[0] for targets in parts for t in targets[:1])
    fused, offset = [], 0
    for targets in parts:
        n = targets[0].hf_shape[0]
        fused += [t._replace(hf_shape=(total,) + t.hf_shape[1:],
                             convert=lambda a, t=t, rows=slice(offset, offset + n): t.convert(a[rows]))
                  for t in targets]
        offset += n
    return fused


def sliding_windows(hf_config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention). `layer_types` names the windowed layers
    (Qwen2/3, Gemma); without it a config's `sliding_window` covers every layer (Mistral, Phi-3)."""
    window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", True):  # Qwen2 configs written by older transformers
        window = None
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def weight_param(shape, axes, dtype) -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=tuple(axes))


def fp32_precision(dtype):
    """fp32 matmuls in IEEE fp32, not the TF32 NVIDIA GPUs default to; bf16/fp16 keep the default."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


class Linear(nnx.Module):
    """y = x · W (+ b), W of shape in_shape + out_shape (e.g. [embed, q_heads, head_dim])."""

    def __init__(self, in_shape, out_shape, axes, *, use_bias=False, dtype=jnp.float32):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.dtype = jnp.dtype(dtype)  # of the activations, and of the kernel unless quantized
        self.kernel = weight_param(self.in_shape + self.out_shape, axes, dtype)
        self.bias = weight_param(self.out_shape, axes[len(self.in_shape):], dtype) if use_bias else None
        # Quantized weights (jpaged/quantization): the kernel holds 8- or 4-bit values, and
        # W = (kernel - kernel_zero) * kernel_scale, scale and zero broadcast over tiles of the kernel.
        self.kernel_scale = self.kernel_zero = nnx.data(None)
        # How (a WeightScheme); its `activations`: a checkpoint calibrated with dynamic per-token input
        # quantization (compressed-tensors FP8_DYNAMIC, W8A8) has each token's inputs rounded to that type.
        self.scheme = None
        # LoRA slots (jpaged/lora/model.py adds them to the adaptable projections when enabled):
        # A [slots, in..., rank], B [slots, rank, out...].
        self.lora_a = self.lora_b = nnx.data(None)
        self.batch_invariant = False  # the engine's batch_invariant mode: row_tiled_dot (static)

    def __call__(self, x):
        n_in = len(self.in_shape)
        precision = fp32_precision(x.dtype)
        dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
        if self.batch_invariant:  # quantized and LoRA layers are refused with it (EngineConfig)
            y = row_tiled_dot(x, self.kernel[...], dims[0], precision)
        elif self.kernel_scale is None:
            y = jax.lax.dot_general(x, self.kernel[...], dims, precision=precision)
        else:  # qwix dequantizes inside the fused computation (XLA fuses the convert into the dot on GPU)
            import qwix  # only quantized models need it (the GPU image has no qwix unless carried in .whl/)

            kernel = self.kernel[...]
            if kernel.dtype == jnp.uint8:  # 4-bit values, two per byte (jpaged/quantization/scheme.py)
                kernel = jax.lax.bitcast_convert_type(kernel, jnp.int4).reshape(kernel.shape[:-1] + (-1,))
            zero = None if self.kernel_zero is None else self.kernel_zero[...].astype(kernel.dtype)
            xq = x if self.scheme.activations is None else qwix.dequantize(
                qwix.quantize(x, self.scheme.activations, channelwise_axes=tuple(range(x.ndim - n_in))))
            y = qwix.dot_general(xq, qwix.QArray(kernel, self.kernel_scale[...], zero), dims, precision=precision)
        if self.lora_a is not None:
            y = self._add_lora(x, y, get_forward_context().lora_slots, precision)
        return y if self.bias is None else y + self.bias[...]

    def _add_lora(self, x, y, slots, precision):
        """y + each token's x·A[slot]·B[slot] (slot -1: y unchanged): every slot's shrink in one
        matmul, the other slots' parts masked to zero, then one expand over slots x rank."""
        a, b = self.lora_a[...], self.lora_b[...]
        n_in = len(self.in_shape)
        xa = jax.lax.dot_general(x, a, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(1, 1 + n_in))), ((), ())),
                                 precision=precision)  # [tokens, slots, rank]
        mask = slots[:, None] == jnp.arange(a.shape[0], dtype=slots.dtype)[None, :]
        xa = jnp.where(mask[:, :, None], xa, 0).astype(x.dtype)
        return y + jax.lax.dot_general(xa, b, (((1, 2), (0, 1)), ((), ())), precision=precision).astype(y.dtype)

    def hf_weights(self, prefix: str, *, hf_layout: str = "out_in", out_repeats: int = 1) -> HFWeights:
        """torch.nn.Linear stores weight as [out, in] ("out_in"); GPT-2's Conv1D as [in, out] ("in_out").
        `out_repeats` > 1: the checkpoint has out_shape[0] / out_repeats slices on the first output
        axis and each is stored that many times (kv heads replicated for tensor parallelism)."""
        hf_out = (self.out_shape[0] // out_repeats,) + self.out_shape[1:]
        n_in, n_out = math.prod(self.in_shape), math.prod(hf_out)
        full = self.in_shape + hf_out

        def repeat(a, axis):
            return np.repeat(a, out_repeats, axis=axis) if out_repeats > 1 else a

        if hf_layout == "out_in":
            w = WeightTarget(self.kernel, (n_out, n_in), lambda a: repeat(a.T.reshape(full), len(self.in_shape)))
        else:
            w = WeightTarget(self.kernel, (n_in, n_out), lambda a: repeat(a.reshape(full), len(self.in_shape)))
        specs = {f"{prefix}.weight": [w]}
        if self.bias is not None:
            specs[f"{prefix}.bias"] = [WeightTarget(self.bias, (n_out,), lambda a: repeat(a.reshape(hf_out), 0))]
        return specs



def linears_of(model: nnx.Module) -> dict[tuple, Linear]:
    """The model's Linear layers by their nnx path."""
    return {path: node for path, node in nnx.iter_graph(model) if isinstance(node, Linear)}


def kernel_path(param: nnx.Param, linears: dict[tuple, Linear]) -> tuple | None:
    """The path of the Linear in `linears` ({path: Linear}) whose kernel `param` is, or None.
    nnx Params are unhashable; a model holds few Linears (its layers are stacked), so a scan."""
    return next((path for path, linear in linears.items() if linear.kernel is param), None)

class Embedding(nnx.Module):
    def __init__(self, num_embeddings, features, axes=("vocab", "embed"), *, dtype=jnp.float32):
        self.embedding = weight_param((num_embeddings, features), axes, dtype)
        self.batch_invariant = False

    def __call__(self, ids):
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x):
        """Tied output projection: logits = x · Eᵀ."""
        if self.batch_invariant:
            return row_tiled_dot(x, self.embedding[...], ((x.ndim - 1,), (1,)), fp32_precision(x.dtype))
        return jnp.matmul(x, self.embedding[...].T, precision=fp32_precision(x.dtype))

    def hf_weights(self, name: str) -> HFWeights:
        return {name: [WeightTarget(self.embedding, self.embedding.shape, lambda a: a)]}


class RMSNorm(nnx.Module):
    """`offset` 1.0: Gemma's (1 + w) scaling, applied in fp32 before the cast (Llama casts first)."""

    def __init__(self, dim, eps, *, dtype=jnp.float32, offset=0.0):
        self.eps, self.offset = eps, offset
        self.weight = weight_param((dim,), ("norm",), dtype)
        self.batch_invariant = False

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        if self.batch_invariant:  # squares and output products kept from any add (batch_invariant.separate)
            x32 = x32 * jax.lax.rsqrt(mean_last(separate(x32 * x32))[..., None] + self.eps)
            return separate(self._scaled(x, x32))
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1)[..., None] + self.eps)
        return self._scaled(x, x32)

    def _scaled(self, x, x32):
        if self.offset:
            return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)

    def hf_weights(self, prefix: str) -> HFWeights:
        return {f"{prefix}.weight": [WeightTarget(self.weight, self.weight.shape[-1:], lambda a: a)]}


class LayerNorm(nnx.Module):
    def __init__(self, dim, eps, *, dtype=jnp.float32, use_bias: bool = True):
        self.eps = eps
        self.weight = weight_param((dim,), ("norm",), dtype)
        self.bias = weight_param((dim,), ("norm",), dtype) if use_bias else nnx.data(None)  # ModernBERT: none
        self.batch_invariant = False

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        inv = self.batch_invariant
        mean_of = mean_last if inv else functools.partial(jnp.mean, axis=-1)
        kept = separate if inv else (lambda v: v)
        mean = mean_of(x32)[..., None]
        var = mean_of(kept(jnp.square(x32 - mean)))[..., None]
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = kept(y * self.weight[...].astype(jnp.float32))
        return (y if self.bias is None else y + self.bias[...].astype(jnp.float32)).astype(x.dtype)

    def hf_weights(self, prefix: str) -> HFWeights:
        return {f"{prefix}.{n}": [WeightTarget(p, p.shape[-1:], lambda a: a)] for n, p in (("weight", self.weight), ("bias", self.bias))
                if p is not None}


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nnx.Module):
    """Llama-style MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden, intermediate, act, *, dtype):
        self.act = act
        self.gate_proj = Linear((hidden,), (intermediate,), ("embed", "mlp"), dtype=dtype)
        self.up_proj = Linear((hidden,), (intermediate,), ("embed", "mlp"), dtype=dtype)
        self.down_proj = Linear((intermediate,), (hidden,), ("mlp", "embed"), dtype=dtype)

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.gate_proj.hf_weights(f"{prefix}.gate_proj"), **self.up_proj.hf_weights(f"{prefix}.up_proj"),
                **self.down_proj.hf_weights(f"{prefix}.down_proj")}


class MLP(nnx.Module):
    """OPT / GPT-2 MLP: fc2(act(fc1(x))), with biases."""

    def __init__(self, hidden, intermediate, act, *, dtype):
        self.act = act
        self.fc1 = Linear((hidden,), (intermediate,), ("embed", "mlp"), use_bias=True, dtype=dtype)
        self.fc2 = Linear((intermediate,), (hidden,), ("mlp", "embed"), use_bias=True, dtype=dtype)

    def __call__(self, x):
        return self.fc2(activation(self.act)(self.fc1(x)))


# ----------------------------------------------------------------------------- rotary embedding

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `params` is a sorted tuple of the HF rope parameters that shape
    the frequencies; rotary_dim < head_dim rotates only the first rotary_dim features (Phi-4's
    partial_rotary_factor)."""

    head_dim: int
    theta: float
    params: tuple = ()
    rotary_dim: int | None = None

    @classmethod
    def from_hf(cls, hf_config, head_dim: int, layer_type: str | None = None,
                max_model_len: int | None = None) -> "RopeConfig":
        """`layer_type` picks Gemma 3's per-layer-type parameters. LongRoPE (Phi-3) rotates with its
        long factors when the context may exceed original_max_position_embeddings (max_model_len,
        default the model's max_position_embeddings), else with its short ones, fixed for the
        engine's life as vLLM does: cached keys never change rotation."""
        # transformers >= 5 keeps everything in `rope_parameters` (per layer type for Gemma 3);
        # older versions use `rope_theta` + `rope_scaling`.
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if layer_type is not None and layer_type in params:
            params = dict(params[layer_type])
        theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", 10000.0)
        if not params:
            params = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "su":  # LongRoPE's older name
            rope_type = "longrope"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0
        rotary_dim = int(head_dim * partial)
        kept = {"rope_type": rope_type}
        if rope_type in ("linear", "llama3"):
            kept.update((k, v) for k, v in params.items() if k in ("factor", "low_freq_factor", "high_freq_factor",
                                                                   "original_max_position_embeddings"))
        elif rope_type == "longrope":
            # Phi-3 keeps the pretrained length as a top-level field, which wins over the parameter.
            original = getattr(hf_config, "original_max_position_embeddings", None) or params[
                "original_max_position_embeddings"]
            longest = max_model_len or hf_config.max_position_embeddings
            factors = params["long_factor"] if longest > original else params["short_factor"]
            factor = params.get("factor") or hf_config.max_position_embeddings / original
            attention_factor = params.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
            kept.update(ext_factors=tuple(factors), attention_factor=attention_factor)
        return cls(head_dim, float(theta), tuple(sorted(kept.items())) if rope_type != "default" else (), rotary_dim)

    def inv_freq(self) -> np.ndarray:
        dim = self.rotary_dim or self.head_dim
        inv_freq = 1.0 / (self.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        scaling = dict(self.params)
        if scaling.get("rope_type") == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif scaling.get("rope_type") == "llama3":
            # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
            factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            wavelen = 2 * np.pi / inv_freq
            scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            inv_freq = np.where(medium, smoothed, scaled)
        elif scaling.get("rope_type") == "longrope":
            inv_freq = inv_freq / np.asarray(scaling["ext_factors"], np.float32)
        return inv_freq.astype(np.float32)

    def attention_factor(self) -> float:
        """LongRoPE scales cos and sin by this (1 for the others)."""
        return dict(self.params).get("attention_factor", 1.0)


def apply_rope(x, positions, inv_freq, attention_factor=1.0, batch_invariant=False):
    """Rotate-half rotary embedding of x: [tokens, heads, head_dim] at integer positions [tokens];
    inv_freq [rotary_dim / 2] (a traced per-layer row under the scan is fine); features past
    rotary_dim pass through. `batch_invariant`: angles, cos, sin and products `separate`d (no FMA)."""
    kept = separate if batch_invariant else (lambda *v: v[0] if len(v) == 1 else v)
    rotary_dim = 2 * inv_freq.shape[-1]
    freqs = kept(positions.astype(jnp.float32)[:, None] * inv_freq[None, :])
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = (jnp.cos(emb) * attention_factor).astype(x.dtype), (jnp.sin(emb) * attention_factor).astype(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    a, b = kept(x_rot * kept(cos), rotated * kept(sin))
    return jnp.concatenate([a + b, x_pass], axis=-1)


# ----------------------------------------------------------------------------- paged attention

# The kernels' call site (paged_attention.AttentionOps) comes in as `ops`, and the KV pool
# (kv_cache.KVCache) as `kv_cache`: both modules read this one's layers, so it imports neither.

class Attention(nnx.Module):
    """Multi-head attention with GQA/MQA over paged K/V, shared by every architecture.

    Projections keep heads as their own axis ([embed, q_heads, head_dim]) so tensor
    parallelism splits them by rule. When the tensor-parallel size exceeds the kv heads, each
    kv head is stored tp / num_kv_heads times, so every shard owns whole kv heads (vLLM does
    the same). New K/V are scattered into the pages first, then the queries attend through
    the block tables.
    """

    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, *, ops, dtype,
                 qkv_bias=False, o_bias=False, rope: RopeConfig | tuple[RopeConfig, ...] | None = None, scale=None,
                 sliding_window: int | None | tuple[int | None, ...] = None, logits_soft_cap: float | None = None,
                 qk_norm: Callable[[], RMSNorm] | None = None):
        """`rope` and `sliding_window` are either one value for every layer or a tuple with one per
        layer of the stack (picked at run time by `meta.layer`); `qk_norm` builds the per-head
        RMSNorm that Qwen3 and Gemma 3 apply to q and k before the rotation."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.kv_replicas = kv_head_replicas(num_heads, num_kv_heads, tp_size(ops.mesh))
        num_kv_heads *= self.kv_replicas
        self.ops, self.logits_soft_cap = ops, logits_soft_cap
        ropes = rope if isinstance(rope, tuple) else (rope,)
        # Hashable tuples: they are part of the static graph.
        self.rope = None if rope is None else (tuple(tuple(r.inv_freq().tolist()) for r in ropes),
                                               tuple(r.attention_factor() for r in ropes))
        windows = sliding_window if isinstance(sliding_window, tuple) else (sliding_window,)
        self.sliding_window = None if all(w is None for w in windows) else tuple(
            NO_WINDOW if w is None else int(w) for w in windows)
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.q_norm = qk_norm() if qk_norm else None
        self.k_norm = qk_norm() if qk_norm else None
        self.q_proj = Linear((hidden,), (num_heads, head_dim), ("embed", "q_heads", "head_dim"), use_bias=qkv_bias, dtype=dtype)
        self.k_proj = Linear((hidden,), (num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), use_bias=qkv_bias, dtype=dtype)
        self.v_proj = Linear((hidden,), (num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), use_bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear((num_heads, head_dim), (hidden,), ("q_heads", "head_dim", "embed"), use_bias=o_bias, dtype=dtype)

    def __call__(self, x, positions, kv_cache):
        meta = get_forward_context().attn
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            inv_freq, factor = (_for_layer(table, meta.layer) for table in self.rope)
            inv = getattr(self.ops, "batch_invariant", False)  # (the pooling runner's PackedAttentionOps has none)
            q, k = apply_rope(q, positions, inv_freq, factor, inv), apply_rope(k, positions, inv_freq, factor, inv)
        window = None if self.sliding_window is None else _for_layer(self.sliding_window, meta.layer)
        out, kv_cache = self.ops(q, k, v, kv_cache, meta, self.scale, window, self.logits_soft_cap)
        return self.o_proj(out.astype(x.dtype)), kv_cache

    def hf_weights(self, prefix: str, names=("q_proj", "k_proj", "v_proj", "o_proj")) -> HFWeights:
        specs = {}
        for ours, theirs in zip(("q_proj", "k_proj", "v_proj", "o_proj"), names):
            repeats = self.kv_replicas if ours in ("k_proj", "v_proj") else 1
            specs.update(getattr(self, ours).hf_weights(f"{prefix}.{theirs}", out_repeats=repeats))
        if self.q_norm is not None:
            specs.update({**self.q_norm.hf_weights(f"{prefix}.q_norm"), **self.k_norm.hf_weights(f"{prefix}.k_norm")})
        return specs


def _for_layer(values: tuple, layer):
    """Entry `layer` of a per-layer tuple: a constant when every layer has the same."""
    if all(v == values[0] for v in values):
        return np.asarray(values[0], np.float32) if isinstance(values[0], tuple) else values[0]
    return jnp.asarray(values)[layer]


def common_sliding_window(model: nnx.Module) -> int | None:
    """The window every attention layer of the model shares, or None (some attend to everything):
    only then can the block manager free the blocks that fell out of it."""
    windows = {w for _, node in nnx.iter_graph(model) if isinstance(node, Attention)
               for w in (node.sliding_window or (NO_WINDOW,))}
    return windows.pop() if len(windows) == 1 and NO_WINDOW not in windows else None
