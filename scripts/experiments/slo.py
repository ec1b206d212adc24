"""Throughput at the 0.3 s/token SLO for every policy and scale (the table), and the long-trace search
(a steady state).
"""

from __future__ import annotations

import json

from scripts.experiments.common import (
    MAIN,
    POLICIES,
    RATE_GRID,
    REPO,
    SCALE_RATE,
    SCALES,
    SLO_S,
    Ctx,
    kv_gib,
    kv_tokens,
    slo_table,
    throughput_at_slo,
)


def section_slo(ctx: Ctx) -> str:
    table = slo_table(ctx)
    lines = ["## Throughput at the SLO (0.3 s/token), all policies", "",
             f"Command: `{ctx.cmd('slo')}`", "",
             "The highest Poisson rate (req/s) whose mean (or P95) per-token latency over "
             f"max({ctx.n['ShareGPT']} ShareGPT / {ctx.n['Alpaca']} Alpaca, rate x {ctx.args.span:.0f} s) requests "
             f"(at most {ctx.args.max_prompts}) (lengths from the *_lengths.csv "
             "files, vLLM's length filter: prompt <= 1024, total <= 2048) stays <= 0.3 s/token: a geometric grid "
             f"of rates, then {ctx.args.bisect} bisection steps (resolution "
             f"~{100 * (2 ** 0.5 ** ctx.args.bisect - 1):.0f}% of the rate). KV policy proactive, max_num_seqs "
             f"{ctx.args.max_num_seqs}, starvation threshold 0.3 s, block size 16.", ""]
    for shape in ctx.args.scales:
        data = json.loads((REPO / SCALES[shape][1]).read_text())
        tp, pp = data["key"]["tensor_parallel_size"], data["key"]["pipeline_parallel_size"]
        layout = (f"{tp * pp} GPU{'s' if tp * pp > 1 else ''}" + (f", tensor parallel {tp}" if tp > 1 else "")
                  + (f" x pipeline parallel {pp} with {pp} batches in flight" if pp > 1 else ""))
        lines += [f"### {shape} ({SCALES[shape][1]}: {layout}; roofline estimate)", "",
                  "| dataset | metric | " + " | ".join(POLICIES) + " | skip-join / fcfs |",
                  "|---|---|" + "---|" * (len(POLICIES) + 1)]
        for ds in ctx.datasets:
            for metric, name in (("mean_per_token_s", "mean"), ("p95_per_token_s", "P95")):
                rates = [table[(shape, ds, p, metric)] for p in POLICIES]
                cells = [f"{s.rate:.2f}{'+' if s.capped else ''}" for s in rates]
                fc, sj = rates[0].rate, rates[-1].rate
                ratio = f"{sj / fc:.2f}x" if fc > 0 else "n/a"
                lines.append(f"| {ds} | {name} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    lines += ["(`+`: every grid rate met the SLO; the throughput is above this.)", ""]
    ratios = []
    for shape in ctx.args.scales:
        for ds in ctx.datasets:
            for metric in ("mean_per_token_s", "p95_per_token_s"):
                fc = table[(shape, ds, "fcfs", metric)].rate
                sj = table[(shape, ds, "skip-join-mlfq", metric)].rate
                if fc > 0:
                    ratios.append((shape, ds, metric[:4].rstrip("_"), sj / fc))
    if ratios:
        desc = "; ".join(f"{s} {d} {m}: {r:.2f}x" for s, d, m, r in ratios)
        lines += [f"Skip-join MLFQ over FCFS, throughput at the SLO: {desc}. The paper reports 1.9x-2.9x "
                  "(mean, and more at P95) at the same SLO against vLLM (FCFS) on real A100s.", "",
                  "These numbers are with the default scheduler settings (`--kv-overcommit 4 --starvation-factor "
                  "1`); the section \"Past capacity\" below compares them with the paper's rules "
                  "(`--kv-overcommit none --starvation-factor none`) from 0.5x to 2x of capacity.", ""]
    lines += ["**Why the GPU's memory decides it.** On an A100 40GB, OPT-13B has "
              f"{kv_gib(ctx, MAIN):.1f} GiB of KV cache (about {kv_tokens(ctx, MAIN) / 1e3:.1f}K tokens; the vLLM "
              "paper's Table 1 gives 12 GB for this setup), which holds the whole context of only a few dozen "
              "ShareGPT jobs: FCFS's batch is bounded by memory, and jobs with long outputs hold it while short "
              "ones queue behind them (head-of-line blocking). Skip-join MLFQ runs the short jobs first and parks "
              "the preempted ones' KV in host memory (proactive offloading), so it keeps more jobs in flight. "
              "On an A100 80GB "
              f"({kv_gib(ctx, 'opt-13b-80gb'):.1f} GiB, ~{kv_tokens(ctx, 'opt-13b-80gb') / 1e3:.0f}K tokens) "
              "FCFS batches up to max_num_seqs = 256 jobs continuously and memory rarely binds; with so many "
              "slots, head-of-line blocking is rare, and MLFQ's preemptions and offloads cost about what they "
              "save.", ""]
    lines += section_slo_long(ctx)
    return "\n".join(lines)

def section_slo_long(ctx: Ctx) -> list[str]:
    """The same search with long traces (a steady state, not a transient), FCFS and skip-join, ShareGPT."""
    n = ctx.args.long_prompts
    found = {}
    for policy in ("fcfs", "skip-join-mlfq"):
        for metric in ("mean_per_token_s", "p95_per_token_s"):
            def lat(rate, policy=policy, metric=metric):
                return ctx.simulate(MAIN, ctx.trace("ShareGPT", rate, n), policy)[0][metric]
            grid = [r * SCALE_RATE[SCALES[MAIN][0]] for r in RATE_GRID["ShareGPT"]]
            found[(policy, metric)] = throughput_at_slo(lat, grid, SLO_S, iters=ctx.args.bisect)
            print(f"  SLO long {policy:15} {metric[:4]}: {found[(policy, metric)].rate:7.2f} req/s", flush=True)
    lines = ["### Long traces: a steady state", "",
             f"The table above, like the paper's and vLLM's benchmarks, runs a few hundred requests per point: "
             f"at the highest rates the queue is still growing when the trace ends. Here the same search on "
             f"{MAIN}, ShareGPT, with {n} requests per point (arrivals spanning ~{n} / rate s):", "",
             "| metric | fcfs | skip-join-mlfq | skip-join / fcfs |", "|---|---|---|---|"]
    for metric, name in (("mean_per_token_s", "mean"), ("p95_per_token_s", "P95")):
        fc, sj = found[("fcfs", metric)].rate, found[("skip-join-mlfq", metric)].rate
        lines.append(f"| {name} | {fc:.2f} | {sj:.2f} | {sj / fc:.2f}x |" if fc > 0 else f"| {name} | {fc:.2f} | "
                     f"{sj:.2f} | n/a |")
    evaluated = {p: dict(found[(p, "mean_per_token_s")].evaluated) for p in ("fcfs", "skip-join-mlfq")}
    common = sorted(set(evaluated["fcfs"]) & set(evaluated["skip-join-mlfq"]))
    lines += ["", "Mean per-token latency (s) at the rates both searches ran: "
              + ", ".join(f"{r:.2f} req/s: fcfs {evaluated['fcfs'][r]:.3f}, skip-join "
                          f"{evaluated['skip-join-mlfq'][r]:.3f}" for r in common) + ".", "",
              "In a steady state both policies saturate at about the same rate: skip-join MLFQ reorders work, it "
              "does not add capacity (its offloads and preemptions cost a little), and once the arrival rate "
              "passes capacity the queue grows without bound under any policy; with starvation promotion every "
              "job is then promoted in turn and skip-join degrades to round robin, worse than FCFS. Its gain is "
              "the latency just below the knee, where FCFS's head-of-line blocking is worst; the short traces "
              "measure that region plus the transient above it, which is where the paper-sized ratios come "
              "from.", ""]
    return lines
