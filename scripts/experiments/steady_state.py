"""How a comparison is measured (docs/scheduling.md, "How policies are compared"): steady state,
load in units of FCFS's sustained capacity, several seeds with a 95% confidence interval, and the SRPT
oracle in the same table. Shared by the experiments' sections (this package), and a command of its own:

    python -m scripts.experiments.steady_state --scale opt-13b --loads 0.5,0.8,1.0,1.5 --seeds 5 \\
        --policies fcfs,skip-join-mlfq,srpt                   # the table of the capacity section's goals

- A point is one simulation of `n` requests (at least 3,000) of the dataset at a Poisson rate, filtered by
  vLLM's length filter. Only requests that arrive in the middle 80% of the arrival span count; the run goes
  on until every request has finished.
- The served rate of a run is the number of requests (any) that finished while arrivals were in their middle
  80%, per second of that window: under overload, what the policy sustains; below capacity, the offered rate.
- Capacity C: FCFS's served rate when offered more than it can serve (measured once per setup, here, by the
  same harness: a Poisson rate raised until it is at least 1.3x what FCFS serves).
- Seeds: a seed draws both the requests (a sample of the dataset) and their arrival times; every policy of a
  row runs the same traces, so ratios are paired per seed. Mean and a 95% interval (Student's t) over seeds.

Runs go to a pool of worker processes (--jobs, default the machine's cores); results are cached on disk by
their parameters and a hash of the simulation code (--cache, default .cache/steady/) so an interrupted
regeneration resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.simulation import quantile, stall_share  # the project's one quantile rule; copy stalls
from fastserve.bench.arrivals import speedup_for_rate
from fastserve.bench.intervals import t_975
from fastserve.bench.workload import LengthFilter, filter_line, load_workload
from scripts.experiments.common import SCALES, KVUsageTracker, phase_latencies  # SCALES: name -> (shape, profile)

REPO = Path(__file__).resolve().parents[2]

DATASETS = {"sharegpt": REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv",
            "alpaca": REPO.parent / "shared" / "datasets" / "alpaca_lengths.csv"}
# Real arrival times (Setup.arrivals): the Azure LLM inference trace 2023's conversation service.
ARRIVAL_TRACES = {"azure-conv": REPO.parent / "shared" / "datasets" / "azure_llm_trace_2023"
                  / "AzureLLMInferenceTrace_conv.csv"}
# Whole traces as a Setup's dataset (their lengths and their arrival gaps, trace_for): the Azure LLM inference trace
# 2023's conversation and code services.
TRACE_WORKLOADS = {"azure-conv": ARRIVAL_TRACES["azure-conv"],
                   "azure-code": ARRIVAL_TRACES["azure-conv"].with_name("AzureLLMInferenceTrace_code.csv")}
MIN_REQUESTS = 3000
WINDOW = (0.1, 0.9)  # the middle 80% of the arrival span
# The SLO of the measures past capacity (scripts/experiments/measures.py): per-token latency <= SLO_DECODES x a decode
# iteration (the profile's t_dec at batch 1 and a short context: slo_seconds), and for goodput also a TTFT <=
# GOODPUT_TTFT_S; windowed_metrics' "slo_attainment" is the share of counted requests that meet both.
SLO_DECODES = 10
GOODPUT_TTFT_S = 2.0
# Output-length buckets of the per-token latency split ([lo, hi) tokens): windowed_metrics' "mean_per_token_s_out<lo>"
# and "n_out<lo>".
OUTPUT_BUCKETS = ((1, 8), (8, 32), (32, 128), (128, 512), (512, 1 << 30))


@dataclass(frozen=True)
class Setup:
    """What a row of a table shares: the model/profile, the dataset, and engine settings."""

    scale: str = "opt-13b"
    dataset: str = "sharegpt"
    n: int = MIN_REQUESTS
    engine: tuple = ()  # sorted (name, value) pairs passed to simulated_engine (max_num_seqs, kv_policy, ...)
    dataset_path: str | None = None
    # Long prompts mixed in (the chunked section's workload): each request, with this probability (its own seeded draw),
    # gets a prompt of long_range tokens instead (uniform), its output cut to fit 2,048 tokens in all.
    long_share: float = 0.0
    long_range: tuple[int, int] = (1500, 2000)
    # Arrivals: a gamma process of this burstiness at the point's rate (1: Poisson; 0.25: coefficient of
    # variation 2), as the load generator's --burstiness.
    burstiness: float = 1.0
    # A mis-profiled deployment: the scheduler reads t_init x the first and t_dec x the second (quanta, skip-join's
    # entry, ENST) while the simulated machine runs at the profile's true speed.
    profiler_error: tuple[float, float] = (1.0, 1.0)
    # The proactive planner's order of jobs (memory/proactive.py offloads the idle job ranked last and uploads the
    # host job ranked first): "enst" (the scheduler's estimated next scheduled time, the paper's), "lru" (idle
    # longest: offloaded first, uploaded first) or "random" (ablations).
    planner_ranking: str = "enst"
    # Synthetic lengths instead of the dataset (Fig. 14): (mean total tokens, input:output ratio, spread), each
    # length uniform over [1 - spread, 1 + spread] x its mean (fastserve/bench/workload.py synthetic_lengths). As
    # vLLM's random dataset, no length filter: the lengths are what was asked.
    synthetic: tuple[int, float, float] | None = None
    # Arrival times: None, a gamma process (Poisson at burstiness 1); or a trace of ARRIVAL_TRACES: n consecutive
    # requests of it from request seed x n on, their times scaled to the point's mean rate (the gaps keep their
    # shape), carrying the same lengths as the gamma run of the seed.
    arrivals: str | None = None
    # Record the KV blocks in use after every step (Fig. 8): run_point adds kv_usage's fields.
    track_kv: bool = False

    def path(self) -> str:
        return self.dataset_path or str({**DATASETS, **TRACE_WORKLOADS}[self.dataset])


@dataclass
class Stat:
    mean: float
    half: float  # half-width of the 95% interval
    values: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        return fmt(self)


def stat(values: Sequence[float]) -> Stat:
    values = list(values)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Stat(mean, math.nan, values)
    return Stat(mean, t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)), values)


def fmt(s: Stat, digits: int = 3, unit: str = "") -> str:
    if math.isnan(s.half):
        return f"{s.mean:.{digits}g}{unit}"
    return f"{s.mean:.{digits}g} ± {s.half:.{2 if digits > 2 else 1}g}{unit}"


def ratio_stat(num: Sequence[float], den: Sequence[float]) -> Stat:
    """Per-seed ratios (paired: the same trace), mean and interval."""
    return stat([a / b for a, b in zip(num, den) if b > 0])


# -- one run -----------------------------------------------------------------------------------------------------
def trace_for(setup: Setup, rate: float, seed: int) -> tuple[list[tuple[float, int, int]], dict]:
    """The seed's trace, and the length filter's stats with "long": the indices of the requests whose prompt
    was replaced by a long one (setup.long_share; the draws do not depend on the rate)."""
    stats: dict = {}
    if setup.dataset in TRACE_WORKLOADS:
        items = trace_workload(setup, rate, seed, stats)
    elif setup.synthetic is None:
        items = load_workload("lengths", setup.n, path=setup.path(), rate=rate, burstiness=setup.burstiness,
                              seed=seed, length_filter=LengthFilter(), stats=stats)
    else:
        total, ratio, spread = setup.synthetic
        lengths = {"input_len": total // 2, "output_len": total - total // 2, "range_ratio": spread,
                   "io_ratio": ratio}
        items = load_workload("synthetic", setup.n, rate=rate, burstiness=setup.burstiness, seed=seed,
                              synthetic=lengths, stats=stats)
    trace = [(it.arrival_s, it.prompt_len, it.output_len) for it in items]
    if setup.arrivals is not None:
        times = trace_times(setup.arrivals, len(trace), seed, rate)
        trace = [(t, p, o) for t, (_, p, o) in zip(times, trace)]
    stats["long"] = set()
    if setup.long_share > 0:
        rng = random.Random(seed + 1000)
        for i, (arrival, _, out) in enumerate(trace):
            if rng.random() < setup.long_share:
                prompt = rng.randint(*setup.long_range)
                trace[i] = (arrival, prompt, max(1, min(out, 2048 - prompt)))
                stats["long"].add(i)
    return trace, stats


def trace_workload(setup: Setup, rate: float, seed: int, stats: dict) -> list:
    """A TRACE_WORKLOADS dataset: the trace's requests kept by vLLM's length filter, in their order; n consecutive
    ones from kept request seed x n on (wrapping around), with their lengths and their arrival times made relative
    to the first and scaled to a mean rate of `rate` req/s (the gaps between the kept requests keep their shape)."""
    kept = load_workload(setup.dataset, 10**9, path=setup.path(), length_filter=LengthFilter(), stats=stats)
    if len(kept) < setup.n:
        raise ValueError(f"{setup.dataset} keeps {len(kept)} requests, fewer than the {setup.n} asked")
    start = (seed * setup.n) % (len(kept) - setup.n + 1)
    picked = kept[start:start + setup.n]
    speedup = speedup_for_rate([it.arrival_s for it in picked], rate)
    return [replace(it, arrival_s=(it.arrival_s - picked[0].arrival_s) / speedup) for it in picked]


def trace_times(name: str, n: int, seed: int, rate: float) -> list[float]:
    """Setup.arrivals: n consecutive arrival times of the trace from request seed x n on (wrapping around), made
    relative to the first and scaled to a mean rate of `rate` req/s."""
    raw = [it.arrival_s for it in load_workload(name, 10**9, path=ARRIVAL_TRACES[name])]
    if len(raw) < n:
        raise ValueError(f"{name} has {len(raw)} requests, fewer than the {n} asked")
    start = (seed * n) % (len(raw) - n + 1)
    window = raw[start:start + n]
    return [(t - window[0]) / speedup_for_rate(window, rate) for t in window]


def window(arrivals: Sequence[float]) -> tuple[float, float]:
    """The counted window (lo, hi): the middle 80% of the arrival span."""
    first, last = min(arrivals), max(arrivals)
    return first + WINDOW[0] * (last - first), first + WINDOW[1] * (last - first)


def slo_seconds(setup: Setup) -> float:
    """The per-token SLO of a setup: SLO_DECODES x its profile's decode iteration at batch 1 and a short context (the
    skip-join ladder's q1; 0.244 s on the OPT-13B A100-40GB profile)."""
    from scheduler.cost_model import ProfiledCostModel
    from scheduler.skip_join_mlfq import SHORT_CONTEXT

    return SLO_DECODES * ProfiledCostModel.from_json(REPO / SCALES[setup.scale][1]).t_dec(1, SHORT_CONTEXT)


