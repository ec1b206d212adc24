"""Fig. 14: the policies over input:output length ratios (fixed mean total length), measured the steady-state way
(steady_state.py, Setup.synthetic): FCFS's capacity measured for each ratio, every policy at --io-load (at most
1.0) x that capacity, 3,000 requests a point, the middle 80% of arrivals counted, seeds with 95% intervals, the SRPT
oracle beside them.
"""

from __future__ import annotations

import time
from dataclasses import replace

from scripts.experiments.common import MAIN, POLICIES, Ctx, _errorbar, _plt, _save
from scripts.experiments.steady_state import Runner, Setup, capacity, fmt, ratio_stat, stat, table, trace_for

IO_RATIOS = (0.25, 1, 4, 16, 64, 256)
ORACLE = "srpt"
LEARNED = "gittins"  # the order that learns the length distribution (scheduler/gittins.py), opt-in
ALIKE = "skip-join + alike mode"  # skip-join with its opt-in alike-lengths mode (--adapt-to-alike-lengths)
GOAL = 1.05  # skip-join best, or within 5% of the best (non-oracle) policy, in every row


def io_setup(ctx: Ctx, ratio: float) -> Setup:
    return Setup(MAIN, "sharegpt", ctx.args.steady_prompts, synthetic=(ctx.args.io_total, ratio, ctx.args.io_spread))


