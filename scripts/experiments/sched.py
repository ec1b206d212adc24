"""Sections of `make experiments` on scheduling past capacity and on the KV
ranking (registered in __init__.py; each takes its Ctx):

- enst_ablation: what ENST ranking buys the proactive planner over LRU/FIFO
  and random ranking, with the thrash count of each;
- alpha: sensitivity to the starvation threshold (steady state up to C; past C, a burst: measures.bursts);
- robustness: profiler error (t_init, t_dec off by 20%) and bursty arrivals (steady state at C; past C, output
  tokens per second: measures.collapse);
- kv_steady: proactive vs both reactive baselines and recompute at steady load below and at capacity, with the
  requests split by output length (past capacity: Fig. 15's section, by time).
Every one is measured the steady-state way (steady_state.py).
"""

from __future__ import annotations

import math
import time

from scripts.experiments.common import MAIN, Ctx
from scripts.experiments.fig15 import kv_setup
from scripts.experiments.measures import PAST_BY_TIME, BurstShape, bursts, collapse
from scripts.experiments.past_capacity import ratio_cell
from scripts.experiments.steady_state import OUTPUT_BUCKETS, Runner, Setup, capacity, fmt, ratio_stat, stat, table

# -- ENST ranking ablation ------------------------------------------------------------------------------------------
RANKINGS = ("enst", "lru", "random")
ABLATION_LOADS = (0.8, 1.0)  # x C, steady state
ABLATION_PAST = (1.5,)  # x C: past capacity, by time (output tokens per second and the upload stall: measures.collapse)