def windowed_metrics(outputs, arrivals: Sequence[float], long: Collection[int] = frozenset(),
                     slo: tuple[float, float] | None = None) -> dict:
    """The steady-state metrics of a finished run: requests arriving in the middle 80% of the span count. ITL:
    every gap between a counted request's successive tokens. The short requests' metrics leave out the requests
    in `long` (by request id, the trace index); with none long they are every counted request's. Queueing
    share (Fig. 1): the counted requests' time queued (waiting while not running, preempted time included) over
    their end-to-end time, as SimulationResult.summary computes it over every request; swap-wait share the same with
    their swap wait (picked, but waiting on a KV copy). slo = (per-token s, TTFT s):
    "slo_attainment" is the share of counted requests that meet both (goodput's test)."""
    lo, hi = window(arrivals)
    counted = [o for o in outputs if lo <= o.metrics.arrival_time <= hi]
    counted_e2e = sum(o.metrics.e2e_s for o in counted)
    per_token = sorted(o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)) for o in counted)
    ttft = sorted(o.metrics.ttft_s for o in counted)
    e2e = [o.metrics.e2e_s for o in outputs]  # starvation: over every request
    finished_in = sum(1 for o in outputs if lo <= o.metrics.finished_time <= hi)
    itl = [g for o in counted for g in o.metrics.itl_s]
    short = [o for o in counted if int(o.request_id) not in long]
    # Throughput: the tokens generated inside the window by every request (finished in it or not), per second. The
    # tokens of the requests that finish in the window (generated_tokens_per_s) depend on which requests a policy
    # lets finish there: past capacity a preemptive order defers the long ones past the window.
    made = 0
    for o in outputs:
        t = o.metrics.first_token_time
        if t is None:
            continue
        made += lo <= t <= hi
        for gap in o.metrics.itl_s:
            t += gap
            made += lo <= t <= hi
    by_length: dict[str, float] = {}
    for low, high in OUTPUT_BUCKETS:
        bucket = [o.metrics.e2e_s / len(o.outputs[0].token_ids) for o in counted
                  if low <= len(o.outputs[0].token_ids) < high]
        by_length[f"mean_per_token_s_out{low}"] = statistics.fmean(bucket) if bucket else math.nan
        by_length[f"n_out{low}"] = len(bucket)
    return {
        "counted": len(counted),
        "mean_per_token_s": statistics.fmean(per_token),
        "p50_per_token_s": quantile(per_token, 0.5),
        "p95_per_token_s": quantile(per_token, 0.95),
        "p99_per_token_s": quantile(per_token, 0.99),
        "mean_ttft_s": statistics.fmean(ttft),
        **phase_latencies(counted),  # Fig. 13's phases: P95 TTFT, P95 time per output token after the first
        "p99_ttft_s": quantile(ttft, 0.99),
        "mean_e2e_s": statistics.fmean(o.metrics.e2e_s for o in counted),
        "queueing_share": sum(o.metrics.queued_s for o in counted) / counted_e2e if counted_e2e else 0.0,
        # The swap wait (engine/outputs.py swap_wait_s): the time a counted request was picked but waited on a KV copy
        # (its KV on the host or moving, or its room still being freed), over their end-to-end time, as queueing_share.
        "swap_wait_share": sum(o.metrics.swap_wait_s for o in counted) / counted_e2e if counted_e2e else 0.0,
        "mean_swap_wait_s": statistics.fmean(o.metrics.swap_wait_s for o in counted),
        "max_e2e_s": max(e2e),
        "served_rate": finished_in / (hi - lo) if hi > lo else 0.0,
        "window_s": hi - lo,
        "median_itl_s": quantile(itl, 0.5),
        "p99_itl_s": quantile(itl, 0.99),
        "short_mean_per_token_s": statistics.fmean(o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids))
                                                   for o in short) if short else 0.0,
        "short_p99_ttft_s": quantile([o.metrics.ttft_s for o in short], 0.99),
        "generated_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs
                                      if lo <= o.metrics.finished_time <= hi) / (hi - lo) if hi > lo else 0.0,
        "window_tokens_per_s": made / (hi - lo) if hi > lo else 0.0,
        **by_length,
        **({} if slo is None else {"slo_attainment": sum(
            o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)) <= slo[0] and o.metrics.ttft_s <= slo[1]
            for o in counted) / len(counted)}),
    }


