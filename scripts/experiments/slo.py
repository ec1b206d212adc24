"""Throughput at the SLO and goodput for every setup of the paper's Fig. 11/12 (OPT-13B on an A100 40GB and 80GB,
OPT-66B on 4 GPUs, OPT-175B on 16; ShareGPT and Alpaca), measured by time (scripts/experiments/measures.py): per
policy and seed, the highest Poisson load whose steady-state run meets the SLO by its mean, by its P95, and
DistServe's goodput; loads in units of FCFS's capacity C of the setup; ratios paired per seed.

    python -m scripts.experiments --only slo --slo-setups opt-13b:sharegpt --slo-prompts 3000 --slo-seeds 2

Its OPT-13B A100-40GB ShareGPT searches are past_capacity's (the same Setup, capacity and Bracket): with the same
requests a point (--slo-prompts = --past-prompts) the runner's cache serves one section the other's runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from scripts.experiments.common import MAIN, REPO, SCALES, Ctx
from scripts.experiments.measures import GOODPUT_SHARE, Bracket, highest_loads, load_stats
from scripts.experiments.past_capacity import GRID_NOTE, MEASURES, POLICIES, fail_cell, ratio_cell
from scripts.experiments.steady_state import (
    DATASETS,
    GOODPUT_TTFT_S,
    SLO_DECODES,
    Runner,
    Setup,
    capacity,
    fmt,
    slo_seconds,
)

# The paper's Fig. 11/12 setups, in its order: (scale of common.SCALES, dataset of steady_state.DATASETS).
SETUPS = tuple((scale, ds) for scale in ("opt-13b", "opt-13b-80gb", "opt-66b", "opt-175b")
               for ds in ("sharegpt", "alpaca"))
HEADLINE = (MAIN, "sharegpt")
SUBJECT, ORACLE = "skip-join-mlfq", "srpt"
# Where capacity()'s search starts (req/s), from earlier measurements of C, so it needs one or two offers; the
# headline setup starts where past_capacity's does (1.0) so that they share its runs.
CAPACITY_START = {("opt-13b", "alpaca"): 128.0, ("opt-13b-80gb", "sharegpt"): 16.0,
                  ("opt-13b-80gb", "alpaca"): 256.0, ("opt-66b", "sharegpt"): 4.0, ("opt-66b", "alpaca"): 64.0,
                  ("opt-175b", "sharegpt"): 8.0, ("opt-175b", "alpaca"): 128.0}


def parse_setups(text: str) -> list[tuple[str, str]]:
    """--slo-setups: "all", or comma-separated SCALE:DATASET pairs of SETUPS."""
    if text == "all":
        return list(SETUPS)
    pairs = [tuple(item.split(":", 1)) for item in text.split(",") if item]
    bad = [":".join(p) for p in pairs if p not in SETUPS]
    if bad:
        raise ValueError(f"unknown --slo-setups {bad}; choose from {', '.join(f'{s}:{d}' for s, d in SETUPS)}")
    return pairs  # type: ignore[return-value]


def setup_for(ctx: Ctx, scale: str, dataset: str, n: int) -> Setup:
    """The Setup of a row, as past_capacity builds its own (a dataset path only where a flag moved it)."""
    flag = Path(ctx.args.sharegpt if dataset == "sharegpt" else ctx.args.alpaca)
    return Setup(scale, dataset, n, dataset_path=None if flag == DATASETS[dataset] else str(flag))


def layout(scale: str) -> str:
    data = json.loads((REPO / SCALES[scale][1]).read_text())
    tp, pp = data["key"]["tensor_parallel_size"], data["key"]["pipeline_parallel_size"]
    return (f"{tp * pp} GPU{'s' if tp * pp > 1 else ''}" + (f", tensor parallel {tp}" if tp > 1 else "")
            + (f" x pipeline parallel {pp}" if pp > 1 else ""))


def seeds_of(args, setup: tuple[str, str]) -> int:
    """The seeds of a setup: --slo-seeds for the headline, --slo-other-seeds (default: the same) for the others."""
    return args.slo_seeds if setup == HEADLINE or args.slo_other_seeds is None else args.slo_other_seeds


def measure(ctx: Ctx, runner: Runner, scale: str, dataset: str) -> dict:
    a = ctx.args
    setup = setup_for(ctx, scale, dataset, a.slo_prompts)
    seeds = range(seeds_of(a, (scale, dataset)))
    cap = capacity(runner, setup, range(min(3, len(seeds))), CAPACITY_START.get((scale, dataset)))
    found = highest_loads(runner, setup, POLICIES, seeds, cap["C"], resolution=a.past_resolution)
    print(f"  slo {scale} {dataset}: C {cap['C']:.3f} ({runner.runs} simulations so far)", flush=True)
    return {"cap": cap, "slo": slo_seconds(setup), "found": found, "fcfs": load_stats(found, cap["C"]),
            "oracle": load_stats(found, cap["C"], reference=ORACLE)}


def headline(rows: dict, seeds: int) -> list[str]:
    """The sentence on skip-join / FCFS at the headline setup, from its numbers (nothing if it did not run)."""
    if HEADLINE not in rows:
        return []
    r = rows[HEADLINE]
    vs_fcfs = [ratio_cell(r["fcfs"][(j, SUBJECT)]["vs_ref"]) for j, _ in MEASURES]
    vs_oracle = [fmt(r["oracle"][(j, SUBJECT)]["vs_ref"]) for j, _ in MEASURES]
    return [f"**Headline** (OPT-13B, A100 40GB, ShareGPT; {seeds} seeds, ratios paired per seed, mean ± 95% "
            f"interval): skip-join MLFQ's throughput at the SLO is {vs_fcfs[0]} x FCFS's by the mean per-token "
            f"latency and {vs_fcfs[1]} x by the P95, and its goodput {vs_fcfs[2]} x FCFS's; against the bounded "
            f"oracle (srpt) the same three are {vs_oracle[0]}, {vs_oracle[1]} and {vs_oracle[2]}. The paper reports "
            "1.9x-2.9x (mean) at its 0.3 s SLO against vLLM (FCFS) on real A100s, from runs of a few hundred "
            "requests that did not reach a steady state.", ""]


def section_slo(ctx: Ctx) -> str:
    a = ctx.args
    runner = Runner(jobs=a.steady_jobs)
    t0 = time.perf_counter()
    chosen = parse_setups(a.slo_setups)
    rows = {sd: measure(ctx, runner, *sd) for sd in chosen}
    others = "" if a.slo_other_seeds is None else f" --slo-other-seeds {a.slo_other_seeds}"
    flags = f"--slo-setups {a.slo_setups} --slo-prompts {a.slo_prompts} --slo-seeds {a.slo_seeds}{others} " \
            f"--past-resolution {a.past_resolution}"
    counts = sorted({seeds_of(a, sd) for sd in chosen})
    how_many = (f"{counts[0]} seeds" if len(counts) == 1 else
                f"{a.slo_seeds} seeds for the headline setup and {a.slo_other_seeds} for the others")
    left_out = [f"{s} {d}" for s, d in SETUPS if (s, d) not in rows]
    lines = ["## Throughput at the SLO and goodput, every setup (Fig. 11/12), by time", "",
             f"Command: `{ctx.cmd('slo')} {flags}` (scripts/experiments/slo.py, measures.py). Per setup and "
             f"policy, for each of {how_many} (mean ± 95% interval where there are two or more; ratios paired "
             "per seed): the highest "
             "Poisson load, in units of the setup's C (FCFS's sustained capacity, measured by the same harness), "
             f"whose steady-state run ({a.slo_prompts} requests a point through vLLM's length filter, those arriving "
             "in the middle 80% of the trace counted, the run lasting until they finish) keeps the mean per-token "
             f"latency within the SLO; the same for P95; and goodput: at least {GOODPUT_SHARE:.0%} of the counted "
             f"requests within the SLO with a TTFT <= {GOODPUT_TTFT_S:g} s (DistServe's). The SLO of a setup: "
             f"{SLO_DECODES} decode iterations at batch 1 of its profile (steady_state.slo_seconds). Found by "
             f"bracketing (x1.5 from 1.0C) and bisection until the failing load is within "
             f"{a.past_resolution:.0%} of the passing one, up to {Bracket().highest:g}C. {GRID_NOTE} Policies: "
             f"{', '.join(POLICIES)} (`srpt`: SRPT on the true output lengths with the defaults' age promotion, "
             "the bounded oracle; `srpt-unbounded`: without it). The engine's defaults, roofline profiles.", ""]
    if left_out:
        lines += [f"Not run this time (time; `--slo-setups all` runs them): {', '.join(left_out)}.", ""]
    lines += headline(rows, a.slo_seeds)
    lines += ["| setup | C req/s | SLO s/token | skip-join / FCFS: mean | P95 | goodput | skip-join / srpt: mean | "
              "P95 | goodput |", "|---|---|---|---|---|---|---|---|---|"]
    for (scale, ds), r in rows.items():
        cells = [ratio_cell(r["fcfs"][(j, SUBJECT)]["vs_ref"]) for j, _ in MEASURES]
        cells += [fmt(r["oracle"][(j, SUBJECT)]["vs_ref"]) for j, _ in MEASURES]
        lines.append(f"| {scale} {ds} | {r['cap']['C']:.3f} | {r['slo']:.3f} | " + " | ".join(cells) + " |")
    for (scale, ds), r in rows.items():
        lines += ["", f"**{scale}, {ds}** ({SCALES[scale][1]}: {layout(scale)}; roofline estimate; "
                  f"{seeds_of(a, (scale, ds))} seed(s)): C = "
                  f"{r['cap']['C']:.3f} req/s (FCFS served under a {r['cap']['offered']:.2f} req/s offer), SLO "
                  f"{r['slo']:.3f} s/token.", "",
                  "| measure | policy | load (x C) | fails at (per seed) | req/s | / FCFS | / srpt | seeds at the "
                  "ceiling / floor |", "|---|---|---|---|---|---|---|---|"]
        for judge, label in MEASURES:
            for p in POLICIES:
                d, o = r["fcfs"][(judge, p)], r["oracle"][(judge, p)]
                edge = f"{d['capped']} / {d['floored']}" if d["capped"] or d["floored"] else "-"
                lines.append(f"| {label} | {p} | {fmt(d['load'])} | {fail_cell(r['found'][(judge, p)])} | "
                             f"{fmt(d['rate'])} | {ratio_cell(d['vs_ref'])} | "
                             f"{'-' if o['vs_ref'] is None else fmt(o['vs_ref'])} | {edge} |")
    past = sorted({p for r in rows.values() for (_, p), d in r["fcfs"].items() if d["load"].mean > 1.0})
    if past:
        lines += ["", f"Where a load above 1.0C passes ({', '.join(past)}), it is a run of {a.slo_prompts} requests "
                  "past FCFS's capacity: the order keeps the short jobs within the SLO while the long ones queue, "
                  "and that queue grows for as long as the run lasts, so such a load passes for this many requests "
                  "and may fail for more (the past_capacity section measures that region by time: tokens per "
                  "second and a burst)."]
    lines += ["", f"This section: {runner.runs} simulations run now ({runner.wall / 60:.0f} min of simulation, "
              f"{(time.perf_counter() - t0) / 60:.0f} min wall; the rest came from the cache), simulation code "
              f"version {runner.version} (scripts/experiments/steady_state.py, code_version).", ""]
    return "\n".join(lines)
