"""Fig. 8: KV memory in use over time, MLFQ and skip-join MLFQ vs FCFS, with a device tier large enough to show each
policy's demand, measured as every comparison is (steady_state.py: loads in units of FCFS's capacity on this
setup, 3,000 requests a point, the middle 80% of arrivals counted, seeds with 95% intervals). The KV usage after
every step is recorded by the runs themselves (Setup.track_kv) and cached with them.
"""

from __future__ import annotations

import json
import time

from memory.admission import admission_limit
from scripts.experiments.common import MAIN, REPO, SCALES, Ctx, _plt, _save, kv_capacity
from scripts.experiments.steady_state import Runner, Setup, capacity, fmt, ratio_stat, stat, table, trace_for, window

# x C of this setup (FCFS with the large device tier). Past C there is no steady state: the queue, and with it the KV
# the MLFQs hold for the jobs they preempt, grows for as long as the overload lasts.
LOADS = (0.5, 0.8, 0.9, 0.95, 1.0)
POLICIES = ("fcfs", "mlfq", "skip-join-mlfq")
DEVICE_X = 8  # the device KV tier, x the A100's
CAPACITY_SEEDS = 3
CAPACITY_START = 16.0  # req/s: capacity()'s first offer, >= 1.3x FCFS's served rate on this setup (about 6.8 req/s)


