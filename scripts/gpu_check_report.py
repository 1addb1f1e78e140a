"""results.json and results.md for scripts/gpu_check.sh (`scripts/gpu_check.py report LOGS OUT`).

LOGS holds steps.tsv (one line per step: name, status, exit status, seconds, limit, detail), each
step's NAME.log and, for some, NAME.json (gpu_serve_check.py's and bench_throughput.py's), and
environment.txt. results.json maps each step to its status, exit status, seconds, limit and the
figures that are cheap to read from its log or JSON; results.md starts with the wheels the GPU image
lacks and the command that fetches them, then a table of the steps and each step's figures and
the end of its log. Standard library only: it runs after every step, also where jax is missing.
"""

import json
import os
import re

# The GPU image (python 3.12, jax 0.11.2 + CUDA 13, flax, transformers, torch, aiohttp) lacks these
# runtime dependencies of jpaged; they travel as wheels in .whl/ (the run tool's `carry`).
MISSING_WHEELS = ["llguidance==1.9.1", "qwix==0.1.8", "pyzmq==27.3.0", "msgspec==0.22.0"]
MODULES = {"llguidance": "llguidance", "qwix": "qwix", "pyzmq": "zmq", "msgspec": "msgspec"}
FETCH = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
         "--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
         "--platform manylinux2014_x86_64 -d .whl " + " ".join(MISSING_WHEELS))
PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def _read(path, default=""):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def _json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def steps(logs: str) -> list[dict]:
    rows = []
    for line in _read(os.path.join(logs, "steps.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) < 5:
            continue
        name, status, code, seconds, limit = parts[:5]
        rows.append({"name": name, "status": status, "exit": int(code) if code.lstrip("-").isdigit() else None,
                     "seconds": int(seconds) if seconds.isdigit() else None,
                     "limit": int(limit) if limit.isdigit() else None, "detail": parts[5] if len(parts) > 5 else ""})
    return rows


def figures(name: str, logs: str) -> dict:
    """What is cheap to read from a step's log or JSON."""
    log = _read(os.path.join(logs, f"{name}.log"))
    lines = log.splitlines()
    data = _json(os.path.join(logs, f"{name}.json"))
    if name.startswith("defaults") and data:
        keep = ("XLA_PYTHON_CLIENT_PREALLOCATE", "requests", "ok", "failures", "requests_per_s", "output_tokens_per_s",
                "elapsed_s", "latency_p50_s", "latency_max_s", "serving_s", "ready_s", "exit_code",
                "shut_down_cleanly", "shutdown_s", "startup_line", "by_kind", "problems")
        out = {k: data.get(k) for k in keep if k in data}
        out["failure_examples"] = data.get("failure_examples", [])[:5]
        if data.get("server_tail"):
            out["server_tail"] = data["server_tail"][-15:]
        return out
    if name.startswith("tp_") and name != "tp_compare" and data:
        results = data.get("results") or [{}]
        r = results[0]
        out = {k: (round(r[k], 2) if isinstance(r.get(k), float) else r.get(k))
               for k in ("backend", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s",
                         "init_s", "warmup_s", "num_gpu_blocks", "num_preemptions", "compilations_during_run")
               if k in r}
        out["workload"] = data.get("workload")
        if r.get("step_phases"):  # where the engine thread's time went per step (issue 61's phase table)
            out["step_phases_ms"] = {p["phase"]: round(p["ms_per_step"], 3) for p in r["step_phases"]}
            out["steps"] = r.get("steps")
        startup = [x[x.index("jpaged: "):] for x in lines if re.search(r"jpaged: \S+ \(\w+\) on ", x)]
        if startup:
            out["startup_line"] = startup[0]
        return out
    out = {}
    summary = [x for x in lines if re.search(r"\d+ (passed|failed|errors?)", x) and " in " in x]
    if summary:
        out["pytest"] = {kind: int(n) for n, kind in PYTEST_SUMMARY.findall(summary[-1])}
        out["failed_tests"] = [x for x in lines if x.startswith(("FAILED ", "ERROR "))][:10]
    if name == "backend":
        out["devices"] = [x.strip() for x in lines if "compute capability" in x or x.startswith("jax ")]
    if name == "features":
        out["features"] = {m.group(1): m.group(2) for m in
                           (re.match(r"feature (.+?): (ok.*|FAIL.*)", x) for x in lines) if m}
    if name == "engines":
        out["engines"] = [x for x in lines if x.startswith(("generated ", "refused ", "engine ", "attention_backend="))]
        out["startup_lines"] = [x[x.index("jpaged: "):][:300] for x in lines
                                if re.search(r"jpaged: tiny \(\w+\) on ", x)]
    if name in ("tp_compare", "bench_kernels"):
        out["table"] = [x for x in lines if x.startswith("|") or x.startswith("model ")][:80]
        if name == "tp_compare":
            out["ratios"] = re.findall(r"\| ([\d.]+)x \|", log)
    if not out and lines:
        out["last_line"] = lines[-1][:300]
    return out


def environment(logs: str) -> tuple[str, dict]:
    text = _read(os.path.join(logs, "environment.txt"))
    wheels = {}
    for package, module in MODULES.items():
        m = re.search(rf"^{module}: (.*)$", text, re.M)
        wheels[package] = m.group(1) if m else "not checked"
    return text, wheels


def report(logs: str, out: str) -> int:
    os.makedirs(out, exist_ok=True)
    env_text, wheels = environment(logs)
    meta = {}
    for line in _read(os.path.join(logs, "meta.txt")).splitlines():
        key, _, value = line.partition("=")
        if key:
            meta[key] = value
    rows = steps(logs)
    results = {"meta": meta, "wheels_the_gpu_image_lacks": {"wheels": MISSING_WHEELS, "fetch": FETCH, "here": wheels},
               "steps": {}}
    for row in rows:
        entry = {k: row[k] for k in ("status", "exit", "seconds", "limit")}
        if row["detail"]:
            entry["detail"] = row["detail"]
        entry["figures"] = figures(row["name"], logs) if row["status"] != "skipped" else {}
        results["steps"][row["name"]] = entry
    failed = [n for n, s in results["steps"].items() if s["status"] not in ("ok", "skipped")]
    results["failed"] = failed
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)

    md = [f"# gpu_check results ({meta.get('date', '?')}, {meta.get('gpu', '?')}, project {meta.get('commit', '?')})",
          "",
          "## Wheels the GPU image lacks",
          "",
          "The GPU image has jax 0.11.2 (CUDA 13), flax, transformers, torch and aiohttp under Python 3.12, but not "
          "these dependencies of jpaged: " + ", ".join(f"`{w}`" for w in MISSING_WHEELS) + ". Fetch them on the CPU "
          "machine, in the repository's root, and name `.whl` in the run tool's `carry`; gpu_check.sh installs them "
          "with `pip install --target /tmp/site` and puts /tmp/site on PYTHONPATH:",
          "",
          "```bash",
          "echo /.whl/ >> .git/info/exclude",
          FETCH,
          "```",
          "",
          "On this run: " + ", ".join(f"{p} {s}" for p, s in wheels.items()) + ".",
          "",
          f"## Steps ({meta.get('mode', '')}; budget {meta.get('budget_s', '?')} s, "
          f"ended at {meta.get('elapsed_s', '?')} s)",
          "",
          "| step | status | exit | seconds (limit) | key figures |",
          "|---|---|---|---|---|"]
    for row in rows:
        entry = results["steps"][row["name"]]
        timing = "" if row["status"] == "skipped" or row["seconds"] is None else f"{row['seconds']} ({row['limit']})"
        md.append(f"| {row['name']} | {row['status']} | {'' if row['exit'] is None else row['exit']} | {timing} | "
                  f"{(_key(row['name'], entry) or row['detail']).replace('|', '/')} |")
    md += ["", "## Environment", "", "```", env_text.strip(), "```"]
    for row in rows:
        if row["status"] == "skipped":
            continue
        entry = results["steps"][row["name"]]
        md += ["", f"## {row['name']}: {row['status']} (exit {row['exit']}"
               + (f", {row['seconds']} s of {row['limit']})" if row["seconds"] is not None else ")"), ""]
        if row["detail"]:
            md += [f"`{row['detail']}`", ""]
        for key, value in entry["figures"].items():
            if key in ("table",):
                continue
            md.append(f"- {key}: {json.dumps(value) if not isinstance(value, str) else value}")
        if entry["figures"].get("table"):
            md += [""] + entry["figures"]["table"]
        tail = _read(os.path.join(logs, f"{row['name']}.log")).splitlines()[-25:]
        md += ["", "```", *[x[:400] for x in tail], "```"]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


def _key(name: str, entry: dict) -> str:
    """One cell of key figures."""
    f = entry.get("figures") or {}
    if name.startswith("defaults") and "requests" in f:
        pool = re.search(r"KV pool: ([^;]*?\([^)]*\))", f.get("startup_line") or "")
        return (f"{f.get('ok')}/{f.get('requests')} ok, {f.get('requests_per_s')} req/s, "
                f"{f.get('output_tokens_per_s')} out tok/s; serving after {f.get('serving_s')} s, ready "
                f"{f.get('ready_s')} s; exit {f.get('exit_code')}" + (f"; pool {pool.group(1)}" if pool else ""))
    if name.startswith("defaults") and f.get("problems"):
        return "; ".join(f["problems"])[:200]
    if "requests_per_s" in f:
        return (f"{f['requests_per_s']} req/s, {f.get('output_tokens_per_s')} out tok/s, {f.get('elapsed_s')} s "
                f"(init {f.get('init_s')}, warm-up {f.get('warmup_s')})")
    if "pytest" in f:
        return ", ".join(f"{n} {k}" for k, n in f["pytest"].items())
    if "features" in f:
        return ", ".join(f"{k}: {v.split(' ')[0]}" for k, v in f["features"].items())
    if "engines" in f:
        return f"{sum(x.startswith(('generated', 'refused')) for x in f['engines'])}/{len(f['engines'])} ok"
    if f.get("ratios"):
        return "jpaged / hf: " + ", ".join(f"{r}x" for r in f["ratios"])
    if "devices" in f:
        return "; ".join(f["devices"])[:200]
    return (f.get("last_line") or "")[:120].replace("|", "/")
