"""Fig. 12 (P95 per-token latency against request rate) and Fig. 13 (goodput: the highest rate within an SLO
of 5x, 10x and 20x the light-load latency, per phase), OPT-13B, FCFS (vLLM's order) against skip-join MLFQ
(FastServe), ShareGPT and Alpaca. Both read the same sweep (`sweep`, cached in ctx.cache): Fig. 13's rates
are read off Fig. 12's points by common.rate_within, so it costs no simulation of its own.
"""

from __future__ import annotations

from experiment_sections.common import MAIN, Ctx, _ms, _plt, _save, rate_within

CURVE_POLICIES = ("fcfs", "skip-join-mlfq")  # the paper's Fig. 12/13: vLLM against FastServe
# Poisson rates (req/s) of the sweep; they include the SLO table's grid points (ctx.trace, same traces), so
# a full run reuses its simulations.
CURVE_RATES = {"ShareGPT": (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32),
               "Alpaca": (4, 8, 16, 24, 32, 48, 64, 96, 128)}
LIGHT_RATE = {"ShareGPT": 0.25, "Alpaca": 1.0}  # light load: queueing is rare
SLO_MULTIPLES = (5, 10, 20)
# metric of the summary -> what it measures (the per-token latency, and the two phases)
METRICS = {"p95_per_token_s": "per-token latency (e2e / output tokens)",
           "p95_ttft_s": "prefill phase: time to first token",
           "p95_tpot_s": "decode phase: time per output token after the first"}


def sweep(ctx: Ctx) -> dict:
    """{"light": {dataset: {metric: FCFS's P95 at LIGHT_RATE}}, "points": {(dataset, policy): [(rate, summary)]}}.

    A policy's sweep stops at the first rate where every metric is past the largest SLO (20x light load):
    the curves are past the knee and higher rates only cost time."""
    if "curves" in ctx.cache:
        return ctx.cache["curves"]
    light, points = {}, {}
    for ds in ctx.datasets:
        s = ctx.simulate(MAIN, ctx.trace(ds, LIGHT_RATE[ds]), "fcfs")[0]
        light[ds] = {m: s[m] for m in METRICS}
        for policy in CURVE_POLICIES:
            pts = points[(ds, policy)] = []
            for rate in CURVE_RATES[ds]:
                s = ctx.simulate(MAIN, ctx.trace(ds, rate), policy)[0]
                pts.append((rate, s))
                print(f"  curves {ds:8} {policy:15} {rate:6.1f} req/s: P95 per-token {s['p95_per_token_s']:.3f}, "
                      f"TTFT {s['p95_ttft_s']:.3f}, TPOT {s['p95_tpot_s']:.3f}", flush=True)
                if all(s[m] > max(SLO_MULTIPLES) * light[ds][m] for m in METRICS):
                    break
    ctx.cache["curves"] = {"light": light, "points": points}
    return ctx.cache["curves"]


def _setup(ctx: Ctx) -> str:
    return (f"OPT-13B on one A100 40GB (roofline profile), Poisson arrivals, max({ctx.n['ShareGPT']} ShareGPT / "
            f"{ctx.n['Alpaca']} Alpaca, rate x {ctx.args.span:.0f} s) requests per point (at most "
            f"{ctx.args.max_prompts}; the traces of the SLO table), vLLM's length filter, proactive KV policy, "
            "the default scheduler settings (alpha 0.3 s, `--kv-overcommit 4`, `--starvation-factor 1`). "
            "FCFS is vLLM's order; skip-join MLFQ is FastServe's.")


