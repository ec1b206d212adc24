"""The capacity_llama section: the capacity table (steady_state.py: loads in units of FCFS's capacity C, seeds, the
SRPT oracle) of Llama-3-8B on one H100 80GB beside OPT-13B on one A100 40GB, both roofline profiles (profiles/sim/),
and what grouped-query attention changes, in numbers: KV bytes a token, tokens each profile's KV holds, ShareGPT
jobs that fit, C, and the KV offloads at C.

OPT-13B's capacity is measured as the capacity section's is (the same setup and seeds: one cache entry serves both).
"""

from __future__ import annotations

import statistics
import time

from scripts.experiments.common import BLOCK, Ctx, kv_capacity
from scripts.experiments.steady_state import (
    Runner,
    Setup,
    Stat,
    capacity,
    fmt,
    markdown,
    ratio_stat,
    stat,
    table,
    trace_for,
)

LOADS = (0.5, 0.8, 0.9, 1.0)
POLICIES = ("fcfs", "skip-join-mlfq", "srpt")
CAPACITY_SEEDS = 3  # as the capacity section's
# (scale, what it is, the capacity search's first offered rate: None is steady_state.capacity's 1 req/s; Llama-3-8B's
# starts at 16 req/s, below its C, which saves three rounds of slow light-load runs)
COMPARED = (("opt-13b", "OPT-13B on one A100 40GB", None), ("llama-3-8b", "Llama-3-8B on one H100 80GB", 16.0))


