"""The fixed set of step shapes: token and sampling-row ladders, the padded sizes of block
operations, and every executable's key, all compiled ahead of time at warm-up."""

import dataclasses

import numpy as np

# Block copies and swaps are padded to one of these sizes (-1: skip), longer lists split into
# chunks of the largest, so each operation has one executable per size, compiled at warm-up.
BLOCK_OP_SIZES = (32,)
BLOCK_OPS = ("copy_blocks", "swap_out", "swap_in")
# Block-table entries written to the device's copy at once (more: several calls, each padded to
# the smallest size that holds it; a decode step writes a few, a batch of new prompts or swap-ins
# up to a table each).
BLOCK_TABLE_UPDATE_SIZES = (256, 8192)
# Token histories uploaded to the device at once (more: several calls), for penalised sequences
# whose row does not hold their tokens yet.
HISTORY_UPLOAD_ROWS = 16
# ... each upload as wide as its longest sequence needs, on this ladder (x4) up to max_model_len:
# an upload of short prompts does not carry max_model_len columns (131072 for Llama 3).
HISTORY_MIN_WIDTH = 256


# The smallest token bucket, by platform (others: 1). On a GPU a step of fewer tokens costs what a
# step of this many does: its forward reads every weight whatever the batch (an H100's or H200's
# GEMMs stay memory-bound up to a few hundred tokens for a model's layers), and its padding rows'
# attention is skipped (no context), so smaller buckets would only add compiles to the warm-up
# (a forward each, 17-80 s deviceless for a 1B model here, with its autotuning on the GPU on top)
# and sampler row buckets no step reaches. vLLM's TPU runner starts its token paddings at 16 too.
MIN_TOKEN_BUCKET = {"gpu": 16}


def history_widths(max_model_len: int) -> list[int]:
    """The token-history upload's widths: HISTORY_MIN_WIDTH, x4, ..., max_model_len."""
    return ladder(min(HISTORY_MIN_WIDTH, max_model_len), max_model_len, factor=4)


def ladder(smallest: int, largest: int, factor: int = 2) -> list[int]:
    """smallest, smallest * factor, ... below `largest`, then `largest` itself."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= factor
    return sizes + [largest]


def fit(buckets: list[int], n: int) -> int:
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
    to each context's end); the runner keeps them on the device (ModelRunner.block_table), so a step
sends only each sequence's row index and the entries written since. The LM head and the sampler take `sample_rows(tokens)` rows: a coarser
    ladder, because the sampler compiles slowly (its sorts over the vocabulary) and costs little
    per row."""

    tokens: list[int]
    rows: list[int]
    max_num_seqs: int
    width: int
    num_scheduler_steps: int = 1
    history: tuple[int, ...] = ()  # the token-history upload's widths (history_widths)

    @classmethod
    def create(cls, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
               num_scheduler_steps: int = 1, num_speculative_tokens: int = 0,
               batch_invariant: bool = False, max_model_len: int | None = None,
               min_tokens: int = 1) -> "Buckets":
        """Speculative decoding samples a row per draft too: up to max_num_seqs * (1 + k) rows
        (the scheduler keeps them within max_num_batched_tokens), on a doubling ladder above
        max_num_seqs, so that steps without drafts keep their row buckets. `batch_invariant`: no
        one-row buckets (measured: a lone decode's bits differ from a batched one's with them,
        while batches of 2 to 8 agree; XLA special-cases size-1 axes). `min_tokens`: the smallest
        token bucket (MIN_TOKEN_BUCKET), at most max_num_seqs (a decode of every sequence keeps a
        bucket of its own); row buckets below what it samples are left out."""
        least = 2 if batch_invariant and max_num_seqs >= 2 else 1
        rows = ladder(least, max_num_seqs, factor=8)
        max_rows = min(max_num_seqs * (1 + num_speculative_tokens), max_num_batched_tokens)
        if max_rows > max_num_seqs:
            rows += ladder(2 * max_num_seqs, max_rows)
        # Doubling token ladder: at most 2x padding.
        tokens = ladder(min(max(least, min_tokens), max_num_seqs, max_num_batched_tokens), max_num_batched_tokens)
        rows = [r for r in rows if r >= fit(rows, min(tokens[0], rows[-1]))]
        return cls(tokens, rows, max_num_seqs, max_blocks_per_seq, num_scheduler_steps,
                   tuple(history_widths(max_model_len)) if max_model_len else ())

    def seqs(self, num_tokens: int) -> int:
        """Sequence rows of a step of `num_tokens` (a bucket): each sequence has a token."""
        return min(num_tokens, self.max_num_seqs)

    def sample_rows(self, num_tokens: int) -> int:
        """Sampling rows of a step of `num_tokens`: at most a row per token (a fork's rows take
        seats, so the token bucket covers them too), at most the ladder's top (max_num_seqs
        without drafts)."""
        return fit(self.rows, min(num_tokens, self.rows[-1]))

    @property
    def decode_tokens(self) -> list[int]:
        """Token buckets a multi-step decode runs in (a token and a sequence row each)."""
        return [t for t in self.tokens if t <= self.max_num_seqs]

    def keys(self, hidden: bool = False):
        """Every executable: the model forward per token bucket, the sampler per (rows, full on/off),
        each block operation per padded size, and with multi-step decode the K-step decode loop
        per bucket of decode steps (tokens <= max_num_seqs). Compiling the forward and the sampler
        apart keeps the count additive, not a product."""
        for tokens in self.tokens:  # (`hidden`: forwards that also return the sampled rows' hidden states)
            yield ("forward", tokens) + (("hidden",) if hidden else ())
        if self.num_scheduler_steps > 1:
            for tokens in self.decode_tokens:
                yield ("multi_step", tokens)
        for rows in self.rows:  # (the fast sampler also without its random path: all-greedy steps)
            yield ("sample", rows, False, "greedy")
            for full in (False, True):
                yield ("sample", rows, full)
        for op in BLOCK_OPS:
            for num_blocks in BLOCK_OP_SIZES:
                yield (op, num_blocks)
        yield from block_table_keys()
        for width in self.history:
            yield ("write_history", HISTORY_UPLOAD_ROWS, width)


def block_table_keys():
    """The block-table writes' executables, one per update size."""
    for size in BLOCK_TABLE_UPDATE_SIZES:
        yield ("write_block_table", size)


def update_chunks(rows, cols, values):
    """(rows, cols, values) split into chunks of the largest update size, each padded to the
    smallest size that holds it (row -1: skipped)."""
    largest = BLOCK_TABLE_UPDATE_SIZES[-1]
    for start in range(0, len(rows), largest):
        n = min(largest, len(rows) - start)
        size = fit(list(BLOCK_TABLE_UPDATE_SIZES), n)
        chunk = tuple(np.full(size, fill, np.int32) for fill in (-1, 0, 0))
        for out, part in zip(chunk, (rows, cols, values)):
            out[:n] = part[start:start + n]
        yield chunk
