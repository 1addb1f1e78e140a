"""The PagedAttention paper's numbers and what scripts/reproduce_paper.py makes of its results:
the claims table (paper vs ours, whether each claim's shape holds: claims.md) and the figures
(PNG, matplotlib). Reads only the results dict, so it runs without jax or an engine."""

import os

import numpy as np

# The paper's numbers (OPT-13B on an A100 unless said otherwise), for the figures and the report.
PAPER = {
    "fig2_token_fraction": {"paged": 0.963, "orca-oracle": 0.382, "orca-pow2": 0.268, "orca-max": 0.204},
    "fig12_rate_gain_sharegpt": {"orca-oracle": (1.7, 2.7), "orca-max": (2.7, 8.0), "static": (22.0, 22.0)},
    "fig13_batch_gain_sharegpt": {"orca-oracle": 2.2, "orca-max": 4.3},
    "fig15_saved_alpaca": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},
    "fig15_saved_sharegpt": {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)},
    "fig16_throughput_gain": {"1-shot": 1.67, "5-shot": 3.58},
    "fig19_recompute_over_swap_max": 1.2,  # recompute never costs more than 20% over swapping
}

POLICY_LABELS = {"paged": "jpaged (paged)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
                 "orca-max": "Orca (Max)", "static": "FasterTransformer-like (static)"}


# ---------------------------------------------------------------------------------------- claims

