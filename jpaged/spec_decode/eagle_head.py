"""The EAGLE-3 draft head (Li et al. 2025) and its loader, in the layout of the public heads
(`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`, read by vLLM's llama_eagle3.py and written by SpecForge):

  config.json   a Llama config (architectures LlamaForCausalLMEagle3): hidden_size, the heads,
                intermediate_size, rms_norm_eps, rope; num_hidden_layers 1; vocab_size (the
                target's) and draft_vocab_size; optionally eagle_config.eagle_aux_hidden_state_layer_ids
  fc.weight     [hidden, 3 * hidden]: fuses the target's low, middle and high hidden states
  midlayer.*    one decoder layer whose attention reads concat(input_layernorm(embedding),
                hidden_norm(hidden)) ([2 * hidden] -> q/k/v), then post_attention_layernorm + mlp
  norm.weight, lm_head.weight [draft_vocab, hidden]
  d2t [draft_vocab] (draft id + d2t[id] = target id), t2d [vocab] (bool: in the draft vocabulary)

The token embedding is the target's. The midlayer's residual is its hidden input (fc's output at
the first step, the previous step's pre-norm output after), as in vLLM and SpecForge.

EAGLE-1/2 heads (`{"method": "eagle"}`; `yuhuili/EAGLE-LLaMA3-Instruct-8B`, read by vLLM's
llama_eagle.py) have another layout:

  config.json   a Llama config (architectures LlamaForCausalLM), num_hidden_layers 1
  fc.weight     [hidden, 2 * hidden] (fc.bias where the head has one): fuses the embedding of the
                next token with the target's hidden state, in that order
  layers.0.*    a Llama decoder layer without its input norm (fc's output enters attention as it
                is; a layers.0.input_layernorm.weight in the file is not read, as in vLLM)
  embed_tokens.weight (optional, not read: the target's is used)

with no norm of its own: its drafts are the target's LM head over its outputs. Its feature is the
target's output after the final norm (what the LM head reads), at every token; vLLM and the EAGLE
reference code feed the same. Both kinds of head are EagleHeads; EagleRunner (eagle.py) runs
either through `__call__` (a target step's tokens), `step` (one draft) and `draft`.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.forward_context import MODEL_OUTPUT
from jpaged.models.kv_cache import KVCacheSpec, kv_dtype
from jpaged.models.layers import GatedMLP, Linear, RMSNorm
from jpaged.models.llama import head_dim_of, llama_attention
from jpaged.models.loader import LoadedModel, build_model, iter_safetensors, read_hf_config
from jpaged.models.paged_attention import check_kernels
from jpaged.parallel.sharding import replicated


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SpecForge's default: the hidden states entering layers 2, L/2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3DecoderLayer(nnx.Module):
    def __init__(self, cfg, *, ops, dtype, max_model_len=None):
        hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = attn = llama_attention(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len)
        # q/k/v read the embedding and the hidden state side by side.
        for name, axes in (("q_proj", "q_heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads")):
            setattr(attn, name, Linear((2 * hidden,), getattr(attn, name).out_shape, ("embed", axes, "head_dim"),
                                       dtype=dtype))
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act, dtype=dtype)

    def __call__(self, embeds, hidden, positions, kv_cache):
        x = jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(hidden)], axis=-1)
        h, kv_cache = self.self_attn(x, positions, kv_cache)
        residual = hidden + h
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv_cache

    def hf_weights(self, prefix: str):
        return {**self.input_layernorm.hf_weights(f"{prefix}.input_layernorm"),
                **self.hidden_norm.hf_weights(f"{prefix}.hidden_norm"),
                **self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.post_attention_layernorm.hf_weights(f"{prefix}.post_attention_layernorm"),
                **self.mlp.hf_weights(f"{prefix}.mlp")}


class Eagle3Head(nnx.Module):
    """fc, the midlayer, norm and the draft LM head; `embed_tokens` (the target's) and `d2t` are
    attached after loading (Eagle3Head.attach)."""

    # The target's embedding (shared), and the vocabulary maps (read apart).
    ignored_hf_weights = (r"embed_tokens\.weight", r"d2t", r"t2d")
    # The target's modules the head calls: the head's attribute -> the target model's. EagleRunner
    # passes their current weights from the target's state at every call (LoRA slot writes donate
    # the target's state: a copy held here would be deleted).
    shared = {"embed_tokens": "embed_tokens"}

    num_aux = 3  # the target's features it fuses

    def __init__(self, cfg, *, dtype, ops, max_model_len=None):
        hidden = cfg.hidden_size
        # Not split over devices (axes the sharding rules do not name): the head is small.
        self.fc = Linear((self.num_aux * hidden,), (hidden,), ("eagle_aux", "embed"), dtype=dtype)
        self.midlayer = Eagle3DecoderLayer(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear((hidden,), (draft_vocab_size(cfg),), ("embed", "draft_vocab"), dtype=dtype)
        self.embed_tokens = nnx.data(None)
        self.d2t = nnx.data(None)

    def attach(self, target, d2t: jax.Array):
        self.embed_tokens = target.embed_tokens
        self.d2t = nnx.Variable(d2t)

    @property
    def self_attn(self):
        return self.midlayer.self_attn

    def __call__(self, aux, next_ids, positions, kv_cache):
        """A target step's tokens: `aux` [tokens, 3 * hidden] (the target's features at each token)
        and `next_ids` (the token after each): the midlayer's outputs [tokens, hidden]."""
        return self.step(next_ids, self.fc(aux.astype(self.fc.kernel.dtype)), positions, kv_cache)

    def step(self, ids, hidden, positions, kv_cache):
        """One midlayer step: tokens `ids` with the hidden states before them (fc's output, or the
        head's own last outputs in the draft chain)."""
        return self.midlayer(self.embed_tokens(ids), hidden, positions, kv_cache)

    def draft(self, hidden):
        """The most likely next token after each midlayer output, as a target token id."""
        logits = self.lm_head(self.norm(hidden)).astype(jnp.float32)
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return ids + self.d2t[...][ids]

    def hf_weights(self):
        return {**self.fc.hf_weights("fc"), **self.midlayer.hf_weights("midlayer"), **self.norm.hf_weights("norm"),
                **self.lm_head.hf_weights("lm_head")}