def kv_facts(ctx: Ctx, scale: str) -> dict:
    """The KV side of a scale: bytes a token, device KV bytes and blocks (as the simulated engine sizes them), the
    tokens they hold, and the tokens the same bytes would hold with a KV head per query head."""
    from engine.model.registry import load_model_config

    cfg = load_model_config(ctx.model(scale)[0])
    device_bytes, block = kv_capacity(ctx, scale)
    blocks = int(device_bytes // block)
    mha_blocks = int(device_bytes // (block * cfg.num_attention_heads // cfg.num_key_value_heads))
    return {"cfg": cfg, "per_token": block // BLOCK, "device_gib": device_bytes / 2**30, "blocks": blocks,
            "tokens": blocks * BLOCK, "mha_tokens": mha_blocks * BLOCK}


def section_capacity_llama(ctx: Ctx) -> str:
    seeds = range(ctx.args.llama_seeds)
    runner = Runner(jobs=ctx.args.steady_jobs)
    t0 = time.perf_counter()
    results = {}
    for scale, _, start in COMPARED:
        setup = Setup(scale, "sharegpt", ctx.args.steady_prompts)
        cap = capacity(runner, setup, range(CAPACITY_SEEDS), start=start)
        results[scale] = (setup, cap, table(runner, setup, LOADS, POLICIES, seeds, cap["C"]))
    cmd = ctx.cmd("capacity_llama") + (f" --llama-seeds {len(seeds)}" if len(seeds) != 3 else "")
    lines = ["## Llama-3-8B on an H100 beside OPT-13B on an A100: grouped-query attention and capacity", "",
             f"`{cmd}` (scripts/experiments/capacity_llama.py, steady_state.py; {ctx.args.steady_prompts} ShareGPT "
             f"requests a point through vLLM's length filter, the middle 80% of arrivals counted, {len(seeds)} seeds, "
             f"mean ± 95% interval; C from {CAPACITY_SEEDS} seeds). Roofline profiles, not measurements: "
             "profiles/sim/opt-13b-a100-40gb-x1.json and llama-3-8b-h100-80gb-x1.json (docs/benchmarks.md, "
             "\"Simulator profiles\"); the engine's defaults, both on the same traces.", ""]
    for scale, what, _ in COMPARED:
        setup, cap, data = results[scale]
        lines += [f"**{what}** (`{scale}`).", "", markdown(setup, cap, data, LOADS, POLICIES), ""]
    lines += [why_paragraph(ctx, results, seeds), ""]
    points = [w for _, _, data in results.values() for cell in data.values() for w in cell["wall_s"]]
    lines.append(f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
                 f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache; the tables' "
                 f"{len(points)} points took {sum(points) / 60:.0f} min of simulation when they ran), "
                 f"simulation code version {runner.version} (scripts/experiments/steady_state.py, "
                 "code_version).")
    return "\n".join(lines) + "\n"


def why_paragraph(ctx: Ctx, results: dict, seeds: range) -> str:
    """What grouped-query attention changes, every number computed here or measured by the tables' runs."""
    (opt, opt_what, _), (llama, llama_what, _) = COMPARED
    kv = {scale: kv_facts(ctx, scale) for scale in (opt, llama)}
    traces = [trace_for(results[opt][0], 1.0, s)[0] for s in seeds]  # lengths do not depend on the rate
    prompt = statistics.fmean(p for t in traces for _, p, _ in t)
    output = statistics.fmean(o for t in traces for _, _, o in t)
    job = prompt + output
    max_seqs = ctx.args.max_num_seqs
    c = {scale: results[scale][1]["C"] for scale in (opt, llama)}
    offloads = {(scale, p): stat(results[scale][2][(1.0, p)]["offloads"]) for scale in (opt, llama)
                for p in ("fcfs", "skip-join-mlfq")}
    moved = {scale: f"{count(offloads[(scale, 'fcfs')])} times a run under FCFS and "
                    f"{count(offloads[(scale, 'skip-join-mlfq')])} under skip-join" for scale in (opt, llama)}
    at_c = {scale: (results[scale][2][(1.0, "fcfs")], results[scale][2][(1.0, "srpt")]) for scale in (opt, llama)}
    fcfs_vs_oracle = {scale: fmt(ratio_stat(f["mean_per_token_s"], o["mean_per_token_s"]))
                      for scale, (f, o) in at_c.items()}
    none = all(offloads[(llama, p)].mean == 0 for p in ("fcfs", "skip-join-mlfq"))
    per_seq = kv[llama]["tokens"] / max_seqs
    llama_moved = ("it never did (no offload under either policy): the batch limit and the step time bind first; "
                   f"its KV would fill only with {max_seqs} sequences of {per_seq:,.0f} tokens each (the length "
                   "filter caps a job at 2,048)" if none else f"it did so {moved[llama]}")

    def shape(scale: str) -> str:
        cfg = kv[scale]["cfg"]
        return (f"2 x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} x 2 "
                f"bytes = {kv[scale]['per_token'] / 1024:.0f} KiB")

    def holds(scale: str) -> str:
        k = kv[scale]
        return (f"{k['device_gib']:.1f} GiB of KV, {k['blocks']:,} blocks of {BLOCK} tokens: {k['tokens']:,} tokens, "
                f"{k['tokens'] / job:,.0f} jobs of the traces' mean length")

    o, ll = kv[opt], kv[llama]
    cfg = ll["cfg"]
    return (
        f"Why the capacities differ. A token's KV on OPT-13B, a KV head per query head, is {shape(opt)}; Llama-3-8B's "
        f"grouped-query attention keeps {cfg.num_key_value_heads} KV heads for its {cfg.num_attention_heads} query "
        f"heads: {shape(llama)} ({cfg.num_attention_heads // cfg.num_key_value_heads}x less than with "
        f"{cfg.num_attention_heads} KV heads). The ShareGPT jobs of these traces average {prompt:.0f} prompt + "
        f"{output:.0f} output = {job:.0f} tokens. {opt_what} ({opt}) holds {holds(opt)}; {llama_what} ({llama}) "
        f"holds {holds(llama)} (the same bytes would hold {ll['mha_tokens']:,} tokens with "
        f"{cfg.num_attention_heads} KV heads), {ll['tokens'] / (max_seqs * job):.1f}x what the engine's batch limit "
        f"of {max_seqs} sequences (max_num_seqs) needs at that length. So KV memory binds OPT-13B long before its "
        f"batch limit ({o['tokens'] / job:.0f} jobs of {max_seqs}): at 1.0C the KV manager moved a job's KV to the "
        f"host {moved[opt]}; on Llama-3-8B {llama_moved}. FCFS's capacity C is {c[opt]:.2f} req/s on OPT-13B and "
        f"{c[llama]:.2f} req/s on Llama-3-8B ({c[llama] / c[opt]:.1f}x; {c[opt] * output:,.0f} against "
        f"{c[llama] * output:,.0f} output tokens/s at the mean output length). The order of jobs matters less where "
        f"memory does not bind: at 1.0C FCFS's mean per-token latency is {fcfs_vs_oracle[opt]}x the SRPT oracle's on "
        f"OPT-13B and {fcfs_vs_oracle[llama]}x on Llama-3-8B (paired per seed). Both rooflines are datasheet "
        "estimates: they show which resource binds where, not what a real A100 or H100 serves.")


def count(s: Stat) -> str:
    """A mean count over seeds and its 95% interval, as whole numbers."""
    return f"{s.mean:,.0f}" if s.half != s.half else f"{s.mean:,.0f} ± {s.half:,.0f}"
