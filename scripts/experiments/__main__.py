"""Regenerate docs/experiments.md and its figures (docs/figures/*.png): the FastServe paper's experiments,
simulated at the paper's scale with roofline profiles, plus a small live measurement.

    python -m scripts.experiments                       # everything (hours on 2 cores: each section names its time)
    python -m scripts.experiments --only fig5,fig14     # some figures; prints their sections, keeps the doc
    python -m scripts.experiments --no-live --num-prompts 200

Sections: throughput at the SLO and goodput for every setup of the paper's Fig. 11/12 (by time: slo.py),
skip-join at capacity measured at steady state in units of FCFS's capacity beside the SRPT oracle (5
seeds, 95% intervals; steady_state.py), the same table for Llama-3-8B on an H100 beside OPT-13B (grouped-query
attention's KV room), Fig. 1 (queueing share of latency under FCFS, steady state), Fig. 5
(first-iteration vs decode cost), Fig. 8 (KV memory in use, MLFQ vs FCFS, steady state), Fig. 12 (P95 per-token
latency vs rate), Fig. 13 (goodput at 5x/10x/20x light-load SLOs, per phase), Fig. 14 (policies over input:output
ratios; and by time: goodput and a burst, fig14_past.py), Fig. 15a/b (KV policies vs rate, latency breakdown),
sim vs live (scripts/benchmarks/sim_vs_live.py),
and what the paper did not test (the ENST ablation, alpha, profiler error and bursty arrivals, the Azure 2023
conversation trace's arrivals), past capacity by time (throughput at the SLO, goodput, tokens per second, a
burst, the upload stall: past_capacity.py), and chunked prefill with long prompts among short ones (budget vs ITL
and served rate, against their goals).
Everything simulated runs engine/simulation.py (the real engine, scheduler
and KV manager on a virtual clock) with profiles/sim/*.json, which are roofline estimates from datasheets,
not measurements. The simulations are deterministic (seeded traces, virtual clock); the text of the document
is written from the numbers this run measured. Dataset paths come from flags (default
../shared/datasets/*_lengths.csv, relative to the repository root).

This file is the driver (flags, which sections run, the document); the sections are the other modules of
this package (one module per section or group; __init__.py lists them and says how to add one).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from scripts.experiments import SECTIONS, run_order, section
from scripts.experiments.common import DEFAULTS, Ctx
from scripts.experiments.live_slo import LIVE_RATES

REPO = Path(__file__).resolve().parents[2]

FIGURES = tuple(SECTIONS)  # every section, in the document's order


def update_doc(path: Path, parts: dict[str, str], order: tuple[str, ...] = FIGURES) -> None:
    """Replace each part's section (from its '## ' heading to the next) in the doc. A section the doc does not
    have yet goes where `order` puts it: before the first later section found in the doc (by its command line,
    `--only NAME`), else at the end."""
    text = path.read_text()
    for name, part in parts.items():
        heading = part.split("\n", 1)[0]
        start = text.find(heading + "\n")
        if start >= 0:
            end = text.find("\n## ", start + len(heading))
            text = text[:start] + part.rstrip("\n") + "\n" + (text[end:] if end >= 0 else "")
            continue
        later = order[order.index(name) + 1:] if name in order else ()
        at = next((i for i in (_section_start(text, n) for n in later) if i is not None), None)
        if at is None:
            text = text.rstrip("\n") + "\n\n" + part.rstrip("\n") + "\n"
        else:
            text = text[:at] + part.rstrip("\n") + "\n\n" + text[at:]
    path.write_text(text)


def _section_start(text: str, name: str) -> int | None:
    """Where the section whose command line runs `--only NAME` starts (its '## ' heading), if the doc has it."""
    for tail in ("`", " "):
        cmd = text.find(f"--only {name}{tail}")
        if cmd >= 0:
            head = text.rfind("\n## ", 0, cmd)
            return head + 1 if head >= 0 else None
    return None


REPLACED = "Sections replaced since that run by `--only ... --update` runs (the code of the day they ran): "


def note_replaced(path: Path, names: list[str]) -> None:
    """Keep the header true after an --update run: the line naming the sections that no longer come from the
    full run, with the date each was last replaced."""
    import datetime

    lines = path.read_text().split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith(REPLACED)), None)
    dates = dict(item.rsplit(" (", 1) for item in lines[at][len(REPLACED):].rstrip(".").split("; ")) if at else {}
    dates = {k: v.rstrip(")") for k, v in dates.items()}
    dates.update({n: datetime.date.today().isoformat() for n in names})
    line = REPLACED + "; ".join(f"{n} ({d})" for n, d in dates.items()) + "."
    if at is None:
        start = next(i for i, ln in enumerate(lines) if ln.startswith("Generated by"))
        lines[start + 1:start + 1] = ["", line]
    else:
        lines[at] = line
    path.write_text("\n".join(lines))


def check_section_flags(args: argparse.Namespace, names: list[str]) -> None:
    """The sections' own flags, checked before anything runs: a ValueError saying what is wrong."""
    if "slo" in names:
        from scripts.experiments.slo import parse_setups

        parse_setups(args.slo_setups)
    if "past_capacity" in names:
        from scripts.experiments.past_capacity import parse_workloads

        parse_workloads(args.past_workloads)


