"""Smoke tests for scripts/bench_throughput.py (the offline throughput benchmark)."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_throughput.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workload_is_seeded_skewed_and_capped(bench):
    args = bench.parse_args(["--num-prompts", "2000", "--seed", "3"])
    requests = bench.make_requests(args, vocab_size=259)
    again = bench.make_requests(args, vocab_size=259)
    assert [r.prompt_token_ids for r in requests] == [r.prompt_token_ids for r in again]
    prompt = [len(r.prompt_token_ids) for r in requests]
    output = [r.output_len for r in requests]
    assert all(4 <= p <= 1024 for p in prompt) and all(p + o <= 2048 and o >= 4 for p, o in zip(prompt, output))
    assert all(0 <= t < 259 for r in requests for t in r.prompt_token_ids)
    mean_p, mean_o = sum(prompt) / len(prompt), sum(output) / len(output)
    assert 160 <= mean_p <= 220 and 180 <= mean_o <= 340
    assert sorted(prompt)[len(prompt) // 2] < mean_p  # right-skewed: median below mean

    scaled = bench.make_requests(bench.parse_args(["--num-prompts", "50", "--length-scale", "0.25",
                                                   "--max-input-len", "40", "--max-output-len", "30"]), 259)
    assert all(1 <= len(r.prompt_token_ids) <= 40 and 1 <= r.output_len <= 30 for r in scaled)
    fixed = bench.make_requests(bench.parse_args(["--num-prompts", "5", "--input-len", "7", "--output-len", "9"]), 259)
    assert all(len(r.prompt_token_ids) == 7 and r.output_len == 9 for r in fixed)


def test_jpaged_smoke_reports_positive_rates_and_exact_output_count(bench, tmp_path):
    out = tmp_path / "result.json"
    report = bench.main(["--model", "tiny", "--num-prompts", "6", "--length-scale", "0.05",
                         "--max-input-len", "24", "--max-output-len", "12", "--enforce-eager",
                         "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "48",
                         "--no-tqdm", "--output-json", str(out)])
    (res,) = report["results"]
    assert res["backend"] == "jpaged"
    assert res["num_requests"] == 6
    assert res["output_tokens"] == res["expected_output_tokens"] == sum(len(t) for t in res["token_ids"])
    for key in ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert res[key] > 0
    assert res["total_tokens_per_s"] > res["output_tokens_per_s"]
    saved = json.loads(out.read_text())
    assert saved["results"][0]["output_tokens"] == res["output_tokens"]
    assert "token_ids" not in saved["results"][0]


def test_hf_backend_smoke_counts_exact_outputs(bench):
    pytest.importorskip("torch")
    report = bench.main(["--model", "tiny", "--backend", "hf", "--num-prompts", "4", "--input-len", "8",
                         "--output-len", "5", "--no-tqdm"])
    (res,) = report["results"]
    assert res["backend"] == "hf" and res["output_tokens"] == 20 and res["output_tokens_per_s"] > 0