def section_fig14(ctx: Ctx) -> str:
    plt = _plt()
    total, load, spread = ctx.args.io_total, ctx.args.io_load, ctx.args.io_spread
    if load > 1.0:
        raise ValueError(f"--io-load {load:g}: at most 1.0 (x C); past capacity there is no steady state")
    runner = Runner(jobs=ctx.args.steady_jobs)
    seeds = range(ctx.args.curve_seeds)
    t0 = time.perf_counter()
    policies = (*POLICIES, LEARNED, ORACLE)
    caps, data, lens = {}, {}, {}
    for r in IO_RATIOS:
        setup = io_setup(ctx, r)
        caps[r] = capacity(runner, setup, range(3))
        data[r] = table(runner, setup, (load,), policies, seeds, caps[r]["C"])
        alike = replace(setup, engine=(("adapt_to_alike_lengths", True),))
        data[r][(load, ALIKE)] = table(runner, alike, (load,), ("skip-join-mlfq",), seeds, caps[r]["C"])[
            (load, "skip-join-mlfq")]
        trace, _ = trace_for(setup, 1.0, 0)
        lens[r] = (sum(p for _, p, _ in trace) / len(trace), sum(o for _, _, o in trace) / len(trace))
        print(f"  fig14 ratio {r}: C {caps[r]['C']:.3f}", flush=True)
    lines = ["## Fig. 14: policies over input:output ratios", "",
             f"Command: `{ctx.cmd('fig14')} --io-load {load:g} --curve-seeds {len(seeds)}`", "",
             "![fig14](figures/fig14_io_ratio.png)", "",
             f"OPT-13B on one A100 40GB (roofline profile), the engine's defaults, synthetic lengths whose mean total "
             f"is {total} tokens, split input:output = r:1 (fastserve/bench/workload.py synthetic_lengths io_ratio), "
             f"each length uniform over [{1 - spread:g}x, {1 + spread:g}x] of its mean, independently for input and "
             f"output (`--io-spread {spread:g}`), so the longest job of a row is {(1 + spread) / (1 - spread):.0f}x "
             "the shortest. As vLLM's random dataset, no length filter (the high-ratio rows' prompts exceed 1,024 "
             f"tokens). {ctx.args.steady_prompts} requests a point, the middle 80% of arrivals counted, "
             f"{len(seeds)} seeds (mean ± 95% interval; ratios paired per seed), Poisson arrivals at {load:g}x FCFS's "
             "capacity C, measured for each ratio (3 seeds). Mean per-token latency, s; the SRPT oracle (it knows "
             "every output length) for reference.", "",
             "| ratio | prompt/output | C req/s | " + " | ".join((*policies, ALIKE)) + " | skip-join / best | served "
             "skip-join / FCFS | alike mode / best | served alike mode / FCFS | gittins / best | served gittins / "
             "FCFS |",
             "|---|---|---|" + "---|" * (len(policies) + 1) + "---|---|---|---|---|---|"]
    verdicts, learned, moded = {}, {}, {}
    for r in IO_RATIOS:
        row = {p: data[r][(load, p)] for p in policies}
        best = min(POLICIES, key=lambda p, row=row: stat(row[p]["mean_per_token_s"]).mean)
        vs_best = ratio_stat(row["skip-join-mlfq"]["mean_per_token_s"], row[best]["mean_per_token_s"])
        verdicts[r] = (best, vs_best)
        learned[r] = ratio_stat(row[LEARNED]["mean_per_token_s"], row[best]["mean_per_token_s"])
        mode = data[r][(load, ALIKE)]
        moded[r] = ratio_stat(mode["mean_per_token_s"], row[best]["mean_per_token_s"])
        lines.append(f"| {r:g} | {lens[r][0]:.0f}/{lens[r][1]:.0f} | {caps[r]['C']:.3f} | "
                     + " | ".join(fmt(stat(x["mean_per_token_s"])) for x in (*row.values(), mode))
                     + f" | {fmt(vs_best)} ({best}) | "
                     f"{fmt(ratio_stat(row['skip-join-mlfq']['served_rate'], row['fcfs']['served_rate']), 4)} | "
                     f"{fmt(moded[r])} | {fmt(ratio_stat(mode['served_rate'], row['fcfs']['served_rate']), 4)} | "
                     f"{fmt(learned[r])} | "
                     f"{fmt(ratio_stat(row[LEARNED]['served_rate'], row['fcfs']['served_rate']), 4)} |")
    fig, ax = plt.subplots(figsize=(5.6, 3.2))
    for p in (*policies, ALIKE):
        _errorbar(ax, IO_RATIOS, [stat(data[r][(load, p)]["mean_per_token_s"]) for r in IO_RATIOS], p)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("input : output length ratio")
    ax.set_ylabel("mean per-token latency (s)")
    ax.set_title(f"OPT-13B, total length {total}, {load:g}x FCFS capacity (simulated)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, ctx.figdir / "fig14_io_ratio.png")
    met = [r for r, (_, v) in verdicts.items() if v.mean <= GOAL]
    lines += ["", f"Goal: skip-join best, or within {100 * (GOAL - 1):.0f}% of the best policy, in every "
              f"row: {'met' if len(met) == len(IO_RATIOS) else 'NOT met'} ({len(met)} of {len(IO_RATIOS)} rows "
              f"within: {', '.join(f'{r:g}' for r in met) or 'none'}). Best policy per ratio: "
              + ", ".join(f"{r:g}: {b}" for r, (b, _) in verdicts.items()) + ".", "",
              f"The learned order (`--scheduling-policy {LEARNED}`, opt-in; scheduler/gittins.py: a Gittins index over "
              "the output lengths the server has finished, its running jobs counted as censored, so it runs least "
              "attained service on heavy tails and "
              "lets a started job finish on lengths like these) against the best of the four baselines: within "
              f"{100 * (GOAL - 1):.0f}% in {sum(v.mean <= GOAL for v in learned.values())} of {len(IO_RATIOS)} "
              "rows (" + ", ".join(f"{r:g}: {v.mean:.3f}x" for r, v in learned.items()) + ").", "",
              f"Skip-join with its alike-lengths mode (`--adapt-to-alike-lengths`, opt-in; scheduler/skip_join_mlfq.py:"
              " once the Gittins index learned from the last 2,000 finished lengths (256 at least) and the "
              "started jobs held, counted as censored, is at least 2x "
              "higher at the median length than at one token out, no job is demoted, a started job moves to Q1 "
              "keeping its place and runs to completion ahead of the fresh jobs after it, and a fresh job waits "
              "behind a started one that "
              "waits for KV) against the same best: within "
              f"{100 * (GOAL - 1):.0f}% in {sum(v.mean <= GOAL for v in moded.values())} of {len(IO_RATIOS)} rows ("
              + ", ".join(f"{r:g}: {v.mean:.3f}x" for r, v in moded.items()) + "). It is off by "
              "default (docs/scheduling.md, \"Skip-join MLFQ\", alike-lengths mode).", "",
              "Past capacity there is no steady state (the queue grows for as long as the overload lasts, so a "
              "mean over a run depends on its length): the past_capacity section measures these workloads there by "
              "time (fig14-R: output tokens per second at 1.5C and 2C, FCFS against skip-join).", "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version}.", ""]
    return "\n".join(lines)
