"""scripts/profile_summary.py: a real jax.profiler trace read back with jax's ProfileData, and the
idle-gap arithmetic against a hand count."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import profile_summary  # noqa: E402


def test_idle_gaps_against_a_hand_count():
    ms = 1_000_000
    events = [(0, 2 * ms, "a"), (1 * ms, 3 * ms, "b"),  # overlapping: busy until 4 ms
              (10 * ms, 1 * ms, "c"),  # a 6 ms gap before it
              (12 * ms, 1 * ms, "d"),  # 1 ms
              (30 * ms, 1 * ms, "e")]  # 17 ms
    gaps = profile_summary.idle_gaps(sorted(events), 0, keep=2)
    assert gaps == [(13.0, 17.0), (4.0, 6.0)]
    assert profile_summary.idle_gaps([(0, ms, "a")], 0) == []


def test_a_real_trace_names_the_executable_and_counts_its_calls(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256), np.float32))
    f(x).block_until_ready()
    calls = 7
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(calls):
            f(x).block_until_ready()
    assert profile_summary.trace_files(str(tmp_path))
    summary = profile_summary.summarize(str(tmp_path), top=50)
    rows = [row for lines in summary.values() for info in lines.values() for row in info["top"]]
    assert rows, summary
    # Each call runs the executable's ops: some op ran at least once per call, with a positive time.
    assert max(count for _, count, _, _ in rows) >= calls
    assert all(total >= 0 for _, _, total, _ in rows) and any(total > 0 for _, _, total, _ in rows)
    text = profile_summary.render(summary)
    assert "| name | count | total ms | mean µs |" in text
