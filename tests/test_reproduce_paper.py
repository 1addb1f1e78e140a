"""The quick path of scripts/reproduce_paper.py on a tiny workload: every experiment runs, every
figure is written, and the numbers obey what the allocation policies guarantee."""

import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "reproduce_paper.py")
FIGURES = ["fig2_memory_breakdown.png", "fig12_latency_vs_rate.png", "fig13_batched_requests.png",
           "fig15_sharing_savings.png", "fig16_shared_prefix.png", "fig18_block_size.png",
           "fig19_recompute_vs_swap.png"]


def test_quick_path_on_a_tiny_workload(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("reproduce_paper", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # bench_sharing's workloads, shrunk to fit max_model_len=64.
    monkeypatch.setattr(script.bench_sharing, "PREFIX_LENS", {"1-shot": 16, "5-shot": 32})
    monkeypatch.setattr(script.bench_sharing, "ALPACA_PROMPT", (12.0, 0.6, 4, 16))
    monkeypatch.setattr(script.bench_sharing, "ALPACA_OUTPUT", (12.0, 0.8, 4, 16))
    report = script.main(["--quick", "--num-requests", "3", "--kv-slots", "256", "--max-model-len", "64",
                          "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-sizes", "16",
                          "--sharing-prompts", "2", "--widths", "2", "--enforce-eager", "--rate-fractions", "1.0",
                          "--policies", "paged", "orca-max", "--recompute-tokens", "32", "--repeats", "1",
                          "--memory-requests", "6", "--memory-kv-slots", "4096",
                          "--output-dir", str(tmp_path)])
    for name in FIGURES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert json.loads((tmp_path / "results.json").read_text())["results"].keys() == report["results"].keys()
    claims = (tmp_path / "claims.md").read_text()
    assert "Fig. 2 (ShareGPT)" in claims and "Fig. 19b (Alpaca)" in claims

    # Fig. 2 at the paper's context (2048): orca-max holds at most 2 requests in 4096 slots.
    f2 = report["results"]["fig2"]["policies"]
    assert 0 < f2["orca-max"]["mean_batched_requests"] <= 2 < f2["paged"]["mean_batched_requests"]
    assert f2["orca-max"]["token_fraction"] < 0.5 < 0.9 < f2["paged"]["token_fraction"]
    for name, trace in report["results"]["fig12"].items():
        paged, orca = trace["runs"]["paged"][0], trace["runs"]["orca-max"][0]
        # orca-max reserves max_model_len = 4 blocks per request: at most 4 of the 16 blocks' worth run.
        assert 0 < orca["mean_batched_requests"] <= 4
        assert orca["token_fraction"] < paged["token_fraction"], name
        for run in (paged, orca):
            parts = run["token_fraction"] + run["reserved_fraction"] + run["fragmented_fraction"]
            assert abs(parts - 1) < 1e-9 and run["normalized_latency"] > 0 and run["preemptions"] == 0
        # Each request reserves 64 slots and holds at most 32 + 32 tokens: more than half full only at its end.
        assert orca["token_fraction"] < 1
    # fp8 pages in the same KV bytes: twice the slots (bf16 -> 1 byte), never a smaller batch.
    fp8 = report["results"]["fig13_fp8"]["runs"]
    assert fp8["auto"]["kv_cache_dtype"] == "bfloat16" and fp8["fp8"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert fp8["fp8"]["kv_slots"] == 2 * fp8["auto"]["kv_slots"] == 128  # a quarter of --kv-slots, doubled
    assert fp8["fp8"]["requests"] == fp8["auto"]["requests"] == 3
    per_step = "mean_batched_requests_per_step"
    assert fp8["fp8"][per_step] >= fp8["auto"][per_step] > 0
    assert "fp8 / bf16 pages" in claims
    sharing = {(r["workload"], r.get("prefix_caching")): r for r in report["results"]["fig14_16"]}
    assert 0 < sharing[("parallel", None)]["memory_saved"] < sharing[("beam", None)]["memory_saved"]
    assert sharing[("prefix 5-shot", True)]["prefix_cache_hits"] == 32  # 2 blocks, for the second request
    e2e = report["results"]["fig19"]["end_to_end"]
    assert e2e["swap"]["requests"] == e2e["recompute"]["requests"] == 6  # the Alpaca-like trace: twice as many
