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
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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

    def __init__(self, cfg, *, dtype, ops, max_model_len=None):
        hidden = cfg.hidden_size
        self.num_aux = 3
        # Not split over devices (axes the sharding rules do not name): the head is small.
        self.fc = Linear((self.num_aux * hidden,), (hidden,), ("eagle_aux", "embed"), dtype=dtype)
        self.midlayer = Eagle3DecoderLayer(cfg, ops=ops, dtype=dtype, max_model_len=max_model_len)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear((hidden,), (draft_vocab_size(cfg),), ("embed", "draft_vocab"), dtype=dtype)
        self.embed_tokens = nnx.data(None)
        self.d2t = nnx.data(None)

    def attach(self, embed_tokens, d2t: jax.Array):
        self.embed_tokens = embed_tokens
        self.d2t = nnx.Variable(d2t)

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


def draft_vocab_size(cfg) -> int:
    return getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size


@dataclasses.dataclass
class EagleHead:
    loaded: LoadedModel  # the head as a model (its tokenizer None, the target's mesh)
    kv_cache_spec: KVCacheSpec  # its one layer's pages
    aux_layers: tuple[int, ...]  # the target layers whose input hidden states it reads


def load_eagle3_head(config, target: LoadedModel) -> EagleHead:
    """The EAGLE-3 head `config.speculative_config.model` (a local directory), checked against
    the target (ValueError naming the field)."""
    path = config.speculative_config.model

    def refuse(why: str):
        raise ValueError(f"speculative_config.model={path!r} {why}")

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        refuse("is not a directory with an EAGLE-3 head's config.json")
    cfg = read_hf_config(path)
    tcfg = target.hf_config
    for field in ("hidden_size", "vocab_size"):
        if getattr(cfg, field, None) != getattr(tcfg, field, None):
            refuse(f"has {field}={getattr(cfg, field, None)}, the target {getattr(tcfg, field, None)}: "
                   "the head reads the target's hidden states and embeddings")
    if getattr(cfg, "num_hidden_layers", 1) != 1:
        refuse(f"has num_hidden_layers={cfg.num_hidden_layers}; an EAGLE-3 head has one midlayer")
    if not 1 <= draft_vocab_size(cfg) <= cfg.vocab_size:
        refuse(f"has draft_vocab_size={draft_vocab_size(cfg)}; expected 1 .. vocab_size={cfg.vocab_size}")
    num_layers = tcfg.num_hidden_layers
    eagle_config = getattr(cfg, "eagle_config", None) or {}
    aux = tuple(eagle_config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers))
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in aux):
        refuse(f"reads the target's layers {aux} (eagle_config.eagle_aux_hidden_state_layer_ids); expected "
               f"three layer ids in [0, {num_layers})")
    weights = dict(iter_safetensors(path))
    d2t = np.asarray(weights.pop("d2t", np.zeros(draft_vocab_size(cfg), np.int64)))
    t2d = weights.pop("t2d", None)
    if d2t.shape != (draft_vocab_size(cfg),):
        refuse(f"has d2t of shape {d2t.shape}; expected ({draft_vocab_size(cfg)},) (draft_vocab_size)")
    mapped = np.arange(len(d2t)) + d2t
    if mapped.min() < 0 or mapped.max() >= cfg.vocab_size:
        refuse(f"has d2t mapping draft ids outside the target's vocabulary of {cfg.vocab_size}")
    if t2d is not None and np.shape(t2d) != (cfg.vocab_size,):
        refuse(f"has t2d of shape {np.shape(t2d)}; expected ({cfg.vocab_size},) (vocab_size)")
    if not hasattr(cfg, "hidden_act"):
        cfg.hidden_act = "silu"
    try:
        head = build_model(cfg, weights.items(), dtype=target.dtype, attention_backend=config.attention_backend,
                           mesh=target.mesh, max_model_len=config.max_model_len, model_cls=Eagle3Head)
    except ValueError as e:
        refuse(f"does not fit: {e}")
    head.attach(target.model.embed_tokens, jax.device_put(jnp.asarray(d2t, jnp.int32), replicated(target.mesh)))
    spec = KVCacheSpec(1, head.midlayer.self_attn.k_proj.out_shape[0], head_dim_of(cfg), config.block_size,
                       np.dtype(kv_dtype(config.kv_cache_dtype, target.dtype)), config.tensor_parallel_size)
    loaded = LoadedModel(head, cfg, None, target.dtype, target.mesh)
    return EagleHead(loaded, spec, aux)