def claims(results: dict) -> list[tuple[str, str, str, bool]]:
    """(claim, the paper's number, ours, whether the shape holds) for each figure."""
    rows = []
    f2 = results["fig2"]["policies"]
    if "paged" in f2:
        rows.append(("Fig. 2 (paper's sizes, scheduler only): share of allocated KV slots holding tokens, paged",
                     "96.3%", f"{f2['paged']['token_fraction']:.1%}", f2["paged"]["token_fraction"] >= 0.96))
    baselines = [p for p in ("orca-oracle", "orca-pow2", "orca-max") if p in f2]
    if baselines and "paged" in f2:
        ordered = [f2[p]["token_fraction"] for p in baselines]
        rows.append(("Fig. 2 (paper's sizes): the same for " + " / ".join(POLICY_LABELS[p] for p in baselines),
                     " / ".join(f"{PAPER['fig2_token_fraction'][p]:.1%}" for p in baselines),
                     " / ".join(f"{x:.1%}" for x in ordered),
                     ordered == sorted(ordered, reverse=True) and max(ordered) < f2["paged"]["token_fraction"]))
    for p, paper in (("orca-oracle", 2.2), ("orca-max", 4.3)):
        if p in f2 and "paged" in f2:
            gain = f2["paged"]["mean_batched_requests"] / f2[p]["mean_batched_requests"]
            rows.append((f"Fig. 13 (paper's sizes): requests batched, paged / {POLICY_LABELS[p]}", f"{paper}x",
                         f"{gain:.2f}x", gain >= paper / 2))
    f12 = results["fig12"]
    for name, r in f12.items():
        top = {p: runs[-1] for p, runs in r["runs"].items()}
        fractions = {p: top[p]["token_fraction"] for p in top}
        baselines = [p for p in ("orca-oracle", "orca-pow2", "orca-max") if p in fractions]
        if "paged" in fractions:
            rows.append((f"Fig. 2 ({name}): share of allocated KV slots holding tokens, paged",
                         "96.3%", f"{fractions['paged']:.1%}", fractions["paged"] >= 0.96))
        if baselines and "paged" in fractions:
            ordered = [fractions[p] for p in baselines]
            rows.append((f"Fig. 2 ({name}): the same for " + " / ".join(POLICY_LABELS[p] for p in baselines),
                         " / ".join(f"{PAPER['fig2_token_fraction'][p]:.1%}" for p in baselines),
                         " / ".join(f"{x:.1%}" for x in ordered),
                         ordered == sorted(ordered, reverse=True) and max(ordered) < fractions["paged"]))
        # At the highest rate every policy is overloaded: requests served per second is its capacity.
        caps = {p: runs[-1]["throughput_req_s"] for p, runs in r["runs"].items()}
        for p in ("orca-oracle", "orca-pow2", "orca-max", "static"):
            if p in caps and "paged" in caps:
                paper = {"orca-oracle": "1.7-2.7x", "orca-max": "2.7-8x", "static": "up to 22x",
                         "orca-pow2": "between Oracle and Max"}[p]
                gain = caps["paged"] / caps[p]
                rows.append((f"Fig. 12 ({name}): throughput at {r['rates'][-1]:.2f} req/s, paged / {POLICY_LABELS[p]}",
                             paper + " rate at equal latency (ShareGPT)",
                             f"{gain:.2f}x", gain > 1.2))
        batched = {p: runs[-1]["mean_batched_requests"] for p, runs in r["runs"].items()}
        for p, paper in (("orca-oracle", 2.2), ("orca-max", 4.3)):
            if p in batched and "paged" in batched:
                gain = batched["paged"] / batched[p]
                rows.append((f"Fig. 13 ({name}): requests batched at {r['rates'][-1]:.2f} req/s, paged / "
                             f"{POLICY_LABELS[p]}", f"{paper}x (ShareGPT)",
                             f"{gain:.2f}x", gain >= paper / 2))
    fp8 = results.get("fig13_fp8")
    if fp8:
        bf16_run, fp8_run = fp8["runs"]["auto"], fp8["runs"]["fp8"]
        per_step = "mean_batched_requests_per_step"
        gain = fp8_run[per_step] / bf16_run[per_step]
        rows.append((f"Fig. 13 shape, fp8 KV cache ({fp8['trace']}, all at once, {bf16_run['pool_mib']:.2f} MiB "
                     "of KV): requests batched per step, fp8 / bf16 pages", "about 2x (half the bytes per token)",
                     f"{gain:.2f}x ({fp8_run[per_step]:.1f} / {bf16_run[per_step]:.1f})", gain >= 1.5))
    sharing = results.get("fig14_16", [])
    for kind in ("parallel", "beam"):
        runs = [r for r in sharing if r["workload"] == kind]
        saved = [r["memory_saved"] for r in runs]
        if saved:
            lo, hi = PAPER["fig15_saved_alpaca"][kind]
            widths = ", ".join(str(r["width"]) for r in runs)
            rows.append((f"Fig. 15: KV memory saved by sharing, {kind} (widths {widths})",
                         f"{lo:.1%}-{hi:.1%} (Alpaca)", " / ".join(f"{x:.1%}" for x in saved), max(saved) >= lo))
    for shot, paper in PAPER["fig16_throughput_gain"].items():
        on = next((r for r in sharing if r["workload"] == f"prefix {shot}" and r["prefix_caching"]), None)
        if on:
            rows.append((f"Fig. 16 ({shot} prefix): speedup of sharing the prefix (caching on / off)",
                         f"{paper}x throughput vs Orca (Oracle)", f"{on['speedup']}x, hit rate {on['hit_rate']:.0%}",
                         on["speedup"] > 1))
    for name, r in results.get("fig18", {}).items():
        lat = {int(b): run["normalized_latency"] for b, run in r["runs"].items()}
        best = min(lat, key=lat.get)
        rows.append((f"Fig. 18 ({name}): best block size", "16-128 (ShareGPT), 16-32 (Alpaca)",
                     f"{best} ({', '.join(f'{b}: {lat[b]:.4f}' for b in sorted(lat))} s/token)",
                     16 in lat and lat[16] <= 1.1 * lat[best]))
    f19 = results.get("fig19")
    if f19:
        micro = {int(b): m for b, m in f19["micro"].items()}
        ratios = {b: m["recompute_s"] / m["swap_s"] for b, m in sorted(micro.items())}
        rows.append(("Fig. 19a: recompute time / swap time, by block size",
                     "swap costly at small blocks; recompute <= 1.2x swap",
                     ", ".join(f"{b}: {x:.2f}" for b, x in ratios.items()),
                     max(ratios.values()) <= PAPER["fig19_recompute_over_swap_max"]))
        e2e = f19["end_to_end"]
        ratio = e2e["swap"]["normalized_latency"] / e2e["recompute"]["normalized_latency"]
        rows.append((f"Fig. 19b ({f19['trace']}): normalized latency, swap / recompute (block size 16)",
                     "comparable (16-64)",
                     f"{ratio:.2f} ({e2e['recompute']['preemptions']} / {e2e['swap']['preemptions']} preemptions)",
                     0.8 <= ratio <= 1.25))
    return rows


