"""The EAGLE-3 head's training (scripts/train_eagle3.py): its forward in plain jax.numpy over whole
sequences with the training-time test, the optax loop, and the public layout's writer. Parameters
are kept under their checkpoint names, in the checkpoint's [out, in] layout."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors.numpy

EPS = 1e-5


def rope_theta_of(cfg: dict) -> float:
    """The target's RoPE base (transformers >= 5 keeps it in rope_parameters)."""
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w


def _rope(x, positions, theta, head_dim):  # x [B, T, heads, D]; HF's rotate-half
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    ang = positions[:, None].astype(jnp.float32) * inv[None]
    ang = jnp.concatenate([ang, ang], -1)[None, :, None]
    rot = jnp.concatenate([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1)
    return x * jnp.cos(ang) + rot * jnp.sin(ang)


def init_params(cfg, draft_ids, embed, final_norm, seed=0):
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    rng = np.random.default_rng(seed)

    def lin(o, i, gain=1.0):
        return (rng.standard_normal((o, i)) * gain / np.sqrt(i)).astype(np.float32)

    fc = lin(h, 3 * h, 0.1)
    fc[:, 2 * h:] += np.eye(h, dtype=np.float32)  # start from the high layer's features
    p = {"fc.weight": fc,
         "midlayer.input_layernorm.weight": np.ones(h, np.float32),
         "midlayer.hidden_norm.weight": np.ones(h, np.float32),
         "midlayer.self_attn.q_proj.weight": lin(heads * d, 2 * h),
         "midlayer.self_attn.k_proj.weight": lin(kv * d, 2 * h),
         "midlayer.self_attn.v_proj.weight": lin(kv * d, 2 * h),
         "midlayer.self_attn.o_proj.weight": lin(h, heads * d, 0.1),
         "midlayer.post_attention_layernorm.weight": np.ones(h, np.float32),
         "midlayer.mlp.gate_proj.weight": lin(inter, h),
         "midlayer.mlp.up_proj.weight": lin(inter, h),
         "midlayer.mlp.down_proj.weight": lin(h, inter, 0.1),
         "norm.weight": final_norm.astype(np.float32),
         "lm_head.weight": embed[draft_ids].astype(np.float32)}
    return {k: jnp.asarray(v) for k, v in p.items()}


def make_loss(cfg, embed, ttt_steps):
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    theta = rope_theta_of(cfg)
    embed = jnp.asarray(embed)

    def qkv(p, emb, hid, positions):
        x = jnp.concatenate([_rms(emb, p["midlayer.input_layernorm.weight"]),
                             _rms(hid, p["midlayer.hidden_norm.weight"])], -1)
        b, t = x.shape[:2]
        q = (x @ p["midlayer.self_attn.q_proj.weight"].T).reshape(b, t, heads, d)
        k = (x @ p["midlayer.self_attn.k_proj.weight"].T).reshape(b, t, kv, d)
        v = (x @ p["midlayer.self_attn.v_proj.weight"].T).reshape(b, t, kv, d)
        q, k = _rope(q, positions, theta, d), _rope(k, positions, theta, d)
        return q, jnp.repeat(k, heads // kv, 2), jnp.repeat(v, heads // kv, 2)

    def finish(p, hid, attn):
        b, t = attn.shape[:2]
        r = hid + attn.reshape(b, t, heads * d) @ p["midlayer.self_attn.o_proj.weight"].T
        m = _rms(r, p["midlayer.post_attention_layernorm.weight"])
        g, u = m @ p["midlayer.mlp.gate_proj.weight"].T, m @ p["midlayer.mlp.up_proj.weight"].T
        return r + (jax.nn.silu(g) * u) @ p["midlayer.mlp.down_proj.weight"].T

    def loss_fn(p, aux, ids, labels, valid):
        """aux [B, T, 3h], ids [B, T + steps] (tokens, padded), labels [steps, B, T] (draft ids),
        valid [steps, B, T]."""
        b, t = aux.shape[:2]
        hid = aux @ p["fc.weight"].T
        pos = jnp.arange(t)
        causal = pos[None, :] <= pos[:, None]  # [query t, key s]
        keys, values, total, accs = [], [], 0.0, []
        for j in range(ttt_steps):
            emb = embed[ids[:, j + 1:j + 1 + t]]
            q, k, v = qkv(p, emb, hid, pos + j)
            scale = d ** -0.5
            s1 = jnp.einsum("bqhd,bkhd->bhqk", q, keys[0] if keys else k) * scale
            s1 = jnp.where(causal[None, None], s1, -1e30)
            diag = [jnp.einsum("bqhd,bqhd->bhq", q, kk)[..., None] * scale for kk in keys[1:] + ([k] if keys else [])]
            scores = jnp.concatenate([s1] + diag, -1)
            w = jax.nn.softmax(scores, -1)
            attn = jnp.einsum("bhqk,bkhd->bqhd", w[..., :t], values[0] if values else v)
            for i, vv in enumerate(values[1:] + ([v] if values else [])):
                attn = attn + w[..., t + i].transpose(0, 2, 1)[..., None] * vv
            keys.append(k)
            values.append(v)
            hid = finish(p, hid, attn)
            logits = _rms(hid, p["norm.weight"]) @ p["lm_head.weight"].T
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
            nll = -jnp.take_along_axis(logp, labels[j][..., None], -1)[..., 0]
            m = valid[j].astype(jnp.float32)
            total = total + (0.8 ** j) * (nll * m).sum() / jnp.maximum(m.sum(), 1.0)
            accs.append(((jnp.argmax(logits, -1) == labels[j]) * m).sum() / jnp.maximum(m.sum(), 1.0))
        return total, jnp.stack(accs)

    return loss_fn


def batches(seqs, feats, argmax, t2d, steps, batch, length, rng):
    """Random batches: (aux, ids, labels, valid), sequences cut or padded to `length`."""
    n = len(seqs)
    while True:
        idx = rng.choice(n, batch, replace=False)
        hid = feats[0].shape[1]
        aux = np.zeros((batch, length, hid), np.float32)
        ids = np.zeros((batch, length + steps + 1), np.int32)
        labels = np.zeros((steps, batch, length), np.int32)
        valid = np.zeros((steps, batch, length), bool)
        for b, i in enumerate(idx):
            s, f, a = np.asarray(seqs[i]), feats[i], argmax[i]
            start = rng.integers(0, max(1, len(s) - length))
            s, f, a = s[start:start + length + steps + 1], f[start:start + length], a[start:start + length + steps]
            aux[b, :len(f)] = f
            ids[b, :len(s)] = s
            for j in range(steps):
                # Step j at anchor t: the token after t + j + 1, by the target's argmax at t + j + 1.
                lab = a[j + 1:j + 1 + length]
                n_ok = min(len(lab), len(f), len(s) - j - 2)
                if n_ok <= 0:
                    continue
                lab = lab[:n_ok]
                d = np.where(lab >= 0, t2d[np.maximum(lab, 0)], -1)  # -1: no label (the prompt)
                labels[j, b, :n_ok] = np.maximum(d, 0)
                valid[j, b, :n_ok] = d >= 0
        yield aux, ids, labels, valid


def train_head(cfg, seqs, feats, argmax, embed, final_norm, args):
    """(params, draft vocabulary ids) after `args.minutes` of AdamW."""
    known = np.concatenate([np.asarray(a) for a in argmax])
    counts = np.bincount(known[known >= 0], minlength=cfg["vocab_size"])
    draft_ids = np.sort(np.argsort(-counts)[:args.draft_vocab])
    covered = counts[draft_ids].sum() / counts.sum()
    print(f"draft vocabulary: {len(draft_ids)} tokens cover {covered:.1%} of the target's argmax tokens", flush=True)
    t2d = np.full(cfg["vocab_size"], -1, np.int64)
    t2d[draft_ids] = np.arange(len(draft_ids))
    params = init_params(cfg, draft_ids, embed, final_norm)
    loss_fn = make_loss(cfg, embed, args.ttt_steps)
    # The learning rate follows the clock (warm-up, then cosine to 5% at the deadline): the
    # steps' speed on a shared machine is not known in advance.
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.0))
    state = opt.init(params)

    def lr_at(i, frac):
        warm = min(1.0, (i + 1) / 20)
        return args.lr * warm * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * min(frac, 1.0))))

    @jax.jit
    def step(params, state, aux, ids, labels, valid):
        (loss, accs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, aux, ids, labels, valid)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, accs

    rng = np.random.default_rng(0)
    data = batches(seqs, feats, argmax, t2d, args.ttt_steps, args.batch, 160, rng)
    deadline, i, start = time.time() + args.minutes * 60, 0, time.time()
    while time.time() < deadline:
        state[1].hyperparams["learning_rate"] = jnp.asarray(lr_at(i, (time.time() - start) / (args.minutes * 60)))
        params, state, loss, accs = step(params, state, *next(data))
        i += 1
        if i % 20 == 0 or i == 1:
            print(f"step {i} ({time.time() - start:.0f} s): loss {float(loss):.3f}, "
                  f"top-1 by step {np.round(np.asarray(accs), 3).tolist()}", flush=True)
    return {k: np.asarray(v) for k, v in params.items()}, draft_ids


def write_head(out, tcfg, params, draft_ids, layers):
    """The public layout: config.json and model.safetensors (with d2t and t2d)."""
    h = tcfg["hidden_size"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": tcfg["intermediate_size"], "num_attention_heads": tcfg["num_attention_heads"],
           "num_key_value_heads": tcfg["num_key_value_heads"],
           "head_dim": tcfg.get("head_dim") or h // tcfg["num_attention_heads"], "num_hidden_layers": 1,
           "hidden_act": "silu", "rms_norm_eps": tcfg.get("rms_norm_eps", EPS), "rope_theta": rope_theta_of(tcfg),
           "max_position_embeddings": tcfg.get("max_position_embeddings"), "vocab_size": tcfg["vocab_size"],
           "draft_vocab_size": len(draft_ids), "torch_dtype": "float32", "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    t2d = np.zeros(tcfg["vocab_size"], bool)
    t2d[draft_ids] = True
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in params.items()}
    tensors.update(d2t=(draft_ids - np.arange(len(draft_ids))).astype(np.int64), t2d=t2d)
    safetensors.numpy.save_file(tensors, os.path.join(out, "model.safetensors"))
