"""The section of `make experiments` measured the way every comparison should be (docs/scheduling.md, "How policies
are compared"; steady_state.py): skip-join MLFQ against FCFS and the bounded SRPT oracle at 0.5x to 1.0x of FCFS's
sustained capacity C, steady state, seeds with 95% intervals; the goal rows (0.9C and 0.95C) again with
--steady-goal-prompts requests a point and --steady-goal-seeds seeds; and the other setups (Alpaca, the 80GB
profile, OPT-66B on 4 GPUs, OPT-175B on 16). Past C there is no steady state (a queue grows without bound, and a
mean over N requests depends on N): the past_capacity section measures that by time.

Runs are cached on disk by their parameters and the code (.cache/steady/), so a second regeneration is fast.
"""

from __future__ import annotations

import time

from scripts.experiments.common import Ctx
from scripts.experiments.steady_state import Runner, Setup, capacity, fmt, markdown, ratio_stat, stat, table

LOADS = (0.5, 0.8, 0.9, 0.95, 1.0)  # x C; past it: past_capacity
POLICIES = ("fcfs", "skip-join-mlfq", "srpt")
SUBJECT, ORACLE = "skip-join-mlfq", "srpt"  # srpt: the bounded oracle (true lengths, the defaults' age promotion)
LEARNED = "gittins"  # the opt-in learned order (scheduler/gittins.py), beside the default in the goal rows
GOAL_LOADS = (0.9, 0.95)
GOALS = {"mean_per_token_s": 1.1, "p95_per_token_s": 1.3}  # skip-join / oracle at GOAL_LOADS, >= 10,000 requests
GOAL_MIN_REQUESTS = 10000
OTHER_SETUPS = (("opt-13b", "alpaca"), ("opt-13b-80gb", "sharegpt"), ("opt-66b", "sharegpt"), ("opt-175b", "sharegpt"))


def goal_rows(runner: Runner, ctx: Ctx, cap: float, seeds: range) -> tuple[list[str], dict]:
    """The goal rows: skip-join and the bounded oracle at GOAL_LOADS with --steady-goal-prompts requests a point, at
    the C of the main table, over SEEDS (--steady-goal-seeds); their lines, and {load: (mean ratio, P95 ratio)}
    (Stats)."""
    n = ctx.args.steady_goal_prompts
    setup = Setup("opt-13b", "sharegpt", n)
    data = table(runner, setup, GOAL_LOADS, (SUBJECT, LEARNED, ORACLE), seeds, cap)
    enough = n >= GOAL_MIN_REQUESTS
    lines = [f"**Goals** (at 0.9C and 0.95C with >= {GOAL_MIN_REQUESTS:,} requests: mean per-token latency <= "
             f"{GOALS['mean_per_token_s']:g}x the bounded oracle's, P95 <= {GOALS['p95_per_token_s']:g}x), measured "
             f"with {n:,} requests a point, {len(seeds)} seeds, the same C"
             + ("" if enough else f" (fewer than {GOAL_MIN_REQUESTS:,}: these rows do not judge the goals)") + ":", "",
             "| load | skip-join mean s/token | srpt | mean / srpt (goal) | skip-join P95 | srpt P95 | P95 / srpt "
             "(goal) |", "|---|---|---|---|---|---|---|"]
    found = {}
    for load in GOAL_LOADS:
        s, o = data[(load, SUBJECT)], data[(load, ORACLE)]
        ratios = [ratio_stat(s[m], o[m]) for m in GOALS]
        found[load] = ratios
        verdicts = [("met" if r.mean <= GOALS[m] else "NOT met") if enough else "-" for r, m in zip(ratios, GOALS)]
        lines.append(f"| {load:g}C | {fmt(stat(s['mean_per_token_s']))} | {fmt(stat(o['mean_per_token_s']))} | "
                     f"{fmt(ratios[0])} {verdicts[0]} ({GOALS['mean_per_token_s']:g}) | "
                     f"{fmt(stat(s['p95_per_token_s']))} | {fmt(stat(o['p95_per_token_s']))} | {fmt(ratios[1])} "
                     f"{verdicts[1]} ({GOALS['p95_per_token_s']:g}) |")
    learned = {load: [ratio_stat(data[(load, LEARNED)][m], data[(load, ORACLE)][m]) for m in GOALS]
               for load in GOAL_LOADS}
    lines += ["", f"The learned order (`--scheduling-policy {LEARNED}`, opt-in: a Gittins index over the output "
              "lengths the server has finished, its running jobs counted as censored) on the same runs: "
              + "; ".join(f"{load:g}C mean {fmt(stat(data[(load, LEARNED)]['mean_per_token_s']))} s/token, "
                          f"{fmt(r[0])}x srpt's, P95 {fmt(stat(data[(load, LEARNED)]['p95_per_token_s']))}, "
                          f"{fmt(r[1])}x srpt's" for load, r in learned.items()) + "."]
    lines += ["", f"Per seed ({', '.join(str(s) for s in seeds)}):"]
    for load in GOAL_LOADS:
        s, o = data[(load, SUBJECT)], data[(load, ORACLE)]
        lines.append(f"{load:g}C: mean / srpt {per_seed(found[load][0].values)}; P95 / srpt "
                     f"{per_seed(found[load][1].values)}; skip-join P95 {per_seed(s['p95_per_token_s'], 4)} s, "
                     f"srpt P95 {per_seed(o['p95_per_token_s'], 4)} s; {LEARNED} P95 / srpt "
                     f"{per_seed(learned[load][1].values)}.")
    return lines, found