def at_least_one(text: str) -> int:
    """A count flag's type: an integer of 1 or more."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "experiments.md")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(FIGURES)}; prints the "
                                                 "sections and writes their figures, not the document")
    ap.add_argument("--sharegpt", type=Path, default=REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv")
    ap.add_argument("--alpaca", type=Path, default=REPO.parent / "shared" / "datasets" / "alpaca_lengths.csv")
    ap.add_argument("--azure", type=Path, default=REPO.parent / "shared" / "datasets" / "azure_llm_trace_2023"
                    / "AzureLLMInferenceTrace_conv.csv", help="Azure 2023 trace CSV of the azure section")
    ap.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"], help="ShareGPT requests per run")
    ap.add_argument("--num-prompts-alpaca", type=int, default=DEFAULTS["num_prompts_alpaca"])
    ap.add_argument("--slo-setups", default="all", help="the slo section's setups: all, or comma-separated "
                    "SCALE:DATASET of slo.SETUPS (e.g. opt-13b:sharegpt,opt-66b:alpaca)")
    ap.add_argument("--slo-prompts", type=int, default=10000, help="requests per point of the slo section's searches "
                    "(= --past-prompts: its OPT-13B ShareGPT runs are past_capacity's)")
    ap.add_argument("--slo-seeds", type=int, default=3, help="seeds of the slo section")
    ap.add_argument("--slo-other-seeds", type=int, default=None, help="seeds of the non-headline slo setups")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--io-total", type=int, default=1024)
    ap.add_argument("--io-load", type=float, default=0.9, help="Fig. 14's load, x C (at most 1.0: steady state)")
    ap.add_argument("--io-spread", type=float, default=0.5, help="Fig. 14: lengths uniform over [1 - s, 1 + s] x "
                                                                  "their mean")
    ap.add_argument("--no-live", action="store_true", help="skip the live measurements")
    ap.add_argument("--live-prompts", type=int, default=30, help="requests per rate in the live sweep")
    ap.add_argument("--live-seeds", type=int, default=3, help="seeds of the live sweep (each policy, each rate)")
    for ds, rates in LIVE_RATES.items():
        ap.add_argument(f"--live-rates-{ds.lower()}", default=rates, help="live sweep rates (req/s)")
    ap.add_argument("--live-max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overload-prompts", type=int, default=1500, help="requests per point of the overload, "
                    "ablation and alpha sections")
    ap.add_argument("--steady-prompts", type=int, default=3000, help="requests per point of the capacity section")
    ap.add_argument("--steady-seeds", type=int, default=5, help="seeds of the capacity section's main table")
    ap.add_argument("--steady-goal-prompts", type=int, default=10000, help="requests per point of the capacity "
                    "section's goal rows (0.9C and 0.95C)")
    ap.add_argument("--steady-goal-seeds", type=at_least_one, default=5, help="seeds of its goal rows")
    ap.add_argument("--steady-other-seeds", type=int, default=3, help="seeds of its other setups (0: not run)")
    ap.add_argument("--llama-seeds", type=int, default=3, help="seeds of the capacity_llama section's tables")
    ap.add_argument("--curve-seeds", type=int, default=3, help="seeds of Fig. 12 and 13 (steady state)")
    ap.add_argument("--steady-jobs", type=int, default=None, help="simulations at once (default: the cores)")
    ap.add_argument("--past-prompts", type=int, default=10000, help="requests per point of the past_capacity "
                    "section's searches and tokens per second (its steady state)")
    ap.add_argument("--past-seeds", type=int, default=5, help="seeds of the past_capacity section")
    ap.add_argument("--past-resolution", type=float, default=0.05, help="the past_capacity section's searches stop "
                    "when their failing load is within this fraction of their passing one")
    ap.add_argument("--past-workloads", default="all", help="the workloads of the past_capacity section's "
                    "tokens-per-second table beyond ShareGPT: all, none, or comma-separated names of "
                    "past_capacity.WORKLOADS")
    ap.add_argument("--past-workload-prompts", type=int, default=3000, help="requests per point of those workloads")
    ap.add_argument("--past-workload-seeds", type=int, default=3, help="seeds of those workloads")
    ap.add_argument("--fig14-past-seeds", type=int, default=2, help="seeds of fig14_past (C: past_capacity's)")
    ap.add_argument("--burst-seconds", type=float, default=600.0, help="the past_capacity section's burst at 1.5C "
                    "(virtual seconds)")
    ap.add_argument("--chunked-budget", type=int, default=256, help="the chunked section's budget for its goals "
                    "(--max-num-batched-tokens)")
    ap.add_argument("--update", action="store_true", help="with --only: replace those sections in --out")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else [f for f in FIGURES if not (f.startswith("live") and args.no_live)]
    unknown = set(names) - set(FIGURES)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {FIGURES}")
    try:
        check_section_flags(args, names)
    except ValueError as e:
        ap.error(str(e))
    ctx = Ctx(args)
    t0 = time.perf_counter()
    parts = {}
    for name in run_order(names):
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        parts[name] = section(name)(ctx)
        print(f"   {name}: {time.perf_counter() - t:.0f} s", flush=True)
        if args.only and args.update:  # each section lands as it is done: a long run stopped keeps the rest
            update_doc(args.out, {name: parts[name]})
            note_replaced(args.out, [name])
    wall = time.perf_counter() - t0
    if args.only:
        print("\n\n".join(parts.values()))
        if args.update:
            print(f"updated {', '.join(parts)} in {args.out}")
        return 0
    head = ["# Experiments: FastServe's figures, simulated and measured", "",
            "Generated by `make experiments` (`python -m scripts.experiments`); every number below comes from "
            f"that run ({ctx.sim_runs} simulations, {wall / 60:.1f} min on this 2-core shared machine). Do not "
            "edit by hand.", "",
            "What these are: the paper's experiments run through engine/simulation.py, which drives the real "
            "engine, scheduler and KV manager on a virtual clock with iteration costs from a job profile. The "
            "profiles for OPT-13B/66B/175B on A100s and Llama-3 on H100s and an H200 (profiles/sim/, "
            "scripts/tools/make_sim_profiles.py; docs/benchmarks.md, \"Simulator profiles\") are **roofline "
            "estimates from datasheet numbers, not measurements**: we have none of these GPUs. Absolute numbers "
            "therefore differ from the paper's; the comparisons between policies on the same profile and trace "
            "are what these runs show. The live section measures the real engine on this CPU.", "",
            f"Settings shared by all runs unless a section says otherwise: the engine's defaults (docs/scheduling.md), "
            f"seed {args.seed}, max_num_seqs {args.max_num_seqs}, block size 16, float16 KV, proactive KV policy.", ""]
    args.out.write_text("\n".join(head) + "\n" + "\n".join(parts[k] for k in FIGURES if k in parts))
    print(f"wrote {args.out} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