KV_BINS = 400  # points of kv_usage's series


def kv_usage(times: Sequence[float], device: Sequence[int], host: Sequence[int], lo: float, hi: float,
             bins: int = KV_BINS) -> dict:
    """KV blocks in use (device + host tiers) after each step (a KVUsageTracker's record), summed up for a table
    and a plot. A step's count holds until the next step (the last one's for good; none before the first).
    kv_peak_blocks and kv_mean_blocks (weighted by time): over the counted window [lo, hi];
    kv_run_peak_blocks and kv_peak_device_blocks: over the whole run; kv_series: [time, blocks] pairs, the
    highest count holding in each of `bins` equal spans of the run."""
    total = [d + h for d, h in zip(device, host)]
    if not total:
        return {"kv_peak_blocks": 0, "kv_mean_blocks": 0.0, "kv_run_peak_blocks": 0, "kv_peak_device_blocks": 0,
                "kv_series": []}
    ends = [*times[1:], max(hi, times[-1])]
    peak, area = 0, 0.0
    for t0, t1, n in zip(times, ends, total):
        a, b = max(t0, lo), min(t1, hi)
        if b >= a:  # holds during part of the window
            peak = max(peak, n)
            area += n * (b - a)
    width = times[-1] / bins if times[-1] > 0 else 1.0
    series: list[list[float]] = []
    held = 0  # the count holding as a span starts: the last step's before it
    i = 0
    for k in range(bins):
        start, end = k * width, (k + 1) * width
        top = held if i >= len(times) or times[i] > start else 0  # held into the span, unless a step starts it
        while i < len(times) and (times[i] < end or k == bins - 1):
            held = total[i]
            top = max(top, held)
            i += 1
        series.append([round(start, 3), top])
    return {"kv_peak_blocks": peak, "kv_mean_blocks": area / (hi - lo) if hi > lo else float(peak),
            "kv_run_peak_blocks": max(total), "kv_peak_device_blocks": max(device), "kv_series": series}


