"""Past capacity, by time, every request counted (scripts/experiments/measures.py): skip-join MLFQ, FCFS and the SRPT
oracle(s) by throughput at the SLO (mean and P95 per-token latency <= 10 decode iterations), goodput (>= 90% of
requests within that and a 2 s TTFT), output tokens per second at 1.5C and 2C against FCFS's, a burst (10 minutes
at 1.5C, then 0.5C until the queue drains) and the time steps wait for KV uploads. Seeds with 95% intervals; the
searches run at steady state (--past-prompts requests a point, the middle 80% of arrivals counted).

    python -m scripts.experiments --only past_capacity --past-prompts 3000 --past-seeds 2   # a small check
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from engine.config import SCHEDULING_POLICIES
from scripts.experiments.common import MAIN, Ctx
from scripts.experiments.measures import (
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
    slo_seconds,
)

# The oracles beside the policy, by their scheduler names: "srpt" (true output lengths, the starvation bound of the
# defaults: the yardstick) and "srpt-unbounded" (without it); a name the scheduler does not know is left out.
ORACLE_NAMES = ("srpt", "srpt-unbounded")
ORACLES = tuple(name for name in ORACLE_NAMES if name in SCHEDULING_POLICIES)
POLICIES = ("fcfs", "skip-join-mlfq", *ORACLES)
LOADS = (1.0, 1.5, 2.0)  # tokens per second and the upload stall (1.0C: the searches' first load, from the cache)
MEASURES = (("slo_mean", "throughput at the SLO, mean"), ("slo_p95", "throughput at the SLO, P95"),
            ("goodput", "goodput"))


def ratio_cell(s: Stat | None, digits: int = 3) -> str:
    """A paired ratio to FCFS: "-" for FCFS itself; "no difference" when its 95% interval holds 1.0."""
    if s is None:
        return "-"
    same = not math.isnan(s.half) and s.mean - s.half <= 1.0 <= s.mean + s.half
    return fmt(s, digits) + (" (no difference)" if same else "")


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
    ceiling = Bracket().highest
    lines = ["## Past capacity by time: throughput at the SLO, goodput, tokens per second, a burst", "",
             f"Command: `{ctx.cmd('past_capacity')} --past-prompts {a.past_prompts} --past-seeds {a.past_seeds}"
             f" --past-resolution {a.past_resolution} --burst-seconds {a.burst_seconds:g}` "
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
             f"{a.past_resolution:.0%}, up to {ceiling:g}C.", "",
             "| measure | policy | load (x C) | req/s | / FCFS | seeds at the ceiling |", "|---|---|---|---|---|---|"]
    for judge, label in MEASURES:
        for p in POLICIES:
            d = loads[(judge, p)]
            lines.append(f"| {label} | {p} | {fmt(d['load'])} | {fmt(d['rate'])} | {ratio_cell(d['vs_ref'])} | "
                         f"{d['capped'] or '-'} |")
    lines += ["", "**Output tokens per second** in the counted window (lo, hi: 10% and 90% of the way from the first "
              "arrival to the last): every output token of any request made at a time in [lo, hi], over hi - lo; "
              "the **upload stall**: the virtual time no step ran because requests waited for a KV upload, over the "
              "executor's time (computing, or so waiting).", "",
              "| load | policy | output tokens/s | / FCFS | upload stall share |", "|---|---|---|---|---|"]
    for load in LOADS:
        for p in POLICIES:
            d = tokens[(load, p)]
            lines.append(f"| {load:g}C | {p} | {fmt(d['tokens_per_s'], 4)} | {ratio_cell(d['vs_ref'], 4)} | "
                         f"{fmt(d['upload_stall_share'])} |")
    lines += ["", f"**A burst**: {shape.seconds / 60:g} virtual minutes of Poisson arrivals at {shape.high:g}C, then "
              f"{shape.low:g}C until the queue drains (the first step after the burst that holds every request in "
              "the engine); then no more arrivals. Every request sent counts; the run is cut at "
              f"{shape.limit * shape.seconds / 60:g} minutes, a request unfinished there at its age (per token: its "
              "age over its output length). Drain time: from the burst's end to the drain.", "",
              "| policy | requests | mean s/token | P95 s/token | P99 TTFT s | drain s | unfinished at the cut | "
              "lost | upload stall share |", "|---|---|---|---|---|---|---|---|---|"]
    for p in POLICIES:
        b = burst[p]
        lines.append(f"| {p} | {fmt(b['requests'], 4)} | {fmt(b['mean_per_token_s'])} | "
                     f"{fmt(b['p95_per_token_s'])} | {fmt(b['p99_ttft_s'])} | {fmt(b['drain_s'])} | "
                     f"{fmt(b['unfinished'])} | {b['lost'].mean:g} | {fmt(b['upload_stall_share'])} |")
    lines += ["", f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
