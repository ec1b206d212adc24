"""Chunked prefill, measured the way every comparison is (steady_state.py): OPT-13B on the A100
40GB profile, ShareGPT lengths with 10% of the requests given a prompt of 1,500-2,000 tokens instead, at 0.8x of
FCFS's sustained capacity on that mix (FCFS unchunked), steady state, 3,000 requests a point, 5 seeds with 95%
intervals. Two tables: the token budget (--max-num-batched-tokens) against P99 / median ITL, the short requests'
latency and the served rate at 0.8C, skip-join MLFQ; and its goals at --chunked-budget: skip-join chunked
against skip-join unchunked and FCFS chunked (P99 / median ITL, the short requests' mean per-token latency and P99
TTFT). (Throughput at saturation is not in it; docs/benchmarks.md, "Chunked prefill", has measurements of it.)

Every point names enable_chunked_prefill (and the budget) explicitly, so the section measures the same thing
whatever the engine's defaults are.
"""

from __future__ import annotations

import time

from scripts.experiments.common import Ctx
from scripts.experiments.steady_state import Runner, Setup, capacity, fmt, ratio_stat, stat, table

LONG_SHARE = 0.1
LOAD = 0.8
BUDGETS = (256, 512, 1024, 2048)


def mix_setup(prompts: int, budget: int | None) -> Setup:
    """The section's mix; budget None: chunked prefill off."""
    engine = (("enable_chunked_prefill", False),) if budget is None else (
        ("enable_chunked_prefill", True), ("max_num_batched_tokens", budget))
    return Setup("opt-13b", "sharegpt", prompts, engine, long_share=LONG_SHARE)


def _name(budget: int | None) -> str:
    return "unchunked" if budget is None else f"chunked {budget}"


def section_chunked(ctx: Ctx) -> str:
    seeds = range(ctx.args.steady_seeds)
    chosen = ctx.args.chunked_budget
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    n = ctx.args.steady_prompts
    cap = capacity(runner, mix_setup(n, None), range(3))
    c = cap["C"]
    configs = (None, *BUDGETS)
    at_load = {b: table(runner, mix_setup(n, b), (LOAD,), ("skip-join-mlfq",), seeds, c)[(LOAD, "skip-join-mlfq")]
               for b in configs}
    fcfs = table(runner, mix_setup(n, chosen), (LOAD,), ("fcfs",), seeds, c)[(LOAD, "fcfs")]
    lines = ["## Chunked prefill: long prompts among short ones", "",
             f"`{ctx.cmd('chunked')}` (scripts/experiments/steady_state.py's method; {n} requests a point, the "
             f"middle 80% of arrivals counted, mean ± 95% interval over seeds). OPT-13B, A100 40GB roofline profile, "
             f"ShareGPT lengths through vLLM's length filter, then each request with probability {LONG_SHARE:g} (its "
             "own seeded draw) given a prompt of 1,500-2,000 tokens (uniform), its output cut to fit 2,048 tokens. "
             f"C = {c:.3f} req/s: FCFS unchunked's served rate on this mix (offered {cap['offered']:.2f} req/s; "
             f"seeds {', '.join(f'{x:.3f}' for x in cap['per_seed'])}). ITL: every gap between a counted "
             "request's successive tokens; the short requests are those whose prompt was not replaced.", "",
             f"**Budget** (skip-join MLFQ at {LOAD:g}C, {len(seeds)} seeds; the served rate is what finished "
             "while arrivals were in the window, per second; its paired ratio to unchunked's):", "",
             "| budget | P99 ITL s | median ITL s | P99 / median | short mean s/token | short P99 TTFT s | served "
             "req/s | served / unchunked |", "|---|---|---|---|---|---|---|---|"]
    for b in configs:
        d = at_load[b]
        lines.append(f"| {_name(b)} | {fmt(stat(d['p99_itl_s']))} | {fmt(stat(d['median_itl_s']))} | "
                     f"{fmt(ratio_stat(d['p99_itl_s'], d['median_itl_s']))} | "
                     f"{fmt(stat(d['short_mean_per_token_s']))} | {fmt(stat(d['short_p99_ttft_s']))} | "
                     f"{fmt(stat(d['served_rate']), 4)} | "
                     f"{fmt(ratio_stat(d['served_rate'], at_load[None]['served_rate']), 4)} |")
    sj, sj0, fc = at_load[chosen], at_load[None], fcfs
    lines += ["", f"**Goals at budget {chosen}** ({LOAD:g}C, {len(seeds)} seeds):", "",
              "| policy | chunked | P99 ITL s | median ITL s | P99 / median | short mean s/token | short P99 TTFT s | "
              "served req/s |", "|---|---|---|---|---|---|---|---|"]
    for policy, label, d in (("skip-join-mlfq", "no", sj0), ("skip-join-mlfq", str(chosen), sj),
                             ("fcfs", str(chosen), fc)):
        lines.append(f"| {policy} | {label} | {fmt(stat(d['p99_itl_s']))} | {fmt(stat(d['median_itl_s']))} | "
                     f"{fmt(ratio_stat(d['p99_itl_s'], d['median_itl_s']))} | "
                     f"{fmt(stat(d['short_mean_per_token_s']))} | {fmt(stat(d['short_p99_ttft_s']))} | "
                     f"{fmt(stat(d['served_rate']), 4)} |")
    spread = ratio_stat(sj["p99_itl_s"], sj["median_itl_s"])
    goals = [("P99 ITL <= 2x median ITL (skip-join chunked)", spread, 2.0),
             ("short mean s/token, chunked skip-join / unchunked skip-join",
              ratio_stat(sj["short_mean_per_token_s"], sj0["short_mean_per_token_s"]), 1.0),
             ("short mean s/token, chunked skip-join / chunked FCFS",
              ratio_stat(sj["short_mean_per_token_s"], fc["short_mean_per_token_s"]), 1.0),
             ("short P99 TTFT, chunked skip-join / unchunked skip-join",
              ratio_stat(sj["short_p99_ttft_s"], sj0["short_p99_ttft_s"]), 1.0),
             ("short P99 TTFT, chunked skip-join / chunked FCFS",
              ratio_stat(sj["short_p99_ttft_s"], fc["short_p99_ttft_s"]), 1.0)]
    lines += ["", "| goal | paired ratio | limit | verdict |", "|---|---|---|---|"]
    for text, st, limit in goals:
        verdict = "met" if st.mean + (st.half if st.half == st.half else 0) < limit else (
            "met on the mean, not the interval" if st.mean < limit else "NOT met")
        lines.append(f"| {text} | {fmt(st)} | {'<' if limit == 1.0 else '<='} {limit:g} | {verdict} |")
    lines += ["", f"Unchunked skip-join's P99 / median ITL for comparison: "
              f"{fmt(ratio_stat(sj0['p99_itl_s'], sj0['median_itl_s']))}.", "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)