class Eagle1DecoderLayer(nnx.Module):
    """EAGLE-1/2's decoder layer: a Llama layer without the input norm. Biases where the head's
    file has them (cfg.eagle_biases: q/k/v, o)."""

    def __init__(self, cfg, *, ops, dtype, max_model_len=None):
        qkv_bias, o_bias = cfg.eagle_biases
        self.self_attn = llama_attention(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len, qkv_bias=qkv_bias,
                                         o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype)

    def __call__(self, x, positions, kv_cache):
        h, kv_cache = self.self_attn(x, positions, kv_cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache

    def hf_weights(self, prefix: str):
        return {**self.self_attn.hf_weights(f"{prefix}.self_attn"),
                **self.post_attention_layernorm.hf_weights(f"{prefix}.post_attention_layernorm"),
                **self.mlp.hf_weights(f"{prefix}.mlp")}


class Eagle1Head(nnx.Module):
    """fc and one decoder layer; `embed_tokens` and `lm_head` (the target's: None where it ties
    its embeddings) are attached after loading (Eagle1Head.attach)."""

    # The target's embedding and LM head (shared); the first layer's input norm (identity, as in vLLM).
    ignored_hf_weights = (r"embed_tokens\.weight", r"lm_head\.weight", r"layers\.0\.input_layernorm\.weight")
    num_aux = 1  # the target's output

    def __init__(self, cfg, *, dtype, ops, max_model_len=None):
        hidden = cfg.hidden_size
        self.fc = Linear((2 * hidden,), (hidden,), ("eagle_aux", "embed"), use_bias=cfg.eagle_fc_bias, dtype=dtype)
        self.layer = Eagle1DecoderLayer(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len)
        self.embed_tokens = nnx.data(None)
        self.lm_head = nnx.data(None)

    @property
    def shared(self) -> dict:
        """The target's modules the head calls (see Eagle3Head.shared)."""
        return {"embed_tokens": "embed_tokens", **({} if self.lm_head is None else {"lm_head": "lm_head"})}

    def attach(self, target):
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head

    @property
    def self_attn(self):
        return self.layer.self_attn

    def __call__(self, aux, next_ids, positions, kv_cache):
        """A target step's tokens: `aux` [tokens, hidden] (the target's output at each token) and
        `next_ids` (the token after each): the layer's outputs [tokens, hidden]."""
        return self.step(next_ids, aux, positions, kv_cache)

    def step(self, ids, hidden, positions, kv_cache):
        """One step: tokens `ids` with the hidden states before them (the target's, or the head's
        own last outputs in the draft chain), fused by fc."""
        x = jnp.concatenate([self.embed_tokens(ids), hidden.astype(self.fc.kernel.dtype)], axis=-1)
        return self.layer(self.fc(x), positions, kv_cache)

    def draft(self, hidden):
        """The target's most likely next token after each output (its LM head; the target's
        logit scaling or capping, monotone, would not move the argmax)."""
        logits = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)

    def hf_weights(self):
        return {**self.fc.hf_weights("fc"), **self.layer.hf_weights("layers.0")}