def run_point(setup: Setup, policy: str, rate: float, seed: int) -> dict:
    """One simulation; its windowed metrics (with the SLO's attainment at slo_seconds and GOODPUT_TTFT_S) plus KV
    counters, the upload stall (engine/simulation.py's) and the wall time (with setup.track_kv, kv_usage's fields
    too)."""
    from engine.simulation import run_trace, simulated_engine
    from fastserve.make_model import config_only_model

    shape, profile = SCALES[setup.scale]
    trace, stats = trace_for(setup, rate, seed)
    kw = dict(setup.engine)
    if setup.profiler_error == (1.0, 1.0):
        engine = simulated_engine(config_only_model(shape), REPO / profile, scheduling_policy=policy, **kw)
    else:
        engine = misprofiled_engine(config_only_model(shape), REPO / profile, setup.profiler_error, policy, kw)
    if setup.planner_ranking != "enst":
        rank_planner(engine, setup.planner_ranking)
    tracker = KVUsageTracker(engine) if setup.track_kv else None
    t = time.perf_counter()
    result = run_trace(engine, trace)
    wall = time.perf_counter() - t
    kv = engine.kv.stats
    slo = slo_seconds(setup)
    out = windowed_metrics(result.outputs, [a for a, _, _ in trace], stats["long"], (slo, GOODPUT_TTFT_S))
    out |= {"policy": policy, "rate": rate, "seed": seed, "wall_s": wall, "requests": len(trace),
            "dropped_by_filter": stats["dropped"], "dataset_items": stats["read"], "long_prompts": len(stats["long"]),
            "offloads": kv.num_offloads, "uploads": kv.num_uploads,
            "swap_misses": kv.num_swap_misses, "drops": kv.num_drops, "thrash": kv.num_thrash,
            "utilization": result.busy_s / result.duration_s if result.duration_s else 0.0, "slo_s": slo,
            "busy_s": result.busy_s, "copy_stall_s": engine.executor.copy_wait_s,
            "upload_stall_s": result.upload_wait_s, "upload_stall_share": stall_share(result.upload_wait_s,
                                                                                      result.busy_s)}
    if tracker is not None:
        out |= kv_usage(tracker.times, tracker.device, tracker.host, *window([a for a, _, _ in trace]))
    return out


