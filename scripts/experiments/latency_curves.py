"""Fig. 12 (P95 per-token latency against load) and Fig. 13 (goodput: the highest load within an SLO of 5x, 10x
and 20x the light-load latency, per phase), OPT-13B, FCFS (vLLM's order) against skip-join MLFQ (FastServe),
ShareGPT and Alpaca, measured the way every comparison is (docs/scheduling.md, "How policies are compared";
steady_state.py): loads in units of FCFS's sustained capacity C, 3,000 requests a point, the requests
arriving in the middle 80% of the trace counted, seeds with 95% intervals, and Fig. 13's loads searched by
bisection to 2%. Fig. 12's latencies stop at 1.0C: past C there is no steady state (the queue grows for as long as
the overload lasts, so a P95 over the run depends on its length); past C it reads by time, the output tokens per
second at 1.5C and 2C against FCFS's (measures.collapse). Both read the same runs (steady_state.Runner caches them
on disk, shared with the capacity section and Fig. 1).
"""

from __future__ import annotations

import math
import statistics
import time

from scripts.experiments.common import MAIN, Ctx, SLOSearch, _errorbar, _ms, _plt, _save, throughput_at_slo
from scripts.experiments.measures import COLLAPSE_LOADS, collapse
from scripts.experiments.past_capacity import ratio_cell
from scripts.experiments.steady_state import Runner, Setup, capacity, fmt, ratio_stat, stat, table

CURVE_POLICIES = ("fcfs", "skip-join-mlfq")  # the paper's Fig. 12/13: vLLM against FastServe
DATASETS = {"ShareGPT": "sharegpt", "Alpaca": "alpaca"}
CAPACITY_SEEDS = {"ShareGPT": 3, "Alpaca": 2}  # as the capacity section measures C (so its cached runs serve here)
LIGHT = 0.1  # light load, x C: FCFS's P95s there are the SLOs' base (the policies do not differ there)
LOADS = (LIGHT, 0.25, 0.5, 0.8, 0.9, 0.95, 1.0)  # x C: Fig. 12's curves; the capacity section's loads among them
# Fig. 13's searches start from these (x C): a goodput is the highest load whose steady-state run is within the SLO,
# past C too (measures.py's throughput at the SLO).
GOODPUT_GRID = (0.25, 0.5, 0.8, 1.0, 1.25, 1.5, 2.0)
SLO_MULTIPLES = (5, 10, 20)
RESOLUTION = 0.02  # Fig. 13's searches stop once the bracket's loads are within 2% of each other
# metric of steady_state.windowed_metrics -> what it measures (the per-token latency, and the two phases)
METRICS = {"p95_per_token_s": "per-token latency (e2e / output tokens)",
           "p95_ttft_s": "prefill phase: time to first token",
           "p95_tpot_s": "decode phase: time per output token after the first"}


def _setup(ds: str, ctx: Ctx) -> Setup:
    return Setup(MAIN, DATASETS[ds], ctx.args.steady_prompts)


def curves(ctx: Ctx) -> dict:
    """{"C": {dataset: capacity dict}, "data": {dataset: table(...)}, "runner": Runner, "wall": s} (cached in
    ctx.cache: Fig. 13 reads Fig. 12's runs)."""
    if "steady_curves" in ctx.cache:
        return ctx.cache["steady_curves"]
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    caps, data = {}, {}
    for ds in DATASETS:
        setup = _setup(ds, ctx)
        caps[ds] = capacity(runner, setup, range(CAPACITY_SEEDS[ds]))
        data[ds] = table(runner, setup, LOADS, CURVE_POLICIES, range(ctx.args.curve_seeds), caps[ds]["C"])
        print(f"  curves {ds}: C = {caps[ds]['C']:.3f} req/s, {runner.runs} simulations so far", flush=True)
    ctx.cache["steady_curves"] = {"C": caps, "data": data, "runner": runner, "t0": t0}
    return ctx.cache["steady_curves"]


def _method(ctx: Ctx, cur: dict) -> str:
    caps = "; ".join(f"{ds} C = {cur['C'][ds]['C']:.3f} req/s (FCFS served under a {cur['C'][ds]['offered']:.2f} "
                     f"req/s offer, {CAPACITY_SEEDS[ds]} seeds)" for ds in DATASETS)
    return (f"OPT-13B on one A100 40GB (roofline profile), Poisson arrivals, {ctx.args.steady_prompts} requests a "
            f"point through vLLM's length filter, the requests arriving in the middle 80% of the trace counted, "
            f"{ctx.args.curve_seeds} seeds (mean ± 95% interval), the engine's defaults (skip-join MLFQ's service "
            f"ladder, age promotion, proactive KV policy; caching on, though single-turn prompts share nothing). "
            f"Loads are multiples of FCFS's sustained capacity: {caps}. FCFS is vLLM's order; skip-join MLFQ is "
            f"FastServe's.")


