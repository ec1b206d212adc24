"""Fig. 1: the queueing share of end-to-end latency under FCFS, by load, ShareGPT and Alpaca, measured as every
comparison is (docs/scheduling.md, "How policies are compared"; steady_state.py): loads in units of FCFS's
sustained capacity C, 3,000 requests a point, the requests arriving in the middle 80% of the trace counted, seeds
with 95% intervals. The setups, capacities and loads are Fig. 12's, so its FCFS runs serve here from
steady_state.Runner's cache (and these serve it).
"""

from __future__ import annotations

import time

from scripts.experiments.common import Ctx, _errorbar, _plt, _save
from scripts.experiments.latency_curves import CAPACITY_SEEDS, DATASETS, _setup
from scripts.experiments.steady_state import Runner, capacity, fmt, stat, table

# x C; all among Fig. 12's or the capacity section's. Past C there is no steady state: the queue, and with it the
# queueing share, grows for as long as the overload lasts (the past_capacity section measures that region by time).
LOADS = (0.25, 0.5, 0.8, 0.9, 0.95, 1.0)


def _pct(values: list[float]) -> str:
    """A share over seeds in percent, mean ± 95% interval to 0.1%."""
    s = stat([100 * v for v in values])
    return f"{s.mean:.1f}%" if s.half != s.half else f"{s.mean:.1f} ± {s.half:.1f}%"


def section_fig1(ctx: Ctx) -> str:
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    seeds = range(ctx.args.curve_seeds)
    caps, data = {}, {}
    for ds in DATASETS:
        setup = _setup(ds, ctx)
        caps[ds] = capacity(runner, setup, range(CAPACITY_SEEDS[ds]))
        data[ds] = table(runner, setup, LOADS, ("fcfs",), seeds, caps[ds]["C"])
        print(f"  fig1 {ds}: C = {caps[ds]['C']:.3f} req/s, {runner.runs} simulations so far", flush=True)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    cap_text = "; ".join(f"{ds} C = {caps[ds]['C']:.3f} req/s (FCFS served under a {caps[ds]['offered']:.2f} req/s "
                         f"offer; seeds {', '.join(f'{c:.3f}' for c in caps[ds]['per_seed'])})" for ds in DATASETS)
    lines = ["## Fig. 1: queueing share of latency under FCFS", "", f"Command: `{ctx.cmd('fig1')}`", "",
             "![fig1](figures/fig1_queueing_share.png)", "",
             f"OPT-13B on one A100 40GB (roofline profile), FCFS, the engine's defaults (proactive KV policy), "
             f"Poisson arrivals, {ctx.args.steady_prompts} requests a point through vLLM's length filter, the requests "
             f"arriving in the middle 80% of the trace counted, {len(seeds)} seeds (mean ± 95% interval). Loads are "
             f"multiples of FCFS's sustained capacity (Fig. 12's): {cap_text}. Share = the counted requests' time "
             "queued (waiting while not running, preempted time included) / their end-to-end latency.", "",
             "| dataset | load | rate req/s | queueing share | mean s/token | mean e2e s | served req/s |",
             "|---|---|---|---|---|---|---|"]
    shares = {}
    for ds in DATASETS:
        c = caps[ds]["C"]
        rows = {load: data[ds][(load, "fcfs")] for load in LOADS}
        shares[ds] = {load: rows[load]["queueing_share"] for load in LOADS}
        for load, d in rows.items():
            lines.append(f"| {ds} | {load:g}C | {load * c:.2f} | {_pct(d['queueing_share'])} | "
                         f"{fmt(stat(d['mean_per_token_s']))} | {fmt(stat(d['mean_e2e_s']))} | "
                         f"{fmt(stat(d['served_rate']), 4)} |")
        _errorbar(ax, LOADS, [stat([100 * v for v in shares[ds][load]]) for load in LOADS],
                  f"{ds} (C = {c:.2f} req/s)")
    ax.set_xlabel("load (x FCFS's capacity C)")
    ax.set_ylabel("queueing share of e2e latency (%)")
    ax.set_title("FCFS, OPT-13B / 1xA100-40GB (simulated, steady state)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, ctx.figdir / "fig1_queueing_share.png")
    below = [load for load in LOADS if load < 1.0]
    at = lambda load: ", ".join(f"{_pct(shares[ds][load])} ({ds})" for ds in DATASETS)  # noqa: E731
    top_below = max(100 * stat(shares[ds][load]).mean for ds in DATASETS for load in below if load <= 0.8)
    spread = "; ".join(f"{ds} {min(caps[ds]['per_seed']):.3f}-{max(caps[ds]['per_seed']):.3f} req/s" for ds in DATASETS)
    knee = "; ".join(f"{ds} " + ", ".join(f"{100 * v:.1f}%" for v in shares[ds][1.0]) for ds in DATASETS)
    lines += ["", f"Up to 0.8C the queueing share is at most {top_below:.1f}% (the mean over seeds): a job joins the "
              f"running batch within an iteration or a few. It is {at(0.9)} at 0.9C and {at(0.95)} at 0.95C. At "
              f"1.0C, on the knee, it is {at(1.0)}, and the seeds differ most there (per seed: {knee}): the "
              f"capacities measured per seed ({spread}) straddle C, and whether a trace's arrivals outrun FCFS for "
              "long depends on its draw. Past C there is no steady state: the queue grows for as long as the overload "
              "lasts, so a queueing share there depends on the trace's length, and queueing takes over as FCFS "
              "saturates, head-of-line jobs with long outputs holding the batch slots and the KV memory while the "
              "rest wait (the past_capacity section measures that region by time). The paper measures up to ~90% "
              "on vLLM with real workloads, past capacity.", "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.1f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.1f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
