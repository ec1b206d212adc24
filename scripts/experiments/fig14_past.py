"""Fig. 14's input:output ratios measured by time (measures.py): DistServe's goodput at steady state and a burst
past capacity, every policy of Fig. 14 (the four baselines, the learned order, skip-join's alike-lengths mode, the
SRPT oracle), plus the Azure 2023 conversation trace as a check on the opt-in orders (a mode that helps the ratios
must not hurt it). The goal: the default (skip-join MLFQ) within 10% of the best baseline in every row, on both.

    python -m scripts.experiments --only fig14_past --past-workload-prompts 3000 --past-workload-seeds 2 \
        --fig14-past-seeds 2

A row's Setup and C are past_capacity's (workload_setup; capacity from WORKLOAD_START over --past-workload-seeds
seeds), so the runner's cache serves one section the other's capacity runs; --fig14-past-seeds seeds are measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from scripts.experiments.common import POLICIES, Ctx
from scripts.experiments.fig14 import ALIKE, IO_RATIOS, LEARNED, ORACLE
from scripts.experiments.measures import GOODPUT_SHARE, JUDGES, Bracket, BurstShape, bursts, highest_loads
from scripts.experiments.past_capacity import GRID_NOTE, WORKLOAD_START, fail_cell, workload_setup
from scripts.experiments.steady_state import GOODPUT_TTFT_S, Runner, Stat, capacity, fmt, ratio_stat, stat

GOAL = 0.10  # the default within 10% of the best baseline: goodput >= 0.9x its, burst mean <= 1.1x its
SUBJECT = "skip-join-mlfq"
ROWS = (*(f"fig14-{r:g}" for r in IO_RATIOS), "azure-conv")
ALL = (*POLICIES, LEARNED, ALIKE, ORACLE)
GOODPUT = {"goodput": JUDGES["goodput"]}


def measure_row(ctx: Ctx, runner: Runner, name: str) -> dict:
    """One workload: C, each policy's goodput searches ({policy: [Bracket per seed]}) and burst ({policy: {metric:
    Stat}}); the alike-lengths mode is skip-join on the same Setup with the mode's engine flag."""
    a = ctx.args
    seeds = range(a.fig14_past_seeds)
    setup = workload_setup(ctx, name, a.past_workload_prompts)
    alike = replace(setup, engine=(("adapt_to_alike_lengths", True),))
    cap = capacity(runner, setup, range(a.past_workload_seeds), WORKLOAD_START.get(name))
    c, res = cap["C"], a.past_resolution
    plain = (*POLICIES, LEARNED, ORACLE)
    found = {p: v for (_, p), v in highest_loads(runner, setup, plain, seeds, c, GOODPUT, resolution=res).items()}
    found[ALIKE] = highest_loads(runner, alike, (SUBJECT,), seeds, c, GOODPUT, resolution=res)[("goodput", SUBJECT)]
    shape = BurstShape(seconds=a.burst_seconds)
    burst = bursts(runner, setup, plain, seeds, c, shape)
    burst[ALIKE] = bursts(runner, alike, (SUBJECT,), seeds, c, shape)[SUBJECT]
    print(f"  fig14_past {name}: C {c:.3f} ({runner.runs} simulations so far)", flush=True)
    return {"C": c, "found": found, "burst": burst}


def best_of(values: dict[str, list[float]], higher: bool) -> str:
    """The best baseline (POLICIES) by its mean over seeds."""
    return (max if higher else min)(POLICIES, key=lambda p: statistics.fmean(values[p]))


def versus(values: dict[str, list[float]], best: str, higher: bool) -> dict[str, Stat]:
    """Each policy against the best baseline, paired per seed, as a ratio that reads <= 1 + GOAL when within it:
    best / policy for goodput (higher is better), policy / best for latency."""
    return {p: ratio_stat(values[best], v) if higher else ratio_stat(v, values[best]) for p, v in values.items()}


def judged(row: dict[str, Stat], subject: str) -> str:
    s = row[subject]
    return f"{fmt(s)} {'within' if s.mean <= 1 + GOAL else 'NOT within'}"