def draft_vocab_size(cfg) -> int:
    return getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size


@dataclasses.dataclass
class EagleHead:
    loaded: LoadedModel  # the head as a model (its tokenizer None, the target's mesh)
    kv_cache_spec: KVCacheSpec  # its one layer's pages
    aux_layers: tuple[int, ...]  # the target layers whose input hidden states it reads (MODEL_OUTPUT: the output)
    method: str  # "eagle3" or "eagle"


def load_eagle_head(config, target: LoadedModel) -> EagleHead:
    """The EAGLE head `config.speculative_config.model` (a local directory) in the layout of its
    method, checked against the target (ValueError naming the field)."""
    method, path = config.speculative_config.method, config.speculative_config.model

    def refuse(why: str):
        raise ValueError(f"speculative_config.model={path!r} {why}")

    name = "an EAGLE-3" if method == "eagle3" else "an EAGLE"
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        refuse(f"is not a directory with {name} head's config.json")
    cfg = read_hf_config(path)
    tcfg = target.hf_config
    for field in ("hidden_size", "vocab_size"):
        if getattr(cfg, field, None) != getattr(tcfg, field, None):
            refuse(f"has {field}={getattr(cfg, field, None)}, the target {getattr(tcfg, field, None)}: "
                   "the head reads the target's hidden states and embeddings")
    if getattr(cfg, "num_hidden_layers", 1) != 1:
        refuse(f"has num_hidden_layers={cfg.num_hidden_layers}; {name} head has one decoder layer")
    if not hasattr(cfg, "hidden_act"):
        cfg.hidden_act = "silu"
    weights = dict(iter_safetensors(path))
    layout = _eagle3_layout if method == "eagle3" else _eagle1_layout
    model_cls, aux, extras = layout(cfg, tcfg, weights, refuse)
    try:
        head = build_model(cfg, weights.items(), dtype=target.dtype, attention_backend=config.attention_backend,
                           mesh=target.mesh, max_model_len=config.max_model_len, model_cls=model_cls,
                           batch_invariant=config.batch_invariant)  # (its drafts then do not depend on the batch)
    except ValueError as e:
        refuse(f"does not fit: {e}")
    head.attach(target.model, *(jax.device_put(jnp.asarray(x), replicated(target.mesh)) for x in extras))
    spec = KVCacheSpec(1, head.self_attn.k_proj.out_shape[0], head_dim_of(cfg), config.block_size,
                       np.dtype(kv_dtype(config.kv_cache_dtype, target.dtype)), config.tensor_parallel_size)
    loaded = LoadedModel(head, cfg, None, target.dtype, target.mesh)
    return EagleHead(loaded, spec, aux, method)