def misprofiled_engine(model: Path, profile: Path, error: tuple[float, float], policy: str, kw: dict):
    """A simulated engine whose scheduler reads the profile's t_init x error[0] and t_dec x error[1] while its
    executor costs iterations by the true profile."""
    import tempfile

    from engine.simulation import simulated_engine
    from scheduler.cost_model import ProfiledCostModel

    data = json.loads(profile.read_text())
    true_cost = ProfiledCostModel.from_dict(data)
    data["prefill"]["seconds"] = [x * error[0] for x in data["prefill"]["seconds"]]
    data["decode"]["seconds"] = [[x * error[1] for x in row] for row in data["decode"]["seconds"]]
    with tempfile.TemporaryDirectory() as tmp:
        scaled = Path(tmp) / profile.name
        scaled.write_text(json.dumps(data))
        engine = simulated_engine(model, scaled, scheduling_policy=policy, **kw)
    engine.executor.cost = true_cost  # the machine runs at its true speed; only the scheduler's numbers are off
    return engine


def rank_planner(engine, kind: str, seed: int = 0) -> None:
    """Make the engine's proactive planner rank jobs by `kind` ("lru" or "random") instead of the scheduler's ENST
    (the scheduler itself is unchanged)."""
    if kind == "lru":  # the job idle longest goes first to the host and comes back first
        def rank(job, now):
            return -job.last_scheduled_time
    elif kind == "random":  # a fresh draw per job and tick
        rng = random.Random(seed)
        keys: dict[str, float] = {}

        def rank(job, now):
            return keys.setdefault(f"{job.job_id}@{engine.kv.tick}", rng.random())
    else:
        raise ValueError(f"unknown planner ranking {kind!r}")
    plan = engine.kv.plan
    engine.kv.plan = lambda batch, estimated_wait, now: plan(batch, rank, now)


