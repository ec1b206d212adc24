"""Section of `make experiments` on real arrivals: the Azure LLM inference trace 2023 (conversation service)
against Poisson at the same mean rate, FCFS and skip-join MLFQ, ShareGPT lengths in both (so only the arrival
process differs), measured the steady-state way up to C (steady_state.py, Setup.arrivals) and by time past it.
"""

from __future__ import annotations

import time

from fastserve.bench.arrivals import interarrival_cv
from scripts.experiments.common import MAIN, Ctx
from scripts.experiments.measures import PAST_BY_TIME, collapse
from scripts.experiments.past_capacity import ratio_cell
from scripts.experiments.steady_state import (
    ARRIVAL_TRACES,
    Runner,
    Setup,
    capacity,
    fmt,
    ratio_stat,
    stat,
    table,
    trace_for,
)

AZURE = "azure-conv"
AZURE_LOADS = (0.8, 1.0)  # x C (FCFS's capacity under Poisson arrivals), steady state
AZURE_PAST = (1.5,)  # x C: past capacity, by time (output tokens per second: measures.collapse)
AZURE_POLICIES = ("fcfs", "skip-join-mlfq")


def section_azure(ctx: Ctx) -> str:
    runner = Runner(jobs=ctx.args.steady_jobs)
    seeds = range(ctx.args.curve_seeds)
    n = ctx.args.steady_prompts
    t0 = time.perf_counter()
    poisson, azure = Setup(MAIN, "sharegpt", n), Setup(MAIN, "sharegpt", n, arrivals=AZURE)
    cap = capacity(runner, poisson, range(3))
    c = cap["C"]
    cvs = [interarrival_cv([t for t, _, _ in trace_for(azure, c, s)[0]]) for s in seeds]
    data = {name: table(runner, setup, AZURE_LOADS, AZURE_POLICIES, seeds, c)
            for name, setup in (("Poisson", poisson), ("Azure conv", azure))}
    lines = ["## What the paper did not test: real arrivals (Azure 2023 conversation trace) against Poisson", "",
             f"Command: `{ctx.cmd('azure')}`", "",
             f"OPT-13B on one A100 40GB (roofline profile), the engine's defaults, ShareGPT lengths through vLLM's "
             f"length filter in both; only the arrival times differ. {n} requests a point, the middle 80% of "
             f"arrivals counted, {len(seeds)} seeds (mean ± 95% interval; ratios paired per seed), loads in units "
             f"of FCFS's capacity under Poisson arrivals, C = {c:.3f} req/s. Azure: seed s takes requests "
             f"{n}s to {n}(s + 1) - 1 of {ARRIVAL_TRACES[AZURE].name} (production arrivals, 2023-11-16), their "
             "times scaled to the point's mean rate (the gaps keep their shape); gap CV (coefficient of variation "
             f"of the gaps; Poisson 1) per seed {', '.join(f'{x:.2f}' for x in cvs)}. Poisson: the same mean "
             "rate, the same requests.", "",
             "| load | arrivals | FCFS mean s/token | skip-join | skip-join / FCFS | FCFS P95 | skip-join P95 | "
             "FCFS P99 TTFT s | skip-join P99 TTFT s | served skip-join / FCFS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for load in AZURE_LOADS:
        for name in ("Poisson", "Azure conv"):
            f, sj = data[name][(load, "fcfs")], data[name][(load, "skip-join-mlfq")]
            lines.append(f"| {load:g}C | {name} | {fmt(stat(f['mean_per_token_s']))} | "
                         f"{fmt(stat(sj['mean_per_token_s']))} | "
                         f"{fmt(ratio_stat(sj['mean_per_token_s'], f['mean_per_token_s']))} | "
                         f"{fmt(stat(f['p95_per_token_s']))} | {fmt(stat(sj['p95_per_token_s']))} | "
                         f"{fmt(stat(f['p99_ttft_s']))} | {fmt(stat(sj['p99_ttft_s']))} | "
                         f"{fmt(ratio_stat(sj['served_rate'], f['served_rate']), 4)} |")
            print(f"  azure {load:g}C {name:10}: fcfs {stat(f['mean_per_token_s'])} skip-join "
                  f"{stat(sj['mean_per_token_s'])}", flush=True)
    lines += ["", "Azure / Poisson, mean per-token latency (paired per seed): "
              + "; ".join(f"{load:g}C fcfs {fmt(_over(data, load, 'fcfs'))}, skip-join "
                          f"{fmt(_over(data, load, 'skip-join-mlfq'))}" for load in AZURE_LOADS) + ".", "",
              f"In windows of {n:,} requests the conversation trace's gaps are nearly Poisson (the CVs above), so at "
              "steady state the two arrival processes give the same latencies within the seeds' spread.", "",
              *_past(runner, poisson, azure, seeds, c), "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)


def _over(data: dict, load: float, policy: str):
    return ratio_stat(data["Azure conv"][(load, policy)]["mean_per_token_s"],
                      data["Poisson"][(load, policy)]["mean_per_token_s"])



def _past(runner: Runner, poisson: Setup, azure: Setup, seeds: range, c: float) -> list[str]:
    """Past capacity, by time: output tokens per second in the counted window (measures.collapse), skip-join
    against FCFS under each arrival process."""
    lines = [PAST_BY_TIME + " "
             "(measures.collapse), paired per seed.", "",
             "| load | arrivals | FCFS output tokens/s | skip-join | skip-join / FCFS |", "|---|---|---|---|---|"]
    for load in AZURE_PAST:
        for name, setup in (("Poisson", poisson), ("Azure conv", azure)):
            t = collapse(runner, setup, AZURE_POLICIES, seeds, c, (load,))
            f, sj = t[(load, "fcfs")], t[(load, "skip-join-mlfq")]
            lines.append(f"| {load:g}C | {name} | {fmt(f['tokens_per_s'], 4)} | {fmt(sj['tokens_per_s'], 4)} | "
                         f"{ratio_cell(sj['vs_ref'], 4)} |")
    return lines
