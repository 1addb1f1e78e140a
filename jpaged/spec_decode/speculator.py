"""The scheduler's speculation policy: which decoding sequences take drafts this step, how many,
and the counters of what was proposed and accepted."""

from jpaged.core.sequence import SequenceGroup, SequenceStatus
from jpaged.spec_decode.config import SpeculativeConfig
from jpaged.spec_decode.ngram import NgramProposer
from jpaged.spec_decode.proposer import DRAFT_PENDING, Proposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, structured_output=None,
                 proposer: Proposer | None = None):
        """`proposer`: the engine's (spec_decode/proposer.py); by default config.method's n-gram
        lookup, or DRAFT_PENDING placeholders for a draft model (the scheduler's tests)."""
        self.config = config
        self.proposer = proposer if proposer is not None else \
            NgramProposer(config) if config.method == "ngram" else None
        self.max_model_len = max_model_len
        self.structured_output = structured_output  # grammars cut drafts at their first invalid token
        # vLLM's counters: steps that verified drafts, drafts proposed, drafts accepted, and
        # accepted drafts by position (how often the i-th draft of a run was accepted).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens

    def enabled(self, num_running_seqs: int) -> bool:
        """disable_by_batch_size: no drafts while more sequences run than that."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running_seqs <= limit

    def enabled_for(self, groups) -> bool:
        """`enabled` for the running `groups` (counted only when there is a limit: every step asks)."""
        return self.config.disable_by_batch_size is None or self.enabled(sum(g.num_unfinished_seqs() for g in groups))

    def spare_tokens(self, running_groups, budget_tokens: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Tokens this step's drafts may take: what the decodes of `running_groups` leave of the
        step's token budget, and at most max_num_batched_tokens - max_num_seqs, so that sampled
        rows (a seat or a draft each) never outnumber the largest token bucket. 0 with more
        sequences running than disable_by_batch_size."""
        running = decoding = 0
        for group in running_groups:
            num_seqs = group.num_unfinished_seqs()
            running += num_seqs
            decoding += 0 if group.is_prefill() else num_seqs
        if not self.enabled(running):
            return 0
        return max(0, min(budget_tokens - decoding, max_num_batched_tokens - max_num_seqs))

    def may_draft(self, groups) -> bool:
        """Whether the next step may give any of the running `groups` drafts (async scheduling
        then waits for the last step's tokens: step_needs.can_overlap)."""
        return self.enabled_for(groups) and \
            any(len(g.seqs) == 1 and g.needs.speculate for g in groups)

    def propose(self, group: SequenceGroup, max_drafts: int) -> list[int]:
        """Drafts for the group's next step, at most `max_drafts` (empty: it decodes one token;
        a proposer that drafts after scheduling: DRAFT_PENDING placeholders). Only a lone
        sequence that decodes its last token speculates (no beams or forks); no draft runs past
        max_tokens or max_model_len, nor past the first one its grammar rejects. (min_tokens:
        each row bans EOS and stop ids by its own output position.)"""
        sp = group.sampling_params
        if max_drafts < 1 or len(group.seqs) != 1 or not group.needs.speculate:
            return []
        seq = group.seqs[0]
        if seq.status is not SequenceStatus.RUNNING or seq.num_pending_tokens or seq.get_num_uncomputed_tokens() != 1:
            return []
        k = min(self.config.num_speculative_tokens, max_drafts, sp.max_tokens - seq.get_output_len() - 1,
                self.max_model_len - seq.get_len())
        if k < 1:
            return []
        if self.proposer is None or self.proposer.drafts_after_scheduling:
            return [DRAFT_PENDING] * k
        return self.check_drafts(group, self.proposer.draft(seq.get_token_ids(), k))

    def check_drafts(self, group: SequenceGroup, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the group's grammar rejects."""
        sp = group.sampling_params
        if drafts and sp.guided:
            drafts = drafts[:self.structured_output.valid_drafts(group.seqs[0].seq_id, sp, drafts)]
        return drafts

    def record(self, num_drafts: int, num_accepted: int):
        """One verified run: `num_drafts` proposed, the first `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}