# Setup fields added after results were cached: left out of the cache key at their defaults, so a setup that does
# not use them keeps its key.
_KEY_DEFAULTS = {"burstiness": 1.0, "profiler_error": (1.0, 1.0), "planner_ranking": "enst", "synthetic": None,
                 "arrivals": None, "track_kv": False}


def setup_key(setup: Setup) -> dict:
    """The setup's fields as the cache key names them, with "profile": a hash of its scale's profile file (what the
    simulated machine costs iterations by; code_version leaves profiles/sim out)."""
    key = {k: v for k, v in asdict(setup).items() if not (k in _KEY_DEFAULTS and v == _KEY_DEFAULTS[k])}
    return key | {"profile": file_hash(REPO / SCALES[setup.scale][1])}


# -- the cache and the pool ----------------------------------------------------------------------------------------
class Runner:
    """Runs points in a process pool, cached on disk by (setup, policy, rate, seed, code version). A point is
    run_point's arguments; many(points, fn) runs another kind of run instead: fn(setup, policy, rate, seed, *extra)
    -> a JSON-able dict with "wall_s", a module-level function (the workers import it), cached by its name, its
    extra arguments and its module's code too."""

    def __init__(self, jobs: int | None = None, cache: Path | None = None, version: str = "") -> None:
        self.jobs = jobs or os.cpu_count() or 1
        self.cache = cache if cache is not None else REPO / ".cache" / "steady"
        self.cache.mkdir(parents=True, exist_ok=True)
        # $FASTSERVE_STEADY_VERSION reuses results cached at an earlier commit whose simulation code is the same
        # (say so where the numbers are published); otherwise the hash of the code here.
        self.version = version or os.environ.get("FASTSERVE_STEADY_VERSION") or code_version()
        self.runs = 0
        self.wall = 0.0

    def _key(self, setup: Setup, policy: str, rate: float, seed: int, *extra, fn: Callable = run_point) -> Path:
        skey = setup_key(setup)
        if len(self.version) == 16:  # a version of 16 digits hashed all of profiles/sim: its keys name no profile
            del skey["profile"]
        key = [skey, policy, round(rate, 9), seed, self.version]
        if fn is not run_point:
            key += [fn.__name__, list(extra), file_hash(Path(inspect.getfile(fn)))]
        text = json.dumps(key, sort_keys=True, default=str)
        return self.cache / (hashlib.sha256(text.encode()).hexdigest()[:24] + ".json")

    def many(self, points: Sequence[tuple], fn: Callable = run_point) -> list[dict]:
        results: list[dict | None] = []
        todo = []
        for i, p in enumerate(points):
            path = self._key(*p, fn=fn)
            if path.is_file():
                results.append(json.loads(path.read_text()))
            else:
                results.append(None)
                todo.append(i)
        if todo:
            from fastserve.make_model import config_only_model

            for shape in {SCALES[points[i][0].scale][0] for i in todo}:  # written once, before the workers read it
                config_only_model(shape)
            with ProcessPoolExecutor(min(self.jobs, len(todo))) as pool:
                futures = {i: pool.submit(fn, *points[i]) for i in todo}
                for i, fut in futures.items():
                    res = fut.result()
                    self._key(*points[i], fn=fn).write_text(json.dumps(res))
                    results[i] = res
                    self.runs += 1
                    self.wall += res["wall_s"]
        return results  # type: ignore[return-value]


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


SIM_PACKAGES = ("scheduler", "memory", "engine")


