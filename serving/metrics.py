"""Prometheus metrics in the text exposition format, named as vLLM names them (prefix `jpaged:`).

Request-level series (token totals, latency histograms) are recorded by the server as outputs
stream by; engine-level gauges are read from the engine's stats() snapshot at scrape time.

The series fleet routers read are served under vLLM's own names too (prefix `vllm:`, always on):
the Gateway API Inference Extension's model-server protocol (docs/proposals/003-model-server-protocol:
vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:cache_config_info,
vllm:lora_requests_info), which llm-d's inference scheduler reads as well (docs/fleet.md).
"""

import bisect
import collections
import dataclasses
import time

PREFIX = "jpaged:"
VLLM_PREFIX = "vllm:"
LORA_SERIES_KEPT = 16  # vllm:lora_requests_info label sets kept, each with the last time it was current
# vLLM's bucket edges (seconds) for the latency histograms.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0]


@dataclasses.dataclass
class Histogram:
    name: str
    help: str
    buckets: list[float]
    counts: list[int] = dataclasses.field(default=None)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float):
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def render(self, labels: str) -> list[str]:
        name = PREFIX + self.name
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for edge, count in zip(self.buckets + ["+Inf"], self.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{edge}"}} {cumulative}')
        lines += [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {cumulative}"]
        return lines


class Metrics:
    def __init__(self, model_name: str, engine: str | None = None):
        # vLLM's labels; `engine` (the replica's rank) only with data parallelism.
        self.labels = f'model_name="{model_name}"' + (f',engine="{engine}"' if engine is not None else "")
        self.engine = engine
        self.lora_series: collections.OrderedDict = collections.OrderedDict()  # label values -> time
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {}  # finish reason -> requests
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Time per output token (inter-token latency) in "
                              "seconds.", TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS)

    def request_finished(self, reason: str):
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, stats: dict, kv_usage=None) -> str:
        """`kv_usage`: the engine's KVUsage now, when it could be read."""
        return render_engines([(self, stats, kv_usage)])

    def families(self, stats: dict | None, kv_usage=None) -> list[tuple[str, str, str, list[str]]]:
        """(name, type, help, sample lines) of every metric; `stats` None: a replica that is down
        (only its request counters and histograms)."""
        out, labels = [], self.labels

        def metric(name, kind, help, value=None, samples=None):
            out.append((PREFIX + name, kind, help,
                        samples if samples is not None else [f"{PREFIX}{name}{{{labels}}} {value}"]))

        if stats:
            gpu_used = 1 - stats["num_free_gpu_blocks"] / stats["num_gpu_blocks"]
            cpu_used = 1 - stats["num_free_cpu_blocks"] / stats["num_cpu_blocks"] if stats["num_cpu_blocks"] else 0.0
            queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
            metric("num_requests_running", "gauge", "Requests running on the device.", stats["num_running"])
            metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats["num_waiting"])
            metric("num_requests_swapped", "gauge", "Requests swapped out to host memory.", stats["num_swapped"])
            metric("gpu_cache_usage_perc", "gauge", "Fraction of device KV blocks in use (1 = full).", gpu_used)
            metric("cpu_cache_usage_perc", "gauge", "Fraction of host (swap) KV blocks in use (1 = full).", cpu_used)
            metric("num_preemptions_total", "counter", "Sequence-group preemptions.", stats["num_preemptions"])
        metric("prompt_tokens_total", "counter", "Prompt tokens of started requests.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens)
        if stats:
            metric("prefix_cache_queries_total", "counter", "Tokens looked up in the prefix cache at admission.",
                   queries)
            metric("prefix_cache_hits_total", "counter", "Tokens found in the prefix cache at admission.", hits)
            metric("gpu_prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries, in tokens.",
                   hits / queries if queries else 0.0)
            metric("num_gpu_blocks_in_use", "gauge", "Device KV blocks held by sequences (shared blocks once).",
                   stats["num_gpu_blocks_in_use"])
            metric("num_gpu_blocks_without_sharing", "gauge", "Device KV blocks the same block tables would hold "
                   "without sharing (forks, beams, cached prefixes).", stats["num_gpu_blocks_without_sharing"])
            metric("num_cached_gpu_blocks", "gauge", "Free device KV blocks still holding a cached prefix.",
                   stats["num_cached_gpu_blocks"])
        if kv_usage is not None:
            metric("kv_slots", "gauge", "Device KV slots (tokens) by what they hold (the paper's Fig. 2).", samples=[
                f'{PREFIX}kv_slots{{{labels},state="{state}"}} {getattr(kv_usage, f"{state}_slots")}'
                for state in ("token", "reserved", "fragmented", "free")])
        if stats:
            metric("num_compilations", "gauge", "Step shapes compiled (constant after warm-up).",
                   stats["num_compilations"])
            metric("warmup_executables_remaining", "gauge", "Step executables the background warm-up has still to "
                   "compile or load (0: warm).", stats.get("warmup_executables_remaining", 0))
        if stats and "step_phase_seconds" in stats:  # where the steps' time went (jpaged/step_clock.py)
            metric("engine_steps_total", "counter", "Engine steps completed (timed by phase).",
                   stats["num_steps_timed"])
            name = f"{PREFIX}step_phase_seconds_total"
            metric("step_phase_seconds_total", "counter", "Seconds the engine's steps spent in each phase, on "
                   "the engine thread.", samples=[f'{name}{{{labels},phase="{phase}"}} {seconds}'
                                                 for phase, seconds in stats["step_phase_seconds"].items()])
        if stats and "output_thread_seconds" in stats:
            metric("output_thread_seconds_total", "counter", "Seconds the server's output thread spent making the "
                   "text of streamed requests (detokenizing off the engine thread).", stats["output_thread_seconds"])
        if stats and "spec_decode_num_drafts" in stats:  # speculative decoding: vLLM's counters
            metric("spec_decode_num_drafts_total", "counter", "Verified runs of draft tokens.",
                   stats["spec_decode_num_drafts"])
            metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed and verified.",
                   stats["spec_decode_num_draft_tokens"])
            metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   stats["spec_decode_num_accepted_tokens"])
            name = f"{PREFIX}spec_decode_num_accepted_tokens_per_pos"
            metric("spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted, by their position "
                   "in the run.", samples=[f'{name}{{{labels},position="{i}"}} {count}' for i, count in
                                            enumerate(stats["spec_decode_num_accepted_tokens_per_pos"])])
        if stats:
            out += self.vllm_families(stats, gpu_used)
        metric("request_success_total", "counter", "Finished requests by finish reason.", samples=[
            f'{PREFIX}request_success_total{{{labels},finished_reason="{reason}"}} {count}'
            for reason, count in sorted(self.finished.items())])
        for histogram in (self.ttft, self.tpot, self.e2e):
            lines = histogram.render(labels)
            out.append((PREFIX + histogram.name, "histogram", histogram.help, lines[2:]))
        return out

    def vllm_families(self, stats: dict, kv_used: float) -> list[tuple[str, str, str, list[str]]]:
        """The series routers read, as vLLM names and labels them. vLLM counts preempted requests
        as waiting (it has no swapped queue): requests swapped out count as waiting here."""
        out, labels = [], self.labels

        def metric(name, kind, help, value=None, samples=None):
            out.append((VLLM_PREFIX + name, kind, help,
                        samples if samples is not None else [f"{VLLM_PREFIX}{name}{{{labels}}} {value}"]))

        metric("num_requests_running", "gauge", "Number of requests in model execution batches.",
               stats["num_running"])
        metric("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               stats["num_waiting"] + stats["num_swapped"])
        metric("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", kv_used)
        metric("gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage (vLLM V0's name, "
               "read by older endpoint pickers).", kv_used)
        metric("prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
               stats["prefix_cache_queries"])
        metric("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               stats["prefix_cache_hits"])
        if "block_size" in stats:  # an info metric: a gauge of 1 whose labels carry the values
            metric("cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", samples=[
                f'{VLLM_PREFIX}cache_config_info{{{labels},block_size="{stats["block_size"]}",'
                f'num_gpu_blocks="{stats["num_gpu_blocks"]}"}} 1.0'])
        if stats.get("max_lora") is not None:
            metric("lora_requests_info", "gauge", "Running stats on lora requests.", samples=self._lora_samples(stats))
        return out

    def _lora_samples(self, stats: dict) -> list[str]:
        """vLLM's lora_requests_info: one series per (max_lora, waiting, running) label set, its value
        the last time it was the current one (a router takes the latest set with an adapter in it);
        the LORA_SERIES_KEPT latest sets are kept."""
        key = (str(stats["max_lora"]), ",".join(stats["waiting_lora_adapters"]),
               ",".join(stats["running_lora_adapters"]))
        self.lora_series[key] = time.time()
        self.lora_series.move_to_end(key)
        while len(self.lora_series) > LORA_SERIES_KEPT:
            self.lora_series.popitem(last=False)
        engine = f',engine="{self.engine}"' if self.engine is not None else ""
        return [f'{VLLM_PREFIX}lora_requests_info{{max_lora="{escape(max_lora)}",waiting_lora_adapters='
                f'"{escape(waiting)}",running_lora_adapters="{escape(running)}"{engine}}} {stamp}'
                for (max_lora, waiting, running), stamp in self.lora_series.items()]


def escape(label_value: str) -> str:
    """A label value as the text exposition format writes it (backslash, double quote, line feed)."""
    return label_value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_engines(engines: list[tuple["Metrics", dict | None, object]]) -> str:
    """The text exposition of one or more engines' metrics (data-parallel replicas: one sample
    per replica under each metric's HELP and TYPE, told apart by the `engine` label)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for metrics, stats, kv_usage in engines:
        for name, kind, help, samples in metrics.families(stats, kv_usage):
            families.setdefault(name, (kind, help, []))[2].extend(samples)
    lines = []
    for name, (kind, help, samples) in families.items():
        lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"
