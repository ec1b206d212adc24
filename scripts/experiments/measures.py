"""Measures past capacity, by time, every request counted: the part of the steady-state library (steady_state.py)
for loads at and beyond FCFS's capacity C, where a queue grows without bound and a mean over N requests depends on
N (docs/scheduling.md, "How policies are compared"). Every run goes through steady_state.Runner (its pool and its
cache); loads are in units of C (steady_state.capacity).

- Throughput at the SLO (the paper's) and goodput (DistServe's): highest_loads() finds, per policy and seed, the
  highest Poisson load whose steady-state run (run_point: requests arriving in the middle 80% of the trace
  counted, the run lasting until they finish) passes a judge of JUDGES: mean per-token latency <= the SLO
  ("slo_mean"), P95 per-token latency <= the SLO ("slo_p95"), or at least GOODPUT_SHARE of the counted requests
  meeting both per-token latency <= the SLO and TTFT <= steady_state.GOODPUT_TTFT_S ("goodput"). The SLO is
  steady_state.slo_seconds: 10 decode iterations of the profile. The search is a Bracket per (judge, policy,
  seed); load_stats() sums them up over seeds with FCFS's as the paired reference.
- Collapse: collapse() compares the output tokens per second inside the counted window at 1.5C and 2C with
  FCFS's (windowed_metrics' "window_tokens_per_s": see collapse).
- Burst: run_burst() offers BurstShape's load (10 virtual minutes at 1.5C, then 0.5C until the queue drains)
  and reports every request, the drain time and the requests lost (zero, or it raises); bursts() runs it for
  policies and seeds.
- Upload stall: run_point's and run_burst's "upload_stall_share", the virtual time steps waited for KV uploads
  over the executor's time (engine/simulation.py, SimulationResult.upload_wait_s). Past capacity it reads 0: some
  other job is always ready, so no step waits. What the picked job waits is its swap wait (engine/outputs.py
  swap_wait_s: picked, but its KV on the host or moving, or its room still being freed): "swap_wait_share", the
  requests' swap waits over their end-to-end time (run_point: the counted requests', as queueing_share; run_burst:
  every request's, an unfinished one's time counted to the cut). A share of the requests' latency, not of the
  executor's time: their sum over the executor's time would count each second once per waiting job.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engine.simulation import quantile, stall_share
from scripts.experiments.steady_state import REPO, SCALES, Runner, Setup, Stat, ratio_stat, stat, table, trace_for

GOODPUT_SHARE = 0.9  # goodput: the share of counted requests that must meet the SLO and the TTFT bound
JUDGES: dict[str, Callable[[dict], bool]] = {  # a run_point result -> whether its load passes
    "slo_mean": lambda r: r["mean_per_token_s"] <= r["slo_s"],
    "slo_p95": lambda r: r["p95_per_token_s"] <= r["slo_s"],
    "goodput": lambda r: r["slo_attainment"] >= GOODPUT_SHARE,
}
COLLAPSE_LOADS = (1.5, 2.0)
# How a section opens its table of output tokens per second past capacity (each adds how it counts them).
PAST_BY_TIME = ("**Past capacity, by time** (no steady state there: the queue grows for as long as the overload "
                "lasts, so a mean over a run depends on its length): the output tokens per second inside the counted "
                "window")


# -- the highest load that passes ---------------------------------------------------------------------------------
@dataclass
class Bracket:
    """The search for the highest load (x C) that passes a judge, on one policy and seed. From `start`, up (on a
    pass) or down (on a fail) by `factor` until a pass and a fail bracket the crossing, then geometric bisection
    until fail / pass <= 1 + resolution. It stops too when `highest` passes (capped) or `lowest` fails (floored:
    load 0). Runs at higher load are not assumed to be worse: `load` is the highest passing load below the lowest
    failing one, so a pass above a fail (noise) does not count."""

    start: float = 1.0
    factor: float = 1.5
    resolution: float = 0.05
    lowest: float = 1 / 16
    highest: float = 4.0
    passed: list[float] = field(default_factory=list)
    failed: list[float] = field(default_factory=list)

    @property
    def fail(self) -> float:
        """The lowest failing load seen (inf: none)."""
        return min(self.failed, default=math.inf)

    @property
    def load(self) -> float:
        """The answer: the highest passing load below every failing one (0.0: none)."""
        return max((x for x in self.passed if x < self.fail), default=0.0)

    @property
    def capped(self) -> bool:
        return self.fail == math.inf and self.load >= self.highest

    @property
    def floored(self) -> bool:
        return self.load == 0.0 and self.fail <= self.lowest

    def next(self) -> float | None:
        """The next load to run, or None when the search is over."""
        ok, bad = self.load, self.fail
        if not self.passed and not self.failed:
            return self.start
        if bad == math.inf:
            return None if ok >= self.highest else min(ok * self.factor, self.highest)
        if ok == 0.0:
            return None if bad <= self.lowest else max(bad / self.factor, self.lowest)
        return None if bad <= ok * (1 + self.resolution) else math.sqrt(ok * bad)

    def record(self, load: float, passed: bool) -> None:
        (self.passed if passed else self.failed).append(load)


def highest_loads(runner: Runner, setup: Setup, policies: Sequence[str], seeds: Sequence[int], cap: float,
                  judges: dict[str, Callable[[dict], bool]] = JUDGES, **bracket) -> dict[tuple[str, str], list]:
    """{(judge, policy): [each seed's Bracket, in seeds' order]}: the highest load (x cap) at which the judge
    passes. All searches advance together: each round runs the next load of every search still going in one
    runner.many call (the pool), and a load that several judges want runs once. bracket: Bracket's settings."""
    searches = {(j, p, s): Bracket(**bracket) for j in judges for p in policies for s in seeds}
    while True:
        want = {key: b.next() for key, b in searches.items()}
        want = {key: load for key, load in want.items() if load is not None}
        if not want:
            break
        points = sorted({(p, load, s) for (_, p, s), load in want.items()})
        results = dict(zip(points, runner.many([(setup, p, load * cap, s) for p, load, s in points])))
        for (j, p, s), load in want.items():
            searches[(j, p, s)].record(load, judges[j](results[(p, load, s)]))
    return {(j, p): [searches[(j, p, s)] for s in seeds] for j in judges for p in policies}


