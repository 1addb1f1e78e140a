"""The sampler: turns one step's logits into token ids (and logprobs) inside the jitted model step.

Only the sampled ids and the requested logprobs leave the device. Per-sequence knobs travel as
arrays in `SamplingMetadata` (padded to the step's sequence bucket S), so one compiled step serves
any mix of sampling parameters; the only static (compile-time) values are `do_penalties` and
`num_logprobs`.

Pipeline of `sample(logits, meta)` for each row (vLLM v0.6 / v1 semantics unless noted):

1. Penalties (only when `meta.do_penalties`), in vLLM's order:
   - repetition: for every token that occurs in the prompt or in the output so far,
     `l = l / r if l > 0 else l * r`;
   - frequency: `l -= frequency_penalty * count_in_output(token)`;
   - presence:  `l -= presence_penalty * (count_in_output(token) > 0)`.
2. Banned tokens (`banned_token_ids`, e.g. EOS / stop ids while min_tokens is not reached) -> -inf;
   then OpenAI's `logit_bias` (added); then the structured-output grammar's mask (only when
   `meta.do_guided`: tokens whose bit is clear in the row's `allowed_bitmask` -> -inf).
3. Logprobs are taken here: `log_softmax` of these penalized, ban-masked logits, i.e. BEFORE
   temperature and top-k / top-p / min-p. (vLLM v0 reports logprobs after temperature and
   truncation, v1 by default reports raw ones before penalties; we report the distribution of the
   model as adjusted by the request's penalties/bans, which does not depend on the sampling knobs:
   a greedy and a sampled request see the same numbers, and no kept token gets -inf.) The sampled
   token's logprob and the top-K (by logprob, descending) ids / values are returned.
4. Greedy rows (temperature < 1e-5) take the argmax of the step-2 logits.
5. Other rows: divide by temperature; then top-k (keep the k largest), then top-p on the top-k
   renormalised distribution (keep the smallest prefix, in descending order, whose cumulative
   probability reaches top_p; always at least one token), then min-p (drop tokens whose probability
   is < min_p * the largest probability). All three are prefix cuts of the sorted row, so they are
   done with one descending sort per row and turned into a logit threshold; tokens tied with the
   threshold logit are kept. Then Gumbel-max with the row's key
   `fold_in(fold_in(key(seed), seq_index), sample_index)`: the noise depends only on the row's
   (seed, seq_index, sample_index) and the vocab size, so a row draws the same token whatever
   else is in the batch, at whatever position and bucket size.

Cheap when the knobs are off: the sort is under a `lax.cond` taken only when some random row uses
top-k/top-p/min-p, the Gumbel noise only when some row is random, the penalties only when
`do_penalties` is set. A batch the host knows is all greedy (`all_greedy`, a separate
executable) has no branch at all: on a GPU, XLA runs a `lax.cond` by copying its predicate to the
host and waiting for it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.batch_invariant import logsumexp_last
from jpaged.sampling_params import _GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, SamplingParams

GREEDY_TEMPERATURE = _GREEDY_TEMPERATURE  # temperature below this: greedy (argmax)

_DATA_FIELDS = [
    "temperature", "top_k", "top_p", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seeds", "seq_index", "sample_index",
    "prompt_token_ids", "output_token_ids", "banned_token_ids",
    "logit_bias_ids", "logit_bias_values", "allowed_bitmask", "target_token_ids",
]
_META_FIELDS = ["do_penalties", "num_logprobs", "do_guided", "batch_invariant", "all_greedy"]
# Entries of a row's logit_bias (a fixed width: one compiled shape whatever the requests ask).



@functools.partial(jax.tree_util.register_dataclass, data_fields=_DATA_FIELDS, meta_fields=_META_FIELDS)
@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step, padded to the step's sequence bucket S.

    A pytree: the array fields are leaves (jit traces them, any values reuse the compiled step);
    `do_penalties` and `num_logprobs` are static (part of the tree structure: changing them
    compiles another variant). Padding rows may hold any valid values; `from_rows` makes them
    greedy with every knob off and no tokens.

    Array fields (numpy on the host, jax arrays inside the step):
      temperature        f32[S]  < 1e-5 means greedy (argmax)
      top_k              i32[S]  <= 0 or >= vocab: disabled
      top_p              f32[S]  in (0, 1]; 1.0: disabled
      min_p              f32[S]  in [0, 1]; 0.0: disabled
      presence_penalty   f32[S]  0.0: off
      frequency_penalty  f32[S]  0.0: off
      repetition_penalty f32[S]  1.0: off
      seeds              u32[S]  the row's seed (a request's seed modulo 2**32) ...
      seq_index          i32[S]  ... first counter: index of the sequence within its group ...
      sample_index       i32[S]  ... second counter: output position (tokens generated so far).
                                 key = fold_in(fold_in(random.key(seed), seq_index), sample_index)
      prompt_token_ids   i32[S, Lp]  prompt tokens, -1 padded (repetition penalty only)
      output_token_ids   i32[S, Lo]  generated tokens so far, -1 padded (all three penalties)
      banned_token_ids   i32[S, B]   tokens forbidden this step, -1 padded
      logit_bias_ids     i32[S, MAX_LOGIT_BIAS]  tokens whose logit gets a bias, -1 padded ...
      logit_bias_values  f32[S, MAX_LOGIT_BIAS]  ... and the bias added
      allowed_bitmask    i32[S, ceil(V / 32)]    structured output: bit v % 32 of word v // 32 set
                                 = token v allowed (rows without a grammar: all set); [S, 0] unless do_guided
      target_token_ids   i32[S]  a token whose logprob the row reports as target_logprobs (-1: none);
                                 prompt logprobs: the prompt's next token
    Static fields:
      do_penalties  bool  False: penalties are skipped (the two token arrays may be [S, 0])
      num_logprobs  int   K >= 0: how many top logprobs `sample` returns per row (top_ids [S, K])
      do_guided     bool  False: no grammar masks (allowed_bitmask is [S, 0])
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    seeds: jax.Array
    seq_index: jax.Array
    sample_index: jax.Array
    prompt_token_ids: jax.Array
    output_token_ids: jax.Array
    banned_token_ids: jax.Array
    logit_bias_ids: jax.Array
    logit_bias_values: jax.Array
    allowed_bitmask: jax.Array
    target_token_ids: jax.Array
    do_penalties: bool = False
    num_logprobs: int = 0
    do_guided: bool = False
    batch_invariant: bool = False  # logsumexp in a fixed order (the engine's batch_invariant mode)
    # Every row is greedy (the host knows): argmax alone, no branch on the device. A branch on a
    # device value (lax.cond) makes XLA:GPU copy the predicate to the host and wait for it.
    all_greedy: bool = False

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow | tuple], num_rows_padded: int, *,
                  vocab_size: int | None = None,
                  num_logprobs: int | None = None,
                  do_penalties: bool | None = None,
                  prompt_width: int | None = None,
                  output_width: int | None = None,
                  banned_width: int | None = None,
                  do_guided: bool | None = None) -> SamplingMetadata:
        """Builds the host (numpy) metadata of one step from per-row objects; O(rows) Python plus
        vectorised fills. The runner does not call it: it gathers the same arrays from its
        InputBatch by row (step_inputs.sampling_metadata); this is the tests' from-scratch reference.

        rows: one `SamplingRow` (or a plain tuple in its field order) per real sequence, in the
          step's row order; rows past len(rows) up to num_rows_padded are greedy padding.
        vocab_size: when given, num_logprobs is clipped to it.
        num_logprobs: the static K; None -> max over rows of params.logprobs (0 if none). To keep
          the number of compiled variants small, pass a fixed value (e.g. 0 or the server's
          max_logprobs) and slice per row on the host.
        do_penalties: None -> True iff some row has a presence/frequency/repetition penalty.
          Only penalised rows get their tokens copied (the others are all -1: no effect).
        prompt_width / output_width / banned_width: the token arrays' widths; None -> the longest
          row rounded up to a power of two (at least 16 for prompt/output, 4 for banned; 0 for
          prompt/output when penalties are off). A width smaller than a row raises ValueError.
        do_guided: None -> True iff some row has an allowed_bitmask (a grammar); needs vocab_size.
        Empty `rows` with explicit widths gives warm-up metadata for compiling a bucket.
        """
        n = len(rows)
        s = num_rows_padded
        if n > s:
            raise ValueError(f"{n} rows do not fit in num_rows_padded={s}")
        rows = [r if isinstance(r, SamplingRow) else SamplingRow(*r) for r in rows]
        params = [r.params for r in rows]
        if any(r.seed is None for r in rows):
            raise ValueError("every row needs an int seed (the engine draws one for unseeded requests)")

        knobs = np.array([(p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                           p.repetition_penalty) for p in params]
                         + [(0.0, -1, 1.0, 0.0, 0.0, 0.0, 1.0)] * (s - n),  # padding: greedy, every knob off
                         np.float32).reshape(s, 7)
        temperature, top_p, min_p, presence, frequency, repetition = (
            np.ascontiguousarray(knobs[:, i]) for i in (0, 2, 3, 4, 5, 6))
        top_k = knobs[:, 1].astype(np.int32)

        def counter(values, pad, dtype=np.int32):
            out = np.full(s, pad, dtype)
            out[:n] = np.fromiter(values, np.int64, n)
            return out

        seeds = counter((r.seed % (1 << 32) for r in rows), 0, np.uint32)
        seq_index = counter((r.seq_index for r in rows), 0)
        sample_index = counter((r.sample_index for r in rows), 0)
        target_token_ids = counter((r.target_token_id for r in rows), -1)

        penalised = np.flatnonzero((presence[:n] != 0.0) | (frequency[:n] != 0.0) | (repetition[:n] != 1.0)).tolist()
        if do_penalties is None:
            do_penalties = bool(penalised)
        if do_penalties:
            prompt_ids = _fill_tokens([rows[i].prompt_token_ids for i in penalised], penalised, s,
                                      prompt_width, 16, "prompt_width")
            output_ids = _fill_tokens([rows[i].output_token_ids for i in penalised], penalised, s,
                                      output_width, 16, "output_width")
        else:
            prompt_ids = np.full((s, prompt_width or 0), -1, np.int32)
            output_ids = np.full((s, output_width or 0), -1, np.int32)
        banning = [i for i, r in enumerate(rows) if r.banned_token_ids]
        banned = _fill_tokens([rows[i].banned_token_ids for i in banning], banning, s, banned_width, 4,
                              "banned_width")
        if do_guided is None:
            do_guided = any(r.allowed_bitmask is not None for r in rows)
        bias_ids = np.full((s, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((s, MAX_LOGIT_BIAS), np.float32)
        allowed = np.full((s, -(-vocab_size // 32) if do_guided else 0), -1, np.int32)
        for i, r in enumerate(rows):  # one pass; most rows have neither
            if r.logit_bias:  # SamplingParams keeps it within MAX_LOGIT_BIAS entries
                bias_ids[i, :len(r.logit_bias)] = list(r.logit_bias)
                bias_values[i, :len(r.logit_bias)] = list(r.logit_bias.values())
            if do_guided and r.allowed_bitmask is not None:
                allowed[i] = r.allowed_bitmask

        if num_logprobs is None:
            num_logprobs = max([p.logprobs or 0 for p in params], default=0)
        if vocab_size is not None:
            num_logprobs = min(num_logprobs, vocab_size)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                   seeds=seeds, seq_index=seq_index, sample_index=sample_index,
                   prompt_token_ids=prompt_ids, output_token_ids=output_ids, banned_token_ids=banned,
                   logit_bias_ids=bias_ids, logit_bias_values=bias_values, allowed_bitmask=allowed,
                   target_token_ids=target_token_ids,
                   do_guided=bool(do_guided),
                   do_penalties=bool(do_penalties), num_logprobs=int(num_logprobs))


class SamplingRow(NamedTuple):
    """One real row of `SamplingMetadata.from_rows` (a plain tuple in this order works too)."""

    params: SamplingParams
    seed: int  # any int (taken modulo 2**32); the engine draws one for requests without a seed
    seq_index: int = 0  # index of the sequence within its group (n / best_of completions)
    sample_index: int = 0  # output position: how many tokens this sequence has generated
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()  # e.g. EOS + stop_token_ids while min_tokens is not reached
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias added to its logit
    allowed_bitmask: np.ndarray | None = None  # i32[ceil(V / 32)]: the grammar's allowed tokens, if any
    target_token_id: int = -1  # report this token's logprob too (prompt logprobs: the next prompt token)


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[S]   the sampled (or argmax) token of each row
    logprobs: jax.Array  # f32[S]    its logprob (log_softmax of the penalized logits)
    top_ids: jax.Array  # i32[S, K]  the K most likely tokens, most likely first
    top_logprobs: jax.Array  # f32[S, K]
    target_logprobs: jax.Array  # f32[S]  logprob of each row's target token (0 where it has none)

    @classmethod
    def of_tokens(cls, token_ids: Sequence[int], logprob: float = 0.0) -> "SamplerOutput":
        """Rows that sampled `token_ids` (host arrays, no top logprobs): a model-free step's
        output, for the paper's replay and the tests' fake engine."""
        n = len(token_ids)
        return cls(np.asarray(token_ids, np.int32), np.full(n, logprob, np.float32), np.zeros((n, 0), np.int32),
                   np.zeros((n, 0), np.float32), np.zeros(n, np.float32))


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def _fill_tokens(lists, row_ids, s, width, minimum, name) -> np.ndarray:
    lengths = [len(x) for x in lists]
    longest = max(lengths, default=0)
    if width is None:
        width = _bucket(longest, minimum)
    elif longest > width:
        raise ValueError(f"{name}={width} is smaller than a row's {longest} tokens")
    out = np.full((s, width), -1, np.int32)
    for i, ids, length in zip(row_ids, lists, lengths):
        if length:
            out[i, :length] = ids
    return out


# ----------------------------------------------------------------------------- device side


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output) penalties; f32[S, V]."""
    s, v = logits.shape
    rows = jnp.arange(s)[:, None]

    def index(ids):  # -1 padding (and anything out of range) is dropped by the scatter
        ids = ids.astype(jnp.int32)
        return jnp.where(ids < 0, v, ids)

    counts = jnp.zeros((s, v), jnp.int32).at[rows, index(meta.output_token_ids)].add(1, mode="drop")
    seen = jnp.zeros((s, v), jnp.bool_).at[rows, index(meta.prompt_token_ids)].set(True, mode="drop")
    return penalize(logits, counts, seen, meta)


