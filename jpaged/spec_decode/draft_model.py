"""The draft model (`{"method": "draft_model", "model": ..., "num_speculative_tokens": k}`): a
smaller checkpoint with the target's vocabulary, loaded as the target is (dtype, tensor
parallelism, attention backend) on the target's devices.

Its KV pages: a pool of its own layout with the same number of blocks, addressed by the target's
block tables (the block manager manages one set of block ids; a block holds both models' K/V of
the same tokens). So prefix caching, copy-on-write, swapping and recompute need nothing new: the
runner copies and swaps both pools' blocks together, and the pool is sized on the two models'
bytes per block summed. The draft's pages stay level with the target's: every step runs the
draft's K/V-only forward over the same tokens (prefill chunks, decodes, verified drafts), so
wherever the target has K/V, the draft has too (a cached prefix, a swapped-in sequence); except
steps above disable_by_batch_size, which skip it (vLLM's skip_proposer): their tokens' draft K/V
stay missing, so drafts after them are accepted less often, the output unchanged.
DraftModelProposer owns all of it: the draft's DraftRunner (weights, pages, executables), run
through the hooks of the Proposer interface (proposer.py).

A step's drafts come from the step before it, as vLLM v1's (draft_ahead.py, ahead.py): right
after a target step's dispatch (`after_dispatch`: its sampler on its way, no host read between),
one device call per chunk of speculating sequences works out each one's accepted drafts and new
last token from the step's sampled tokens, and runs the draft's k decode steps from there,
writing the draft's K/V to scratch blocks past the target's (the real pages keep the step's
K/V forward's entries). Its output is read with the step's tokens (`read_ahead`, into `ready`);
the next step's `propose` (after scheduling, which reserves k lookahead slots per speculating
sequence) puts those drafts in with no device call where they follow the sequence as it now
stands. A sequence without them (the step before did not sample it: just swapped in, or it
skipped the hooks above disable_by_batch_size, or the call failed) takes no drafts that step.
Each draft row samples with the key of the target's row at that output position and the
request's temperature and top-k/p, so where the two models agree the draft is the very token
the target draws (the two share Gumbel noise). Verification is unchanged: accept while the
target's draw equals the draft. The output is the target's own sampling, token for token, for
every seed (greedy: argmax agreement).
"""

import dataclasses

from jpaged.models.kv_cache import KVCacheSpec, kv_dtype
from jpaged.models.layers import common_sliding_window
from jpaged.models.loader import LoadedModel, load_model
from jpaged.models.paged_attention import check_kernels
from jpaged.runner.buckets import BLOCK_OP_SIZES, BLOCK_OPS
from jpaged.runner.step_functions import StepHandle
from jpaged.spec_decode.ahead import AheadProposer
from jpaged.spec_decode.draft_ahead import DraftRunner, pack_ahead


@dataclasses.dataclass
class DraftModel:
    loaded: LoadedModel
    kv_cache_spec: KVCacheSpec


def load_draft_model(config, target: LoadedModel, max_model_len: int) -> DraftModel:
    """The draft checkpoint of `config.speculative_config`, checked against the target: its
    vocabulary, its positions and its attention window (ValueError naming speculative_config.model)."""
    name = config.speculative_config.model
    loaded = load_model(name, dtype=config.dtype, attention_backend=config.attention_backend,
                        tensor_parallel_size=config.tensor_parallel_size, max_model_len=config.max_model_len,
                        batch_invariant=config.batch_invariant,
                        devices=list(target.mesh.devices.flat))  # the target's devices, in its mesh order

    def refuse(why: str):
        raise ValueError(f"speculative_config.model={name!r} {why}")

    draft_vocab, target_vocab = loaded.hf_config.vocab_size, target.hf_config.vocab_size
    if draft_vocab != target_vocab:
        refuse(f"has a vocabulary of {draft_vocab} tokens, the target {target_vocab}: a draft must share the "
               "target's vocabulary")
    if loaded.tokenizer is not None and target.tokenizer is not None \
            and loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        refuse("has another tokenizer vocabulary than the target (same size, other tokens)")
    limit = getattr(loaded.hf_config, "max_position_embeddings", None) or getattr(loaded.hf_config, "n_positions", None)
    if limit is not None and limit < max_model_len:
        refuse(f"has {limit} positions, fewer than max_model_len={max_model_len}")
    if common_sliding_window(loaded.model) != common_sliding_window(target.model):
        refuse("attends within another window than the target (the block manager frees blocks by the target's)")
    spec = KVCacheSpec.of_model(loaded.model, config.block_size, kv_dtype(config.kv_cache_dtype, loaded.dtype),
                                config.tensor_parallel_size)
    check_kernels(loaded.model, spec, loaded.dtype, config.attention_backend)
    return DraftModel(loaded, spec)


