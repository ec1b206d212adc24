"""Past capacity, by time, every request counted (scripts/experiments/measures.py): skip-join MLFQ, FCFS and the SRPT
oracle(s) by throughput at the SLO (mean and P95 per-token latency <= 10 decode iterations), goodput (>= 90% of
requests within that and a 2 s TTFT), output tokens per second at 1.5C and 2C against FCFS's, a burst (10 minutes
at 1.5C, then 0.5C until the queue drains), the time steps wait for KV uploads and the time picked jobs wait for
their KV (the swap-wait share). Seeds with 95% intervals; the searches run at steady state (--past-prompts requests a
point, the middle 80% of arrivals counted). The tokens-per-second goal is checked on the other workloads too (Alpaca,
the Fig. 14 ratios, the Azure 2023 conversation and code traces: WORKLOADS, --past-workloads).

    python -m scripts.experiments --only past_capacity --past-prompts 3000 --past-seeds 2   # a small check
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from engine.config import SCHEDULING_POLICIES
from scripts.experiments.common import MAIN, Ctx
from scripts.experiments.fig14 import IO_RATIOS
from scripts.experiments.measures import (
    COLLAPSE_LOADS,
    GOODPUT_SHARE,
    Bracket,
    BurstShape,
    bursts,
    collapse,
    highest_loads,
    load_stats,
)
from scripts.experiments.steady_state import (
    DATASETS,
    GOODPUT_TTFT_S,
    SLO_DECODES,
    Runner,
    Setup,
    Stat,
    capacity,
    fmt,
    ratio_stat,
    slo_seconds,
)

# The oracles beside the policy, by their scheduler names: "srpt" (true output lengths, the starvation bound of the
# defaults: the yardstick) and "srpt-unbounded" (without it); a name the scheduler does not know is left out.
ORACLE_NAMES = ("srpt", "srpt-unbounded")
ORACLES = tuple(name for name in ORACLE_NAMES if name in SCHEDULING_POLICIES)
POLICIES = ("fcfs", "skip-join-mlfq", *ORACLES)
LOADS = (1.0, 1.5, 2.0)  # tokens per second and the upload stall (1.0C: the searches' first load, from the cache)
COLLAPSE_GOAL = 0.98  # skip-join's output tokens per second >= this x FCFS's at 1.5C and 2C, on every workload
WORKLOAD_POLICIES = ("fcfs", "skip-join-mlfq")
# The other workloads of the tokens-per-second goal, by name: (dataset, Fig. 14's input:output ratio or None), and
# where capacity()'s search starts (req/s; about 1.3-2x of C as measured before, so one or two offers find it).
WORKLOADS = {"alpaca": ("alpaca", None), **{f"fig14-{r:g}": ("sharegpt", r) for r in IO_RATIOS},
             "azure-conv": ("azure-conv", None), "azure-code": ("azure-code", None)}
WORKLOAD_START = {"alpaca": 128.0, "fig14-0.25": 2.0, "fig14-1": 2.0, "fig14-4": 4.0, "fig14-16": 8.0,
                  "fig14-64": 8.0, "fig14-256": 8.0, "azure-conv": 8.0, "azure-code": 16.0}
MEASURES = (("slo_mean", "throughput at the SLO, mean"), ("slo_p95", "throughput at the SLO, P95"),
            ("goodput", "goodput"))


def ratio_cell(s: Stat | None, digits: int = 3) -> str:
    """A paired ratio to FCFS: "-" for FCFS itself; "no difference" when its 95% interval holds 1.0."""
    if s is None:
        return "-"
    same = not math.isnan(s.half) and s.mean - s.half <= 1.0 <= s.mean + s.half
    return fmt(s, digits) + (" (no difference)" if same else "")


def fail_cell(brackets: list) -> str:
    """The searches' lowest failing loads (x C), per seed: where each answer's bracket ends ("-": none failed)."""
    fails = [b.fail for b in brackets]
    return "-" if all(math.isinf(f) for f in fails) else ", ".join("-" if math.isinf(f) else f"{f:.3g}" for f in fails)


GRID_NOTE = ("The answer of a seed is a load the search ran, so seeds that land on the same load read ± 0; the "
             "crossing lies between it and that seed's lowest failing load (the column beside it).")


def parse_workloads(text: str) -> list[str]:
    """--past-workloads: "all", "none", or comma-separated names of WORKLOADS."""
    if text in ("all", "none"):
        return list(WORKLOADS) if text == "all" else []
    names = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        raise ValueError(f"unknown --past-workloads {bad}; choose from {', '.join(WORKLOADS)}")
    return names


def workload_setup(ctx: Ctx, name: str, n: int) -> Setup:
    """A workload of WORKLOADS as a Setup: Alpaca and the Azure traces as the datasets (steady_state.trace_for); a
    Fig. 14 ratio as fig14.io_setup builds it (synthetic lengths, --io-total and --io-spread)."""
    dataset, ratio = WORKLOADS[name]
    if ratio is not None:
        return Setup(MAIN, dataset, n, synthetic=(ctx.args.io_total, ratio, ctx.args.io_spread))
    return Setup(MAIN, dataset, n)


def workload_collapse(ctx: Ctx, runner: Runner) -> tuple[list[str], list[bool]]:
    """The tokens-per-second goal on the other workloads: skip-join against FCFS at 1.5C and 2C, C measured for each
    workload; the table's lines and, per row, whether the goal is met."""
    a = ctx.args
    names, seeds = parse_workloads(a.past_workloads), range(a.past_workload_seeds)
    lines = ["| workload | C req/s | load | FCFS output tokens/s | skip-join's | / FCFS (goal >= "
             f"{COLLAPSE_GOAL:g}) | skip-join swap-wait share |", "|---|---|---|---|---|---|---|"]
    met = []
    for name in names:
        setup = workload_setup(ctx, name, a.past_workload_prompts)
        cap = capacity(runner, setup, seeds, WORKLOAD_START.get(name))
        tokens = collapse(runner, setup, WORKLOAD_POLICIES, seeds, cap["C"])
        print(f"  past_capacity {name}: C {cap['C']:.3f} ({runner.runs} simulations so far)", flush=True)
        for load in COLLAPSE_LOADS:
            f, sj = tokens[(load, "fcfs")], tokens[(load, "skip-join-mlfq")]
            met.append(sj["vs_ref"].mean >= COLLAPSE_GOAL)
            lines.append(f"| {name} | {cap['C']:.3f} | {load:g}C | {fmt(f['tokens_per_s'], 4)} | "
                         f"{fmt(sj['tokens_per_s'], 4)} | {ratio_cell(sj['vs_ref'], 4)} "
                         f"{'met' if met[-1] else 'NOT met'} | {fmt(sj['swap_wait_share'])} |")
    return lines, met


