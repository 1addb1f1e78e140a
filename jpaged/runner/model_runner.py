"""ModelRunner: owns the weights and the KV pages and runs one padded, precompiled step.

The NNX model is split once into a static graph definition and a state pytree; the step
merges them inside jit, so no Python object traversal happens per step. The KV pool is one
(k_pages, v_pages) pair for every layer, each [num_kv_heads, num_layers * num_pages, page_size,
head_dim] (layer l's page p at l * num_pages + p; see LayerStack); it is donated to the step and
comes back updated in place. Block copies and swaps move every layer's part of a page. A step is
two device calls: the model forward (its logits stay on the device) and the sampler; only sampled
ids and logprobs return to the host. Each call's inputs travel packed in one int32 array, built
from the InputBatch (block tables kept across steps; see input_batch.py). `dispatch` returns
before the device is done and `collect` reads the result, so the engine can prepare and dispatch
the next step first: each row's sampled token also stays on the device (`last_tokens`), where the
next step's forward takes it (a PENDING_TOKEN input).

Every step is padded to a bucket (see Buckets), block copies and swaps to a fixed size, and every
executable is compiled ahead of time at warm-up, so serving never compiles; `num_compilations`
counts them all. Compiled executables are kept on disk whole (executable_cache.py): a restart
loads them without tracing. The forward and the sampler compile apart: the sampler's shapes
depend only on its row bucket and its full/fast switch, so the warm-up compiles forwards +
samplers, not their
product.

Tensor parallelism: weights and KV pages live on the loader's mesh (jpaged/parallel); the runner
only gives every jitted function its shardings. Step inputs are replicated, the KV pages split
on kv heads, and each device keeps its own heads' part of swapped-out pages in host memory.
Multi-host: the driver (process 0) sends every device operation's host inputs to the other
processes before running it; they run the same operation in `follow` (see `lead`).
"""

import concurrent.futures
import dataclasses
import functools
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from tqdm.auto import tqdm

from jpaged.models.layers import Attention, AttentionMetadata, LayerStack
from jpaged.models.loader import LoadedModel
from jpaged.parallel import distributed
from jpaged.parallel.sharding import TP_AXIS, kv_cache_sharding, replicated, tp_size
from jpaged.runner import sampler
from jpaged.runner.executable_cache import ExecutableCache
from jpaged.runner.input_batch import InputBatch, Layout, layout_of, pack, unpack

logger = logging.getLogger(__name__)

# Top logprobs computed every step (OpenAI's and vLLM's maximum); requests slice their own.
MAX_LOGPROBS = 20
# A token the previous step sampled and the host has not read yet (overlapped steps).
PENDING_TOKEN = -1
# Tokens a row can forbid in one step (EOS and stop_token_ids while min_tokens is not reached).
MAX_BANNED_TOKENS = 32
# Block copies and swaps are padded to one of these sizes (-1: skip), longer lists split into
# chunks of the largest, so each operation has one executable per size, compiled at warm-up.
BLOCK_OP_SIZES = (32,)
BLOCK_OPS = ("copy_blocks", "swap_out", "swap_in")
# Token histories uploaded to the device at once (more: several calls), for penalised sequences
# whose row does not hold their tokens yet.
HISTORY_UPLOAD_ROWS = 16