def draft_keys(runner, lora: bool = False):
    """A draft model's executables: its K/V-only forward over each token bucket of the target's
    steps, its drafts after a step (draft_ahead.py: the k decode steps per decode bucket, and
    the sampled tokens' padding per sampler output), and the block operations on its pages.
    `lora`: the target's step inputs carry LoRA slots."""
    for tokens in runner.buckets.tokens:
        yield ("kv_forward", tokens) + (("lora",) if lora else ())
    yield from runner.ahead_keys()
    for op in BLOCK_OPS:
        for num_blocks in BLOCK_OP_SIZES:
            yield (op, num_blocks)


class DraftModelProposer(AheadProposer):
    """Drafts after each target step for the next (draft_ahead.py, ahead.py; the plan reserves k
    slots per speculating sequence), from the draft model's DraftRunner (`runner`, which it
    owns: built with the target's shape, its pages sharing the target's block ids, plus the
    drafts' scratch blocks)."""

    method = "draft_model"
    drafts_ahead = True
    prompt_tail = True  # (a prompt's last token, left for the next step by a chunk, is known: drafts from it)
    label = "the draft model's"

    def __init__(self, draft: DraftModel, executable_cache, target_lora: bool = False, **shape):
        """`shape`: the target runner's (its blocks, sequences, tokens, lengths and drafts);
        `target_lora`: the target has LoRA slots (its steps' inputs carry each token's slot; the
        draft has no adapters: its drafts are the base model's, verified by the adapted target)."""
        super().__init__()
        self.target_lora = target_lora
        self.k = shape["num_speculative_tokens"]
        self.runner = DraftRunner(draft.loaded, draft.kv_cache_spec, self.chain_steps(self.k), executable_cache,
                                  **shape)
        # The target's last step's packed sampler output and device block table (after_sample).
        self.sampled = self.block_table = None

    # ------------------------------------------------------------------ the runner's hooks
    def forward_kv(self, num_tokens: int, inputs, last_tokens, block_table):
        # the step's tokens' K/V in the draft's pages
        self.runner.run_kv_forward(num_tokens, inputs, last_tokens, block_table, self.target_lora)

    def after_sample(self, sampled, block_table):
        self.sampled, self.block_table = sampled, block_table

    def device_ops(self) -> dict:
        return {"draft_ahead": self._run_ahead}

    def _run_ahead(self, rows: int, seqs: int, packed):
        return self.runner.run_ahead(self.sampled, rows, seqs, packed, self.block_table)

    def warm_up(self, stop=None):
        self.runner.warm_up(stop, list(draft_keys(self.runner, self.target_lora)))

    # ------------------------------------------------------------------ drafts
    def can_ahead(self, dispatched, runner) -> bool:
        handle = dispatched.handles[0]  # (a grammar step's deferred sampler has not run yet; a multi-step decode)
        return isinstance(handle, StepHandle) and handle.num_steps == 1 and self.sampled is not None

    def dispatch_ahead(self, part, dispatched, runner):
        """The draft's k decode steps (draft_ahead.py) from the tokens the step samples."""
        return runner.dispatch_op("draft_ahead", dispatched.handles[0].num_rows, len(part.arrays[0]),
                                  pack_ahead(self.runner, part, runner.input_batch))