def section_past_capacity(ctx: Ctx) -> str:
    a = ctx.args
    runner = Runner(jobs=a.steady_jobs)
    t0 = time.perf_counter()
    seeds = range(a.past_seeds)
    path = None if Path(a.sharegpt) == DATASETS["sharegpt"] else str(a.sharegpt)
    setup = Setup(MAIN, "sharegpt", a.past_prompts, dataset_path=path)
    cap = capacity(runner, setup, range(min(3, a.past_seeds)))
    c, slo = cap["C"], slo_seconds(setup)
    found = highest_loads(runner, setup, POLICIES, seeds, c, resolution=a.past_resolution)
    print(f"  past_capacity: searches done ({runner.runs} simulations so far)", flush=True)
    loads = load_stats(found, c)
    tokens = collapse(runner, setup, POLICIES, seeds, c, LOADS)
    shape = BurstShape(seconds=a.burst_seconds)
    burst = bursts(runner, setup, POLICIES, seeds, c, shape)
    workload_lines, workload_met = workload_collapse(ctx, runner)
    ceiling = Bracket().highest
    lines = ["## Past capacity by time: throughput at the SLO, goodput, tokens per second, a burst", "",
             f"Command: `{ctx.cmd('past_capacity')} --past-prompts {a.past_prompts} --past-seeds {a.past_seeds}"
             f" --past-resolution {a.past_resolution} --burst-seconds {a.burst_seconds:g} --past-workloads "
             f"{a.past_workloads} --past-workload-prompts {a.past_workload_prompts} --past-workload-seeds "
             f"{a.past_workload_seeds}` "
             "(scripts/experiments/measures.py). OPT-13B on one A100 40GB (roofline profile), ShareGPT lengths "
             f"through vLLM's length filter, the engine's defaults, {len(seeds)} seeds (mean ± 95% interval; ratios "
             f"paired per seed). C = {c:.3f} req/s, FCFS's sustained capacity (served under a {cap['offered']:.2f} "
             f"req/s offer). SLO: {SLO_DECODES} decode iterations at batch 1 = {slo:.3f} s per output token. Oracles: "
             f"{', '.join(ORACLES)}.", "",
             f"**Throughput at the SLO and goodput** at steady state ({a.past_prompts} requests a point, those "
             "arriving in the middle 80% of the trace counted, the run lasting until they finish): the highest "
             "Poisson load whose mean (or P95) per-token latency is within the SLO; goodput: the highest at which "
             f"at least {GOODPUT_SHARE:.0%} of the counted requests meet both the SLO and a TTFT <= "
             f"{GOODPUT_TTFT_S:g} s. Found per seed by bracketing (x1.5 from 1.0C) and bisection to "
             f"{a.past_resolution:.0%}, up to {ceiling:g}C. {GRID_NOTE}", "",
             "| measure | policy | load (x C) | fails at (per seed) | req/s | / FCFS | seeds at the ceiling |",
             "|---|---|---|---|---|---|---|"]
    for judge, label in MEASURES:
        for p in POLICIES:
            d = loads[(judge, p)]
            lines.append(f"| {label} | {p} | {fmt(d['load'])} | {fail_cell(found[(judge, p)])} | {fmt(d['rate'])} | "
                         f"{ratio_cell(d['vs_ref'])} | {d['capped'] or '-'} |")
    lines += ["", "**Output tokens per second** in the counted window (lo, hi: 10% and 90% of the way from the first "
              "arrival to the last): every output token of any request made at a time in [lo, hi], over hi - lo; "
              "the **upload stall**: the virtual time no step ran because requests waited for a KV upload, over the "
              "executor's time (computing, or so waiting); past capacity it reads 0, because some other job is "
              "always ready to run. The **swap-wait share** is what the picked jobs wait instead: each counted "
              "request's swap wait (engine/outputs.py swap_wait_s: the time it was picked but could not run "
              "because its KV was on the host or moving, or its room was still being freed) summed over the counted "
              "requests, over their summed end-to-end time (as the queueing share is). It is a share of the "
              "requests' latency, not of the machine's time: the waits of jobs that wait at once overlap, so "
              "their sum over the executor's time would count one second once per waiting job. Goal: skip-join's "
              f"tokens per second >= {COLLAPSE_GOAL:g}x FCFS's at 1.5C and 2C.", "",
              "| load | policy | output tokens/s | / FCFS | upload stall share | swap-wait share |",
              "|---|---|---|---|---|---|"]
    for load in LOADS:
        for p in POLICIES:
            d = tokens[(load, p)]
            goal = "" if p != "skip-join-mlfq" or load not in COLLAPSE_LOADS else (
                " met" if d["vs_ref"].mean >= COLLAPSE_GOAL else " NOT met")
            lines.append(f"| {load:g}C | {p} | {fmt(d['tokens_per_s'], 4)} | {ratio_cell(d['vs_ref'], 4)}{goal} | "
                         f"{fmt(d['upload_stall_share'])} | {fmt(d['swap_wait_share'])} |")
    if workload_lines:
        lines += ["", "**The other workloads** (the same goal): Alpaca, the Fig. 14 ratios (fig14-R: input:output "
                  f"R:1, synthetic lengths, mean total {a.io_total} tokens, each length uniform over "
                  f"[{1 - a.io_spread:g}x, "
                  f"{1 + a.io_spread:g}x] of its mean, no length filter: fig14.io_setup), and the Azure LLM inference "
                  "trace 2023's conversation and code services as whole traces (their requests kept by vLLM's length "
                  "filter, in order, n consecutive ones from kept request seed x n on, with their own lengths and "
                  "arrival gaps scaled to the point's mean rate: steady_state.trace_workload). "
                  f"{a.past_workload_prompts} requests a point, {a.past_workload_seeds} seed(s), FCFS and skip-join, C "
                  f"measured for each workload (FCFS's served rate under an offer >= 1.3x it). Goal met in "
                  f"{sum(workload_met)} of {len(workload_met)} rows.", "", *workload_lines]
    lines += ["", f"**A burst**: {shape.seconds:g} virtual seconds of Poisson arrivals at {shape.high:g}C, then "
              f"{shape.low:g}C until the queue drains (the first step after the burst that holds every request in "
              "the engine); then no more arrivals. Every request sent counts; the run is cut at "
              f"{shape.limit * shape.seconds / 60:g} minutes, a request unfinished there at its age (per token: its "
              "age over its output length). Drain time: from the burst's end to the drain. Ratios to FCFS paired "
              "per seed (goals for skip-join: mean <= 0.5x, drain <= 1.05x, none lost).", "",
              "| policy | requests | mean s/token | / FCFS | P95 s/token | P99 TTFT s | drain s | / FCFS | "
              "unfinished at the cut | lost | upload stall share | swap-wait share |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fcfs = burst["fcfs"]
    for p in POLICIES:
        b = burst[p]
        vs = [("-" if p == "fcfs" else ratio_cell(ratio_stat(b[m].values, fcfs[m].values)))
              for m in ("mean_per_token_s", "drain_s")]
        lines.append(f"| {p} | {fmt(b['requests'], 4)} | {fmt(b['mean_per_token_s'])} | {vs[0]} | "
                     f"{fmt(b['p95_per_token_s'])} | {fmt(b['p99_ttft_s'])} | {fmt(b['drain_s'])} | {vs[1]} | "
                     f"{fmt(b['unfinished'])} | {b['lost'].mean:g} | {fmt(b['upload_stall_share'])} | "
                     f"{fmt(b['swap_wait_share'])} |")
    lines += ["", f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