def section_fig8(ctx: Ctx) -> str:
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    seeds = range(ctx.args.curve_seeds)
    device_bytes, block = kv_capacity(ctx, MAIN)
    gb = block / 1e9  # GB per block
    big = int(DEVICE_X * device_bytes // block)  # room for every job's KV: the demand, not the capped use
    host = int(json.loads((REPO / SCALES[MAIN][1]).read_text())["capacity"]["host_kv_bytes"] // block)
    bound = admission_limit(big, host)  # the engine's admission bound (no --kv-overcommit)
    setup = Setup(MAIN, "sharegpt", ctx.args.steady_prompts, (("num_device_blocks", big),), track_kv=True)
    cap = capacity(runner, setup, range(CAPACITY_SEEDS), CAPACITY_START)
    data = table(runner, setup, LOADS, POLICIES, seeds, cap["C"])
    print(f"  fig8: C = {cap['C']:.3f} req/s, {runner.runs} simulations so far", flush=True)
    a100 = device_bytes / 1e9
    plt = _plt()
    fig, axes = plt.subplots(1, len(LOADS), figsize=(3 * len(LOADS), 3.0), sharey=True)
    for ax, load in zip(axes, LOADS):  # seed 0's runs (cached: their KV series)
        runs = runner.many([(setup, p, load * cap["C"], 0) for p in POLICIES])
        for policy, run in zip(POLICIES, runs):
            ax.plot([t for t, _ in run["kv_series"]], [n * gb for _, n in run["kv_series"]], label=policy, lw=0.8)
        ax.axvspan(*window([a for a, _, _ in trace_for(setup, load * cap["C"], 0)[0]]), color="0.9", zorder=0)
        ax.axhline(a100, color="k", ls="--", lw=0.8, label="A100 KV capacity")
        ax.axhline(big * gb, color="k", ls=":", lw=0.8, label=f"device tier here ({DEVICE_X}x)")
        ax.set_title(f"{load:g}C = {load * cap['C']:.2f} req/s (seed 0)", fontsize=8)
        ax.set_xlabel("time (s, simulated)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("KV cache in use (GB)")
    axes[0].legend(fontsize=7)
    _save(fig, ctx.figdir / "fig8_kv_memory.png")
    lines = ["## Fig. 8: KV memory, MLFQ vs FCFS", "", f"Command: `{ctx.cmd('fig8')}`", "",
             "![fig8](figures/fig8_kv_memory.png)", "",
             f"OPT-13B (A100 40GB roofline profile), ShareGPT lengths through vLLM's length filter, Poisson arrivals, "
             f"{ctx.args.steady_prompts} requests a point, {len(seeds)} seeds (mean ± 95% interval), the engine's "
             f"defaults (proactive KV policy, max_num_seqs 256) but the device KV tier, made {DEVICE_X}x the A100's "
             f"({big * gb:.0f} GB, {big} blocks, instead of {a100:.1f} GB) so that the curves show each policy's KV "
             "demand rather than the A100's cap (the host tier is the profile's 256 GiB). Loads are multiples of "
             f"FCFS's sustained capacity on this setup: C = {cap['C']:.3f} req/s (FCFS served under a "
             f"{cap['offered']:.2f} req/s offer; seeds {', '.join(f'{c:.3f}' for c in cap['per_seed'])}), higher "
             "than the A100's (the capacity section's) because FCFS's batches are no longer capped by KV. KV in use: "
             "the blocks held in both tiers after every step (a KVUsageTracker wrapping engine.step); the peak and "
             "the time-weighted mean are over the counted window (the middle 80% of the arrival span; shaded in "
             "the figure, whose curves are seed 0's, the highest count in each of 400 spans of the run).",
             "", "| load | policy | peak KV GB | mean KV GB | peak x A100 KV | peak / FCFS | mean / FCFS | "
             "mean s/token | served req/s |", "|---|---|---|---|---|---|---|---|---|"]
    for load in LOADS:
        f = data[(load, "fcfs")]
        for policy in POLICIES:
            d = data[(load, policy)]
            ratios = ["-", "-"] if policy == "fcfs" else [fmt(ratio_stat(d["kv_peak_blocks"], f["kv_peak_blocks"])),
                                                          fmt(ratio_stat(d["kv_mean_blocks"], f["kv_mean_blocks"]))]
            lines.append(f"| {load:g}C | {policy} | {fmt(stat([n * gb for n in d['kv_peak_blocks']]))} | "
                         f"{fmt(stat([n * gb for n in d['kv_mean_blocks']]))} | "
                         f"{fmt(stat([n * gb / a100 for n in d['kv_peak_blocks']]))} | " + " | ".join(ratios)
                         + f" | {fmt(stat(d['mean_per_token_s']))} | {fmt(stat(d['served_rate']), 4)} |")
    lines += ["", _reading(data, gb, big, bound), "",
              f"This section: {runner.runs} simulations run now ({runner.wall / 60:.1f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.1f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)


def _reading(data: dict, gb: float, big: int, bound: int) -> str:
    """The section's reading of its table, from the numbers."""
    def peak(load, policy):
        return stat([n * gb for n in data[(load, policy)]["kv_peak_blocks"]])

    def ratio(load, policy, metric="kv_peak_blocks"):
        return ratio_stat(data[(load, policy)][metric], data[(load, "fcfs")][metric])

    def differs(r):  # docs/scheduling.md's rule: an interval that includes 1.0 is no difference
        return not (r.mean - r.half <= 1.0 <= r.mean + r.half)

    metrics = ("kv_peak_blocks", "kv_mean_blocks", "mean_per_token_s")
    same = [load for load in LOADS if all(abs(ratio(load, p, m).mean - 1) < 1e-3 for p in POLICIES[1:]
                                          for m in metrics)]
    parts = []
    if same:
        parts.append("At " + ", ".join(f"{load:g}C" for load in same) + " the three policies' runs coincide (peaks, "
                     "means and mean latency within 0.1%): with room in the batch for every job, a policy has nothing "
                     "to reorder.")
    for load in [x for x in LOADS if x not in same]:
        m = ratio(load, "mlfq")
        verdict = "" if differs(m) else ": no difference, the interval includes 1"
        parts.append(f"At {load:g}C MLFQ's peak is {fmt(peak(load, 'mlfq'))} GB against FCFS's "
                     f"{fmt(peak(load, 'fcfs'))}, {fmt(m)}x per seed{verdict}; its time-weighted mean "
                     f"{fmt(ratio(load, 'mlfq', 'kv_mean_blocks'))}x FCFS's.")
    high = LOADS[-1]
    top = peak(high, "mlfq")
    where = (f"outgrows the {big * gb:.0f} GB device tier (the rest offloaded to the host) and "
             if top.mean > big * gb else "")
    parts.append(f"There MLFQ's KV {where}reaches {top.mean / (bound * gb):.0%} of the admission bound "
                 f"({bound * gb:.0f} GB: new jobs start while the started jobs' KV fits both tiers less an eighth of "
                 f"both), while FCFS holds only its running batch's KV ({fmt(peak(high, 'fcfs'))} GB). The MLFQs "
                 "preempt jobs that keep their KV while others start, so more jobs hold memory at once: the pressure "
                 "proactive offloading relieves (paper Fig. 8 shows the effect qualitatively, past capacity). MLFQ's "
                 f"mean per-token latency there is {fmt(stat(data[(high, 'mlfq')]['mean_per_token_s']))} s, FCFS's "
                 f"{fmt(stat(data[(high, 'fcfs')]['mean_per_token_s']))} s. Past C there is no steady state: the "
                 "queue, and with it the KV the MLFQs hold for the jobs they preempt, grows for as long as the "
                 "overload lasts, so a peak there depends on the trace's length.")
    gap = max(abs(ratio_stat(data[(load, "skip-join-mlfq")]["kv_peak_blocks"], data[(load, "mlfq")]["kv_peak_blocks"])
                  .mean - 1) for load in LOADS)
    parts.append(f"Skip-join MLFQ's peaks are within {gap:.1%} of plain MLFQ's at every load.")
    return " ".join(parts)
