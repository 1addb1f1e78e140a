"""A random EAGLE-3 head in the public layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: config.json,
fc, midlayer.*, norm, lm_head, d2t, t2d), and its drafts computed in float64 numpy from the
target's hidden states (Hugging Face transformers), the tests' independent reference. The same
for an EAGLE-1/2 head (yuhuili/EAGLE-LLaMA3-Instruct-8B: fc with its bias, layers.0.*)."""

import json

import numpy as np
import safetensors.numpy


HEAD_SHAPE = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def _head_config(target_cfg, architecture: str, **fields) -> dict:
    """A one-layer Llama head's config for `target_cfg` (4 heads, 2 kv heads of 32, MLP 2h)."""
    h = target_cfg.hidden_size
    return {"architectures": [architecture], "model_type": "llama", "hidden_size": h, "intermediate_size": 2 * h,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 1,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "vocab_size": target_cfg.vocab_size, "torch_dtype": "float32", "tie_word_embeddings": False, **fields}


def _random_linear(rng):
    def linear(out_dim, in_dim, gain=1.0):
        return (rng.standard_normal((out_dim, in_dim)) * gain / np.sqrt(in_dim)).astype(np.float32)
    return linear


def _save(path, cfg: dict, weights: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    safetensors.numpy.save_file(weights, str(path / "model.safetensors"))
    return str(path)


def write_head(path, target_cfg, *, draft_vocab: int = 64, seed: int = 0, aux_layers=None, draft_ids=None,
               d2t_dtype=np.int64, **overrides) -> str:
    """A random head for `target_cfg` (a transformers config) in `path`; `overrides`: config fields;
    `draft_ids`: the draft vocabulary (target ids; default: `draft_vocab` random ones); `d2t_dtype`:
    d2t's dtype (None: no d2t, a malformed head)."""
    rng = np.random.default_rng(seed)
    if draft_ids is not None:
        draft_vocab = len(draft_ids)
    cfg = _head_config(target_cfg, "LlamaForCausalLMEagle3", draft_vocab_size=draft_vocab)
    h, heads, kv, d, inter = (cfg[k] for k in HEAD_SHAPE)
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    cfg.update(overrides)
    linear = _random_linear(rng)

    # The draft vocabulary: a sorted subset of the target's (d2t: target id - draft id).
    draft_ids = np.sort(rng.choice(cfg["vocab_size"], draft_vocab, replace=False) if draft_ids is None else draft_ids)
    t2d = np.zeros(cfg["vocab_size"], bool)
    t2d[draft_ids] = True
    weights = {
        "fc.weight": linear(h, 3 * h),
        "midlayer.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "midlayer.hidden_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "midlayer.self_attn.q_proj.weight": linear(heads * d, 2 * h, 2.0),
        "midlayer.self_attn.k_proj.weight": linear(kv * d, 2 * h, 2.0),
        "midlayer.self_attn.v_proj.weight": linear(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": linear(h, heads * d),
        "midlayer.post_attention_layernorm.weight": np.ones(h, np.float32),
        "midlayer.mlp.gate_proj.weight": linear(inter, h),
        "midlayer.mlp.up_proj.weight": linear(inter, h),
        "midlayer.mlp.down_proj.weight": linear(h, inter),
        "norm.weight": np.ones(h, np.float32),
        "lm_head.weight": linear(draft_vocab, h, 4.0),
        "d2t": (draft_ids - np.arange(draft_vocab)).astype(d2t_dtype or np.int64),
        "t2d": t2d,
    }
    if d2t_dtype is None:
        del weights["d2t"]
    return _save(path, cfg, weights)


def write_successor_head(path, target_cfg, embed, successors: dict) -> str:
    """A head built by hand (not random) whose drafts follow `successors` {token: next token}: after
    token t it drafts successors[t], then successors of that, ... (for a token not in the map, one
    of the successors). Its attention reads only the token's embedding and attends to itself (q and
    k are that embedding); the value carries the embedding into the first 64 hidden dimensions and
    subtracts the hidden input (the chain's last output), so each step's output is the embedding of
    its own token. fc and the MLP are zero; the LM head's row for successors[t] is t's embedding."""
    write_head(path, target_cfg, draft_ids=sorted(set(successors.values())))
    cfg = json.loads(open(f"{path}/config.json").read())
    weights = safetensors.numpy.load_file(f"{path}/model.safetensors")
    h, d, eps = cfg["hidden_size"], cfg["head_dim"], cfg["rms_norm_eps"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2) and 2 * d <= h
    w = 2 * d  # the dimensions carried: kv head j carries [j * d, (j + 1) * d)
    # The hidden input's first w dims, after hidden_norm, are about 1 / sqrt(w / h) times the output's.
    cancel = np.sqrt(w / h)
    eye = np.eye(d, dtype=np.float32)
    q, k, v = (np.zeros((n * d, 2 * h), np.float32) for n in (4, 2, 2))
    o = np.zeros((h, 4 * d), np.float32)
    for head in range(4):
        kv = head // 2
        q[head * d:(head + 1) * d, kv * d:(kv + 1) * d] = 2 * eye
    for kv in range(2):
        k[kv * d:(kv + 1) * d, kv * d:(kv + 1) * d] = 2 * eye
        v[kv * d:(kv + 1) * d, kv * d:(kv + 1) * d] = eye
        v[kv * d:(kv + 1) * d, h + kv * d:h + (kv + 1) * d] = -cancel * eye
        o[kv * d:(kv + 1) * d, 2 * kv * d:(2 * kv + 1) * d] = eye  # q heads 0 and 2; 1 and 3 add nothing
    normed = embed / np.sqrt((embed.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
    draft_ids = [int(i) for i in np.arange(len(weights["d2t"])) + weights["d2t"]]
    lm_head = np.zeros((len(draft_ids), h), np.float32)
    for t, nxt in successors.items():
        lm_head[draft_ids.index(nxt), :w] = normed[t, :w]
    weights.update({"fc.weight": np.zeros_like(weights["fc.weight"]), "midlayer.self_attn.q_proj.weight": q,
                    "midlayer.self_attn.k_proj.weight": k, "midlayer.self_attn.v_proj.weight": v,
                    "midlayer.self_attn.o_proj.weight": o, "lm_head.weight": lm_head,
                    "midlayer.input_layernorm.weight": np.ones(h, np.float32),
                    "midlayer.hidden_norm.weight": np.ones(h, np.float32),
                    "midlayer.mlp.down_proj.weight": np.zeros_like(weights["midlayer.mlp.down_proj.weight"])})
    safetensors.numpy.save_file(weights, f"{path}/model.safetensors")
    return str(path)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):  # x [tokens, heads, d], HF's rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def write_eagle_head(path, target_cfg, *, seed: int = 0, fc_bias: bool = True, **overrides) -> str:
    """A random EAGLE-1/2 head for `target_cfg` in `path`; `overrides`: config fields. Like the
    public files it carries embed_tokens.weight (random here: the target's must be used) and here
    a layers.0.input_layernorm.weight far from 1 (vLLM does not read it: neither may we)."""
    rng = np.random.default_rng(seed)
    cfg = _head_config(target_cfg, "LlamaForCausalLM", bias=fc_bias)
    h, heads, kv, d, inter = (cfg[k] for k in HEAD_SHAPE)
    cfg.update(overrides)
    linear = _random_linear(rng)

    # fc's gain: the embedding (rms 1) and the target's output (rms 1 after its norm) both count.
    weights = {
        "fc.weight": linear(h, 2 * h, 2.0),
        "layers.0.input_layernorm.weight": np.full(h, 3.0, np.float32),
        "layers.0.self_attn.q_proj.weight": linear(heads * d, h, 2.0),
        "layers.0.self_attn.k_proj.weight": linear(kv * d, h, 2.0),
        "layers.0.self_attn.v_proj.weight": linear(kv * d, h),
        "layers.0.self_attn.o_proj.weight": linear(h, heads * d),
        "layers.0.post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "layers.0.mlp.gate_proj.weight": linear(inter, h),
        "layers.0.mlp.up_proj.weight": linear(inter, h),
        "layers.0.mlp.down_proj.weight": linear(h, inter),
        "embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], h)).astype(np.float32),
    }
    if fc_bias:
        weights["fc.bias"] = (0.5 * rng.standard_normal(h)).astype(np.float32)
    return _save(path, cfg, weights)


def _load(path):
    cfg = json.loads(open(f"{path}/config.json").read())
    weights = {k: v.astype(np.float64) if v.dtype.kind == "f" else v
               for k, v in safetensors.numpy.load_file(f"{path}/model.safetensors").items()}
    return cfg, weights


def _attention(x, w, prefix, c, positions):
    """A causal GQA attention with rotary embeddings over whole sequences (biases where `w` has them)."""
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def proj(name, n):
        y = x @ w[f"{prefix}.{name}.weight"].T + w.get(f"{prefix}.{name}.bias", 0)
        return y.reshape(len(x), n, d)

    q, k, v = proj("q_proj", heads), proj("k_proj", kv), proj("v_proj", kv)
    q, k = _rope(q, positions, c["rope_theta"]), _rope(k, positions, c["rope_theta"])
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((len(q), len(q)), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", p, v).reshape(len(q), -1)
    return o @ w[f"{prefix}.o_proj.weight"].T + w.get(f"{prefix}.o_proj.bias", 0)


def _mlp(x, w, prefix):
    g, u = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ w[f"{prefix}.down_proj.weight"].T


class ReferenceEagleHead:
    """An EAGLE-1/2 head in float64 numpy, over whole sequences: the drafts it proposes with the
    target's embedding and LM head."""

    def __init__(self, path, embed, lm_head):
        self.cfg, self.w = _load(path)
        self.embed, self.lm_head = embed.astype(np.float64), lm_head.astype(np.float64)

    def layer(self, emb, hidden, positions):
        w, c = self.w, self.cfg
        x = np.concatenate([emb, hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        r = x + _attention(x, w, "layers.0.self_attn", c, positions)  # no input norm
        return r + _mlp(_rms(r, w["layers.0.post_attention_layernorm.weight"], c["rms_norm_eps"]), w, "layers.0.mlp")

    def drafts(self, tokens, hidden, k):
        """The k drafts after `tokens` (its last one not yet run by the target): `hidden` [len - 1,
        hidden], the target's output (after its final norm) at every token but the last."""
        emb = self.embed[np.asarray(tokens[1:])]
        drafts = []
        for _ in range(k):
            out = self.layer(emb, hidden, np.arange(len(emb), dtype=np.float64))
            drafts.append(int(np.argmax(self.lm_head @ out[-1])))
            emb = np.concatenate([emb, self.embed[drafts[-1]][None]])
            hidden = np.concatenate([hidden, out[-1:]])
        return drafts


class ReferenceHead:
    """The head in float64 numpy, over whole sequences (no pages): the drafts it proposes."""

    def __init__(self, path, embed):
        self.cfg, self.w = _load(path)
        self.embed = embed.astype(np.float64)

    def layer(self, emb, hidden, positions):
        c, w = self.cfg, self.w
        eps = c["rms_norm_eps"]
        x = np.concatenate([_rms(emb, w["midlayer.input_layernorm.weight"], eps),
                            _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)
        r = hidden + _attention(x, w, "midlayer.self_attn", c, positions)
        return r + _mlp(_rms(r, w["midlayer.post_attention_layernorm.weight"], eps), w, "midlayer.mlp")

    def draft(self, hidden):
        logits = _rms(hidden, self.w["norm.weight"], self.cfg["rms_norm_eps"]) @ self.w["lm_head.weight"].T
        i = int(np.argmax(logits))
        return i + int(self.w["d2t"][i])

    def drafts(self, tokens, aux, k):
        """The k drafts after `tokens` (its last one not yet run by the target): `aux` [len - 1,
        3 * hidden], the target's features at every token but the last."""
        n = len(tokens) - 1
        hidden = aux @ self.w["fc.weight"].T
        emb = self.embed[np.asarray(tokens[1:])]
        positions = np.arange(n, dtype=np.float64)
        out = self.layer(emb, hidden, positions)
        drafts = [self.draft(out[-1])]
        for _ in range(k - 1):
            emb = np.concatenate([emb, self.embed[drafts[-1]][None]])
            hidden = np.concatenate([hidden, out[-1:]])
            positions = np.arange(len(emb), dtype=np.float64)
            out = self.layer(emb, hidden, positions)
            drafts.append(self.draft(out[-1]))
        return drafts
