"""Section of `make experiments` on real arrivals: the Azure LLM inference trace 2023 (conversation service)
against Poisson at the same mean rate, FCFS and skip-join MLFQ, ShareGPT lengths in both (so only the
arrival process differs). The helpers speedup_for_rate and interarrival_cv are tested in
tests/test_experiments.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from experiment_sections.common import MAIN, Ctx, clip_trace
from experiment_sections.sched import CAPACITY, sharegpt
from fastserve.bench.workload import LengthFilter, load_workload

AZURE_LOADS = (0.75, 1.0)
AZURE_POLICIES = ("fcfs", "skip-join-mlfq")


def speedup_for_rate(arrivals: Sequence[float], rate: float) -> float:
    """The factor to divide trace arrival times by so that their mean rate, (n - 1) / (last - first), is `rate`."""
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        raise ValueError("need at least two arrivals spanning a positive time")
    return rate / ((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))


def interarrival_cv(arrivals: Sequence[float]) -> float:
    """Coefficient of variation (stdev / mean) of the gaps between sorted arrivals: 1 for Poisson, 1/sqrt(b) for
    gamma arrivals of burstiness b."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def azure_trace(ctx: Ctx, rate: float, n: int) -> tuple[list[tuple[float, int, int]], float]:
    """The first n requests of the conversation trace, their arrival times scaled to a mean of `rate` req/s,
    carrying the lengths of the Poisson run's ShareGPT trace (same n, same seed); and the trace's own mean rate."""
    raw = load_workload("azure-conv", n, path=ctx.args.azure)
    times = [it.arrival_s for it in raw]
    speedup = speedup_for_rate(times, rate)
    timed = load_workload("azure-conv", n, path=ctx.args.azure, trace_speedup=speedup)
    lengths = load_workload("lengths", n, path=ctx.datasets["ShareGPT"], rate=rate, seed=ctx.args.seed,
                            length_filter=LengthFilter())
    items = [replace(it, arrival_s=t.arrival_s) for it, t in zip(lengths, timed)]
    return clip_trace(items, 2048), rate / speedup


def section_azure(ctx: Ctx) -> str:
    n = ctx.args.overload_prompts
    lines = ["## What the paper did not test: real arrivals (Azure 2023 conversation trace) against Poisson", "",
             f"Command: `{ctx.cmd('azure')}{'' if n == 1500 else f' --overload-prompts {n}'}`", ""]
    rows, results, native = [], {}, None
    for load in AZURE_LOADS:
        rate = CAPACITY * load
        poisson = sharegpt(ctx, rate, n)
        azure, native = azure_trace(ctx, rate, n)
        for arrivals, trace in (("Poisson", poisson), ("Azure conv", azure)):
            cv = interarrival_cv([t for t, _, _ in trace])
            for policy in AZURE_POLICIES:
                s = ctx.simulate(MAIN, trace, policy)[0]
                results[(load, arrivals, policy)] = s
                rows.append(f"| {load:.2f}x ({rate:.2f}) | {arrivals} (gap CV {cv:.2f}) | {policy} | "
                            f"{s['mean_per_token_s']:.3f} | {s['p95_per_token_s']:.3f} | {s['p95_ttft_s']:.2f} | "
                            f"{s['duration_s']:.0f} |")
                print(f"  azure {load:.2f}x {arrivals:10} {policy:15} mean {s['mean_per_token_s']:.3f} "
                      f"p95 {s['p95_per_token_s']:.3f}", flush=True)
    lines += [f"OPT-13B on one A100 40GB (roofline profile), {n} requests per point, ShareGPT lengths (the overload "
              "section's trace: no length filter, clipped to 2048 tokens) in both columns; only the arrival times "
              f"differ. Azure: the first {n} requests of {ctx.args.azure.name} (production arrivals, "
              f"2023-11-16; {native:.2f} req/s on average in this window), their times scaled to the target "
              "mean rate (the gaps keep their shape). Poisson: the same mean rate. Gap CV: coefficient of "
              "variation of the gaps between arrivals (1 for Poisson, 1.4 and 2 for the robustness section's "
              "burstiness 0.5 and 0.25). Default scheduler settings; P95 TTFT in seconds.", "",
              "| load (req/s) | arrivals | policy | mean s/token | P95 s/token | P95 TTFT s | duration s |",
              "|---|---|---|---|---|---|---|", *rows, ""]
    notes = []
    for load in AZURE_LOADS:
        sj = {a: results[(load, a, "skip-join-mlfq")] for a in ("Poisson", "Azure conv")}
        fc = {a: results[(load, a, "fcfs")] for a in ("Poisson", "Azure conv")}
        notes.append(f"at {load:.2f}x, Azure / Poisson mean per-token latency: fcfs "
                     f"{fc['Azure conv']['mean_per_token_s'] / fc['Poisson']['mean_per_token_s']:.2f}x, skip-join "
                     f"{sj['Azure conv']['mean_per_token_s'] / sj['Poisson']['mean_per_token_s']:.2f}x; fcfs / "
                     f"skip-join: Poisson {fc['Poisson']['mean_per_token_s'] / sj['Poisson']['mean_per_token_s']:.2f}x "
                     f"(P95 {fc['Poisson']['p95_per_token_s'] / sj['Poisson']['p95_per_token_s']:.2f}x), Azure "
                     f"{fc['Azure conv']['mean_per_token_s'] / sj['Azure conv']['mean_per_token_s']:.2f}x "
                     f"(P95 {fc['Azure conv']['p95_per_token_s'] / sj['Azure conv']['p95_per_token_s']:.2f}x)")
    lines += ["Measured: " + "; ".join(notes) + ".", ""]
    return "\n".join(lines)