def section_fig14_past(ctx: Ctx) -> str:
    a = ctx.args
    runner = Runner(jobs=a.steady_jobs)
    t0 = time.perf_counter()
    rows = {name: measure_row(ctx, runner, name) for name in ROWS}
    mode_names = (SUBJECT, LEARNED, ALIKE)
    lines = ["## Fig. 14 by time: goodput and a burst over input:output ratios", "",
             f"Command: `{ctx.cmd('fig14_past')} --past-workload-prompts {a.past_workload_prompts} "
             f"--past-workload-seeds {a.past_workload_seeds} --fig14-past-seeds {a.fig14_past_seeds} "
             f"--past-resolution {a.past_resolution} --burst-seconds "
             f"{a.burst_seconds:g}` (scripts/experiments/fig14_past.py, measures.py). OPT-13B on one A100 40GB "
             "(roofline profile), the engine's defaults; the rows are past_capacity's fig14-R workloads (input:output "
             f"R:1, synthetic lengths, mean total {a.io_total} tokens, each length uniform over "
             f"[{1 - a.io_spread:g}x, {1 + a.io_spread:g}x] of its mean) and the Azure 2023 conversation trace "
             "(its lengths and arrival gaps), C measured for each (FCFS's served rate under an offer >= 1.3x it, "
             f"{a.past_workload_seeds} seeds). {a.fig14_past_seeds} seed(s) measured (mean ± 95% interval where "
             "there are two or more; ratios paired per seed). Policies: the four "
             f"baselines ({', '.join(POLICIES)}), the learned order (`{LEARNED}`), skip-join's alike-lengths mode "
             f"(`{ALIKE}`, `--adapt-to-alike-lengths`), both opt-in and learning with running jobs censored, and the "
             f"bounded SRPT oracle (`{ORACLE}`) for reference. Goal: the default (skip-join MLFQ) within "
             f"{GOAL:.0%} of the best baseline in every row, on both measures.", "",
             f"**Goodput** (DistServe's, at steady state: {a.past_workload_prompts} requests a point, those arriving "
             "in the middle 80% of the trace counted, the run lasting until they finish): the highest Poisson load "
             f"(x C) at which at least {GOODPUT_SHARE:.0%} of the counted requests meet both a per-token latency "
             f"within the SLO (10 decode iterations at batch 1) and a TTFT <= {GOODPUT_TTFT_S:g} s; found per seed "
             f"by bracketing (x1.5 from 1.0C) and bisection to {a.past_resolution:.0%}, up to {Bracket().highest:g}C. "
             f"{GRID_NOTE} The last columns: the best baseline's goodput over each one's (<= {1 + GOAL:g}: within "
             "the goal).", "",
             "| workload | C req/s | " + " | ".join(ALL) + " | best baseline | skip-join | gittins | alike mode | "
             "skip-join fails at (per seed) |", "|---|---|" + "---|" * len(ALL) + "---|---|---|---|---|"]
    verdicts = {"goodput": {}, "burst": {}}
    for name, r in rows.items():
        loads = {p: [b.load for b in r["found"][p]] for p in ALL}
        best = best_of(loads, higher=True)
        vs = versus(loads, best, higher=True)
        verdicts["goodput"][name] = {p: vs[p] for p in mode_names}
        lines.append(f"| {name} | {r['C']:.3f} | " + " | ".join(fmt(stat(loads[p])) for p in ALL)
                     + f" | {best} | {judged(vs, SUBJECT)} | {fmt(vs[LEARNED])} | {fmt(vs[ALIKE])} | "
                     f"{fail_cell(r['found'][SUBJECT])} |")
    shape = BurstShape(seconds=a.burst_seconds)
    lines += ["", f"**A burst** (measures.py run_burst, as past_capacity's): {shape.seconds:g} virtual seconds of "
              f"Poisson arrivals at {shape.high:g}C, then {shape.low:g}C until the queue drains; every request sent "
              f"counts, one unfinished at the cut ({shape.limit * shape.seconds / 60:g} minutes) at its age. Mean "
              "per-token latency, s; the last columns: each one's over the best baseline's (<= "
              f"{1 + GOAL:g}: within the goal), skip-join's drain time over FCFS's, and the requests lost over all "
              "policies and seeds.", "",
              "| workload | " + " | ".join(ALL) + " | best baseline | skip-join | gittins | alike mode | "
              "skip-join drain / FCFS | lost |", "|---|" + "---|" * len(ALL) + "---|---|---|---|---|---|"]
    for name, r in rows.items():
        b = r["burst"]
        means = {p: b[p]["mean_per_token_s"].values for p in ALL}
        best = best_of(means, higher=False)
        vs = versus(means, best, higher=False)
        verdicts["burst"][name] = {p: vs[p] for p in mode_names}
        drain = ratio_stat(b[SUBJECT]["drain_s"].values, b["fcfs"]["drain_s"].values)
        lost = sum(sum(b[p]["lost"].values) for p in ALL)
        lines.append(f"| {name} | " + " | ".join(fmt(b[p]["mean_per_token_s"]) for p in ALL)
                     + f" | {best} | {judged(vs, SUBJECT)} | {fmt(vs[LEARNED])} | {fmt(vs[ALIKE])} | {fmt(drain)} | "
                     f"{lost:g} |")
    lines += ["", "Within the goal (rows of " + str(len(ROWS)) + "; azure-conv included):"]
    for measure, per_row in verdicts.items():
        counts = {p: sum(v[p].mean <= 1 + GOAL for v in per_row.values()) for p in mode_names}
        lines.append(f"- {measure}: " + ", ".join(f"{p} {n}" for p, n in counts.items()) + " (missed by skip-join: "
                     + (", ".join(f"{n} {v[SUBJECT].mean:.3f}x" for n, v in per_row.items()
                                  if v[SUBJECT].mean > 1 + GOAL) or "none") + ").")
    lines += ["", f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
