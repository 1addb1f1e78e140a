"""What one request needs of a step, from its SamplingParams alone: worked out once per request,
when its SequenceGroup is made (`SequenceGroup.needs`); the step-level rules built on it are in
step_needs.py. A module of its own because the group makes it and step_needs reads groups."""

import dataclasses

from jpaged.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestNeeds:
    # The next step's plan depends on this step's token on the host: beam search's choice of
    # beams. (Not penalties: the sampler appends each sampled token to the sequence's device token
    # history, which the next step's penalties read. Not a grammar: see `grammar`.)
    host_tokens: bool
    # The sampler's full path (per-row history, masks, top logprobs) rather than the fast one.
    full_sampler: bool
    # Drafts may be verified for it: one sequence samples (no forks or beams). Penalties read
    # the drafts before each row from the token history the runner uploads; a grammar gives each
    # row the mask after them.
    speculate: bool
    # A grammar: the next step's SAMPLER needs this step's token on the host (the matcher advances
    # with it before the next mask is made), its plan and forward do not. With a step in flight
    # the runner launches the next forward at once and its sampling once the token is read
    # (runner/deferred_sample.py), so a grammar does not stop async scheduling's overlap.
    grammar: bool = False

    @staticmethod
    def of(sp: SamplingParams) -> "RequestNeeds":
        host = sp.use_beam_search
        return RequestNeeds(host, host or sp.guided or sp.has_penalties or sp.logprobs is not None,
                            not sp.use_beam_search and sp.best_of == 1, bool(sp.guided))