def simulation_files(entry: Path = Path(__file__), root: Path = REPO) -> list[Path]:
    """The source files a simulation runs: `entry` and the modules of SIM_PACKAGES that importing it loads, with
    the ones its functions import (run_point's), found from the import statements rather than by importing (the
    answer does not depend on what the caller imported). The other files' imports inside functions are left out:
    in those packages they load the real executors and the offline LLM, which a simulation does not run."""
    found: set[Path] = {entry}
    todo = [entry]
    while todo:
        path = todo.pop()
        for name in _imports(path, root, in_functions=path == entry):
            parts = name.split(".")
            if parts[0] not in SIM_PACKAGES:
                continue
            for i in range(1, len(parts) + 1):  # the packages on the way, then the module
                base = root.joinpath(*parts[:i])
                for file in (base / "__init__.py", base.with_suffix(".py")):
                    if file.is_file() and file not in found:
                        found.add(file)
                        todo.append(file)
    return sorted(found)


def _imports(path: Path, root: Path, in_functions: bool) -> set[str]:
    """The dotted names `path`'s import statements name (`from a import b` names a and a.b: b may be a module); those
    under `if TYPE_CHECKING:` left out, and those in function bodies unless `in_functions`."""
    import ast

    package = path.parent.relative_to(root).parts
    names: set[str] = set()

    def visit(nodes: list) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*package[:len(package) + 1 - node.level], node.module or ""] if node.level
                                else [node.module or ""]).strip(".")
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif in_functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(list(ast.iter_child_nodes(node)))

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def code_version(entry: Path = Path(__file__), root: Path = REPO) -> str:
    """A hash of the code a simulation runs (simulation_files; the profile is in each point's key, setup_key): the
    cache key's part. 20 hex digits; the versions of 16 hashed all of scheduler/, memory/, engine/ and profiles/sim."""
    h = hashlib.sha256()
    for path in simulation_files(entry, root):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


# -- capacity ---------------------------------------------------------------------------------------------------
def capacity(runner: Runner, setup: Setup, seeds: Sequence[int] = (0,), start: float | None = None) -> dict:
    """FCFS's sustained capacity: its served rate when offered more than it serves (offered >= 1.3x served),
    averaged over seeds. Returns {"C": req/s, "offered": req/s, "per_seed": [...]}."""
    offered = start or 1.0
    while True:
        res = runner.many([(setup, "fcfs", offered, s) for s in seeds])
        served = statistics.fmean(r["served_rate"] for r in res)
        if offered >= 1.3 * served:
            return {"C": served, "offered": offered, "per_seed": [r["served_rate"] for r in res]}
        offered = max(offered * 2, 1.5 * served)


# -- a table ----------------------------------------------------------------------------------------------------
METRICS = ("mean_per_token_s", "p95_per_token_s", "p99_per_token_s", "mean_ttft_s", "p99_ttft_s", "max_e2e_s",
           "served_rate")


def table(runner: Runner, setup: Setup, loads: Sequence[float], policies: Sequence[str], seeds: Sequence[int],
          cap: float) -> dict:
    """{(load, policy): {metric: [per-seed values]}} for every load (x cap) and policy."""
    points = [(setup, p, load * cap, s) for load in loads for p in policies for s in seeds]
    res = iter(runner.many(points))
    out: dict = {}
    for load in loads:
        for p in policies:
            rows = [next(res) for _ in seeds]
            out[(load, p)] = {m: [r[m] for r in rows] for m in rows[0] if isinstance(rows[0][m], (int, float))}
    return out