def _wrong_layout(weights: dict, prefix: str, method: str, refuse):
    if any(name.startswith(prefix) for name in weights):
        refuse(f"has {prefix}* tensors, the layout of method {method!r}")


def _eagle3_layout(cfg, tcfg, weights: dict, refuse):
    """EAGLE-3: the aux layers (from eagle_config or the default) and d2t; pops d2t and t2d. A
    midlayer saved as layers.0.* is read as midlayer.* (vLLM reads both). d2t must be an integer
    tensor, and may be left out only by a head that drafts from the target's whole vocabulary."""
    for name in [n for n in weights if n.startswith("layers.0.")]:
        weights["midlayer." + name.removeprefix("layers.0.")] = weights.pop(name)
    num_layers = tcfg.num_hidden_layers
    eagle_config = getattr(cfg, "eagle_config", None) or {}
    aux = tuple(eagle_config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers))
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in aux):
        refuse(f"reads the target's layers {aux} (eagle_config.eagle_aux_hidden_state_layer_ids); expected "
               f"three layer ids in [0, {num_layers})")
    if not 1 <= draft_vocab_size(cfg) <= cfg.vocab_size:
        refuse(f"has draft_vocab_size={draft_vocab_size(cfg)}; expected 1 .. vocab_size={cfg.vocab_size}")
    if "d2t" in weights:
        d2t = np.asarray(weights.pop("d2t"))
        if d2t.dtype.kind not in "iu":  # float offsets once drafted nothing, silently
            refuse(f"has d2t of dtype {d2t.dtype}; expected an integer tensor (int64: target id - draft id)")
    elif draft_vocab_size(cfg) != cfg.vocab_size:  # without it, draft id i would be read as target id i
        refuse(f"has no d2t tensor; a head whose draft vocabulary (draft_vocab_size={draft_vocab_size(cfg)}) is "
               f"smaller than the target's ({cfg.vocab_size}) needs d2t to map its draft ids to target ids")
    else:  # the target's whole vocabulary: draft id = target id (vLLM reads such a head the same)
        d2t = np.zeros(cfg.vocab_size, np.int64)
    t2d = weights.pop("t2d", None)
    if d2t.shape != (draft_vocab_size(cfg),):
        refuse(f"has d2t of shape {d2t.shape}; expected ({draft_vocab_size(cfg)},) (draft_vocab_size)")
    mapped = np.arange(len(d2t)) + d2t
    if mapped.min() < 0 or mapped.max() >= cfg.vocab_size:
        refuse(f"has d2t mapping draft ids outside the target's vocabulary of {cfg.vocab_size}")
    if t2d is not None and np.shape(t2d) != (cfg.vocab_size,):
        refuse(f"has t2d of shape {np.shape(t2d)}; expected ({cfg.vocab_size},) (vocab_size)")
    return Eagle3Head, aux, (d2t.astype(np.int32),)


def _eagle1_layout(cfg, tcfg, weights: dict, refuse):
    """EAGLE-1/2: the target's output is the feature; biases where the file has them (the
    configs' `bias` fields disagree across trainers, the tensors do not)."""
    _wrong_layout(weights, "midlayer.", "eagle3", refuse)
    if getattr(cfg, "add_para_norm", False):
        refuse("has add_para_norm=true (HASS's norms before fc), which jpaged does not read")
    if getattr(cfg, "draft_vocab_size", None) not in (None, cfg.vocab_size):
        refuse(f"has draft_vocab_size={cfg.draft_vocab_size}; an EAGLE head drafts from the target's whole "
               f"vocabulary of {cfg.vocab_size}")
    cfg.eagle_fc_bias = "fc.bias" in weights
    cfg.eagle_biases = ("layers.0.self_attn.q_proj.bias" in weights, "layers.0.self_attn.o_proj.bias" in weights)
    return Eagle1Head, (MODEL_OUTPUT,), ()
