"""The vision transformers of Qwen2-VL and Qwen2.5-VL, and the patch merger that turns their
output into language-model embeddings (one per 2x2 block of patches).

Images come in at their own resolution (dynamic resolution): the image processor cuts each into
patches of temporal_patch_size x patch_size x patch_size pixels, ordered block by block (each
spatial_merge_size^2 neighbours together) and described by its grid (t, h, w) in patches. The
patch embedding is a linear map of a flattened patch (HF's Conv3d with stride = kernel). Each
block's attention carries a 2D rotary embedding: half of the rotated features turn with the
patch's row, half with its column.

Qwen2-VL: LayerNorm, a quick-GELU MLP and full attention within each frame. Qwen2.5-VL: RMSNorm,
a gated SiLU MLP with biases, and attention within windows of window_size pixels except in the
blocks `fullatt_block_indexes` names (full attention within each frame). As in HF, the patches go
in window order (each window a contiguous run, so the windowed blocks attend within bands of three
windows' length, not over the whole sequence) and the merged output goes back to image order.

`vision_layout` (numpy, on the host) computes everything that depends on the grids: the rotary
positions, the frame and window segment ids, padded to a bucket size (padding is one more
segment), and the window order.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.layers import HFWeights, LayerNorm, RMSNorm
from jpaged.models.vision_layers import (EncoderStack, apply_rotary, banded_attention, conv_as_linear,
                                         dense_attention, pad_rows, vision_activation, vision_linear)


def vision_layout(grids, merge: int, *, patch_size: int | None = None, window_size: int | None = None,
                  pad_to: int | None = None) -> dict[str, np.ndarray]:
    """Host-side inputs of the tower for images of `grids` [(t, h, w)] in patches, packed in order.

    rope: int32[N, 2], each patch's (row, column) in its frame; frames: int32[N], the frame it
    belongs to (full attention stays within one); windows: int32[N] (Qwen2.5-VL, when
    `window_size` is given), its attention window (window_size // merge // patch_size merged
    blocks on a side). Padded to `pad_to` patches: padding rows have segment id -1 and
    position 0. With windows, the patches are in window order (each window a contiguous run):
    patch_order [N] (which packed patch each row is: apply it to the pixel rows) and unpermute
    [N / merge^2] (the merged rows back in packed order)."""
    rope, frames, windows = [], [], []
    frame = window = 0
    for t, h, w in grids:
        t, h, w = int(t), int(h), int(w)
        if h % merge or w % merge:
            raise ValueError(f"image grid {(t, h, w)} is not a multiple of spatial_merge_size={merge}")
        bh, bw = h // merge, w // merge
        # Patch order: frame, block row, block column, row within the block, column within it.
        ti, bi, bj, ii, jj = np.meshgrid(np.arange(t), np.arange(bh), np.arange(bw), np.arange(merge),
                                         np.arange(merge), indexing="ij")
        rope.append(np.stack([(bi * merge + ii).ravel(), (bj * merge + jj).ravel()], axis=-1))
        frames.append(frame + ti.ravel())
        frame += t
        if window_size is not None:
            side = window_size // merge // patch_size
            nh, nw = math.ceil(bh / side), math.ceil(bw / side)
            windows.append(window + (ti * nh * nw + (bi // side) * nw + bj // side).ravel())
            window += t * nh * nw
    n = sum(len(r) for r in rope)
    pad_to = n if pad_to is None else pad_to
    if pad_to < n or pad_to % (merge * merge):
        raise ValueError(f"pad_to={pad_to} must be a multiple of {merge * merge} holding {n} patches")
    cat = (lambda parts, shape: np.concatenate(parts) if parts else np.zeros(shape, np.int64))
    out = {"rope": pad_rows(cat(rope, (0, 2)), pad_to).astype(np.int32),
           "frames": pad_rows(cat(frames, (0,)), pad_to, -1).astype(np.int32)}
    if window_size is not None:
        out["windows"] = pad_rows(cat(windows, (0,)), pad_to, -1).astype(np.int32)
        # Window order (HF's window_index): merged blocks grouped by window, each window's in
        # row-major order, padding last; the merger's output is put back by `unpermute`.
        unit = merge * merge
        unit_window = out["windows"][::unit]
        perm = np.argsort(np.where(unit_window < 0, np.iinfo(np.int32).max, unit_window), kind="stable")
        order = (perm[:, None] * unit + np.arange(unit)[None]).reshape(-1)
        out = {name: value[order] for name, value in out.items()}
        out["patch_order"] = order
        out["unpermute"] = np.argsort(perm).astype(np.int32)
    return out


def tokens_per_image(grid, merge: int) -> int:
    """The language-model tokens (merged patches) of an image of `grid` (t, h, w)."""
    t, h, w = (int(v) for v in grid)
    return t * h * w // (merge * merge)


class VisionAttention(nnx.Module):
    def __init__(self, dim, num_heads, *, dtype):
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = vision_linear(dim, (3, num_heads, self.head_dim), dtype=dtype)
        self.proj = vision_linear(dim, dim, dtype=dtype)

    def __call__(self, x, cos, sin, segments, band: int | None = None):
        """`band`: the segments are contiguous runs of at most `band` patches (windows in window order)."""
        qkv = self.qkv(x)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if band is not None and x.shape[0] % band == 0:
            out = banded_attention(q, k, v, segments, band, self.head_dim ** -0.5)
        else:
            out = dense_attention(q, k, v, segments, self.head_dim ** -0.5)
        return self.proj(out.reshape(x.shape[0], -1))

    def hf_weights(self, prefix):
        return {**self.qkv.hf_weights(f"{prefix}.qkv"), **self.proj.hf_weights(f"{prefix}.proj")}


class VisionMLP(nnx.Module):
    """Qwen2-VL: fc2(act(fc1 x)); Qwen2.5-VL (gated): down(act(gate x) * up x), all with biases."""

    def __init__(self, dim, hidden, act, *, gated, dtype):
        self.act, self.gated = act, gated
        if gated:
            self.gate_proj = vision_linear(dim, hidden, dtype=dtype)
            self.up_proj = vision_linear(dim, hidden, dtype=dtype)
            self.down_proj = vision_linear(hidden, dim, dtype=dtype)
        else:
            self.fc1 = vision_linear(dim, hidden, dtype=dtype)
            self.fc2 = vision_linear(hidden, dim, dtype=dtype)

    def __call__(self, x):
        act = vision_activation(self.act)
        if self.gated:
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(act(self.fc1(x)))

    def hf_weights(self, prefix):
        names = ("gate_proj", "up_proj", "down_proj") if self.gated else ("fc1", "fc2")
        return {k: v for n in names for k, v in getattr(self, n).hf_weights(f"{prefix}.{n}").items()}


class VisionBlock(nnx.Module):
    def __init__(self, dim, num_heads, mlp_hidden, act, *, qwen25, dtype):
        norm = (lambda: RMSNorm(dim, 1e-6, dtype=dtype)) if qwen25 else (lambda: LayerNorm(dim, 1e-6, dtype=dtype))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, num_heads, dtype=dtype)
        self.mlp = VisionMLP(dim, mlp_hidden, act, gated=qwen25, dtype=dtype)

    def __call__(self, x, shared, full_attention):
        h, cos, sin = self.norm1(x), shared["cos"], shared["sin"]
        if full_attention is None:
            x = x + self.attn(h, cos, sin, shared["frames"])
        else:  # Qwen2.5-VL: windows (banded: each a contiguous run) except in the full-attention blocks
            x = x + jax.lax.cond(full_attention, lambda: self.attn(h, cos, sin, shared["frames"]),
                                 lambda: self.attn(h, cos, sin, shared["windows"], shared["band"]))
        return x + self.mlp(self.norm2(x))

    def hf_weights(self, prefix):
        return {**self.norm1.hf_weights(f"{prefix}.norm1"), **self.norm2.hf_weights(f"{prefix}.norm2"),
                **self.attn.hf_weights(f"{prefix}.attn"), **self.mlp.hf_weights(f"{prefix}.mlp")}


class PatchMerger(nnx.Module):
    """Norm each patch, concatenate the merge x merge patches of a block, then a GELU MLP."""

    def __init__(self, out_dim, context_dim, merge, *, rms, dtype):
        self.hidden = context_dim * merge * merge
        self.ln_q = RMSNorm(context_dim, 1e-6, dtype=dtype) if rms else LayerNorm(context_dim, 1e-6, dtype=dtype)
        self.fc1 = vision_linear(self.hidden, self.hidden, dtype=dtype)
        self.fc2 = vision_linear(self.hidden, out_dim, dtype=dtype)

    def __call__(self, x):
        x = self.ln_q(x).reshape(-1, self.hidden)
        return self.fc2(vision_activation("gelu")(self.fc1(x)))

    def hf_weights(self, prefix):
        return {**self.ln_q.hf_weights(f"{prefix}.ln_q"), **self.fc1.hf_weights(f"{prefix}.mlp.0"),
                **self.fc2.hf_weights(f"{prefix}.mlp.2")}


class Qwen2VisionTransformer(nnx.Module):
    """Qwen2-VL's (model_type qwen2_vl_vision) or Qwen2.5-VL's (qwen2_5_vl_vision) tower + merger.

    Called on packed patches [N, C * T * P * P] with `vision_layout`'s arrays, it returns the
    merged embeddings [N / merge^2, out_hidden_size] in patch-block order (images one after
    another, as their placeholder tokens are)."""

    def __init__(self, vcfg, *, dtype):
        self.qwen25 = vcfg.model_type == "qwen2_5_vl_vision"
        self.merge = vcfg.spatial_merge_size
        self.patch_size, self.temporal_patch_size = vcfg.patch_size, vcfg.temporal_patch_size
        self.window_size = vcfg.window_size if self.qwen25 else None
        dim = vcfg.hidden_size if self.qwen25 else vcfg.embed_dim
        out_dim = vcfg.out_hidden_size if self.qwen25 else vcfg.hidden_size
        mlp_hidden = vcfg.intermediate_size if self.qwen25 else int(vcfg.embed_dim * vcfg.mlp_ratio)
        self.num_heads, self.head_dim = vcfg.num_heads, dim // vcfg.num_heads
        self.in_channels = vcfg.in_channels
        self.patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
        self.patch_embed = vision_linear(self.patch_dim, dim, bias=False, dtype=dtype)
        theta = dict(getattr(vcfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = self.head_dim // 2
        self.inv_freq = tuple((1.0 / theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial)).tolist())
        self.full_blocks = tuple(vcfg.fullatt_block_indexes) if self.qwen25 else ()
        self.depth = vcfg.depth
        self.blocks = EncoderStack(lambda: VisionBlock(dim, vcfg.num_heads, mlp_hidden, vcfg.hidden_act,
                                                       qwen25=self.qwen25, dtype=dtype), vcfg.depth)
        self.merger = PatchMerger(out_dim, dim, self.merge, rms=self.qwen25, dtype=dtype)

    def layout(self, grids, pad_to: int | None = None) -> dict[str, np.ndarray]:
        return vision_layout(grids, self.merge, patch_size=self.patch_size, window_size=self.window_size,
                             pad_to=pad_to)

    def pack(self, rows: np.ndarray, grids, pad_to: int | None = None) -> dict[str, np.ndarray]:
        """The tower's inputs for images of `grids` whose processor rows [patches, patch_dim] are
        `rows` (one after another): rows padded to `pad_to` (in window order for Qwen2.5-VL) and
        the layout's arrays."""
        layout = self.layout(grids, pad_to)
        pixels = pad_rows(np.asarray(rows, np.float32), len(layout["frames"]))
        order = layout.pop("patch_order", None)
        return {"pixel_values": pixels if order is None else pixels[order], **layout}

    def __call__(self, patches, rope, frames, windows=None, unpermute=None):
        x = self.patch_embed(patches.astype(self.patch_embed.kernel.dtype))
        freqs = rope.astype(jnp.float32)[:, :, None] * jnp.asarray(self.inv_freq, jnp.float32)  # [N, 2, hd/4]
        freqs = freqs.reshape(freqs.shape[0], -1)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        shared = {"cos": jnp.cos(emb), "sin": jnp.sin(emb), "frames": frames}
        per_layer = None
        if self.qwen25:
            side = self.window_size // self.merge // self.patch_size
            shared.update(windows=windows, band=side * side * self.merge * self.merge)
            per_layer = jnp.asarray([i in self.full_blocks for i in range(self.depth)])
        out = self.merger(self.blocks(x, shared, per_layer))
        return out if unpermute is None else out[unpermute]

    def hf_weights(self, prefix: str = "visual") -> HFWeights:
        shape = (self.patch_embed.out_shape[0], self.in_channels, self.temporal_patch_size, self.patch_size,
                 self.patch_size)
        return {**conv_as_linear(self.patch_embed, f"{prefix}.patch_embed.proj.weight", shape),
                **self.blocks.hf_weights(lambda i: f"{prefix}.blocks.{i}"),
                **self.merger.hf_weights(f"{prefix}.merger")}

