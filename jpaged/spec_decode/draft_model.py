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
DraftModelProposer owns all of it: the draft's ModelRunner (weights, pages, executables), run
through the hooks of the Proposer interface (proposer.py).

A step's drafts: after scheduling (which reserves k lookahead slots per speculating sequence),
the draft runs k decode steps in one device call (the multi-step loop) from each sequence's last
token, writing its K/V into the reserved slots. Each draft row samples with the key of the
target's row at that output position and the request's temperature and top-k/p, so where the
two models agree the draft is the very token the target draws (the two share Gumbel noise).
Verification is unchanged: accept while the target's draw equals the draft. The output is the
target's own sampling, token for token, for every seed (greedy: argmax agreement).
"""

import dataclasses
import logging

from jpaged.models.kv_cache import KVCacheSpec, kv_dtype
from jpaged.models.layers import common_sliding_window
from jpaged.models.loader import LoadedModel, load_model
from jpaged.models.paged_attention import check_kernels
from jpaged.runner.buckets import BLOCK_OP_SIZES, BLOCK_OPS, block_table_keys
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.prepare_inputs import SeqInput, prepare_inputs
from jpaged.runner.input_batch import pack
from jpaged.runner.step_inputs import StepBatch
from jpaged.runner.step_functions import StepHandle
from jpaged.spec_decode.proposer import DRAFT_PENDING, RunnerProposer

logger = logging.getLogger(__name__)


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


def draft_keys(buckets, lora: bool = False):
    """A draft model's executables: its K/V-only forward over each token bucket of the target's
    steps, its k-step proposal loop (multi_step with k = num_scheduler_steps) per decode bucket,
    and the block operations on its pages. `lora`: the target's step inputs carry LoRA slots."""
    for tokens in buckets.tokens:
        yield ("kv_forward", tokens) + (("lora",) if lora else ())
    for tokens in buckets.decode_tokens:
        yield ("multi_step", tokens)
    for op in BLOCK_OPS:
        for num_blocks in BLOCK_OP_SIZES:
            yield (op, num_blocks)
    yield from block_table_keys()


class DraftModelProposer(RunnerProposer):
    """Drafts after scheduling, from the draft model's ModelRunner (`runner`, which it owns: built
    with the target's shape and num_scheduler_steps = k, its pages sharing the target's block ids)."""

    method = "draft_model"

    def __init__(self, draft: DraftModel, executable_cache, target_lora: bool = False, **shape):
        """`shape`: the target runner's (its blocks, sequences, tokens, lengths and drafts);
        `target_lora`: the target has LoRA slots (its steps' inputs carry each token's slot; the
        draft has no adapters: its drafts are the base model's, verified by the adapted target)."""
        self.target_lora = target_lora
        self.runner = ModelRunner(draft.loaded, draft.kv_cache_spec, **shape,
                                  num_scheduler_steps=shape["num_speculative_tokens"], executable_cache=executable_cache)

    # ------------------------------------------------------------------ the runner's hooks
    def forward_kv(self, num_tokens: int, inputs, last_tokens, block_table):
        # the step's tokens' K/V in the draft's pages
        self.runner.run_kv_forward(num_tokens, inputs, last_tokens, block_table, self.target_lora)

    def device_ops(self) -> dict:
        return {"propose": self.runner.run_multi_step, "draft_block_table": self.runner._write_block_table}

    def warm_up(self, stop=None):
        self.runner.warm_up(stop, list(draft_keys(self.runner.buckets, self.target_lora)))

    # ------------------------------------------------------------------ drafts
    def propose(self, plan, scheduler, runner, seed_of):
        """The drafts of the groups `plan` reserved them for (DRAFT_PENDING), into the plan
        (Scheduler.set_drafts). If proposing fails, those groups decode without drafts this step."""
        pending = [s for s in plan.scheduled_seq_groups if s.spec_token_ids[:1] == [DRAFT_PENDING]]
        if not pending:
            return
        seqs, rows = [], []
        for scheduled in pending:
            group, seq = scheduled.seq_group, scheduled.seqs[0]
            seqs.append(SeqInput(seq.seq_id, [seq.get_last_token_id()], seq.get_len() - 1,
                                 scheduler.block_manager.get_block_table(seq), 1))
            # The key and sampling knobs of the target's first row (not its penalties, bans or grammar):
            # (params, seed, seq_index, sample_index).
            rows.append((group.sampling_params, seed_of(group.sampling_params, seq), group.seqs.index(seq),
                         seq.get_output_len()))
        try:
            drafts = self.draft_tokens(runner, seqs, rows, [len(s.spec_token_ids) for s in pending])
        except Exception as e:
            if not runner.is_alive():
                raise
            logger.warning("the draft model's proposals failed (%r): this step verifies no drafts", e)
            drafts = [[] for _ in pending]
        for scheduled, tokens in zip(pending, drafts):
            scheduler.set_drafts(plan, scheduled, tokens)

    def draft_tokens(self, target, seqs: list[SeqInput], sampling_rows: list, steps_of: list[int]) -> list[list[int]]:
        """From each sequence's last token (one SeqInput token, one sample), `steps_of[i]` tokens,
        drafted one after another on the device by the draft's k-step decode loop (run through
        the `target` runner's dispatch: multi-host sends it). Each row samples with the target
        row's key at that output position (`sampling_rows`: the first one's (params, seed,
        seq_index, sample_index); the draft's InputBatch rows keep them), so a draft is the
        token the target draws there when the two models agree, and verification keeps the
        target's draws exactly (spec_decode/__init__.py). The blocks must hold slots for every
        drafted token."""
        draft, drafts = self.runner, []
        chunk = draft.buckets.decode_tokens[-1]  # a decode bucket holds at most this many sequences
        for start in range(0, len(seqs), chunk):
            part = slice(start, start + chunk)
            ib = draft.input_batch
            ib.free_absent({s.seq_id for s in seqs[part]})
            for s, (sp, seed, index, _) in zip(seqs[part], sampling_rows[part]):
                if s.seq_id not in ib.row_of:
                    ib.add(s.seq_id, sp, seed, index, key_only=True)
            step = prepare_inputs(seqs[part], ib, draft.buckets, draft.block_size, multi_step=True,
                                  steps_of=steps_of[part])
            draft.flush_block_table(target.dispatch_op, "draft_block_table")
            num_rows = len(step.inputs.logits_indices)
            rows = StepBatch(src=step.rows.tolist(), sample_index=[r[3] for r in sampling_rows[part]])
            smeta = draft.sampling_metadata(rows, num_rows, False)
            out = target.dispatch_op("propose", step.num_tokens,
                                     pack((step.inputs, smeta, step.dst_rows, step.lookahead_slots)))
            outs = target.collect(StepHandle(out, num_rows, 0, step.num_rows, draft.buckets.num_scheduler_steps))
            drafts += [[outs[j].token_ids[i] for j in range(k)] for i, k in enumerate(steps_of[part])]
        return drafts
