"""Smoke test for scripts/bench_sharing.py (KV memory saved by sharing, prefix cache hits)."""

import importlib.util
import json
import os
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_sharing.py")


def test_small_run_reports_savings_and_exact_prefix_hits(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_sharing", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sharing.json"
    monkeypatch.setattr(sys, "argv", ["bench_sharing.py", "--num-prompts", "4", "--widths", "3", "--max-num-seqs", "16",
                                      "--max-num-batched-tokens", "256", "--num-gpu-blocks-override", "256",
                                      "--output-json", str(out)])
    bench.main()
    results = {(r["workload"], r.get("prefix_caching")): r for r in json.loads(out.read_text())["results"]}
    parallel, beam = results[("parallel", None)], results[("beam", None)]
    assert 0 < parallel["memory_saved"] < beam["memory_saved"] < 1
    assert parallel["preemptions"] == beam["preemptions"] == 0
    for name, prefix_len in bench.PREFIX_LENS.items():
        on, off = results[(f"prefix {name}", True)], results[(f"prefix {name}", False)]
        # Every request but the first finds the prefix's full blocks cached.
        assert on["prefix_cache_hits"] == 3 * (prefix_len // 16 * 16) == on["prefill_tokens_saved"]
        assert on["prefix_cache_queries"] == on["prompt_tokens"] == off["prompt_tokens"]
        assert off["prefix_cache_queries"] == 0 and off["memory_saved"] == 0 < on["memory_saved"]