def section_fig12(ctx: Ctx) -> str:
    data = sweep(ctx)
    plt = _plt()
    fig, axes = plt.subplots(1, len(ctx.datasets), figsize=(9, 3.2))
    lines = ["## Fig. 12: P95 per-token latency against request rate", "", f"Command: `{ctx.cmd('fig12')}`", "",
             "![fig12](figures/fig12_p95_latency.png)", "", _setup(ctx), ""]
    for ax, ds in zip(axes, ctx.datasets):
        for policy in CURVE_POLICIES:
            pts = data["points"][(ds, policy)]
            ax.plot([r for r, _ in pts], [s["p95_per_token_s"] for _, s in pts], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("P95 per-token latency (s)")
        ax.set_title(f"{ds}, OPT-13B (simulated)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        rates = sorted({r for p in CURVE_POLICIES for r, _ in data["points"][(ds, p)]})
        by = {p: dict(data["points"][(ds, p)]) for p in CURVE_POLICIES}
        lines += [f"{ds} (P95 per-token latency, s; `-`: not run, the sweep had passed the knee):", "",
                  "| rate req/s | " + " | ".join(CURVE_POLICIES) + " | fcfs / skip-join |",
                  "|---|" + "---|" * (len(CURVE_POLICIES) + 1)]
        for r in rates:
            cells = [f"{by[p][r]['p95_per_token_s']:.3f}" if r in by[p] else "-" for p in CURVE_POLICIES]
            both = all(r in by[p] for p in CURVE_POLICIES)
            ratio = (f"{by['fcfs'][r]['p95_per_token_s'] / by['skip-join-mlfq'][r]['p95_per_token_s']:.2f}x"
                     if both else "-")
            lines.append(f"| {r} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    _save(fig, ctx.figdir / "fig12_p95_latency.png")
    wins = []
    for ds in ctx.datasets:
        by = {p: dict(data["points"][(ds, p)]) for p in CURVE_POLICIES}
        ratio = {r: by["fcfs"][r]["p95_per_token_s"] / by["skip-join-mlfq"][r]["p95_per_token_s"]
                 for r in by["fcfs"] if r in by["skip-join-mlfq"]}
        best, worst = max(ratio, key=ratio.get), min(ratio, key=ratio.get)
        wins.append(f"{ds}: largest fcfs / skip-join ratio {ratio[best]:.2f}x at {best} req/s, smallest "
                    f"{ratio[worst]:.2f}x at {worst} req/s")
    lines += ["Over the rates both ran: " + "; ".join(wins) + ". The paper's Fig. 12 shows FastServe's P95 below "
              "vLLM's across its rates.", ""]
    return "\n".join(lines)


def section_fig13(ctx: Ctx) -> str:
    data = sweep(ctx)
    plt = _plt()
    lines = ["## Fig. 13: goodput at SLOs of 5x, 10x and 20x the light-load latency", "",
             f"Command: `{ctx.cmd('fig13')}`", "", "![fig13](figures/fig13_goodput.png)", "", _setup(ctx), "",
             "Our reading of the paper's \"P95 goodput at SLO 5x, 10x, 20x of the light-load latency per phase\": "
             "for each of three P95 latencies (the per-token latency, the prefill phase's time to first token and "
             "the decode phase's time per output token after the first), the SLO is k x that same P95 measured "
             f"under FCFS at light load (ShareGPT {LIGHT_RATE['ShareGPT']} req/s, Alpaca {LIGHT_RATE['Alpaca']} "
             "req/s; the policies barely differ there), and the goodput is the highest Poisson rate whose P95 "
             "stays within it. Each phase is held to its own light-load value. The rates are read off Fig. 12's "
             "sweep (the last rate within the SLO, moved towards the first rate past it by log-log "
             "interpolation between the two), not searched; `+`: every rate of the sweep was within the SLO.", "",
             "| dataset | P95 of | light load | SLO | " + " | ".join(f"{p} req/s" for p in CURVE_POLICIES)
             + " | skip-join / fcfs |", "|---|---|---|---|" + "---|" * (len(CURVE_POLICIES) + 1)]
    fig, axes = plt.subplots(1, len(ctx.datasets), figsize=(9, 3.2))
    ratios = []
    for ax, ds in zip(axes, ctx.datasets):
        labels, bars = [], {p: [] for p in CURVE_POLICIES}
        for metric, what in METRICS.items():
            base = data["light"][ds][metric]
            for k in SLO_MULTIPLES:
                found = {p: rate_within([(r, s[metric]) for r, s in data["points"][(ds, p)]], k * base)
                         for p in CURVE_POLICIES}
                cells = [f"{found[p].rate:.2f}{'+' if found[p].capped else ''}" for p in CURVE_POLICIES]
                fc, sj = found["fcfs"].rate, found["skip-join-mlfq"].rate
                ratio = f"{sj / fc:.2f}x" if fc > 0 else "n/a"
                if fc > 0:
                    ratios.append((ds, metric, k, sj / fc))
                lines.append(f"| {ds} | {what} | {_ms(base)} | {k}x | " + " | ".join(cells) + f" | {ratio} |")
                labels.append(f"{metric.split('_')[1]} {k}x")
                for p in CURVE_POLICIES:
                    bars[p].append(found[p].rate)
        width = 0.8 / len(CURVE_POLICIES)
        for i, p in enumerate(CURVE_POLICIES):
            ax.bar([j + i * width for j in range(len(labels))], bars[p], width, label=p)
        ax.set_xticks([j + width * (len(CURVE_POLICIES) - 1) / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=45, fontsize=6, ha="right")
        ax.set_ylabel("goodput (req/s)")
        ax.set_title(f"{ds}, OPT-13B (simulated)", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, ctx.figdir / "fig13_goodput.png")
    if ratios:
        by_metric = {}
        for _ds, metric, _k, r in ratios:
            by_metric.setdefault(metric, []).append(r)
        summary = "; ".join(f"{METRICS[m].split(':')[0]}: {min(rs):.2f}x to {max(rs):.2f}x"
                            for m, rs in by_metric.items())
        tpot = {p: max(s["p95_tpot_s"] for ds in ctx.datasets for _, s in data["points"][(ds, p)])
                for p in CURVE_POLICIES}
        lines += ["", f"Skip-join MLFQ's goodput over FCFS's, range over datasets and SLOs: {summary}. The paper "
                  "reports FastServe's goodput above vLLM's at each SLO scale.", "",
                  "The phases pull apart. Under FCFS a started job is never preempted, so its time per output token "
                  "is the step time of the batch it runs in: the highest P95 of the decode phase anywhere in "
                  f"FCFS's sweep is {_ms(tpot['fcfs'])}, while FCFS's queueing lands entirely in the time to first "
                  "token. Skip-join MLFQ starts jobs sooner (a shorter TTFT) and pays with preemptions between "
                  f"tokens (its decode-phase P95 reaches {_ms(tpot['skip-join-mlfq'])}). The per-token latency "
                  "(e2e / tokens) adds both, which is what the paper's SLO counts.", "",
                  "These are the SLO table's short traces: at rates past capacity the queue is still growing when "
                  "the trace ends, so the high-rate points measure a transient (see \"Long traces\" there)."]
    lines.append("")
    return "\n".join(lines)
