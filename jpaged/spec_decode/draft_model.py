"""The draft model (`{"method": "draft_model", "model": ..., "num_speculative_tokens": k}`): a
smaller checkpoint with the target's vocabulary, loaded as the target is (dtype, tensor
parallelism, attention backend) on the target's devices.

Its KV pages: a pool of its own layout with the same number of blocks, addressed by the target's
block tables (the block manager manages one set of block ids; a block holds both models' K/V of
the same tokens). So prefix caching, copy-on-write, swapping and recompute need nothing new: the
runner copies and swaps both pools' blocks together, and the pool is sized on the two models'
bytes per block summed. The draft's pages stay level with the target's: every step runs the
draft's K/V-only forward over the same tokens (prefill chunks, decodes, verified drafts), so
wherever the target has K/V, the draft has too (a cached prefix, a swapped-in sequence).

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
from jpaged.runner.prepare_inputs import SeqInput
from jpaged.runner.sampler import SamplingRow
from jpaged.spec_decode.speculator import DRAFT_PENDING

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


def propose_drafts(plan, scheduler, runner, seed_of):
    """The drafts of the groups `plan` reserved them for (DRAFT_PENDING), from the runner's draft
    model, into the plan (Scheduler.set_drafts). `seed_of(params, seq)`: the seed the target's
    rows sample with. If proposing fails, those groups decode without drafts this step."""
    pending = [s for s in plan.scheduled_seq_groups if s.spec_token_ids[:1] == [DRAFT_PENDING]]
    if not pending:
        return
    seqs, rows = [], []
    for scheduled in pending:
        group, seq = scheduled.seq_group, scheduled.seqs[0]
        seqs.append(SeqInput(seq.seq_id, [seq.get_last_token_id()], seq.get_len() - 1,
                             scheduler.block_manager.get_block_table(seq), 1))
        # The key and sampling knobs of the target's first row (not its penalties, bans or grammar).
        rows.append(SamplingRow(group.sampling_params, seed_of(group.sampling_params, seq), group.seqs.index(seq),
                                seq.get_output_len()))
    try:
        drafts = runner.propose(seqs, rows, [len(s.spec_token_ids) for s in pending])
    except Exception as e:
        if not runner.is_alive():
            raise
        logger.warning("the draft model's proposals failed (%r): this step verifies no drafts", e)
        drafts = [[] for _ in pending]
    for scheduled, tokens in zip(pending, drafts):
        scheduler.set_drafts(plan, scheduled, tokens)