def section_enst_ablation(ctx: Ctx) -> str:
    """The proactive planner's ranking (Setup.planner_ranking), steady state, the engine's defaults."""
    runner = Runner(jobs=ctx.args.steady_jobs)
    seeds = range(ctx.args.curve_seeds)
    n = ctx.args.steady_prompts
    t0 = time.perf_counter()
    cap = capacity(runner, Setup(MAIN, "sharegpt", n), range(3))
    lines = ["## ENST ranking ablation: what the proactive planner's order buys", "",
             f"Command: `{ctx.cmd('enst_ablation')}`", "",
             f"OPT-13B on one A100 40GB (roofline profile), skip-join MLFQ with the engine's defaults, proactive KV, "
             f"ShareGPT lengths through vLLM's length filter, {n} requests a point, the middle 80% of arrivals "
             f"counted, {len(seeds)} seeds (mean ± 95% interval; ratios paired per seed), loads in units of FCFS's "
             f"capacity C = {cap['C']:.3f} req/s. The planner offloads the idle job ranked last and uploads the host "
             "job ranked first; only its ranking changes (`Setup.planner_ranking`): ENST (the paper's), LRU (idle "
             "longest: offloaded first, uploaded first) or random. The scheduler's own order and evictions are the "
             "same in every row. Thrash: offloads whose job was wanted back within 4 ticks; a swap miss: an upload "
             "started because the scheduler picked a job whose KV was on the host.", "",
             "| load | ranking | mean s/token | P95 | served req/s | mean / ENST | offloads | uploads | swap misses "
             "/ uploads | thrash |", "|---|---|---|---|---|---|---|---|---|---|"]
    for load in ABLATION_LOADS:
        enst = None
        for kind in RANKINGS:
            d = table(runner, Setup(MAIN, "sharegpt", n, planner_ranking=kind), [load], ["skip-join-mlfq"], seeds,
                      cap["C"])[(load, "skip-join-mlfq")]
            enst = enst or d
            misses = sum(d["swap_misses"]) / max(1, sum(d["uploads"]))
            lines.append(f"| {load:g}C | {kind} | {fmt(stat(d['mean_per_token_s']))} | "
                         f"{fmt(stat(d['p95_per_token_s']))} | {fmt(stat(d['served_rate']), 4)} | "
                         f"{fmt(ratio_stat(d['mean_per_token_s'], enst['mean_per_token_s']))} | "
                         f"{stat(d['offloads']).mean:.0f} | {stat(d['uploads']).mean:.0f} | {100 * misses:.1f}% | "
                         f"{stat(d['thrash']).mean:.0f} |")
            print(f"  ablation {load:g}C {kind:7} mean {stat(d['mean_per_token_s'])}", flush=True)
    lines += ["", "Offloads, uploads and thrash are per run (mean over seeds). Nearly every upload is the scheduler's "
              "own pick (the swap-miss column; new jobs start only while the started jobs' KV fits both tiers), so "
              "the planner's order decides only which idle job it offloads, and a random order's extra offloads and "
              "thrash cost no latency where each copy takes less than a step (docs/benchmarks.md, \"KV policies\").",
              "", *_ablation_past(runner, n, seeds, cap["C"]), "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)


def _ablation_past(runner: Runner, n: int, seeds: range, c: float) -> list[str]:
    """The rankings past capacity, by time: output tokens per second in the counted window against ENST's, and the
    share of the executor's time that steps waited for KV uploads (measures.collapse)."""
    lines = [PAST_BY_TIME + " "
             "(measures.collapse), paired per seed, and the upload stall: the share of the executor's time that no "
             "step ran because a request waited for a KV upload (0 where another job was always ready to run "
             "while an upload was in flight).", "",
             "| load | ranking | output tokens/s | / ENST | upload stall share |", "|---|---|---|---|---|"]
    for load in ABLATION_PAST:
        enst = None
        for kind in RANKINGS:
            d = collapse(runner, Setup(MAIN, "sharegpt", n, planner_ranking=kind), ["skip-join-mlfq"], seeds, c,
                         (load,))[(load, "skip-join-mlfq")]
            enst = enst or d
            vs = None if kind == RANKINGS[0] else ratio_stat(d["tokens_per_s"].values, enst["tokens_per_s"].values)
            lines.append(f"| {load:g}C | {kind} | {fmt(d['tokens_per_s'], 4)} | {ratio_cell(vs, 4)} | "
                         f"{fmt(d['upload_stall_share'])} |")
    return lines


ALPHAS = (None, 0.1, 0.3, 1.0, 3.0)  # None: the default (no alpha; age promotion bounds waits)
ALPHA_LOADS = (0.8, 1.0)  # x C, steady state; past C, a burst (measures.BurstShape: 1.5C, then 0.5C until drained)


def section_alpha(ctx: Ctx) -> str:
    """Skip-join with alpha set (the paper's promotion, on top of the defaults) against the default, steady state
    (scripts/experiments/steady_state.py; the runs at alpha None are Fig. 12's)."""
    runner = Runner(jobs=ctx.args.steady_jobs)
    seeds = range(ctx.args.curve_seeds)
    t0 = time.perf_counter()
    cap = capacity(runner, Setup(MAIN, "sharegpt", ctx.args.steady_prompts), range(3))
    lines = ["## Sensitivity to alpha (the starvation threshold)", "",
             f"Command: `{ctx.cmd('alpha')} --burst-seconds {ctx.args.burst_seconds:g}`", "",
             f"OPT-13B on one A100 40GB (roofline profile), skip-join MLFQ with the engine's defaults but alpha, "
             f"proactive KV, ShareGPT lengths through vLLM's length filter, {ctx.args.steady_prompts} requests a "
             f"point, the middle 80% of arrivals counted, {len(seeds)} seeds (mean ± 95% interval), loads in units "
             f"of FCFS's capacity C = {cap['C']:.3f} req/s. Alpha (`--starvation-threshold`) is off by default: "
             "age promotion (`--starvation-age 3`) bounds waits instead; with alpha set, a waiting job is "
             "promoted after max(alpha, W), W the recent mean wait to a first run (`--starvation-factor 1`).", "",
             "| load | alpha s | mean s/token | P95 | P99 | max e2e s | mean / default | P95 / default |",
             "|---|---|---|---|---|---|---|---|"]
    for load in ALPHA_LOADS:
        base = None
        for alpha in ALPHAS:
            setup = Setup(MAIN, "sharegpt", ctx.args.steady_prompts,
                          () if alpha is None else (("starvation_threshold", alpha),))
            d = table(runner, setup, [load], ["skip-join-mlfq"], seeds, cap["C"])[(load, "skip-join-mlfq")]
            base = base or d
            vs = [fmt(ratio_stat(d[m], base[m])) for m in ("mean_per_token_s", "p95_per_token_s")]
            lines.append(f"| {load:g}C | {'none (default)' if alpha is None else alpha} | "
                         f"{fmt(stat(d['mean_per_token_s']))} | {fmt(stat(d['p95_per_token_s']))} | "
                         f"{fmt(stat(d['p99_per_token_s']))} | {fmt(stat(d['max_e2e_s']))} | " + " | ".join(vs) + " |")
            print(f"  alpha {load:g}C {alpha}: mean {stat(d['mean_per_token_s'])}", flush=True)
    shape = BurstShape(seconds=ctx.args.burst_seconds)
    lines += ["", f"**Past capacity, a burst** (no steady state there: the queue grows for as long as the overload "
              f"lasts, so a mean over a run depends on its length): {shape.seconds:g} virtual seconds of Poisson "
              f"arrivals at {shape.high:g}C, then {shape.low:g}C until the queue drains, every request counted, the "
              f"run cut at {shape.limit * shape.seconds / 60:g} minutes (a request unfinished there at its age; "
              "measures.run_burst, as the past_capacity section's burst). Drain time: from the burst's end to the "
              "drain.", "",
              "| alpha s | requests | mean s/token | P95 s/token | P99 TTFT s | drain s | unfinished at the cut | "
              "mean / default | P95 / default |", "|---|---|---|---|---|---|---|---|---|"]
    base = None
    for alpha in ALPHAS:
        setup = Setup(MAIN, "sharegpt", ctx.args.steady_prompts,
                      () if alpha is None else (("starvation_threshold", alpha),))
        b = bursts(runner, setup, ["skip-join-mlfq"], seeds, cap["C"], shape)["skip-join-mlfq"]
        base = base or b
        vs = [fmt(ratio_stat(b[m].values, base[m].values)) for m in ("mean_per_token_s", "p95_per_token_s")]
        lines.append(f"| {'none (default)' if alpha is None else alpha} | {fmt(b['requests'], 4)} | "
                     f"{fmt(b['mean_per_token_s'])} | {fmt(b['p95_per_token_s'])} | {fmt(b['p99_ttft_s'])} | "
                     f"{fmt(b['drain_s'])} | {fmt(b['unfinished'])} | " + " | ".join(vs) + " |")
        print(f"  alpha burst {alpha}: mean {b['mean_per_token_s']}", flush=True)
    lines += ["", f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)


# -- what the paper did not test: profiler error, bursty arrivals ----------------------------------------------------
PROFILER_ERRORS = ((1.0, 1.0), (0.8, 0.8), (1.2, 1.2), (0.8, 1.2), (1.2, 0.8))  # (t_init, t_dec) as the scheduler reads
BURSTINESS = (1.0, 0.5, 0.25)  # gamma arrivals: coefficient of variation 1, 1.4, 2
ROBUSTNESS_LOADS = (1.0,)  # x C, steady state (below capacity no case differs)
ROBUSTNESS_PAST = (1.5,)  # x C: past capacity, by time (output tokens per second, measures.collapse)


def section_robustness(ctx: Ctx) -> str:
    """Profiler error and bursty arrivals, steady state (scripts/experiments/steady_state.py: Setup.profiler_error and
    Setup.burstiness), in units of FCFS's capacity under Poisson arrivals."""
    runner = Runner(jobs=ctx.args.steady_jobs)
    seeds = range(ctx.args.curve_seeds)
    n = ctx.args.steady_prompts
    t0 = time.perf_counter()
    cap = capacity(runner, Setup(MAIN, "sharegpt", n), range(3))
    c = cap["C"]
    lines = ["## What the paper did not test: profiler error and bursty arrivals", "",
             f"Command: `{ctx.cmd('robustness')}`", "",
             f"OPT-13B on one A100 40GB (roofline profile), the engine's defaults, proactive KV, ShareGPT lengths "
             f"through vLLM's length filter, {n} requests a point, the middle 80% of arrivals counted, {len(seeds)} "
             f"seeds (mean ± 95% interval; ratios paired per seed), loads in units of FCFS's capacity under Poisson "
             f"arrivals, C = {c:.3f} req/s. **Profiler error**: the scheduler reads t_init and t_dec (its quanta, "
             "skip-join's entry, ENST) off by the factors shown while the simulated machine runs at the profile's "
             "true speed (`Setup.profiler_error`). **Bursty arrivals**: gamma arrivals of burstiness 0.5 and 0.25 "
             "(coefficient of variation 1.4 and 2) at the same mean rate as Poisson (burstiness 1), FCFS beside "
             "skip-join (`Setup.burstiness`).", "",
             "| load | t_init x | t_dec x | mean s/token | P95 | served req/s | mean / exact profile | "
             "P95 / exact profile |", "|---|---|---|---|---|---|---|---|"]
    for load in ROBUSTNESS_LOADS:
        exact = None
        for err in PROFILER_ERRORS:
            d = table(runner, Setup(MAIN, "sharegpt", n, profiler_error=err), [load], ["skip-join-mlfq"], seeds,
                      c)[(load, "skip-join-mlfq")]
            exact = exact or d
            lines.append(f"| {load:g}C | {err[0]:g} | {err[1]:g} | {fmt(stat(d['mean_per_token_s']))} | "
                         f"{fmt(stat(d['p95_per_token_s']))} | {fmt(stat(d['served_rate']), 4)} | "
                         f"{fmt(ratio_stat(d['mean_per_token_s'], exact['mean_per_token_s']))} | "
                         f"{fmt(ratio_stat(d['p95_per_token_s'], exact['p95_per_token_s']))} |")
            print(f"  profiler {load:g}C {err}: mean {stat(d['mean_per_token_s'])}", flush=True)
    lines += ["", "| load | burstiness | FCFS mean s/token | skip-join | skip-join / FCFS mean | FCFS P95 | skip-join "
              "P95 | skip-join / FCFS P95 | served skip-join / FCFS |", "|---|---|---|---|---|---|---|---|---|"]
    for load in ROBUSTNESS_LOADS:
        for burst in BURSTINESS:
            data = table(runner, Setup(MAIN, "sharegpt", n, burstiness=burst), [load], ["fcfs", "skip-join-mlfq"],
                         seeds, c)
            f, sj = data[(load, "fcfs")], data[(load, "skip-join-mlfq")]
            lines.append(f"| {load:g}C | {burst:g} | {fmt(stat(f['mean_per_token_s']))} | "
                         f"{fmt(stat(sj['mean_per_token_s']))} | "
                         f"{fmt(ratio_stat(sj['mean_per_token_s'], f['mean_per_token_s']))} | "
                         f"{fmt(stat(f['p95_per_token_s']))} | {fmt(stat(sj['p95_per_token_s']))} | "
                         f"{fmt(ratio_stat(sj['p95_per_token_s'], f['p95_per_token_s']))} | "
                         f"{fmt(ratio_stat(sj['served_rate'], f['served_rate']), 4)} |")
            print(f"  burst {load:g}C {burst}: fcfs {stat(f['mean_per_token_s'])} skip-join "
                  f"{stat(sj['mean_per_token_s'])}", flush=True)
    lines += ["", *_robustness_past(runner, n, seeds, c), "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)


def _robustness_past(runner: Runner, n: int, seeds: range, c: float) -> list[str]:
    """The robustness cases past capacity, by time: output tokens per second in the counted window
    (measures.collapse), each profiler error against the exact profile and skip-join against FCFS per burstiness."""
    lines = [PAST_BY_TIME + " "
             "(every output token of any request made in it, over its length: measures.collapse), paired per seed.",
             "", "| load | t_init x | t_dec x | skip-join output tokens/s | / exact profile |", "|---|---|---|---|---|"]
    for load in ROBUSTNESS_PAST:
        exact = None
        for err in PROFILER_ERRORS:
            d = collapse(runner, Setup(MAIN, "sharegpt", n, profiler_error=err), ["skip-join-mlfq"], seeds, c,
                         (load,))[(load, "skip-join-mlfq")]["tokens_per_s"]
            exact = exact or d
            vs = None if err == PROFILER_ERRORS[0] else ratio_stat(d.values, exact.values)
            lines.append(f"| {load:g}C | {err[0]:g} | {err[1]:g} | {fmt(d, 4)} | {ratio_cell(vs, 4)} |")
    lines += ["", "| load | burstiness | FCFS output tokens/s | skip-join | skip-join / FCFS |",
              "|---|---|---|---|---|"]
    for load in ROBUSTNESS_PAST:
        for burst in BURSTINESS:
            t = collapse(runner, Setup(MAIN, "sharegpt", n, burstiness=burst), ["fcfs", "skip-join-mlfq"], seeds, c,
                         (load,))
            f, sj = t[(load, "fcfs")], t[(load, "skip-join-mlfq")]
            lines.append(f"| {load:g}C | {burst:g} | {fmt(f['tokens_per_s'], 4)} | {fmt(sj['tokens_per_s'], 4)} | "
                         f"{ratio_cell(sj['vs_ref'], 4)} |")
    return lines


KV_LOADS = (0.8, 1.0)  # x C, steady state (past capacity: Fig. 15's tokens per second, by time)
KV_POLICIES = ("proactive", "reactive", "reactive-blocking", "recompute")


def section_kv_steady(ctx: Ctx) -> str:
    """Skip-join MLFQ under each KV policy at 0.8x and 1x of FCFS's capacity, steady state (Fig. 15's points,
    so its cached runs), the per-token latency split by output length (steady_state.OUTPUT_BUCKETS)."""
    runner = Runner(jobs=ctx.args.steady_jobs)
    seeds = range(ctx.args.curve_seeds)
    n = ctx.args.steady_prompts
    t0 = time.perf_counter()
    cap = capacity(runner, kv_setup(n, "proactive"), range(3))
    data = {kv: table(runner, kv_setup(n, kv), KV_LOADS, ("skip-join-mlfq",), seeds, cap["C"]) for kv in KV_POLICIES}
    # Buckets no counted request falls in (vLLM's filter keeps outputs of 4+ tokens: 1-7 may hold none) are left out.
    buckets = [(lo, hi) for lo, hi in OUTPUT_BUCKETS
               if any(sum(rows[(load, "skip-join-mlfq")][f"n_out{lo}"]) for rows in data.values() for load in KV_LOADS)]
    heads = [f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+" for lo, hi in buckets]
    lines = ["## KV policies at steady load: where proactive and reactive differ", "",
             f"Command: `{ctx.cmd('kv_steady')}`", "",
             f"Fig. 15's runs split by output length: OPT-13B on one A100 40GB (roofline profile), skip-join MLFQ with "
             f"the engine's defaults under each KV policy, ShareGPT lengths through vLLM's length filter, {n} "
             f"requests a point, the middle 80% of arrivals counted, {len(seeds)} seeds (mean ± 95% interval), loads "
             f"in units of FCFS's capacity C = {cap['C']:.3f} req/s. Mean per-token latency (s) of the counted "
             "requests whose output length (tokens) falls in each column; the request count per seed in "
             "brackets.", "",
             "| load | kv policy | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for load in KV_LOADS:
        for kv in KV_POLICIES:
            d = data[kv][(load, "skip-join-mlfq")]
            cells = [f"{fmt(stat(_present(d[f'mean_per_token_s_out{lo}'])))} ({stat(d[f'n_out{lo}']).mean:.0f})"
                     for lo, _ in buckets]
            lines.append(f"| {load:g}C | {kv} | " + " | ".join(cells) + " |")
    lines += ["", "Each baseline over proactive, per bucket (paired per seed; above 1: proactive is better):", "",
              "| load | baseline | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for load in KV_LOADS:
        pro = data["proactive"][(load, "skip-join-mlfq")]
        for kv in KV_POLICIES[1:]:
            d = data[kv][(load, "skip-join-mlfq")]
            cells = [fmt(stat(_present([a / b for a, b in zip(d[f"mean_per_token_s_out{lo}"],
                                                              pro[f"mean_per_token_s_out{lo}"])])))
                     for lo, _ in buckets]
            lines.append(f"| {load:g}C | {kv} | " + " | ".join(cells) + " |")
    lines += ["", "Past capacity the KV policies are compared by time (output tokens per second and the upload stall) "
              "in Fig. 15's section.", "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)


def _present(values: list[float]) -> list[float]:
    """The seeds' values less the NaN of a seed with no request in the bucket (vLLM's filter keeps outputs of 4+
    tokens, so the shortest bucket can be empty)."""
    return [v for v in values if v == v] or [math.nan]
