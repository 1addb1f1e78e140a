"""What a step needs from the host: the one place that decides it.

Per request (its SamplingParams alone, worked out once: `SequenceGroup.needs`, a
request_needs.RequestNeeds): whether each sampled token must reach
the host before the next step is scheduled, and whether its rows need the full sampler. From
those and the queues: whether the next step may be scheduled before this one's tokens are read
(async scheduling's overlap) and whether a step may run K decode steps in one device call
(num_scheduler_steps). A new feature that needs the host (speculative decoding's verification)
adds its rule here, nowhere else.
"""

from jpaged.core.sequence import SequenceStatus


def can_overlap(scheduler, step_groups: set[str], max_model_len: int) -> bool:
    """Whether the next step can be scheduled before the step of `step_groups` (its groups'
    request ids) is read: each running group decodes one pending token per sequence with sampling
    that needs no host state of it (no penalties, grammar, beam search or fork), nothing waits
    or is swapped out (no admission), every sequence can take a block (no preemption), none is
    sure to end with its pending token (no slot past its end) and, with prefix caching, none
    fills a block with it (the block's hash needs the token)."""
    # Speculative decoding: drafts are proposed from the last token, so it must be on the host
    # whenever the next step may take drafts (the speculator's policy); otherwise (above
    # disable_by_batch_size, or no request that speculates) steps overlap as without it.
    spec = scheduler.speculator
    if scheduler.waiting or scheduler.swapped or (spec is not None and spec.may_draft(scheduler.running)):
        return False
    bm = scheduler.block_manager
    caching, num_seqs = bm.enable_caching, 0
    for group in scheduler.running:
        sp = group.sampling_params
        if group.request_id not in step_groups or group.needs.host_tokens:
            return False
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if (seq.num_pending_tokens != 1 or seq.get_output_len() >= sp.max_tokens
                    or seq.get_len() >= max_model_len or (caching and seq.get_len() % bm.block_size == 0)):
                return False  # (a block the pending token fills is hashed from its tokens)
            num_seqs += 1
    return num_seqs > 0 and bm.get_num_free_gpu_blocks() >= num_seqs


def can_multi_step(scheduler, num_steps: int, max_model_len: int) -> bool:
    """Whether the next step can be a multi-step decode of `num_steps`: nothing waits or is
    swapped out, every running sequence decodes (its tokens but the last computed) with what the
    fast sampler does on the device alone (no penalties, logprobs, grammar, beam search or
    min_tokens ban), has room for the K more positions, and the device blocks for every
    sequence's lookahead slots are free (no preemption)."""
    if num_steps == 1 or scheduler.waiting or scheduler.swapped or not scheduler.running:
        return False
    seqs = []
    for group in scheduler.running:
        sp = group.sampling_params
        if group.is_prefill() or group.needs.full_sampler:
            return False
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if (seq.num_pending_tokens or seq.get_num_uncomputed_tokens() != 1
                    or seq.get_output_len() < sp.min_tokens or seq.get_len() + num_steps - 1 > max_model_len
                    or (not seq.output_token_ids and (sp.best_of > 1 or sp.prompt_logprobs is not None))):
                return False  # (the last prompt token of a chunked prefill may fork or need prompt rows)
            seqs.append(seq)
    bm = scheduler.block_manager
    return bm.num_blocks_to_append(seqs, num_steps - 1) <= bm.get_num_free_gpu_blocks()