def write_claims(rows, path: str, report: dict):
    lines = [f"<!-- written by scripts/reproduce_paper.py{' --quick' if report['quick'] else ''}: "
             f"{report['model']} on {report['backend']} ({report['machine']}), {report['total_s']} s -->",
             "| claim | paper | ours | shape holds |", "|---|---|---|---|"]
    lines += [f"| {c} | {p} | {o} | {'yes' if h else 'no'} |" for c, p, o, h in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------- figures

def plot(results: dict, out_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)

    f12 = results["fig12"]
    fig, axes = plt.subplots(1, len(f12), figsize=(5.5 * len(f12), 4))
    for ax, (name, r) in zip(np.atleast_1d(axes), f12.items()):
        for policy, runs in r["runs"].items():
            ax.plot([x["rate"] for x in runs], [x["normalized_latency"] for x in runs], "o-",
                    label=POLICY_LABELS[policy])
        ax.set(title=f"{name}-like trace (Fig. 12)", xlabel="request rate (req/s)",
               ylabel="normalized latency (s/token)", yscale="log")
        ax.legend(fontsize=8)
    save(fig, "fig12_latency_vs_rate.png")

    # Figs. 13 and 2: the paper-scale scheduler-only run, then each quick trace at its highest rate.
    panels = [("paper's sizes, ShareGPT-like\n(scheduler and block manager only)", results["fig2"]["policies"])]
    panels += [(f"{name}-like at {r['rates'][-1]:.2f} req/s", {p: runs[-1] for p, runs in r["runs"].items()})
               for name, r in f12.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, runs) in zip(axes, panels):
        policies = list(runs)
        ax.bar(range(len(policies)), [runs[p]["mean_batched_requests"] for p in policies],
               color=[f"C{i}" for i in range(len(policies))])
        ax.set_xticks(range(len(policies)), policies, fontsize=7)
        ax.set(title=title + " (Fig. 13)", ylabel="mean batched requests")
    save(fig, "fig13_batched_requests.png")

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    for ax, (title, runs) in zip(axes, panels):
        policies = [p for p in runs if p != "static"]
        bottom = np.zeros(len(policies))
        for part, color, label in (("token", "#16a34a", "token states"), ("reserved", "#facc15", "reservation"),
                                   ("fragmented", "#ef4444", "internal fragmentation")):
            values = np.array([runs[p][f"{part}_fraction"] * 100 for p in policies])
            ax.bar(range(len(policies)), values, bottom=bottom, color=color, label=label)
            bottom += values
        for i, p in enumerate(policies):
            ax.text(i, 2, f"{runs[p]['token_fraction']:.1%}", ha="center", fontsize=8, color="white")
            ax.plot([i - 0.4, i + 0.4], [PAPER["fig2_token_fraction"][p] * 100] * 2, "k--", lw=1)
        ax.set_xticks(range(len(policies)), policies, fontsize=8)
        ax.set(title=title + "\n(Fig. 2; dashes: the paper)", ylabel="% of allocated KV slots", ylim=(0, 100))
        ax.legend(fontsize=7, loc="upper right")
    save(fig, "fig2_memory_breakdown.png")

    sharing = results["fig14_16"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("parallel", "beam")):
        rows = [r for r in sharing if r["workload"] == kind]
        ax.bar([str(r["width"]) for r in rows], [r["memory_saved"] * 100 for r in rows], color="#7c3aed", label="ours")
        for key, style in (("fig15_saved_alpaca", "k--"), ("fig15_saved_sharegpt", "k:")):
            lo, hi = PAPER[key][kind]
            ax.axhspan(lo * 100, hi * 100, alpha=0.12, color="k" if "alpaca" in key else "b",
                       label="paper, " + key.split("_")[-1])
        ax.set(title=f"{'parallel sampling (n)' if kind == 'parallel' else 'beam search (width)'}: "
               "memory saved by sharing (Figs. 14-15)", xlabel="n" if kind == "parallel" else "beam width",
               ylabel="% of KV blocks saved")
        ax.legend(fontsize=7)
    save(fig, "fig15_sharing_savings.png")

    prefix = [r for r in sharing if r["workload"].startswith("prefix")]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted({r["workload"] for r in prefix})
    for i, caching in enumerate((False, True)):
        ax.bar(np.arange(len(names)) + 0.4 * i - 0.2,
               [next(r for r in prefix if r["workload"] == n and r["prefix_caching"] == caching)["elapsed_s"]
                for n in names], 0.4, label="prefix caching " + ("on" if caching else "off"))
    ax.set_xticks(range(len(names)), names)
    ax.set(title="Shared-prefix prompts (Fig. 16): time to serve", ylabel="seconds")
    ax.legend()
    save(fig, "fig16_shared_prefix.png")

    f18 = results["fig18"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in f18.items():
        sizes = sorted(r["runs"], key=int)
        ax.plot([str(s) for s in sizes], [r["runs"][s]["normalized_latency"] for s in sizes], "o-",
                label=f"{name}-like at {r['rate']:.2f} req/s")
    ax.set(title="Block size (Fig. 18b)", xlabel="block size (tokens)", ylabel="normalized latency (s/token)")
    ax.legend(fontsize=8)
    save(fig, "fig18_block_size.png")

    f19 = results["fig19"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted(f19["micro"], key=int)
    axes[0].plot([str(s) for s in sizes], [f19["micro"][s]["swap_s"] * 1e3 for s in sizes], "o-", label="swap out + in")
    axes[0].plot([str(s) for s in sizes], [f19["micro"][s]["recompute_s"] * 1e3 for s in sizes], "o-",
                 label="recompute")
    axes[0].set(title=f"(a) overhead for {f19['tokens']} tokens (Fig. 19a)", xlabel="block size",
                ylabel="ms")
    axes[0].legend()
    modes = list(f19["end_to_end"])
    axes[1].bar(modes, [f19["end_to_end"][m]["normalized_latency"] for m in modes], color=["C0", "C1"])
    axes[1].set(title=f"(b) {f19['trace']}-like at {f19['rate']:.2f} req/s (Fig. 19b)\n"
                f"{' / '.join(str(f19['end_to_end'][m]['preemptions']) for m in modes)} preemptions",
                ylabel="normalized latency (s/token)")
    save(fig, "fig19_recompute_vs_swap.png")
