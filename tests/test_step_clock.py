"""The engine's step clock: each phase's own time (a phase inside another counts for itself only),
totals the engine reports in stats(), and the phases of a real engine's steps."""

import jpaged
from jpaged import step_clock
from jpaged.step_clock import PHASES, StepClock, table


def test_nested_phases_count_their_own_time(monkeypatch, test_seed):
    import random

    rng = random.Random(test_seed)
    now = [0.0]
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    expected = dict.fromkeys(PHASES, 0.0)
    for _ in range(50):
        a, b, c = (rng.uniform(0, 1) for _ in range(3))
        with clock.phase("update"):
            now[0] += a
            with clock.phase("detokenize"):
                now[0] += b
                with clock.phase("outputs"):
                    now[0] += c
        expected["update"] += a
        expected["detokenize"] += b
        expected["outputs"] += c
        clock.step_done()
    for phase in PHASES:
        assert abs(clock.seconds[phase] - expected[phase]) < 1e-9, phase
    clock.move("update", "read", 1.5)
    assert abs(clock.seconds["read"] - 1.5) < 1e-12 and abs(clock.seconds["update"] - expected["update"] + 1.5) < 1e-9
    rows = table({"num_steps_timed": 0}, clock.snapshot())
    assert [p for p, _, _ in rows] == list(PHASES) and abs(sum(s for _, _, s in rows) - 1) < 1e-9
    assert abs(dict((p, ms) for p, ms, _ in rows)["outputs"] - 1000 * expected["outputs"] / 50) < 1e-6


def test_an_engines_steps_are_timed_by_phase(monkeypatch):
    llm = jpaged.LLM("tiny", enforce_eager=True, max_num_seqs=8, max_model_len=128)
    engine = llm.llm_engine
    completed = []
    complete = engine._complete
    monkeypatch.setattr(engine, "_complete", lambda d: completed.append(1) or complete(d))
    before = llm.stats()
    sp = jpaged.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    outs = llm.generate(["one", "two words", "three more words"], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    after = llm.stats()
    assert after["num_steps_timed"] - before["num_steps_timed"] == len(completed) >= 6
    spent = {p: after["step_phase_seconds"][p] - before["step_phase_seconds"][p] for p in PHASES}
    assert spent["propose"] == 0  # no speculation
    for phase in ("schedule", "prepare", "launch", "read", "update", "detokenize", "outputs"):
        assert spent[phase] > 0, phase