def section_fig12(ctx: Ctx) -> str:
    cur = curves(ctx)
    plt = _plt()
    fig, axes = plt.subplots(1, len(DATASETS), figsize=(9, 3.2))
    lines = ["## Fig. 12: P95 per-token latency against load", "", f"Command: `{ctx.cmd('fig12')}`", "",
             "![fig12](figures/fig12_p95_latency.png)", "", _method(ctx, cur), ""]
    summary = []
    for ax, ds in zip(axes, DATASETS):
        d, c = cur["data"][ds], cur["C"][ds]["C"]
        for policy in CURVE_POLICIES:
            _errorbar(ax, LOADS, [stat(d[(load, policy)]["p95_per_token_s"]) for load in LOADS], policy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("load (x FCFS's capacity)")
        ax.set_ylabel("P95 per-token latency (s)")
        ax.set_title(f"{ds}, OPT-13B (simulated), C = {c:.2f} req/s", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        lines += [f"{ds} (P95 per-token latency, s; FCFS / skip-join paired per seed):", "",
                  "| load | req/s | fcfs | skip-join-mlfq | fcfs / skip-join | served: skip-join / fcfs |",
                  "|---|---|---|---|---|---|"]
        ratios = {}
        for load in LOADS:
            f, s = d[(load, "fcfs")], d[(load, "skip-join-mlfq")]
            ratios[load] = ratio_stat(f["p95_per_token_s"], s["p95_per_token_s"])
            lines.append(f"| {load:g}C | {load * c:.2f} | {fmt(stat(f['p95_per_token_s']))} | "
                         f"{fmt(stat(s['p95_per_token_s']))} | {fmt(ratios[load])} | "
                         f"{fmt(ratio_stat(s['served_rate'], f['served_rate']), 4)} |")
        lines.append("")
        best, worst = max(ratios, key=lambda k: ratios[k].mean), min(ratios, key=lambda k: ratios[k].mean)
        summary.append(f"{ds}: largest fcfs / skip-join {fmt(ratios[best])} at {best:g}C, smallest "
                       f"{fmt(ratios[worst])} at {worst:g}C")
    _save(fig, ctx.figdir / "fig12_p95_latency.png")
    lines += ["Up to 1.0C: " + "; ".join(summary) + ". The paper's Fig. 12 shows FastServe's P95 below vLLM's "
              "across its rates, most of them past capacity.", "", *_past_capacity(ctx, cur), ""]
    runner = cur["runner"]
    lines += [f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - cur['t0']) / 60:.0f} min wall; the rest came from the cache), simulation "
              f"code version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)


def _past_capacity(ctx: Ctx, cur: dict) -> list[str]:
    """Fig. 12 past C, by time: output tokens per second in the counted window, skip-join against FCFS."""
    runner, seeds = cur["runner"], range(ctx.args.curve_seeds)
    lines = ["**Past capacity, by time.** Past C there is no steady state: the queue grows for as long as the "
             "overload lasts, so a P95 over a run depends on its length. What a policy does there reads by time: the "
             "output tokens per second inside the counted window (every output token of any request made in it, "
             "over its length: measures.collapse), skip-join's paired per seed with FCFS's (short-first policies "
             "finish more, smaller requests, so requests per second would flatter them); the past_capacity section "
             "has throughput at the SLO, goodput and a burst.", "",
             "| dataset | load | req/s | fcfs output tokens/s | skip-join-mlfq | skip-join / fcfs |",
             "|---|---|---|---|---|---|"]
    for ds in DATASETS:
        c = cur["C"][ds]["C"]
        tokens = collapse(runner, _setup(ds, ctx), CURVE_POLICIES, seeds, c)
        for load in COLLAPSE_LOADS:
            f, sj = tokens[(load, "fcfs")], tokens[(load, "skip-join-mlfq")]
            lines.append(f"| {ds} | {load:g}C | {load * c:.2f} | {fmt(f['tokens_per_s'], 4)} | "
                         f"{fmt(sj['tokens_per_s'], 4)} | {ratio_cell(sj['vs_ref'], 4)} |")
    return lines


def goodput(runner: Runner, setup: Setup, policy: str, seeds: range, cap: float, metric: str,
            limit: float) -> SLOSearch:
    """The highest load (x cap) whose P95 `metric`, averaged over seeds, stays <= limit: the curve's loads, then
    bisection of the bracket until its ends are within RESOLUTION of each other."""

    def latency_at(load: float) -> float:
        return statistics.fmean(table(runner, setup, [load], [policy], seeds, cap)[(load, policy)][metric])

    grid = GOODPUT_GRID  # from 0.25C: the light load is the SLO's base, within every SLO by construction
    return throughput_at_slo(latency_at, grid, limit, bisection_steps(grid, RESOLUTION), RESOLUTION)


def bisection_steps(grid, resolution: float) -> int:
    """Geometric bisection steps that narrow the widest bracket of `grid` (its largest ratio of neighbours, or
    the lowest point over a quarter of it, throughput_at_slo's bracket below the grid) to ends within
    `resolution` of each other."""
    pts = sorted(grid)
    ratio = max([4.0] + [b / a for a, b in zip(pts, pts[1:])])
    return max(0, math.ceil(math.log2(math.log(ratio) / math.log(1 + resolution))))


