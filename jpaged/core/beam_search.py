"""One beam search step over a group's beams (vLLM v0.4's _process_sequence_group_outputs).

Called by Scheduler.update_from_output for a beam search group; it forks, appends, finishes,
drops and frees through the scheduler, like the rest of the post-step update. The scheduler
imports this module, so this one knows it only as a `BeamScheduler`.
"""

import typing
from collections.abc import Sequence as Seq

import numpy as np

from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.core.stop_checker import StopChecker
from jpaged.sampling_params import SamplingParams


class BeamScheduler(typing.Protocol):
    """What a beam search step does through the scheduler (`Scheduler` is one)."""

    stop_checker: StopChecker

    def new_seq_id(self) -> int: ...

    def fork_seq(self, parent: Sequence, child: Sequence) -> None: ...

    def free_seq(self, seq: Sequence) -> None: ...


def top_logprobs(sp: SamplingParams, out, row: int) -> dict[int, float] | None:
    """Row `row`'s top `sp.logprobs` tokens and their logprobs, when the request asks for them."""
    if sp.logprobs is None:
        return None
    return {int(t): float(lp) for t, lp in zip(out.top_ids[row, :sp.logprobs], out.top_logprobs[row, :sp.logprobs])}


def beam_search_step(scheduler: BeamScheduler, group: SequenceGroup, beams: list[tuple[Sequence, int]], out):
    """The 2 * best_of best (beam, token) candidates become children of their beams; the best
    best_of finished ones are kept aside and the best best_of live ones continue. A parent
    continues as its own last child; other children fork it (sharing its blocks) and dropped
    beams free theirs. `beams`: (beam, its row in `out`)."""
    sp, width, stops = group.sampling_params, group.sampling_params.best_of, scheduler.stop_checker
    existing_finished = [seq for seq in group.seqs if seq.is_finished()]
    rows = [row for _, row in beams]
    candidates = beam_search_candidates([seq.cumulative_logprob for seq, _ in beams], out.top_ids[rows],
                                        out.top_logprobs[rows], 2 * width)
    children: list[tuple[Sequence, Sequence]] = []  # (child, parent)
    for i, (parent, row) in enumerate(beams):
        tokens = [(token, logprob) for beam, token, logprob in candidates if beam == i]
        if not tokens:  # no candidate: the beam ends here
            parent.status = SequenceStatus.FINISHED_ABORTED
            group.remove(parent)
            scheduler.free_seq(parent)
            continue
        top = top_logprobs(sp, out, row)  # the row's; each child adds its own token to a copy
        for token, logprob in tokens[:-1]:
            child = parent.fork(scheduler.new_seq_id())
            stops.append_token(sp, child, token, logprob, dict(top) if top is not None else None)
            children.append((child, parent))
        stops.append_token(sp, parent, *tokens[-1], top)
        children.append((parent, parent))

    def by_score(pairs):
        return sorted(pairs, key=lambda pair: stops.beam_score(sp, pair[0]), reverse=True)

    # The best `width` finished beams so far stay (parent None: finished before this step).
    finished = by_score([(seq, None) for seq in existing_finished]
                        + [(seq, parent) for seq, parent in children if seq.is_finished()])
    selected = [pair for pair in finished[:width] if pair[1] is not None]
    dropped = [pair for pair in finished[width:] if pair[1] is not None]
    for seq, parent in finished[width:]:
        if parent is None:
            group.remove(seq)
    running = by_score([pair for pair in children if not pair[0].is_finished()])
    if not running:
        stop = True
    elif len(finished) < width:
        stop = False
    else:
        stop = _done(stops, sp, running[0][0], finished[width - 1][0])
    selected += [] if stop else running[:width]
    dropped += running if stop else running[width:]

    # Fork the new children before any parent lets go of the blocks they share.
    for seq, parent in selected:
        if seq is not parent:
            group.add(seq)
            if not seq.is_finished():
                scheduler.fork_seq(parent, seq)
    for seq, parent in selected:
        if seq is parent and seq.is_finished():
            scheduler.free_seq(seq)
    for seq, parent in dropped:
        if seq is parent:
            group.remove(seq)
            scheduler.free_seq(seq)


def _done(stops, sp: SamplingParams, best_running: Sequence, worst_finished: Sequence) -> bool:
    """With best_of beams finished: can no live beam beat the worst of them (vLLM v0.4's
    _check_beam_search_early_stopping)?"""
    if sp.early_stopping is True:
        return True
    best = stops.beam_score(sp, best_running)
    if sp.early_stopping == "never" and sp.length_penalty > 0:
        # Longer is better: score the best live beam at the longest length it could reach
        # (vLLM takes the larger of prompt + max_tokens and max_model_len).
        longest = max(best_running.get_prompt_len() + sp.max_tokens, stops.max_model_len)
        best = stops.beam_score(sp, best_running, longest)
    return stops.beam_score(sp, worst_finished) >= best


def beam_search_candidates(cumulative_logprobs: Seq[float], top_ids: np.ndarray, top_logprobs: np.ndarray,
                           num_candidates: int) -> list[tuple[int, int, float]]:
    """vLLM v0.4's beam search step, on the host: the `num_candidates` (2 * beam width) best
    (beam, next token) pairs over all beams x the vocabulary by cumulative logprob, best first, as
    (beam index, token id, token logprob). Each beam's own `num_candidates` most likely tokens
    (from `sample`'s top logprobs, one row per beam) hold every pair that can make the cut. Ties
    go to the earlier beam, then the more likely token; banned (-inf) tokens never count."""
    ids, logprobs = top_ids[:, :num_candidates], top_logprobs[:, :num_candidates].astype(np.float64)
    scores = (np.asarray(cumulative_logprobs, np.float64)[:, None] + logprobs).ravel()
    best = [i for i in np.argsort(-scores, kind="stable")[:num_candidates] if np.isfinite(scores[i])]
    width = ids.shape[1]
    return [(int(i) // width, int(ids.flat[i]), float(logprobs.flat[i])) for i in best]