def kv_cache_layout(model: nnx.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim), read off the model's attention layers; num_kv_heads
    counts the copies when tensor parallelism replicates kv heads (the page arrays' head axis)."""
    nodes = [node for _, node in nnx.iter_graph(model)]
    stack = next(node for node in nodes if isinstance(node, LayerStack))
    num_kv_heads, head_dim = next(node for node in nodes if isinstance(node, Attention)).k_proj.out_shape
    return stack.num_layers, num_kv_heads, head_dim


def _ladder(smallest: int, largest: int, factor: int = 2) -> list[int]:
    """smallest, smallest * factor, ... below `largest`, then `largest` itself."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= factor
    return sizes + [largest]


def _fit(buckets: list[int], n: int) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The fixed set of step shapes: one step family keyed by its token bucket (vLLM v1's ragged
    layout: decode and mixed prefill + decode steps alike). A step of `tokens` rows has
    `seqs(tokens)` = min(tokens, max_num_seqs) sequence rows, so a lone prompt or a small decode
    batch does not pay for max_num_seqs rows. Block tables always have the full `width`: the
    attention's cost follows the real contexts (pallas_kernels/xla.py, and the Pallas kernels loop
    to each context's end). The LM head and the sampler take `sample_rows(seqs)` rows: a coarser
    ladder, because the sampler compiles slowly (its sorts over the vocabulary) and costs little
    per row."""

    tokens: list[int]
    rows: list[int]
    max_num_seqs: int
    width: int
    num_scheduler_steps: int = 1

    @classmethod
    def create(cls, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
               num_scheduler_steps: int = 1) -> "Buckets":
        # Doubling token ladder: at most 2x padding.
        return cls(_ladder(1, max_num_batched_tokens), _ladder(1, max_num_seqs, factor=8), max_num_seqs,
                   max_blocks_per_seq, num_scheduler_steps)

    def seqs(self, num_tokens: int) -> int:
        """Sequence rows of a step of `num_tokens` (a bucket): each sequence has a token."""
        return min(num_tokens, self.max_num_seqs)

    def sample_rows(self, num_seqs: int) -> int:
        return _fit(self.rows, num_seqs)

    def keys(self):
        """Every executable: the model forward per token bucket, the sampler per (rows, full on/off),
        each block operation per padded size, and with multi-step decode the K-step decode loop
        per bucket of decode steps (tokens <= max_num_seqs). Compiling the forward and the sampler
        apart keeps the count additive, not a product."""
        for tokens in self.tokens:
            yield ("forward", tokens)
        if self.num_scheduler_steps > 1:
            for tokens in self.tokens:
                if tokens <= self.max_num_seqs:
                    yield ("multi_step", tokens)
        for rows in self.rows:
            for full in (False, True):
                yield ("sample", rows, full)
        for op in BLOCK_OPS:
            for num_blocks in BLOCK_OP_SIZES:
                yield (op, num_blocks)
        yield ("write_history", HISTORY_UPLOAD_ROWS)


@dataclasses.dataclass
class SeqInput:
    """One sequence's share of a step: compute `token_ids` at positions start_pos.. through
    `block_table`, and sample `num_samples` tokens after the last one (0: a prefill chunk). Prompt
    logprobs: the first `num_prompt_rows` tokens also get a logits row each (before the samples').
    `block_table` is the block manager's own list (read only); `seq_id` keys the sequence's row
    in the InputBatch. A token id -1 (PENDING_TOKEN) is the one the previous step sampled for this
    sequence: it is still on the device and is taken from there."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_samples: int
    num_prompt_rows: int = 0


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["rows", "prompt_lens", "lens", "dst_rows"], meta_fields=[])
@dataclasses.dataclass
class HistoryInputs:
    """Where each sampling row's penalty tokens are in the device's token history (full sampler)."""

    rows: np.ndarray  # int32[sampling rows]: the history row of the row's sequence (-1: no penalties)
    prompt_lens: np.ndarray  # int32[sampling rows]: its first tokens are the prompt's ...
    lens: np.ndarray  # int32[sampling rows]: ... and the rest, up to here, the outputs so far
    dst_rows: np.ndarray  # int32[sampling rows]: append the sampled token to this history row (-1: no)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["input_ids", "positions", "attn", "logits_indices", "src_rows"], meta_fields=[])
@dataclasses.dataclass
class StepInputs:
    input_ids: jax.Array  # int32[tokens]
    positions: jax.Array  # int32[tokens]
    attn: AttentionMetadata
    logits_indices: jax.Array  # int32[rows]: token row whose logits each sampling row uses
    src_rows: jax.Array  # int32[tokens]: >= 0: the token is last_tokens[row] (sampled by a step in flight)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_scheduler_steps: int = 1,
                 executable_cache: ExecutableCache | None = None):
        self.block_size, self.num_gpu_blocks = block_size, num_gpu_blocks
        self.vocab_size = loaded.hf_config.vocab_size
        self.max_model_len = max_model_len
        self.mesh = loaded.mesh
        self.is_driver = distributed.is_driver()
        self._multihost = jax.process_count() > 1
        self.graphdef, self.state = nnx.split(loaded.model)
        num_layers, num_kv_heads, head_dim = kv_cache_layout(loaded.model)
        self.num_layers = num_layers
        shape = (num_kv_heads, num_layers * num_gpu_blocks, block_size, head_dim)
        kv, rep = kv_cache_sharding(self.mesh), replicated(self.mesh)
        self._replicated = rep
        self.kv_cache = (jnp.zeros(shape, loaded.dtype, device=kv), jnp.zeros(shape, loaded.dtype, device=kv))
        # Host pool for swapped-out pages, one per local shard, keyed by the shard's first kv head:
        # [layer, k/v, kv_heads / tp, cpu_blocks, block_size, head_dim].
        local_shape = (num_layers, 2, num_kv_heads // tp_size(self.mesh), num_cpu_blocks, block_size, head_dim)
        self.host_kv = {index[0].start or 0: np.zeros(local_shape, jnp.dtype(loaded.dtype))
                        for index in kv.addressable_devices_indices_map(shape).values()}
        # Swapped pages in flight: [layer, k/v, kv_heads, blocks, block_size, head_dim], split on kv heads.
        self._pages_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(None, None, TP_AXIS))
        self.buckets = Buckets.create(max_num_seqs, max_num_batched_tokens, math.ceil(max_model_len / block_size),
                                      num_scheduler_steps)
        self.input_batch = InputBatch(max_num_seqs, self.buckets.width)
        # The token each InputBatch row sampled last, kept on the device: the next step can read it
        # before the host has (overlap).
        self.last_tokens = jnp.zeros(max_num_seqs, jnp.int32, device=rep)
        # Penalties' tokens, kept on the device per InputBatch row (prompt, then outputs; the
        # full sampler appends each sampled token): sent once per sequence, not every step.
        # `_history` says what each row holds: (seq_id, tokens).
        self.token_history = jnp.full((max_num_seqs, max_model_len), -1, jnp.int32, device=rep)
        self._history: dict[int, tuple[int, int]] = {}
        # Each takes its inputs packed in one int32 array (one transfer), unpacked by `layout`.
        self._forward = lambda layout: jax.jit(functools.partial(_forward, self.graphdef, rep, layout=layout),
                                               donate_argnums=(1,), out_shardings=(rep, kv))
        self._sample = lambda layout: jax.jit(functools.partial(_sample, layout=layout),
                                              out_shardings=(rep, rep, rep), donate_argnums=(2, 3))
        self._history_writer = jax.jit(_write_history, out_shardings=rep, donate_argnums=(0,))
        self._multi_step = lambda layout: jax.jit(
            functools.partial(_multi_step, self.graphdef, rep, layout=layout, num_steps=num_scheduler_steps),
            donate_argnums=(1, 3), out_shardings=(rep, kv, rep))
        self.executable_cache = executable_cache or ExecutableCache(None, "")
        self._executables = {}
        if self._multihost:  # the driver's broadcasts: one executable, compiled now
            self._executables[("broadcast", distributed.BROADCAST_CHUNK)] = distributed.broadcast_executable()[0]
        self._warm = False
        self._copy = jax.jit(functools.partial(_copy_blocks, num_layers), in_shardings=(kv, rep, rep),
                             out_shardings=kv, donate_argnums=(0,))
        self._gather = jax.jit(functools.partial(_gather_blocks, num_layers), in_shardings=(kv, rep),
                               out_shardings=self._pages_sharding)
        self._scatter = jax.jit(functools.partial(_scatter_blocks, num_layers),
                                in_shardings=(kv, self._pages_sharding, rep), out_shardings=kv, donate_argnums=(0,))

    @property
    def num_compilations(self) -> int:
        return len(self._executables)

    def is_alive(self) -> bool:
        """False once the KV pages are gone: a step that failed after donating them."""
        return not any(pages.is_deleted() for pages in jax.tree.leaves(self.kv_cache))

    def warm_up(self):
        """Compile every bucket now, so serving never compiles. A pipeline: this thread traces and
        lowers the next executables (Python) while one worker thread runs XLA's compiles (C++,
        without the GIL), one at a time as before: 26.0 -> 23.6 s for the quick start's 22 on two
        cores. Not several compiles at once: on a GPU they would autotune side by side, and
        tracing in several threads once hung in CI."""
        keys = [k for k in self.buckets.keys() if k not in self._executables]
        cache = self.executable_cache
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpaged-compile") as pool, \
                tqdm(total=len(keys), desc="Compiling step buckets", unit="shape") as progress:
            pending, missing = {}, []
            with cache.loading():  # loads first, under one marker (a crash in XLA is seen next start)
                for key in keys:
                    jitted, args = self._jitted_and_args(key)
                    executable = cache.load(repr(key), args)
                    if executable is not None:
                        self._executables[key] = executable
                        progress.update()
                    else:
                        missing.append((key, jitted, args))
            try:
                for key, jitted, args in missing:
                    future = pool.submit(cache.compile_lowered, repr(key), args, jitted.lower(*args))
                    future.add_done_callback(lambda _: progress.update())
                    pending[key] = future
                for key, future in pending.items():
                    self._executables[key] = future.result()
            except BaseException:  # SIGTERM during the warm-up: wait for the running compile only
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        self._warm = True

    def bypass_executable_cache(self):
        """Forget what warm_up loaded and load nothing more from disk (compiles still write)."""
        self._executables.clear()
        self.executable_cache.skip_loads = True

    def _compile(self, key):
        return self.executable_cache.compile(repr(key), *self._jitted_and_args(key))

    def _lower(self, key):
        jitted, args = self._jitted_and_args(key)
        return jitted.lower(*args)

    def _jitted_and_args(self, key):
        """The jitted function executable `key` compiles, and its (abstract) arguments."""
        if key[0] == "forward":
            layout = layout_of(self._abstract_inputs(key[1]))
            return self._forward(layout), (self.state, self.kv_cache, self._packed(layout), self.last_tokens)
        if key[0] == "multi_step":
            layout = layout_of(self._abstract_multi_step_inputs(key[1]))
            return self._multi_step(layout), (self.state, self.kv_cache, self._packed(layout), self.last_tokens)
        if key[0] == "sample":
            _, num_rows, full = key
            logits = jax.ShapeDtypeStruct((num_rows, self.vocab_size), jnp.float32, sharding=self._replicated)
            i32 = jax.ShapeDtypeStruct((num_rows,), jnp.int32)
            history = HistoryInputs(i32, i32, i32, i32) if full else None
            layout = layout_of((self._sampling_metadata([], num_rows, full), i32, history))
            return self._sample(layout), (logits, self._packed(layout), self.last_tokens, self.token_history)
        if key[0] == "write_history":
            rows = jax.ShapeDtypeStruct((key[1],), jnp.int32, sharding=self._replicated)
            tokens = jax.ShapeDtypeStruct((key[1], self.max_model_len), jnp.int32, sharding=self._replicated)
            return self._history_writer, (self.token_history, rows, tokens)
        op, num_blocks = key
        blocks = jax.ShapeDtypeStruct((num_blocks,), jnp.int32, sharding=self._replicated)
        if op == "copy_blocks":
            return self._copy, (self.kv_cache, blocks, blocks)
        if op == "swap_out":
            return self._gather, (self.kv_cache, blocks)
        return self._scatter, (self.kv_cache, self._swapped_pages_shape(num_blocks), blocks)

    def _swapped_pages_shape(self, num_blocks: int) -> jax.ShapeDtypeStruct:
        """Pages in flight between the pool and the host: [layers, k/v, kv_heads, blocks, page_size, head_dim]."""
        num_kv_heads, _, page_size, head_dim = self.kv_cache[0].shape
        return jax.ShapeDtypeStruct((self.num_layers, 2, num_kv_heads, num_blocks, page_size, head_dim),
                                    self.kv_cache[0].dtype, sharding=self._pages_sharding)

    def _executable(self, key):
        if key not in self._executables:
            if self._warm:
                logger.warning("compiling an unexpected step shape %s while serving", key)
            self._executables[key] = self._compile(key)
        return self._executables[key]

    def _abstract_inputs(self, num_tokens: int) -> StepInputs:
        num_seqs = self.buckets.seqs(num_tokens)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        decode = jax.ShapeDtypeStruct((), jnp.bool_) if num_seqs == num_tokens else None
        attn = AttentionMetadata(i32((num_tokens,)), i32((num_seqs, self.buckets.width)), i32((num_seqs,)),
                                 i32((num_seqs + 1,)), decode)
        return StepInputs(i32((num_tokens,)), i32((num_tokens,)), attn, i32((self.buckets.sample_rows(num_seqs),)),
                          i32((num_tokens,)))

    def _abstract_multi_step_inputs(self, num_tokens: int):
        """A K-step decode's inputs: the first step's, its sampler metadata (fast variant) and
        sampled rows' last_tokens entries, and the slots of the K - 1 later steps' tokens."""
        inputs = self._abstract_inputs(num_tokens)
        num_rows = inputs.logits_indices.shape[0]
        smeta = self._sampling_metadata([], num_rows, False)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        return inputs, smeta, i32((num_rows,)), i32((self.buckets.num_scheduler_steps - 1, num_tokens))

    def _packed(self, layout: Layout) -> jax.ShapeDtypeStruct:
        """The abstract packed inputs of `layout`, replicated on every device."""
        return jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self._replicated)

    def _sampling_metadata(self, rows, num_rows: int, full: bool) -> sampler.SamplingMetadata:
        """Fixed widths and logprob count, so the sampler has two variants: the fast one (no
        penalties, grammars or logprobs) and `full`, taken when any row needs one of them. The
        penalties' tokens are not sent: the full sampler reads them from the token history."""
        rows = [r._replace(prompt_token_ids=(), output_token_ids=()) if r.output_token_ids or r.prompt_token_ids
                else r for r in rows] if full else rows
        return sampler.SamplingMetadata.from_rows(rows, num_rows, vocab_size=self.vocab_size,
                                                  num_logprobs=MAX_LOGPROBS if full else 0, do_penalties=full,
                                                  prompt_width=0, output_width=0,
                                                  banned_width=MAX_BANNED_TOKENS, do_guided=full)

    def _history_inputs(self, seqs: list[SeqInput], rows: np.ndarray, sampling_rows: list,
                        num_rows: int) -> HistoryInputs:
        """The full sampler's history rows; first uploads the tokens of penalised sequences whose
        row does not hold them (a new row, or tokens the sampler did not append: forks, beams)."""
        history = HistoryInputs(*(np.full(num_rows, fill, np.int32) for fill in (-1, 0, 0, -1)))
        uploads, k = {}, 0
        for seq, row in zip(seqs, rows):
            k += seq.num_prompt_rows
            for i in range(k, k + seq.num_samples):
                r = sampling_rows[i]
                p = r.params
                if not p.has_penalties:
                    continue
                prompt_len, length = len(r.prompt_token_ids), len(r.prompt_token_ids) + len(r.output_token_ids)
                if self._history.get(row) != (seq.seq_id, length):
                    uploads[int(row)] = list(r.prompt_token_ids) + list(r.output_token_ids)
                history.rows[i], history.prompt_lens[i], history.lens[i] = row, prompt_len, length
                # The sampler appends a lone sample's token (a beam may take another token).
                if seq.num_samples == 1 and not p.use_beam_search:
                    history.dst_rows[i] = row
                    self._history[int(row)] = (seq.seq_id, length + 1)
                else:
                    self._history.pop(int(row), None)
            k += seq.num_samples
        items = list(uploads.items())
        for start in range(0, len(items), HISTORY_UPLOAD_ROWS):
            chunk = items[start:start + HISTORY_UPLOAD_ROWS]
            upload_rows = np.full(HISTORY_UPLOAD_ROWS, -1, np.int32)
            tokens = np.full((HISTORY_UPLOAD_ROWS, self.max_model_len), -1, np.int32)
            for j, (row, ids) in enumerate(chunk):
                upload_rows[j] = row
                tokens[j, :len(ids)] = ids
            self._dispatch("write_history", upload_rows, tokens)
        return history

    @staticmethod
    def _needs_full_sampler(rows) -> bool:
        return any(r.params.has_penalties
                   or r.allowed_bitmask is not None or r.params.logprobs is not None or r.params.use_beam_search
                   or r.target_token_id >= 0 for r in rows)

    def dispatch(self, seqs: list[SeqInput], sampling_rows: list, multi_step: bool = False) -> "StepHandle":
        """Start one step on the device and return at once. `sampling_rows` are the per-sample rows
        for the sampler, in the order of the sequences' samples. `multi_step`: a decode step (one
        token and one sample per sequence, fast sampler) run num_scheduler_steps times in one
        device call, each step's sampled tokens the next one's inputs; the block tables must hold
        the later tokens' slots (the scheduler's lookahead slots)."""
        n = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int32, n)
        start_pos = np.fromiter((s.start_pos for s in seqs), np.int32, n)
        num_samples = np.fromiter((s.num_samples for s in seqs), np.int32, n)
        num_prompt_rows = np.fromiter((s.num_prompt_rows for s in seqs), np.int32, n)
        num_rows = int(num_samples.sum() + num_prompt_rows.sum())
        num_tokens_real = int(lens.sum())
        # Enough token rows for the sequence rows and the sampling rows (both at most max_num_seqs).
        num_tokens = _fit(self.buckets.tokens, max(num_tokens_real, n, num_rows))
        num_seqs = self.buckets.seqs(num_tokens)

        rows = self.input_batch.rows([s.seq_id for s in seqs], [s.block_table for s in seqs])
        block_tables = np.zeros((num_seqs, self.buckets.width), np.int32)
        block_tables[:n] = self.input_batch.block_tables[rows]
        query_start_loc = np.full(num_seqs + 1, num_tokens_real, np.int32)
        query_start_loc[0] = 0
        np.cumsum(lens, out=query_start_loc[1:n + 1])
        context_lens = np.zeros(num_seqs, np.int32)
        context_lens[:n] = start_pos + lens
        input_ids = np.zeros(num_tokens, np.int32)
        input_ids[:num_tokens_real] = [t for s in seqs for t in s.token_ids] if num_tokens_real > n \
            else [s.token_ids[0] for s in seqs]
        # Pending tokens come from the device: a decode token's sequence row in last_tokens.
        src_rows = np.full(num_tokens, -1, np.int32)
        pending = np.flatnonzero(input_ids[:num_tokens_real] == PENDING_TOKEN)
        src_rows[pending] = rows[np.repeat(np.arange(n, dtype=np.int32), lens)[pending]] if len(pending) else 0
        # Each token's sequence and position; padding tokens write nowhere (slot -1).
        seq_of = np.repeat(np.arange(n, dtype=np.int32), lens)
        pos = start_pos[seq_of] + np.arange(num_tokens_real, dtype=np.int32) - query_start_loc[seq_of]
        positions = np.zeros(num_tokens, np.int32)
        positions[:num_tokens_real] = pos
        slot_mapping = np.full(num_tokens, -1, np.int32)
        slot_mapping[:num_tokens_real] = (block_tables[seq_of, pos // self.block_size] * self.block_size
                                          + pos % self.block_size)
        # Logits rows: each sequence's prompt-logprob rows (its first tokens), then its samples (its last).
        logits_indices = np.zeros(self.buckets.sample_rows(num_seqs), np.int32)
        last = query_start_loc[1:n + 1] - 1
        # A sequence's single sample goes to its row of last_tokens (several: a fork, read by the host).
        dst_rows = np.full(len(logits_indices), -1, np.int32)
        if num_prompt_rows.any():
            row = 0
            for i in range(n):
                k = num_prompt_rows[i]
                logits_indices[row:row + k] = query_start_loc[i] + np.arange(k)
                logits_indices[row + k:row + k + num_samples[i]] = last[i]
                if num_samples[i] == 1:
                    dst_rows[row + k] = rows[i]
                row += k + num_samples[i]
        else:
            logits_indices[:num_rows] = np.repeat(last, num_samples)
            dst_rows[:num_rows] = np.repeat(np.where(num_samples == 1, rows, -1), num_samples)

        full = not multi_step and self._needs_full_sampler(sampling_rows)
        smeta = self._sampling_metadata(sampling_rows, len(logits_indices), full)
        decode = np.bool_(num_tokens_real == n) if num_seqs == num_tokens else None
        attn = AttentionMetadata(slot_mapping, block_tables, context_lens, query_start_loc, decode)
        inputs = StepInputs(input_ids, positions, attn, logits_indices, src_rows)
        if not multi_step:
            history = self._history_inputs(seqs, rows, sampling_rows, len(logits_indices)) if full else None
            out = self._dispatch("run_step", (num_tokens, full), pack(inputs), pack((smeta, dst_rows, history)))
            return StepHandle(out, len(logits_indices), smeta.num_logprobs, num_rows)
        if num_tokens_real != n or num_rows != n or num_seqs != num_tokens:
            raise ValueError("a multi-step decode takes one token and one sample per sequence")
        # The slots of the later steps' tokens: positions pos + 1 .. pos + K - 1.
        num_steps = self.buckets.num_scheduler_steps
        later = pos[None, :] + np.arange(1, num_steps, dtype=np.int32)[:, None]
        lookahead_slots = np.full((num_steps - 1, num_tokens), -1, np.int32)
        lookahead_slots[:, :n] = (block_tables[seq_of[None, :], later // self.block_size] * self.block_size
                                  + later % self.block_size)
        out = self._dispatch("run_multi_step", num_tokens, pack((inputs, smeta, dst_rows, lookahead_slots)))
        return StepHandle(out, len(logits_indices), 0, num_rows, num_steps)

    @staticmethod
    def collect(handle: "StepHandle") -> list[sampler.SamplerOutput]:
        """Wait for a dispatched step: its sampler output as numpy arrays (its real rows), one per
        step it ran (several: a multi-step decode)."""
        # Outputs are replicated: any local copy is the whole.
        packed = np.asarray(handle.out.addressable_data(0)).reshape(handle.num_steps, -1)
        return [_unpack_output(part, handle.num_rows, handle.num_logprobs, handle.num_real_rows) for part in packed]

    def _run_step(self, key, inputs: np.ndarray, smeta: np.ndarray):
        num_tokens, full = key
        logits, self.kv_cache = self._executable(("forward", num_tokens))(self.state, self.kv_cache, inputs,
                                                                          self.last_tokens)
        out, self.last_tokens, self.token_history = self._executable(
            ("sample", self.buckets.sample_rows(self.buckets.seqs(num_tokens)), full))(
            logits, smeta, self.last_tokens, self.token_history)
        return out

    def _write_history(self, rows: np.ndarray, tokens: np.ndarray):
        self.token_history = self._executable(("write_history", len(rows)))(self.token_history, rows, tokens)

    def _run_multi_step(self, num_tokens: int, inputs: np.ndarray):
        out, self.kv_cache, self.last_tokens = self._executable(("multi_step", num_tokens))(
            self.state, self.kv_cache, inputs, self.last_tokens)
        return out

    # ------------------------------------------------------------------ multi-host
    def _dispatch(self, op: str, *args):
        """Run device operation `op` on host inputs `args`; in a multi-host job the driver first
        sends it to the other processes, which run it in `follow`."""
        if self._multihost:
            distributed.broadcast_object((op, args))
        return getattr(self, "_" + op)(*args)

    def follow(self):
        """On a process other than 0: run the driver's device operations until its `lead` ends,
        then return the driver's result (or raise its error)."""
        while True:
            op, args = distributed.broadcast_object()
            if op == "done":
                result, error = args
                if error is not None:
                    raise error
                return result
            getattr(self, "_" + op)(*args)

    def lead(self, drive):
        """Run `drive()` (anything that steps the engine: a generate call, a server) on process 0
        while the other processes follow; every process returns its result. One process: drive()."""
        if not self._multihost:
            return drive()
        if not self.is_driver:
            return self.follow()
        try:
            result = drive()
        except BaseException as e:  # the followers stop too, also on Ctrl-C
            distributed.broadcast_object(("done", (None, e)))
            raise
        distributed.broadcast_object(("done", (result, None)))
        return result

    # ------------------------------------------------------------------ block copies
    @staticmethod
    def _padded_chunks(pairs):
        """Index pairs as chunks of at most BLOCK_OP_SIZES[-1], each padded to a size of
        BLOCK_OP_SIZES (-1: skip): (first indices, second indices, real length) per chunk."""
        largest = BLOCK_OP_SIZES[-1]
        for start in range(0, len(pairs), largest):
            chunk = pairs[start:start + largest]
            arr = np.full((_fit(BLOCK_OP_SIZES, len(chunk)), 2), -1, np.int32)
            arr[:len(chunk)] = chunk
            yield arr[:, 0], arr[:, 1], len(chunk)

    def copy_blocks(self, pairs: list[tuple[int, int]]):
        # Chunks may run one after another: copy-on-write never chains copies within a step.
        for src, dst, _ in self._padded_chunks(pairs):
            self._dispatch("copy_blocks", src, dst)

    def _copy_blocks(self, src, dst):
        self.kv_cache = self._executable(("copy_blocks", len(src)))(self.kv_cache, src, dst)

    def swap_out(self, pairs: list[tuple[int, int]]):
        """Device pages -> host pool, for (gpu_block, cpu_block) pairs."""
        for gpu, cpu, n in self._padded_chunks(pairs):
            self._dispatch("swap_out", gpu, cpu[:n])

    def _swap_out(self, gpu, cpu):
        pages = self._executable(("swap_out", len(gpu)))(self.kv_cache, gpu)
        for shard in pages.addressable_shards:  # each shard's heads go to its own host pool
            self.host_kv[shard.index[2].start or 0][:, :, :, cpu] = np.asarray(shard.data)[:, :, :, :len(cpu)]

    def swap_in(self, pairs: list[tuple[int, int]]):
        """Host pool -> device pages, for (cpu_block, gpu_block) pairs."""
        for cpu, gpu, n in self._padded_chunks(pairs):
            self._dispatch("swap_in", cpu[:n], gpu)

    def _swap_in(self, cpu, gpu):
        pool = next(iter(self.host_kv.values()))

        def local_pages(index):  # this shard's heads, padded to len(gpu) blocks
            pages = np.zeros(pool.shape[:3] + (len(gpu),) + pool.shape[4:], pool.dtype)
            pages[:, :, :, :len(cpu)] = self.host_kv[index[2].start or 0][:, :, :, cpu]
            return pages

        pages = jax.make_array_from_callback(self._swapped_pages_shape(len(gpu)).shape, self._pages_sharding,
                                             local_pages)
        self.kv_cache = self._executable(("swap_in", len(gpu)))(self.kv_cache, pages, gpu)


def _forward(graphdef, logits_sharding, state, kv_cache, packed, last_tokens, *, layout: Layout):
    """The model's part of a step: write the new K/V, attend, and the fp32 logits of the rows to
    sample. They stay on the device for the sampler executable."""
    inputs = _with_pending_tokens(unpack(packed, layout), last_tokens)
    return _model_logits(graphdef, logits_sharding, state, kv_cache, inputs)


def _with_pending_tokens(inputs: StepInputs, last_tokens) -> StepInputs:
    """The inputs with each pending token (sampled by a step in flight) read from last_tokens."""
    input_ids = jnp.where(inputs.src_rows >= 0, last_tokens[jnp.maximum(inputs.src_rows, 0)], inputs.input_ids)
    return dataclasses.replace(inputs, input_ids=input_ids)


def _model_logits(graphdef, logits_sharding, state, kv_cache, inputs: StepInputs):
    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model(inputs.input_ids, inputs.positions, kv_cache, inputs.attn)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    # Vocabulary-parallel logits are gathered: every device samples the same full rows.
    return jax.lax.with_sharding_constraint(logits, logits_sharding), kv_cache


def _sample(logits, packed, last_tokens, token_history, *, layout: Layout):
    """The sampler on packed metadata; its outputs come back packed too (`_pack_output`). Each
    row's token also goes to its `dst_rows` entry of last_tokens (-1: none), for the next step.
    The full sampler takes the penalties' tokens from the token history and appends to it."""
    meta, dst_rows, history = unpack(packed, layout)
    if history is not None:
        tokens = token_history[jnp.maximum(history.rows, 0)]  # [rows, max_model_len]
        pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        used = (history.rows >= 0)[:, None]
        in_prompt = used & (pos < history.prompt_lens[:, None])
        in_output = used & ~in_prompt & (pos < history.lens[:, None])
        meta = dataclasses.replace(meta, prompt_token_ids=jnp.where(in_prompt, tokens, -1),
                                   output_token_ids=jnp.where(in_output, tokens, -1))
    out = sampler.sample(logits, meta)
    if history is not None:
        dst = jnp.where(history.dst_rows < 0, token_history.shape[0], history.dst_rows)
        token_history = token_history.at[dst, history.lens].set(out.token_ids, mode="drop")
    return _pack_output(out), _keep_last_tokens(last_tokens, dst_rows, out.token_ids), token_history


def _write_history(token_history, rows, tokens):
    """Rows' whole token histories (-1 padded); row -1: skipped."""
    return token_history.at[jnp.where(rows < 0, token_history.shape[0], rows)].set(tokens, mode="drop")


def _multi_step(graphdef, logits_sharding, state, kv_cache, packed, last_tokens, *, layout: Layout,
                num_steps: int):
    """`num_steps` decode steps (forward + fast sampler) in one call: each step's sampled tokens
    are the next one's inputs, at the next position, writing into the precomputed lookahead
    slots. Returns the steps' packed outputs, one after another."""
    inputs, meta, dst_rows, lookahead_slots = unpack(packed, layout)
    inputs = _with_pending_tokens(inputs, last_tokens)
    slots = jnp.concatenate([inputs.attn.slot_mapping[None], lookahead_slots])
    live = inputs.attn.context_lens > 0  # padding rows stay empty
    num_tokens = inputs.input_ids.shape[0]

    def one_step(carry, j):
        kv_cache, token_ids, _ = carry
        attn = dataclasses.replace(inputs.attn, slot_mapping=slots[j], decode=True,
                                   context_lens=jnp.where(live, inputs.attn.context_lens + j, 0))
        step = dataclasses.replace(inputs, input_ids=token_ids, positions=inputs.positions + j, attn=attn)
        logits, kv_cache = _model_logits(graphdef, logits_sharding, state, kv_cache, step)
        out = sampler.sample(logits, dataclasses.replace(meta, sample_index=meta.sample_index + j))
        return (kv_cache, out.token_ids[:num_tokens], out.token_ids), _pack_output(out)

    num_rows = inputs.logits_indices.shape[0]
    carry = (kv_cache, inputs.input_ids, jnp.zeros(num_rows, jnp.int32))
    (kv_cache, _, sampled), outs = jax.lax.scan(one_step, carry, jnp.arange(num_steps))
    return outs.reshape(-1), kv_cache, _keep_last_tokens(last_tokens, dst_rows, sampled)


def _keep_last_tokens(last_tokens, dst_rows, token_ids):
    return last_tokens.at[jnp.where(dst_rows < 0, last_tokens.shape[0], dst_rows)].set(token_ids, mode="drop")


def _pack_output(out: sampler.SamplerOutput) -> jax.Array:
    """One int32 array of [token_ids, logprobs, target_logprobs, top_ids, top_logprobs], float32s bitcast."""
    as_i32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([out.token_ids, as_i32(out.logprobs), as_i32(out.target_logprobs),
                            out.top_ids.reshape(-1), as_i32(out.top_logprobs).reshape(-1)])


class StepHandle(NamedTuple):
    """A dispatched step: its packed sampler output (a device array, maybe not ready yet)."""

    out: jax.Array
    num_rows: int  # padded sampling rows
    num_logprobs: int
    num_real_rows: int
    num_steps: int = 1  # a multi-step decode's steps


def _unpack_output(packed: np.ndarray, num_rows: int, k: int, num_real: int) -> sampler.SamplerOutput:
    """`_sample`'s packed output -> its SamplerOutput, the first `num_real` rows."""
    r = num_rows
    token_ids, logprobs, target = packed[:r], packed[r:2 * r].view(np.float32), packed[2 * r:3 * r].view(np.float32)
    top_ids = packed[3 * r:3 * r + r * k].reshape(r, k)
    top_logprobs = packed[3 * r + r * k:].view(np.float32).reshape(r, k)
    # Sampled ids and their logprobs as Python lists: the host reads them one by one.
    return sampler.SamplerOutput(token_ids[:num_real].tolist(), logprobs[:num_real].tolist(), top_ids[:num_real],
                                 top_logprobs[:num_real], target[:num_real])


def every_layer(blocks, num_layers: int, pages_per_layer: int):
    """Blocks int32[n] -> the pool pages holding them in every layer, int32[num_layers * n] (layer
    major); padding (-1) stays -1."""
    pages = blocks[None, :] + pages_per_layer * jnp.arange(num_layers, dtype=blocks.dtype)[:, None]
    return jnp.where(blocks[None, :] < 0, -1, pages).reshape(-1)


def _copy_blocks(num_layers, kv_cache, src, dst):
    pages_per_layer = kv_cache[0].shape[1] // num_layers
    return pallas_kernels.copy_blocks(*kv_cache, every_layer(src, num_layers, pages_per_layer),
                                      every_layer(dst, num_layers, pages_per_layer))


def _gather_blocks(num_layers, kv_cache, blocks):
    """Blocks' pages of every layer: [num_layers, k/v, num_kv_heads, blocks, page_size, head_dim]."""
    k, v = kv_cache
    pages = every_layer(blocks, num_layers, k.shape[1] // num_layers)
    both = jnp.stack([k[:, pages], v[:, pages]])  # [2, kv_heads, layers * blocks, ...]
    both = both.reshape(both.shape[:2] + (num_layers, len(blocks)) + both.shape[3:])
    return both.transpose(2, 0, 1, 3, 4, 5)


def _scatter_blocks(num_layers, kv_cache, pages, blocks):
    k, v = kv_cache
    dst = every_layer(blocks, num_layers, k.shape[1] // num_layers)
    dst = jnp.where(dst < 0, k.shape[1], dst)  # padding -> dropped

    def layer_major(part):  # [layers, kv_heads, blocks, ...] -> [kv_heads, layers * blocks, ...]
        part = part.transpose(1, 0, 2, 3, 4)
        return part.reshape((part.shape[0], -1) + part.shape[3:])

    return (k.at[:, dst].set(layer_major(pages[:, 0]), mode="drop"),
            v.at[:, dst].set(layer_major(pages[:, 1]), mode="drop"))
