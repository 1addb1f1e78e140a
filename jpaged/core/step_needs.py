"""What a step needs from the host: the one place that decides it.

Per request (its SamplingParams alone, worked out once: `SequenceGroup.needs`, a
request_needs.RequestNeeds): whether each sampled token must reach
the host before the next step is scheduled, and whether its rows need the full sampler. From
those and the queues: whether the next step may be scheduled before this one's tokens are read
(async scheduling's overlap) and whether a step may run K decode steps in one device call
(num_scheduler_steps). A new feature that needs the host (speculative decoding's verification)
adds its rule here, nowhere else.
"""

from jpaged.core import decode_lane
from jpaged.core.sequence import SequenceStatus


def can_overlap(scheduler, results, max_model_len: int, lane=None) -> bool:
    """Whether the next step can be scheduled before the dispatched step of `results` (its
    (ScheduledSequenceGroup, handle, row) each; `lane`: its decode lane's LanePlan) is read: each
    running group decodes one pending token per sequence with a plan
    that needs no host state of it (no beam search or fork; penalties read the device's
    token history, where the sampler appended the pending token; a grammar's mask needs the
    token only before the next step's SAMPLING: the runner launches that step's forward at once
    and its sampler once the token is read and the matcher advanced, runner/deferred_sample.py), nothing is
    swapped out, every sequence can take a block (no preemption) and has a position left under
    max_model_len. A prompt whose chunk is in flight with more to come takes its next chunk
    behind it (its tokens are the host's), if blocks for that chunk are free too and it asks for
    no prompt logprobs. Waiting requests are admitted behind the step in flight, as vLLM v1's async
    scheduling admits them: a prompt needs no token of it, and the scheduler admits after the
    running decodes took their blocks, so an admission never preempts.

    What is corrected one step late instead of refused (as vLLM's async scheduling does): a
    sequence that ends with its pending token (max_tokens, EOS, a stop) computes one more token,
    which is dropped when the pending one is read (Scheduler._process: a finished sequence's
    row is skipped; its blocks go back after the step that used them was dispatched); with
    prefix caching, a block the pending token fills is hashed when the token is read
    (Scheduler._process), not when it is scheduled. With static KV allocation (blocks reserved
    for max_tokens) a sequence at its max_tokens is still refused: its extra slot may lie past them."""
    # Speculative decoding: drafts are proposed from the last token, so it must be on the host
    # whenever the next step may take drafts (the speculator's policy); otherwise (above
    # disable_by_batch_size, or no request that speculates) steps overlap as without it.
    spec = scheduler.speculator
    if scheduler.swapped or (spec is not None and spec.may_draft(scheduler.running)):
        return False
    whole_lane = _lane_can_overlap(scheduler, lane, results, max_model_len)  # (the same rules, as arrays)
    if whole_lane is not None:
        return whole_lane
    step_groups = {s.seq_group.request_id for s, _, _ in results}
    bm = scheduler.block_manager
    static, num_seqs, chunk_blocks = bm.kv_allocation == "static", 0, 0
    running = SequenceStatus.RUNNING
    for group in scheduler.running:
        if group.request_id not in step_groups or group.needs.host_tokens:
            return False
        seqs = group.seqs
        if len(seqs) == 1 and not static:  # (most groups, every step: the checks below inlined)
            seq = seqs[0]
            if seq.status is running:
                if seq.num_pending_tokens == 1:
                    if len(seq.prompt_token_ids) + len(seq.output_token_ids) + 1 >= max_model_len:
                        return False
                    num_seqs += 1
                elif (seq.num_pending_tokens == 0 and seq.get_num_uncomputed_tokens() > 0
                      and group.prompt_logprobs is None):
                    # A prompt's chunk in flight and more to come: its next chunk's tokens are the
                    # host's (prompt logprobs' rows follow those read: Sequence.prompt_logprob_rows).
                    # Blocks for the largest next chunk are kept free, so nothing is preempted.
                    chunk = min(seq.get_num_uncomputed_tokens(), scheduler.max_num_batched_tokens)
                    chunk_blocks += -(-chunk // bm.block_size) + 1
                else:
                    return False
            continue
        for seq in group.get_seqs(running):
            if (seq.num_pending_tokens != 1 or seq.get_len() >= max_model_len
                    or (static and seq.get_output_len() >= group.sampling_params.max_tokens)):
                return False
            num_seqs += 1
    return (num_seqs or chunk_blocks) > 0 and bm.get_num_free_gpu_blocks() >= num_seqs + chunk_blocks


def _lane_can_overlap(scheduler, lane, results, max_model_len: int) -> bool | None:
    """can_overlap for a step that is the scheduler's current decode lane whole, the running
    queue that lane (None: not that case; core/decode_lane.py): the rows' needs and positions as
    arrays."""
    current = scheduler.lane
    if (current is None or not decode_lane.whole(lane, results) or current.rows is not lane.rows
            or not current.matches(scheduler.running) or scheduler.block_manager.kv_allocation == "static"):
        return None
    # Each row has its token pending (after the dispatch, one of its position + 1): room for one more.
    if lane.rows.host_tokens.any() or (lane.start + 2 >= max_model_len).any():
        return False
    return scheduler.block_manager.get_num_free_gpu_blocks() >= lane.n


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
