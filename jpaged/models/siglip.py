"""SigLIP's vision transformer (SiglipVisionModel without its pooling head), Gemma 3's image
encoder: a patch embedding (HF's Conv2d with stride = kernel, a Linear over each flattened
patch) plus learned position embeddings, pre-norm encoder layers (LayerNorm, biased q/k/v/out
projections, full bidirectional attention within an image, a tanh-GELU MLP) and a final
LayerNorm. Images arrive at the processor's fixed size, [batch, channels, size, size].
"""

from flax import nnx

from jpaged.models.layers import HFWeights, LayerNorm, WeightTarget, weight_param
from jpaged.models.vision_layers import (EncoderStack, conv_as_linear, dense_attention, vision_activation,
                                         vision_linear)


class SiglipAttention(nnx.Module):
    def __init__(self, dim, num_heads, *, dtype):
        self.head_dim = dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = (vision_linear(dim, (num_heads, self.head_dim), dtype=dtype)
                                                 for _ in range(3))
        self.out_proj = vision_linear(dim, dim, dtype=dtype)

    def __call__(self, x):
        out = dense_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), None, self.head_dim ** -0.5)
        return self.out_proj(out.reshape(out.shape[:-2] + (-1,)))

    def hf_weights(self, prefix):
        return {k: v for n in ("q_proj", "k_proj", "v_proj", "out_proj")
                for k, v in getattr(self, n).hf_weights(f"{prefix}.{n}").items()}


class SiglipEncoderLayer(nnx.Module):
    def __init__(self, vcfg, *, dtype):
        dim, eps = vcfg.hidden_size, vcfg.layer_norm_eps
        self.act = vcfg.hidden_act
        self.layer_norm1 = LayerNorm(dim, eps, dtype=dtype)
        self.self_attn = SiglipAttention(dim, vcfg.num_attention_heads, dtype=dtype)
        self.layer_norm2 = LayerNorm(dim, eps, dtype=dtype)
        self.fc1 = vision_linear(dim, vcfg.intermediate_size, dtype=dtype)
        self.fc2 = vision_linear(vcfg.intermediate_size, dim, dtype=dtype)

    def __call__(self, x, shared=None, per_layer=None):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(vision_activation(self.act)(self.fc1(self.layer_norm2(x))))

    def hf_weights(self, prefix):
        return {**self.layer_norm1.hf_weights(f"{prefix}.layer_norm1"),
                **self.layer_norm2.hf_weights(f"{prefix}.layer_norm2"),
                **self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.fc1.hf_weights(f"{prefix}.mlp.fc1"), **self.fc2.hf_weights(f"{prefix}.mlp.fc2")}


class SiglipVisionTower(nnx.Module):
    """pixel_values [batch, channels, size, size] -> the last hidden states [batch, patches, hidden]
    (after post_layernorm, as SiglipVisionModel's last_hidden_state)."""

    def __init__(self, vcfg, *, dtype):
        self.channels, self.patch, self.size = vcfg.num_channels, vcfg.patch_size, vcfg.image_size
        self.side = vcfg.image_size // vcfg.patch_size
        dim = vcfg.hidden_size
        self.patch_embedding = vision_linear(self.channels * self.patch ** 2, dim, dtype=dtype)
        self.position_embedding = weight_param((self.side ** 2, dim), ("vision_positions", "vision_embed"), dtype)
        self.layers = EncoderStack(lambda: SiglipEncoderLayer(vcfg, dtype=dtype), vcfg.num_hidden_layers)
        self.post_layernorm = LayerNorm(dim, vcfg.layer_norm_eps, dtype=dtype)

    def __call__(self, pixel_values):
        b, c, p, s = pixel_values.shape[0], self.channels, self.patch, self.side
        if pixel_values.shape[1:] != (c, self.size, self.size):
            raise ValueError(f"pixel_values of shape {pixel_values.shape}; expected [batch, {c}, {self.size}, "
                             f"{self.size}]")
        patches = pixel_values.reshape(b, c, s, p, s, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, s * s, c * p * p)
        x = self.patch_embedding(patches.astype(self.patch_embedding.kernel.dtype))
        x = x + self.position_embedding[...][None]
        return self.post_layernorm(self.layers(x, None))

    def hf_weights(self, prefix: str) -> HFWeights:
        dim = self.position_embedding.shape[-1]
        return {**conv_as_linear(self.patch_embedding, f"{prefix}.embeddings.patch_embedding.weight",
                                 (dim, self.channels, self.patch, self.patch)),
                f"{prefix}.embeddings.position_embedding.weight": [
                    WeightTarget(self.position_embedding, self.position_embedding.shape, lambda a: a)],
                **self.layers.hf_weights(lambda i: f"{prefix}.encoder.layers.{i}"),
                **self.post_layernorm.hf_weights(f"{prefix}.post_layernorm")}

