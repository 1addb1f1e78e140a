"""CLIP's vision transformer (the image encoder of LLaVA-1.5), as Flax NNX.

Pixels [images, channels, size, size] -> patches (a strided convolution, done as one matmul over
each patch's channels x rows x columns), a class token in front, learned position embeddings,
a pre-LayerNorm, then pre-norm encoder layers (bidirectional multi-head attention with biases,
an MLP with quick_gelu). `__call__` returns every layer's hidden states, as transformers'
`output_hidden_states` does: entry 0 the encoder's input, entry k the output of layer k; a
vision-language model picks the one(s) its `vision_feature_layer` names. Layers past the last
one asked for are not run.

Weights are replicated under tensor parallelism (their axis names have no mesh rule): the
encoder is small next to the language model, and runs once per image.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.layers import HFWeights, LayerNorm, Linear, WeightTarget, activation, fp32_precision, weight_param
from jpaged.models.stacked import Unrollable, stack_params


def quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def vision_activation(name: str):
    return quick_gelu if name == "quick_gelu" else activation(name)


class VisionAttention(nnx.Module):
    def __init__(self, hidden: int, num_heads: int, *, dtype):
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        axes = ("vision_embed", "vision_heads", "vision_head_dim")
        shape = (num_heads, self.head_dim)
        self.q_proj = Linear((hidden,), shape, axes, use_bias=True, dtype=dtype)
        self.k_proj = Linear((hidden,), shape, axes, use_bias=True, dtype=dtype)
        self.v_proj = Linear((hidden,), shape, axes, use_bias=True, dtype=dtype)
        self.out_proj = Linear(shape, (hidden,), axes[1:] + axes[:1], use_bias=True, dtype=dtype)

    def __call__(self, x):  # x: [images, tokens, hidden]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [images, tokens, heads, head_dim]
        precision = fp32_precision(x.dtype)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision).astype(jnp.float32)
        probs = jax.nn.softmax(scores * self.head_dim ** -0.5, axis=-1).astype(x.dtype)
        return self.out_proj(jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision))

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.q_proj.hf_weights(f"{prefix}.q_proj"), **self.k_proj.hf_weights(f"{prefix}.k_proj"),
                **self.v_proj.hf_weights(f"{prefix}.v_proj"), **self.out_proj.hf_weights(f"{prefix}.out_proj")}


class VisionMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, *, dtype):
        self.act = act
        self.fc1 = Linear((hidden,), (intermediate,), ("vision_embed", "vision_mlp"), use_bias=True, dtype=dtype)
        self.fc2 = Linear((intermediate,), (hidden,), ("vision_mlp", "vision_embed"), use_bias=True, dtype=dtype)

    def __call__(self, x):
        return self.fc2(vision_activation(self.act)(self.fc1(x)))

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.fc1.hf_weights(f"{prefix}.fc1"), **self.fc2.hf_weights(f"{prefix}.fc2")}


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, cfg, *, dtype):
        eps = cfg.layer_norm_eps
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps, dtype=dtype)
        self.self_attn = VisionAttention(cfg.hidden_size, cfg.num_attention_heads, dtype=dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps, dtype=dtype)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))

    def hf_weights(self, prefix: str) -> HFWeights:
        return {**self.layer_norm1.hf_weights(f"{prefix}.layer_norm1"), **self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.layer_norm2.hf_weights(f"{prefix}.layer_norm2"), **self.mlp.hf_weights(f"{prefix}.mlp")}


class VisionLayers(nnx.Module, Unrollable):
    """Encoder layers with their weights stacked on a leading "layers" axis, run by a scan that
    keeps each layer's output (a vision encoder has no KV cache: not models.layers.LayerStack).
    `unroll` (the loader sets it on a GPU, stacked.unroll_layers_on_gpu): unrolled, each layer's
    GEMMs read its weights in place instead of a copy of them per image batch."""

    def __init__(self, make_layer, num_layers: int):
        self.num_layers = num_layers
        self.unroll = False
        self.layer = make_layer()
        stack_params(self.layer, num_layers)

    def __call__(self, x, num_layers: int):
        """The outputs of the first `num_layers` layers, [num_layers, *x.shape]."""
        graphdef, weights = nnx.split(self.layer)
        weights = jax.tree.map(lambda w: w[:num_layers], weights)

        def one_layer(x, layer_weights):
            x = nnx.merge(graphdef, layer_weights)(x)
            return x, x

        _, outputs = jax.lax.scan(one_layer, x, weights, unroll=self.scan_unroll())
        return outputs

    def hf_weights(self, prefix) -> HFWeights:
        specs = {}
        for i in range(self.num_layers):
            for name, targets in self.layer.hf_weights(prefix(i)).items():
                specs[name] = [target._replace(layer=i) for target in targets]
        return specs


class CLIPVisionTower(nnx.Module):
    def __init__(self, cfg, *, dtype):
        self.patch_size, self.image_size = cfg.patch_size, cfg.image_size
        self.num_channels = getattr(cfg, "num_channels", 3)
        hidden = cfg.hidden_size
        patch_dim = self.num_channels * self.patch_size ** 2
        self.patch_embedding = Linear((patch_dim,), (hidden,), ("vision_patch", "vision_embed"), dtype=dtype)
        self.class_embedding = weight_param((hidden,), ("vision_embed",), dtype)
        self.num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.position_embedding = weight_param((self.num_positions, hidden), ("vision_pos", "vision_embed"), dtype)
        self.pre_layrnorm = LayerNorm(hidden, cfg.layer_norm_eps, dtype=dtype)
        self.layers = VisionLayers(lambda: CLIPEncoderLayer(cfg, dtype=dtype), cfg.num_hidden_layers)
        # Not read by LLaVA (it takes hidden states, not the pooled output), kept to load the checkpoint.
        self.post_layernorm = LayerNorm(hidden, cfg.layer_norm_eps, dtype=dtype)

    def patches(self, pixel_values):
        """[images, C, S, S] -> [images, patches, C * P * P] in the convolution weight's order."""
        b, c, h, w = pixel_values.shape
        p = self.patch_size
        x = pixel_values.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def __call__(self, pixel_values, num_layers: int):
        """Hidden states 0..num_layers (0: the encoder's input), [num_layers + 1, images, tokens, hidden]."""
        dtype = self.class_embedding.dtype
        x = self.patch_embedding(self.patches(pixel_values.astype(dtype)))
        cls = jnp.broadcast_to(self.class_embedding[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...][None]
        x = self.pre_layrnorm(x)
        if num_layers == 0:
            return x[None]
        return jnp.concatenate([x[None], self.layers(x, num_layers)])

    def hf_weights(self, prefix: str) -> HFWeights:
        hidden = self.class_embedding.shape[0]
        conv = (hidden, self.num_channels, self.patch_size, self.patch_size)
        return {
            f"{prefix}.embeddings.patch_embedding.weight": [
                WeightTarget(self.patch_embedding.kernel, conv, lambda a: np.asarray(a).reshape(hidden, -1).T)],
            f"{prefix}.embeddings.class_embedding": [WeightTarget(self.class_embedding, (hidden,), lambda a: a)],
            f"{prefix}.embeddings.position_embedding.weight": [
                WeightTarget(self.position_embedding, (self.num_positions, hidden), lambda a: a)],
            **self.pre_layrnorm.hf_weights(f"{prefix}.pre_layrnorm"),
            **self.post_layernorm.hf_weights(f"{prefix}.post_layernorm"),
            **self.layers.hf_weights(lambda i: f"{prefix}.encoder.layers.{i}"),
        }
