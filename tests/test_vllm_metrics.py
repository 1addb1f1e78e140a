"""/metrics under vLLM's names, read as the Gateway API Inference Extension's endpoint picker reads
them: its model-server protocol (docs/proposals/003-model-server-protocol @ 84436a96) and its vLLM
metrics client (pkg/epp/backend/metrics, vllm `promToPodMetrics`), restated below over the text
exposition as prometheus_client's parser reads it."""

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jpaged.engine.router_stats import router_stats
from jpaged.lora.request import LoRARequest
from serving.metrics import LORA_SERIES_KEPT, Metrics, render_engines


def _seeded():
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def samples(text: str) -> dict[str, list]:
    """Every sample of the exposition, by sample name: [(labels, value, timestamp)]."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value, s.timestamp))
    return out


def endpoint_picker(text: str, kv_metric: str = "vllm:kv_cache_usage_perc") -> dict:
    """The EPP's vLLM client: each gauge from the sample with the latest timestamp (the last one when
    none has a timestamp, as vLLM's have none); vllm:lora_requests_info from the series with the
    largest value (its time) among those naming a running or waiting adapter; adapters split on
    ","; max_lora read as an integer. cache_config_info (the protocol's optional BlockSize and
    NumGPUBlocks) from its labels."""
    found = samples(text)

    def latest(name):
        assert found.get(name), f"metric family {name!r} not found"
        return max(enumerate(found[name]), key=lambda kv: (kv[1][2] or 0, kv[0]))[1]

    out = {"waiting": int(latest("vllm:num_requests_waiting")[1]), "running": int(latest("vllm:num_requests_running")[1]),
           "kv_cache_usage": latest(kv_metric)[1], "active_models": None, "max_active_models": None}
    if "vllm:cache_config_info" in found:
        labels = latest("vllm:cache_config_info")[0]
        out["block_size"], out["num_gpu_blocks"] = int(labels["block_size"]), int(labels["num_gpu_blocks"])
    best, best_ts = None, 0.0
    for labels, value, _ in found.get("vllm:lora_requests_info", []):
        if (labels["running_lora_adapters"] or labels["waiting_lora_adapters"]) and value > best_ts:
            best, best_ts = labels, value
    if best is not None:
        out["active_models"] = {a for key in ("running_lora_adapters", "waiting_lora_adapters")
                                for a in (best[key].split(",") if best[key] else [])}
        out["max_active_models"] = int(best["max_lora"])
        out["running_adapters"] = best["running_lora_adapters"].split(",") if best["running_lora_adapters"] else []
    return out


def _stats(rng, **extra) -> dict:
    total = int(rng.integers(16, 5000))
    cpu = int(rng.integers(0, 100))
    return {"num_gpu_blocks": total, "num_free_gpu_blocks": int(rng.integers(0, total + 1)), "num_cpu_blocks": cpu,
            "num_free_cpu_blocks": int(rng.integers(0, cpu + 1)), "num_running": int(rng.integers(0, 300)),
            "num_waiting": int(rng.integers(0, 300)), "num_swapped": int(rng.integers(0, 20)),
            "num_preemptions": int(rng.integers(0, 9)), "prefix_cache_queries": 1000, "prefix_cache_hits": 600,
            "num_gpu_blocks_in_use": 1, "num_gpu_blocks_without_sharing": 1, "num_cached_gpu_blocks": 0,
            "num_compilations": 3, "block_size": int(rng.choice([8, 16, 32])), "max_lora": None,
            "running_lora_adapters": [], "waiting_lora_adapters": [], **extra}


@pytest.mark.parametrize("kv_metric", ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"])
def test_the_protocols_series_as_the_endpoint_picker_reads_them(kv_metric):
    """TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization (a fraction: vLLM's 1 = full;
    both vLLM's current and V0 names), BlockSize and NumGPUBlocks, for random engine states."""
    rng = _seeded()
    for _ in range(20):
        stats = _stats(rng)
        read = endpoint_picker(Metrics("tiny").render(stats), kv_metric)
        assert read["waiting"] == stats["num_waiting"] + stats["num_swapped"]  # swapped out: waiting to run again
        assert read["running"] == stats["num_running"]
        assert read["kv_cache_usage"] == pytest.approx(1 - stats["num_free_gpu_blocks"] / stats["num_gpu_blocks"])
        assert 0.0 <= read["kv_cache_usage"] <= 1.0
        assert (read["block_size"], read["num_gpu_blocks"]) == (stats["block_size"], stats["num_gpu_blocks"])
        assert read["active_models"] is None  # LoRA off: no lora_requests_info, as vLLM without --enable-lora
        assert "vllm:lora_requests_info" not in samples(Metrics("tiny").render(stats))


def test_lora_requests_info_in_vllms_form():
    """One series per label set, valued by the last time it was current: the EPP takes the newest
    that names an adapter, so after the requests finish it keeps the last adapters seen (as with
    vLLM); max_lora is the engine's; only the LORA_SERIES_KEPT newest sets are kept."""
    rng = _seeded()
    metrics = Metrics("tiny")
    names = [f"adapter-{i}" for i in range(8)]
    for _ in range(30):
        running = sorted(rng.choice(names, int(rng.integers(0, 3)), replace=False).tolist())
        waiting = sorted(rng.choice(names, int(rng.integers(0, 4)), replace=False).tolist())
        text = metrics.render(_stats(rng, max_lora=2, running_lora_adapters=running, waiting_lora_adapters=waiting))
        read = endpoint_picker(text)
        found = samples(text)["vllm:lora_requests_info"]
        assert len(found) <= LORA_SERIES_KEPT
        assert all(set(labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"} for labels, _, _ in found)
        if running or waiting:
            assert read["active_models"] == set(running) | set(waiting) and read["running_adapters"] == running
            assert read["max_active_models"] == 2
            last = (running, waiting)
    idle = endpoint_picker(metrics.render(_stats(rng, max_lora=2)))
    assert idle["active_models"] == set(last[0]) | set(last[1])


def test_adapter_names_are_escaped_in_label_values():
    names = ['quote"d', "back\\slash", "line\nfeed", "plain"]
    text = Metrics("tiny").render(_stats(np.random.default_rng(0), max_lora=4, running_lora_adapters=names[:2],
                                         waiting_lora_adapters=names[2:]))
    (labels, _, _), = samples(text)["vllm:lora_requests_info"]
    assert labels["running_lora_adapters"].split(",") == names[:2]
    assert labels["waiting_lora_adapters"].split(",") == names[2:]


def test_data_parallel_replicas_are_series_of_their_own():
    """The built-in front's /metrics: each replica's series told apart by `engine` (a valid exposition:
    no two samples with the same labels)."""
    rng = _seeded()
    engines = [(Metrics("tiny", engine=str(rank)), _stats(rng, max_lora=1, running_lora_adapters=["a"]), None)
               for rank in range(3)]
    found = samples(render_engines(engines))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:lora_requests_info"):
        assert sorted(labels["engine"] for labels, _, _ in found[name]) == ["0", "1", "2"]
    assert [v for _, v, _ in found["vllm:num_requests_running"]] == [s["num_running"] for _, s, _ in engines]


def test_router_stats_read_the_schedulers_queues():
    """The model-free engine of test_scheduler, at most 2 adapters a step (the scheduler's max_loras):
    after every step the running adapters are those of the running requests (never more than 2),
    the waiting ones those of the requests not running (swapped out too), and together every
    unfinished request's adapter."""
    from types import SimpleNamespace

    from test_scheduler import FakeEngine

    rng = _seeded()
    fake = FakeEngine(block_size=4, num_gpu_blocks=24, num_cpu_blocks=16, max_num_seqs=4,
                      preemption_mode="swap", max_num_batched_tokens=24)
    fake.scheduler.max_loras = 2
    engine = SimpleNamespace(scheduler=fake.scheduler, block_manager=fake.bm,
                             config=SimpleNamespace(enable_lora=True, max_loras=2))
    groups = []
    for i in range(10):
        group = fake.add(f"r{i}", int(rng.integers(2, 20)), int(rng.integers(2, 16)))
        if rng.random() < 0.8:
            adapter = int(rng.integers(1, 5))
            group.lora_request = LoRARequest(f"adapter-{adapter}", adapter, f"/adapters/{adapter}")
        groups.append(group)
    saw_waiting = False
    while fake.scheduler.has_unfinished_seqs():
        fake.step()
        stats = router_stats(engine)
        running = {g.lora_request.lora_name for g in fake.scheduler.running if g.lora_request}
        unfinished = {g.lora_request.lora_name for g in groups if g.lora_request and not g.is_finished()}
        assert stats["running_lora_adapters"] == sorted(running) and len(running) <= 2
        assert set(stats["running_lora_adapters"]) | set(stats["waiting_lora_adapters"]) == unfinished
        assert stats["max_lora"] == 2 and stats["block_size"] == 4
        saw_waiting |= bool(stats["waiting_lora_adapters"])
    assert saw_waiting
    engine.config.enable_lora = False
    assert router_stats(engine)["max_lora"] is None


def test_a_server_serves_the_protocols_series():
    """`jpaged serve` (tiny): after a completion, the endpoint picker reads the same queue, running
    and KV numbers as jpaged's own series, and the block size and pool it was started with."""
    import asyncio

    from test_server import Server, get

    server = Server("--enforce-eager", "--block-size", "8", "--max-model-len", "128")
    try:
        status, _ = asyncio.run(get(server.url, "/v1/models"))
        assert status == 200
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model="tiny", prompt="hello there", max_tokens=4, temperature=0)
        status, text = asyncio.run(get(server.url, "/metrics"))
        assert status == 200
        read, found = endpoint_picker(text), samples(text)
        own = {name: values[0][1] for name, values in found.items() if name.startswith("jpaged:")}
        assert read["running"] == own["jpaged:num_requests_running"]
        assert read["waiting"] == own["jpaged:num_requests_waiting"] + own["jpaged:num_requests_swapped"]
        assert read["kv_cache_usage"] == own["jpaged:gpu_cache_usage_perc"]
        assert read["block_size"] == 8 and read["num_gpu_blocks"] > 0
        assert found["vllm:prefix_cache_queries_total"][0][1] == own["jpaged:prefix_cache_queries_total"]
    finally:
        assert server.stop() == 0
