"""Where an engine step's time goes, phase by phase, on the thread that runs the step.

The engine (and the runner and detokenizer it hands the clock to) wraps each phase of a step in
`clock.phase(name)`; a phase opened inside another counts for itself only (the outer one's time
excludes it). Totals since the engine started are read by `LLM.stats()` ("step_phase_seconds",
"num_steps_timed"), served as `/metrics` counters and printed by bench_throughput.

The phases of one step, in the order they run:
- schedule: the scheduler's plan (admission, preemption, block allocation);
- block_ops: the plan's block swaps and copies, dispatched;
- propose: a speculative proposer's drafts;
- prepare: the step's inputs built on the host (rows, block tables, sampling metadata, packing);
- launch: the device calls dispatched (the inputs' transfer included);
- read: waiting for the sampled ids and reading them back (device time shows here, less what
  overlapped the host's work: async scheduling, or the host being slower);
- update: the sequences updated, stop checks;
- detokenize: incremental detokenizing (inside update);
- outputs: the RequestOutputs built, KV events published.
"""

import contextlib
import time

PHASES = ("schedule", "block_ops", "propose", "prepare", "launch", "read", "update", "detokenize", "outputs")


class StepClock:
    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._inner = [0.0]  # per open phase: the time of the phases opened inside it

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = self._inner.pop()
            self.seconds[name] += elapsed - inner
            self._inner[-1] += elapsed

    def move(self, source: str, target: str, seconds: float):
        """Count `seconds` of phase `source` as `target`'s (time measured inside it by other means)."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def step_done(self):
        self.steps += 1

    def snapshot(self) -> dict:
        return {"step_phase_seconds": dict(self.seconds), "num_steps_timed": self.steps}


def table(before: dict, after: dict) -> list[tuple[str, float, float]]:
    """(phase, ms per step, share of the total) between two snapshots (stats() dicts)."""
    steps = max(after["num_steps_timed"] - before.get("num_steps_timed", 0), 1)
    spent = {p: after["step_phase_seconds"][p] - before.get("step_phase_seconds", {}).get(p, 0.0) for p in PHASES}
    total = sum(spent.values()) or 1.0
    return [(p, 1000 * spent[p] / steps, spent[p] / total) for p in PHASES]