def per_seed(values, digits: int = 3) -> str:
    return ", ".join(f"{v:.{digits}g}" for v in values)


def section_capacity(ctx: Ctx) -> str:
    seeds, other_seeds = range(ctx.args.steady_seeds), range(ctx.args.steady_other_seeds)
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    main = Setup("opt-13b", "sharegpt", ctx.args.steady_prompts)
    cap = capacity(runner, main, range(3))
    data = table(runner, main, LOADS, POLICIES, seeds, cap["C"])
    goals, _ = goal_rows(runner, ctx, cap["C"], range(ctx.args.steady_goal_seeds))
    lines = ["## Skip-join at capacity: steady state, in units of FCFS's capacity, beside the SRPT oracle", "",
             f"`{ctx.cmd('capacity')} --steady-prompts {ctx.args.steady_prompts} --steady-seeds "
             f"{ctx.args.steady_seeds} --steady-goal-prompts {ctx.args.steady_goal_prompts} --steady-goal-seeds "
             f"{ctx.args.steady_goal_seeds} --steady-other-seeds "
             f"{ctx.args.steady_other_seeds}` (scripts/experiments/steady_state.py; {ctx.args.steady_prompts} "
             f"requests a point, the middle 80% of arrivals counted, {len(seeds)} seeds, mean ± 95% interval, ratios "
             "paired per seed). OPT-13B, A100 40GB roofline profile, ShareGPT lengths through vLLM's length filter, "
             "the engine's defaults (the service ladder, age promotion 3, no alpha; new jobs start while the started "
             "jobs' KV fits both tiers less an eighth of both; skip-join MLFQ's docstring). The oracle `srpt` "
             "knows every output length and keeps the defaults' age promotion (the bounded oracle). Loads stop at "
             "1.0C: past capacity there is no steady state (the queue grows without bound and a mean over N requests "
             "depends on N); the past_capacity section measures that region by time (throughput at the SLO, "
             "goodput, output tokens per second, a burst).", "",
             markdown(main, cap, data, LOADS, POLICIES, reference=ORACLE, subjects=(SUBJECT,)), "", *goals, ""]
    if other_seeds:
        lines += [f"Other setups, skip-join against FCFS ({len(other_seeds)} seeds; the goal: no worse than FCFS on "
                  "any row, within the interval):", ""]
    for scale, dataset in OTHER_SETUPS if other_seeds else ():
        setup = Setup(scale, dataset, ctx.args.steady_prompts)
        c = capacity(runner, setup, range(2))
        d = table(runner, setup, LOADS, ("fcfs", SUBJECT), other_seeds, c["C"])
        lines += [f"**{scale}, {dataset}**: C = {c['C']:.3f} req/s.", "",
                  "| load | FCFS mean s/token | skip-join's | / FCFS mean | P95 / FCFS P95 | served / FCFS |",
                  "|---|---|---|---|---|---|"]
        for load in LOADS:
            f, s = d[(load, "fcfs")], d[(load, SUBJECT)]
            lines.append(f"| {load:g}C | {fmt(stat(f['mean_per_token_s']))} | {fmt(stat(s['mean_per_token_s']))} | "
                         f"{fmt(ratio_stat(s['mean_per_token_s'], f['mean_per_token_s']))} | "
                         f"{fmt(ratio_stat(s['p95_per_token_s'], f['p95_per_token_s']))} | "
                         f"{fmt(ratio_stat(s['served_rate'], f['served_rate']), 4)} |")
        lines.append("")
    if not other_seeds:
        lines += ["The other setups (Alpaca, the 80GB profile, OPT-66B, OPT-175B) were not run this time "
                  "(`--steady-other-seeds 0`); the slo section compares the policies on each of them "
                  "(`--slo-setups all`).", ""]
    lines.append(f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
                 f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
                 f"version {runner.version} (scripts/experiments/steady_state.py, code_version).")
    return "\n".join(lines) + "\n"