def load_stats(found: dict[tuple[str, str], list], cap: float, reference: str = "fcfs") -> dict:
    """highest_loads' answers over seeds: {(judge, policy): {"load": Stat (x C), "rate": Stat (req/s), "vs_ref":
    Stat of the paired ratio to the reference policy's load (None for the reference itself, or without it),
    "capped": seeds at the search's ceiling, "floored": seeds below its floor}}."""
    out = {}
    for (judge, policy), brackets in found.items():
        loads = [b.load for b in brackets]
        ref = found.get((judge, reference))
        out[(judge, policy)] = {
            "load": stat(loads), "rate": stat([x * cap for x in loads]),
            "vs_ref": None if ref is None or policy == reference else ratio_stat(loads, [b.load for b in ref]),
            "capped": sum(b.capped for b in brackets), "floored": sum(b.floored for b in brackets)}
    return out


# -- collapse -----------------------------------------------------------------------------------------------------
def collapse(runner: Runner, setup: Setup, policies: Sequence[str], seeds: Sequence[int], cap: float,
             loads: Sequence[float] = COLLAPSE_LOADS, reference: str = "fcfs") -> dict:
    """Output tokens per second past capacity, against FCFS's. Of one run: with [lo, hi] the counted window (lo and
    hi 10% and 90% of the way from the first arrival to the last: steady_state.window), every output token of any
    request (finished in the window or not) made at a time t with lo <= t <= hi (a request's first token at its
    first_token_time, each next one an inter-token gap later), divided by hi - lo (windowed_metrics'
    "window_tokens_per_s"). {(load, policy): {"tokens_per_s": Stat, "vs_ref": Stat of the paired ratio to the
    reference policy's (None for itself), "upload_stall_share": Stat, "swap_wait_share": Stat}}."""
    data = table(runner, setup, loads, policies, seeds, cap)
    out = {}
    for load in loads:
        ref = data.get((load, reference))
        for p in policies:
            d = data[(load, p)]
            out[(load, p)] = {
                "tokens_per_s": stat(d["window_tokens_per_s"]),
                "vs_ref": None if ref is None or p == reference else ratio_stat(d["window_tokens_per_s"],
                                                                                 ref["window_tokens_per_s"]),
                "upload_stall_share": stat(d["upload_stall_share"]), "swap_wait_share": stat(d["swap_wait_share"])}
    return out


# -- a burst ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BurstShape:
    seconds: float = 600.0  # the burst's length (virtual seconds)
    high: float = 1.5  # its Poisson load, x C
    low: float = 0.5  # the load after it, x C, until the queue has drained
    limit: float = 6.0  # the run is cut at limit x seconds (virtual); unfinished requests count at their age


def burst_trace(setup: Setup, cap: float, seed: int, shape: BurstShape) -> list[tuple[float, int, int]]:
    """Poisson arrivals from 0 at shape.high x cap until shape.seconds, then at shape.low x cap until the cut
    (shape.limit x shape.seconds), carrying the lengths of the setup's seed (trace_for's requests, in order)."""
    rng = random.Random(seed * 1_000_003 + 17)
    times, t, end = [], 0.0, shape.limit * shape.seconds
    while True:
        nxt = t + rng.expovariate((shape.high if t < shape.seconds else shape.low) * cap)
        if t < shape.seconds <= nxt:  # memoryless: the burst's end starts the slower process afresh
            t = shape.seconds
            continue
        if nxt >= end:
            break
        times.append(nxt)
        t = nxt
    lengths, _ = trace_for(replace(setup, n=len(times)), 1.0, seed)
    return [(at, p, o) for at, (_, p, o) in zip(times, lengths)]


