"""A complete, small RL loop with jpaged as the rollout engine: trainer and engine in one process.

Policy gradient (REINFORCE with a mean baseline) on the built-in `tiny` model: each step jpaged
samples completions, a reward scores them (here: the share of generated tokens that are ASCII
letters or spaces, a toy objective the random model learns in a few steps), the trainer (plain JAX,
optax) computes the loss over the sampled tokens and updates its parameters, and
`llm.load_weights` pushes them into the engine, jax arrays that never leave the devices. With
--sleep the engine sleeps (level 1) while the trainer works, freeing its KV pool and weights.

    python scripts/rl_rollout.py --steps 8

Prints per step the mean reward, the time of each phase (generate, update, load_weights), and
how far log-probabilities of the sampled tokens computed by a trainer are from the engine's:
`policy` is `llm.policy().token_logprobs` (the engine's own model as a pure JAX function, the
engine's live weights), `independent` this script's own Llama forward (the one it trains with).
With --batch-invariant the policy's rows do not depend on how it batches them.
"""

import argparse
import sys
import time
from importlib.util import find_spec

if find_spec("optax") is None:  # the trainer's optimizer
    sys.exit('error: scripts/rl_rollout.py needs optax: pip install ".[rl]"')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jpaged  # noqa: E402
from jpaged.models import tiny  # noqa: E402



# ----------------------------------------------------------------------------- the trainer's model
def rms_norm(x, w, eps):
    return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions[:, None] * inv[None, :]
    cos, sin = jnp.cos(jnp.concatenate([angles, angles], -1)), jnp.sin(jnp.concatenate([angles, angles], -1))
    rotated = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def forward(params: dict, tokens: jax.Array, cfg) -> jax.Array:
    """Causal Llama over one sequence [T] -> logits [T, vocab], from Hugging Face-named weights."""
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]  # transformers >= 5
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.float32)
    mask = jnp.tril(jnp.ones((t, t), bool))
    x = params["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_hidden_layers):
        p = lambda name: params[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        h = rms_norm(x, p("input_layernorm"), cfg.rms_norm_eps)
        q = rope((h @ p("self_attn.q_proj").T).reshape(t, heads, d), positions, theta)
        k = rope((h @ p("self_attn.k_proj").T).reshape(t, kv_heads, d), positions, theta)
        v = (h @ p("self_attn.v_proj").T).reshape(t, kv_heads, d)
        k, v = jnp.repeat(k, heads // kv_heads, axis=1), jnp.repeat(v, heads // kv_heads, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        attn = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("hqk,khd->qhd", attn, v).reshape(t, heads * d) @ p("self_attn.o_proj").T
        h = rms_norm(x, p("post_attention_layernorm"), cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps) @ params["lm_head.weight"].T


def sequence_logprobs(params, tokens, num_prompt, cfg):
    """log p(token) of each generated token of `tokens` (prompt first, `num_prompt` of them)."""
    logprobs = jax.nn.log_softmax(forward(params, tokens, cfg)[:-1], axis=-1)
    taken = jnp.take_along_axis(logprobs, tokens[1:, None], axis=-1)[:, 0]
    return taken[num_prompt - 1:]


def reward(token_ids, tokenizer) -> float:
    """The share of generated tokens whose text is plain ASCII letters or spaces."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    return sum(bool(p) and all(c.isascii() and (c.isalpha() or c == " ") for c in p) for p in pieces) / len(pieces)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=16, help="completions per step")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--sleep", action="store_true", help="the engine sleeps (level 1) during each update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-invariant", action="store_true", help="the engine's batch_invariant mode")
    args = parser.parse_args()

    cfg = tiny.tiny_config()
    params = {name: jnp.asarray(w) for name, w in tiny.tiny_weights(cfg)}
    llm = jpaged.LLM("tiny", max_model_len=128, max_num_seqs=args.rollouts, enable_sleep_mode=args.sleep,
                     batch_invariant=args.batch_invariant)
    policy = llm.policy()
    policy_logprobs = jax.jit(policy.token_logprobs, static_argnums=1)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer("Once upon a time").input_ids
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)

    def loss_fn(params, sequences, advantages):
        per_seq = [jnp.sum(sequence_logprobs(params, seq, len(prompt), cfg)) for seq in sequences]
        return -jnp.mean(jnp.stack(per_seq) * advantages)

    @jax.jit
    def update(params, opt_state, sequences, advantages):
        loss, grads = jax.value_and_grad(loss_fn)(params, sequences, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    print(f"seed {args.seed}; {args.rollouts} rollouts of {args.max_tokens} tokens per step")
    print("| step | mean reward | generate s | update s | load_weights s | max abs(policy - engine) logprob "
          "| max abs(independent - engine) |")
    print("|---|---|---|---|---|---|---|")
    for step in range(args.steps):
        t0 = time.perf_counter()
        sps = [jpaged.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0,
                                     seed=(args.seed * args.steps + step) * args.rollouts + i)
               for i in range(args.rollouts)]
        outs = llm.generate([prompt] * args.rollouts, sps, use_tqdm=False)
        completions = [o.outputs[0] for o in outs]
        t1 = time.perf_counter()
        rewards = np.array([reward(c.token_ids, tokenizer) for c in completions], np.float32)
        sequences = jnp.asarray([prompt + list(c.token_ids) for c in completions], jnp.int32)
        # The engine's own log-probabilities of what it sampled, against the trainer's (same weights).
        engine_lp = np.array([[lp[t] for lp, t in zip(c.logprobs, c.token_ids)] for c in completions])
        trainer_lp = np.asarray(jax.vmap(lambda s: sequence_logprobs(params, s, len(prompt), cfg))(sequences))
        gap = float(np.max(np.abs(engine_lp - trainer_lp)))
        rows = tuple(tuple(prompt + list(c.token_ids)) for c in completions)
        policy_lp = np.stack([np.asarray(lp)[len(prompt) - 1:] for lp in policy_logprobs(policy.params, rows)])
        policy_gap = float(np.max(np.abs(engine_lp - policy_lp)))
        if args.batch_invariant:  # on-policy: PPO/GRPO's importance ratio is exactly 1 for every token (issue 62)
            ratio = np.exp(policy_lp - engine_lp.astype(np.float32))
            assert np.all(ratio == 1.0), f"step {step}: importance ratio off 1.0 at {np.argwhere(ratio != 1.0)[:5]}"
        if args.sleep:
            llm.sleep(1)
        params, opt_state, _ = update(params, opt_state, sequences, jnp.asarray(rewards - rewards.mean()))
        jax.block_until_ready(params)
        t2 = time.perf_counter()
        if args.sleep:
            llm.wake_up()
        llm.load_weights(params)
        t3 = time.perf_counter()
        print(f"| {step} | {rewards.mean():.3f} | {t1 - t0:.2f} | {t2 - t1:.2f} | {t3 - t2:.3f} | {policy_gap:.1e} "
              f"| {gap:.1e} |")


if __name__ == "__main__":
    main()