def section_fig13(ctx: Ctx) -> str:
    cur = curves(ctx)
    runner, seeds = cur["runner"], range(ctx.args.curve_seeds)
    plt = _plt()
    lines = ["## Fig. 13: goodput at SLOs of 5x, 10x and 20x the light-load latency", "",
             f"Command: `{ctx.cmd('fig13')}`", "", "![fig13](figures/fig13_goodput.png)", "", _method(ctx, cur), "",
             "Our reading of the paper's \"P95 goodput at SLO 5x, 10x, 20x of the light-load latency per phase\": "
             "for each of three P95 latencies (the per-token latency, the prefill phase's time to first token and "
             "the decode phase's time per output token after the first), the SLO is k x that same P95 measured "
             f"under FCFS at light load ({LIGHT:g}C; the policies do not differ there), and the goodput is the "
             "highest load whose P95 (the mean over seeds) stays within it at steady state: the loads "
             f"{', '.join(f'{x:g}C' for x in GOODPUT_GRID)}, then bisection of the bracket until its ends are within "
             f"{RESOLUTION:.0%}. `+`: every load up to {GOODPUT_GRID[-1]:g}C was within the SLO. A load past 1.0C "
             "that passes is a run of this many requests past FCFS's capacity: it passes for this trace length "
             "and may fail for a longer one (the past_capacity section measures that region by time).", "",
             "| dataset | P95 of | light load | SLO | " + " | ".join(f"{p} (x C)" for p in CURVE_POLICIES)
             + " | skip-join / fcfs |", "|---|---|---|---|" + "---|" * (len(CURVE_POLICIES) + 1)]
    fig, axes = plt.subplots(1, len(DATASETS), figsize=(9, 3.2))
    ratios = []
    for ax, ds in zip(axes, DATASETS):
        setup, cap, d = _setup(ds, ctx), cur["C"][ds]["C"], cur["data"][ds]
        labels, bars = [], {p: [] for p in CURVE_POLICIES}
        for metric, what in METRICS.items():
            base = statistics.fmean(d[(LIGHT, "fcfs")][metric])
            for k in SLO_MULTIPLES:
                found = {p: goodput(runner, setup, p, seeds, cap, metric, k * base) for p in CURVE_POLICIES}
                cells = [f"{found[p].rate:.3g}{'+' if found[p].capped else ''}" for p in CURVE_POLICIES]
                fc, sj = found["fcfs"].rate, found["skip-join-mlfq"].rate
                ratio = f"{sj / fc:.2f}x" if fc > 0 else "n/a"
                if fc > 0:
                    ratios.append((ds, metric, sj / fc))
                lines.append(f"| {ds} | {what} | {_ms(base)} | {k}x | " + " | ".join(cells) + f" | {ratio} |")
                labels.append(f"{metric.split('_')[1]} {k}x")
                for p in CURVE_POLICIES:
                    bars[p].append(found[p].rate)
                print(f"  goodput {ds} {metric} {k}x: " + ", ".join(f"{p} {found[p].rate:.3f}C"
                                                                    for p in CURVE_POLICIES), flush=True)
        width = 0.8 / len(CURVE_POLICIES)
        for i, p in enumerate(CURVE_POLICIES):
            ax.bar([j + i * width for j in range(len(labels))], bars[p], width, label=p)
        ax.set_xticks([j + width * (len(CURVE_POLICIES) - 1) / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=45, fontsize=6, ha="right")
        ax.set_ylabel("goodput (x FCFS's capacity)")
        ax.set_title(f"{ds}, OPT-13B (simulated), C = {cap:.2f} req/s", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, ctx.figdir / "fig13_goodput.png")
    by_metric: dict[str, list[float]] = {}
    for _ds, metric, r in ratios:
        by_metric.setdefault(metric, []).append(r)
    summary = "; ".join(f"{METRICS[m].split(':')[0]}: {min(rs):.2f}x to {max(rs):.2f}x" for m, rs in by_metric.items())
    tpot = {p: max(statistics.fmean(v["p95_tpot_s"]) for ds in DATASETS for (_, pol), v in cur["data"][ds].items()
                   if pol == p) for p in CURVE_POLICIES}
    lines += ["", f"Skip-join MLFQ's goodput over FCFS's, range over datasets and SLOs: {summary}. The paper "
              "reports FastServe's goodput above vLLM's at each SLO scale.", "",
              "The phases pull apart. Under FCFS a started job is never preempted, so its time per output token is "
              "the step time of the batch it runs in (the highest P95 of FCFS's decode phase over Fig. 12's loads: "
              f"{_ms(tpot['fcfs'])}), while its queueing lands in the time to first token. Skip-join MLFQ starts "
              "jobs sooner (a shorter TTFT) and pays with preemptions between tokens (its decode-phase P95 reaches "
              f"{_ms(tpot['skip-join-mlfq'])}). The per-token latency (e2e / tokens) adds both, which is what the "
              "paper's SLO counts.", "",
              f"Fig. 12 and 13 together: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - cur['t0']) / 60:.0f} min wall; the rest came from the cache), simulation "
              f"code version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