def markdown(setup: Setup, cap: dict, data: dict, loads: Sequence[float], policies: Sequence[str],
             reference: str = "srpt", subjects: Sequence[str] = ("skip-join-mlfq",)) -> str:
    """A table: per load and policy, mean/P95/P99 per-token latency, P99 TTFT, max e2e and served rate, with
    each subject's paired ratios to the reference and to FCFS."""
    lines = [f"Capacity C = {cap['C']:.3f} req/s (FCFS served under a {cap['offered']:.2f} req/s offer; "
             f"seeds {', '.join(f'{c:.3f}' for c in cap['per_seed'])}).", "",
             "| load | policy | mean s/token | P95 | P99 | P99 TTFT s | max e2e s | served req/s |",
             "|---|---|---|---|---|---|---|---|"]
    for load in loads:
        for p in policies:
            d = data[(load, p)]
            lines.append(f"| {load:g}C | {p} | {fmt(stat(d['mean_per_token_s']))} | "
                         f"{fmt(stat(d['p95_per_token_s']))} | {fmt(stat(d['p99_per_token_s']))} | "
                         f"{fmt(stat(d['p99_ttft_s']))} | "
                         f"{fmt(stat(d['max_e2e_s']))} | {fmt(stat(d['served_rate']), 4)} |")
    for subject in (name for name in subjects if name in policies):
        lines += ["", f"Paired ratios of {subject} (per seed, mean ± 95% interval):", "",
                  "| load | mean / " + reference + " | P95 / " + reference + " | served / FCFS | max e2e / FCFS max |"
                  " P99 / FCFS P99 |", "|---|---|---|---|---|---|"]
        for load in loads:
            s = data[(load, subject)]
            ref = data.get((load, reference))
            f = data.get((load, "fcfs"))
            cells = [f"{load:g}C"]
            cells.append(fmt(ratio_stat(s["mean_per_token_s"], ref["mean_per_token_s"])) if ref else "-")
            cells.append(fmt(ratio_stat(s["p95_per_token_s"], ref["p95_per_token_s"])) if ref else "-")
            cells.append(fmt(ratio_stat(s["served_rate"], f["served_rate"]), 4) if f else "-")
            cells.append(fmt(ratio_stat(s["max_e2e_s"], f["max_e2e_s"])) if f else "-")
            cells.append(fmt(ratio_stat(s["p99_per_token_s"], f["p99_per_token_s"])) if f else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.experiments.steady_state", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="opt-13b", choices=sorted(SCALES))
    ap.add_argument("--dataset", default="sharegpt", choices=sorted(DATASETS))
    ap.add_argument("--dataset-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=MIN_REQUESTS)
    ap.add_argument("--loads", default="0.5,0.8,1.0,1.5,2.0")
    ap.add_argument("--policies", default="fcfs,skip-join-mlfq,srpt")
    ap.add_argument("--subject", default="skip-join-mlfq", help="policies (comma-separated) whose paired ratios "
                    "to the oracle and to FCFS are printed")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--capacity-seeds", type=int, default=3)
    ap.add_argument("--engine", action="append", default=[], help="NAME=VALUE passed to the simulated engine "
                    "(e.g. kv_policy=reactive, max_num_seqs=256); repeatable")
    ap.add_argument("--long-share", type=float, default=0.0, help="share of requests given a 1,500-2,000-token "
                    "prompt instead (the chunked section's mix)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    engine = tuple(sorted(engine_arg(a) for a in args.engine))
    setup = Setup(args.scale, args.dataset, args.num_prompts, engine, args.dataset_path, args.long_share)
    runner = Runner(args.jobs, args.cache)
    t0 = time.perf_counter()
    _, stats = trace_for(setup, 1.0, 0)
    print(filter_line(stats))
    cap = capacity(runner, setup, range(args.capacity_seeds))
    print(f"capacity C = {cap['C']:.3f} req/s", flush=True)
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    data = table(runner, setup, loads, policies, range(args.seeds), cap["C"])
    print(markdown(setup, cap, data, loads, policies, subjects=args.subject.split(",")))
    print(f"\n{runner.runs} simulations, {time.perf_counter() - t0:.0f} s wall")
    if args.json:
        args.json.write_text(json.dumps({"capacity": cap, "data": {f"{k[0]}|{k[1]}": v for k, v in data.items()}},
                                        indent=1))
    return 0


def engine_arg(text: str) -> tuple[str, object]:
    """NAME=VALUE of an --engine flag: the value as an int, a float, true/false/none, or else the string."""
    name, _, value = text.partition("=")
    for conv in (int, float):
        try:
            return name, conv(value)
        except ValueError:
            pass
    return name, {"true": True, "false": False, "none": None}.get(value.lower(), value)


if __name__ == "__main__":
    raise SystemExit(main())
