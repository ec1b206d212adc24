"""Past capacity: skip-join MLFQ with the engine's defaults, and with the paper's rules, against FCFS from 0.5x to
2x of FCFS's sustained capacity, measured as every comparison is (steady_state.py: 3,000 requests a point,
the middle 80% of arrivals counted, seeds with 95% intervals). The runs of FCFS and the default skip-join are
Fig. 12's (steady_state.Runner's cache); the paper's rules are this section's own.
"""

from __future__ import annotations

import time

from scripts.experiments.common import MAIN, Ctx, _errorbar, _plt, _save
from scripts.experiments.steady_state import Runner, Setup, capacity, fmt, ratio_stat, stat, table

LOADS = (0.5, 0.8, 1.0, 1.25, 1.5, 2.0)  # x C
# The paper's rules in today's settings: its prefill ladder, promotion after alpha = 0.3 s to the tail of Q1 with a
# round-robin last queue, no age promotion, and no bound on the started jobs' KV.
PAPER = (("kv_overcommit", None), ("mlfq_ladder", "prefill"), ("starvation_age", None), ("starvation_factor", None),
         ("starvation_threshold", 0.3))
VARIANTS = (("fcfs", "fcfs", ()), ("skip-join (default)", "skip-join-mlfq", ()),
            ("skip-join (paper's rules)", "skip-join-mlfq", PAPER))
CHANGED = ("What changed since this section's previous version: it ran 1,500 requests a "
           "point with every request counted, one seed, all lengths clipped to 2,048 tokens (no length filter), at "
           "multiples of 2.8 req/s, and its default was the overload remedies of its day (`--kv-overcommit 4`, "
           "alpha 0.3 s with the starvation factor 1, the prefill ladder). It read the default skip-join at 0.74-0.81x "
           "FCFS's mean past capacity and the paper's rules at 0.21-0.23x, serving 0.83-0.88x FCFS's rate "
           "(durations 1.14-1.21x). The defaults have changed since (the service ladder, age promotion, "
           "admission within both tiers less an eighth of the device: docs/benchmarks.md, \"Skip-join at "
           "capacity\"), and the short traces measured how a burst drains rather than a steady state.")


def section_overload(ctx: Ctx) -> str:
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    seeds = range(ctx.args.curve_seeds)
    main = Setup(MAIN, "sharegpt", ctx.args.steady_prompts)
    cap = capacity(runner, main, range(3))
    data = {}
    for label, policy, engine in VARIANTS:
        setup = Setup(MAIN, "sharegpt", ctx.args.steady_prompts, engine)
        d = table(runner, setup, LOADS, (policy,), seeds, cap["C"])
        data[label] = {load: d[(load, policy)] for load in LOADS}
        print(f"  overload {label}: done ({runner.runs} simulations so far)", flush=True)
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    panels = (("mean_per_token_s", "mean per-token latency (s)"), ("p95_per_token_s", "P95 per-token latency (s)"),
              ("served_rate", "served rate (req/s)"))
    for ax, (metric, title) in zip(axes, panels):
        for label, _, _ in VARIANTS:
            _errorbar(ax, LOADS, [stat(data[label][load][metric]) for load in LOADS], label)
        ax.set_xlabel("load (x FCFS's capacity)")
        ax.set_title(title, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=7)
    fig_path = _save(fig, ctx.figdir / "overload.png")
    lines = ["## Past capacity: skip-join MLFQ vs FCFS from 0.5x to 2x", "", f"Command: `{ctx.cmd('overload')}`", "",
             f"![overload]({fig_path})", "",
             f"OPT-13B on one A100 40GB (roofline profile), ShareGPT lengths through vLLM's length filter, "
             f"{ctx.args.steady_prompts} requests a point, the requests arriving in the middle 80% of the trace "
             f"counted, {len(seeds)} seeds (mean ± 95% interval), loads in units of FCFS's sustained capacity C = "
             f"{cap['C']:.3f} req/s (the capacity section's), proactive KV policy. `skip-join (default)` is the "
             "engine's defaults (the service ladder, age promotion 3, no alpha; new jobs start while the started "
             "jobs' KV fits both tiers less an eighth of the device). `skip-join (paper's rules)` is the paper's: "
             "its prefill ladder (the last quantum covers t_init of the longest prompt), promotion after alpha = "
             "0.3 s to the tail of Q1 with a round-robin last queue (`--starvation-threshold 0.3 "
             "--starvation-factor none --starvation-age none --mlfq-ladder prefill`), and no bound on the started "
             "jobs' KV (`--kv-overcommit none`). The capacity section has the SRPT oracle beside the default.", "",
             "| load | policy | mean s/token | P95 | P99 TTFT s | max e2e s | served req/s | mean / FCFS | "
             "P95 / FCFS | served / FCFS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for load in LOADS:
        f = data["fcfs"][load]
        for label, _, _ in VARIANTS:
            d = data[label][load]
            ratios = ["-", "-", "-"] if label == "fcfs" else [
                fmt(ratio_stat(d["mean_per_token_s"], f["mean_per_token_s"])),
                fmt(ratio_stat(d["p95_per_token_s"], f["p95_per_token_s"])),
                fmt(ratio_stat(d["served_rate"], f["served_rate"]), 4)]
            lines.append(f"| {load:g}C | {label} | {fmt(stat(d['mean_per_token_s']))} | "
                         f"{fmt(stat(d['p95_per_token_s']))} | {fmt(stat(d['p99_ttft_s']))} | "
                         f"{fmt(stat(d['max_e2e_s']))} | {fmt(stat(d['served_rate']), 4)} | " + " | ".join(ratios)
                         + " |")
    lines += ["", CHANGED, "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