def drive_burst(engine, trace: Sequence[tuple[float, int, int]], burst_end: float, cut_at: float) -> dict:
    """Run the engine on the trace's arrivals (sorted by time) until the queue has drained after burst_end: the
    first schedule at or after burst_end in which every request in the engine is in a step (or the engine is
    empty). No request arrives after that; the run goes on until every request sent has finished, or is cut at
    cut_at (virtual s). engine/simulation.py run_trace runs it (its stop hook ends the arrivals at the drain, its
    `until` cuts the run); this function only notices the drain. Returns {"sent", "drained_at" (None: never),
    "end", "finished": [RequestOutputs], "unfinished": [RequestOutputs, at the cut]}."""
    from engine.simulation import run_trace

    clock, drained = engine.clock, []
    inner = engine.schedule_step

    def schedule_step():
        plan = inner()
        if plan is not None and not drained and clock.now() >= burst_end:
            running = len(plan.seqs) + sum(len(p.seqs) for p, _ in engine.in_flight)
            if running >= len(engine.requests):
                drained.append(clock.now())
        return plan

    def stop(engine) -> bool:
        if not drained and clock.now() >= burst_end and not engine.requests:
            drained.append(clock.now())
        return bool(drained)

    engine.schedule_step = schedule_step
    result = run_trace(engine, trace, stop=stop, until=cut_at)
    return {"sent": result.sent, "drained_at": drained[0] if drained else None, "end": clock.now(),
            "finished": result.outputs, "unfinished": result.unfinished}


def run_burst(setup: Setup, policy: str, cap: float, seed: int, shape: BurstShape) -> dict:
    """One burst (BurstShape) at capacity `cap` req/s; a Runner's kind of run (many(points, fn=run_burst)). Every
    request sent counts: a finished one by its per-token latency (e2e / output tokens) and TTFT; one unfinished at
    the cut by its age at the end (per-token: age / its asked output length, a lower bound of its own; TTFT: its
    first token's, or its age). Drain time: from the burst's end until the queue drained (drive_burst), or until
    the cut if it never did. Lost: requests sent that neither finished by length nor were still running at the
    end; any raises RuntimeError. Swap-wait share: every request's swap wait (picked but waiting on a KV copy) over
    their time in the system (e2e, or age at the cut)."""
    from engine.simulation import simulated_engine
    from fastserve.make_model import config_only_model

    shape_name, profile = SCALES[setup.scale]
    trace = burst_trace(setup, cap, seed, shape)
    engine = simulated_engine(config_only_model(shape_name), REPO / profile, scheduling_policy=policy,
                              **dict(setup.engine))
    t = time.perf_counter()
    run = drive_burst(engine, trace, shape.seconds, shape.limit * shape.seconds)
    wall = time.perf_counter() - t
    done_ok = sum(o.outputs[0].finish_reason in ("length", "stop") for o in run["finished"])
    lost = run["sent"] - done_ok - len(run["unfinished"])
    if lost:
        raise RuntimeError(f"burst run lost {lost} of {run['sent']} requests ({policy}, seed {seed})")
    end, per_token, ttft = run["end"], [], []
    lived = sum(o.metrics.e2e_s for o in run["finished"]) + sum(end - o.metrics.arrival_time for o in run["unfinished"])
    swap_wait = sum(o.metrics.swap_wait_s for o in (*run["finished"], *run["unfinished"]))
    for o in run["finished"]:
        per_token.append(o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)))
        ttft.append(o.metrics.ttft_s)
    for o in run["unfinished"]:
        age = end - o.metrics.arrival_time
        per_token.append(age / trace[int(o.request_id)][2])
        ttft.append(age if o.metrics.first_token_time is None else o.metrics.ttft_s)
    drained_at = run["drained_at"]
    busy, upload = engine.executor.busy_s, engine.executor.upload_wait_s
    return {"policy": policy, "seed": seed, "capacity": cap, "requests": run["sent"],
            "burst_requests": sum(at < shape.seconds for at, _, _ in trace[:run["sent"]]),
            "unfinished": len(run["unfinished"]), "lost": lost, "drained": drained_at is not None,
            "drain_s": (end if drained_at is None else drained_at) - shape.seconds, "end_s": end,
            "mean_per_token_s": statistics.fmean(per_token), "p95_per_token_s": quantile(per_token, 0.95),
            "p99_ttft_s": quantile(ttft, 0.99), "mean_ttft_s": statistics.fmean(ttft), "busy_s": busy,
            "upload_stall_s": upload, "upload_stall_share": stall_share(upload, busy),
            "swap_wait_share": swap_wait / lived if lived > 0 else 0.0, "wall_s": wall}


BURST_METRICS = ("mean_per_token_s", "p95_per_token_s", "p99_ttft_s", "drain_s", "requests", "unfinished", "lost",
                 "upload_stall_share", "swap_wait_share")


def bursts(runner: Runner, setup: Setup, policies: Sequence[str], seeds: Sequence[int], cap: float,
           shape: BurstShape = BurstShape()) -> dict[str, dict[str, Stat]]:
    """{policy: {metric of BURST_METRICS: Stat over seeds}} of run_burst at capacity `cap`."""
    res = iter(runner.many([(setup, p, cap, s, shape) for p in policies for s in seeds], fn=run_burst))
    out = {}
    for p in policies:
        rows = [next(res) for _ in seeds]
        out[p] = {m: stat([r[m] for r in rows]) for m in BURST_METRICS}
    return out