def penalize(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """The penalties from each row's output token counts (int32[S, V]) and prompt tokens (bool[S, V])."""
    in_output = counts > 0
    seen = in_prompt | in_output
    rep = meta.repetition_penalty.astype(jnp.float32)[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - meta.frequency_penalty.astype(jnp.float32)[:, None] * counts.astype(jnp.float32)
    logits = logits - meta.presence_penalty.astype(jnp.float32)[:, None] * in_output.astype(jnp.float32)
    return logits


def apply_banned(logits: jax.Array, banned_token_ids: jax.Array) -> jax.Array:
    s, v = logits.shape
    if banned_token_ids.shape[1] == 0:
        return logits
    ids = banned_token_ids.astype(jnp.int32)
    ids = jnp.where(ids < 0, v, ids)
    return logits.at[jnp.arange(s)[:, None], ids].set(-jnp.inf, mode="drop")


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    s, v = logits.shape
    ids = jnp.where(ids < 0, v, ids.astype(jnp.int32))
    return logits.at[jnp.arange(s)[:, None], ids].add(values.astype(jnp.float32), mode="drop")


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear -> -inf (bit v % 32 of word v // 32 stands for token v)."""
    _, v = logits.shape
    words = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)
    token = jnp.arange(v)
    bits = jax.lax.shift_right_logical(words[:, token // 32], (token % 32).astype(jnp.uint32)[None, :]) & 1
    return jnp.where(bits == 1, logits, -jnp.inf)


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Top-k, then top-p (on the top-k distribution), then min-p; dropped logits become -inf."""
    _, v = scaled.shape
    desc = -jnp.sort(-scaled, axis=-1)
    pos = jnp.arange(v)[None, :]
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)[:, None]
    keep = pos < k
    probs = jax.nn.softmax(jnp.where(keep, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass of the better tokens
    p = top_p[:, None]
    keep = keep & ((before < p) | (p >= 1.0))
    keep = keep & (desc - desc[:, :1] >= jnp.log(min_p)[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def row_keys(seeds: jax.Array, seq_index: jax.Array, sample_index: jax.Array) -> jax.Array:
    """The per-row PRNG keys: fold_in(fold_in(key(seed), seq_index), sample_index)."""

    def one(seed, a, b):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), a), b)

    return jax.vmap(one)(seeds.astype(jnp.uint32), seq_index.astype(jnp.int32), sample_index.astype(jnp.int32))


def sample(logits: jax.Array, meta: SamplingMetadata) -> SamplerOutput:
    """Samples one token per row of `logits` (f32/bf16 [S, V]); jittable, static shapes, no host sync."""
    logits = logits.astype(jnp.float32)
    s, v = logits.shape
    if meta.do_penalties:
        logits = apply_penalties(logits, meta)
    logits = apply_banned(logits, meta.banned_token_ids)
    logits = apply_logit_bias(logits, meta.logit_bias_ids, meta.logit_bias_values)
    if meta.do_guided:
        logits = apply_bitmask(logits, meta.allowed_bitmask)

    temperature = meta.temperature.astype(jnp.float32)
    greedy = temperature < GREEDY_TEMPERATURE
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    top_k = meta.top_k.astype(jnp.int32)
    top_p = meta.top_p.astype(jnp.float32)
    min_p = meta.min_p.astype(jnp.float32)

    def random_ids(logits):
        scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
        truncating = ~greedy & (((top_k > 0) & (top_k < v)) | (top_p < 1.0) | (min_p > 0.0))
        scaled = jax.lax.cond(jnp.any(truncating), lambda x: _truncate(x, top_k, top_p, min_p),
                              lambda x: x, scaled)
        keys = row_keys(meta.seeds, meta.seq_index, meta.sample_index)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys)
        return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)

    if meta.all_greedy:
        token_ids = greedy_ids
    else:
        sampled = jax.lax.cond(jnp.any(~greedy), random_ids, lambda _: greedy_ids, logits)
        token_ids = jnp.where(greedy, greedy_ids, sampled)

    lse = logsumexp_last(logits) if meta.batch_invariant else jax.nn.logsumexp(logits, axis=-1)
    token_logprobs = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] - lse
    k = meta.num_logprobs
    if k > 0:
        top_values, top_ids = jax.lax.top_k(logits, k)
        top_logprobs = top_values - lse[:, None]
        top_ids = top_ids.astype(jnp.int32)
    else:
        top_logprobs = jnp.zeros((s, 0), jnp.float32)
        top_ids = jnp.zeros((s, 0), jnp.int32)
    targets = meta.target_token_ids.astype(jnp.int32)
    target_logprobs = jnp.where(targets >= 0, jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None],
                                                                  axis=-1)[:, 0] - lse, 0.0)
    return SamplerOutput(token_ids=token_ids, logprobs=token_logprobs, top_ids=top_ids, top_logprobs=top_logprobs,
                         target_logprobs=target_logprobs)

