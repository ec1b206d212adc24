"""Regenerate docs/experiments.md and its figures (docs/figures/*.png): the FastServe paper's experiments,
simulated at the paper's scale with roofline profiles, plus a small live measurement.

    python scripts/experiments.py                       # everything (~10 min on 2 shared cores)
    python scripts/experiments.py --only fig5,fig14     # some figures; prints their sections, keeps the doc
    python scripts/experiments.py --no-live --num-prompts 200

Sections: Fig. 1 (queueing share of latency under FCFS), Fig. 5 (first-iteration vs decode cost), Fig. 8
(peak KV memory, MLFQ vs FCFS), Fig. 12 (P95 per-token latency vs rate), Fig. 13 (goodput at 5x/10x/20x
light-load SLOs, per phase), Fig. 14 (policies over input:output ratios), Fig. 15a/b (KV policies vs
rate, latency breakdown), throughput at the 0.3 s/token SLO for every policy (table), sim vs live
(scripts/bench_sim_vs_live.py), and what the paper did not test (past capacity, the ENST ablation, alpha,
profiler error and bursty arrivals, the Azure 2023 conversation trace's arrivals).
Everything simulated runs engine/simulation.py (the real engine, scheduler
and KV manager on a virtual clock) with profiles/sim/*.json, which are roofline estimates from datasheets,
not measurements. The simulations are deterministic (seeded traces, virtual clock); the text of the document
is written from the numbers this run measured. Dataset paths come from flags (default
../shared/datasets/*_lengths.csv, relative to the repository root).

This file is the driver (flags, which sections run, the document); the sections live in
scripts/experiment_sections/ (one module per section or group; its __init__.py lists them and says how to
add one).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from experiment_sections import SECTIONS, run_order, section  # noqa: E402  (scripts/ is on the path)
from experiment_sections.common import DEFAULTS, MAIN, SCALES, Ctx  # noqa: E402
from experiment_sections.live_slo import LIVE_RATES  # noqa: E402

FIGURES = tuple(SECTIONS)  # every section, in the document's order


def update_doc(path: Path, parts: dict[str, str]) -> None:
    """Replace each part's section (from its '## ' heading to the next) in the doc, or append it."""
    text = path.read_text()
    for part in parts.values():
        heading = part.split("\n", 1)[0]
        start = text.find(heading + "\n")
        if start < 0:
            text = text.rstrip("\n") + "\n\n" + part.rstrip("\n") + "\n"
            continue
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + part.rstrip("\n") + "\n" + (text[end:] if end >= 0 else "")
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "experiments.md")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(FIGURES)}; prints the "
                                                 "sections and writes their figures, not the document")
    ap.add_argument("--sharegpt", type=Path, default=REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv")
    ap.add_argument("--alpaca", type=Path, default=REPO.parent / "shared" / "datasets" / "alpaca_lengths.csv")
    ap.add_argument("--azure", type=Path, default=REPO.parent / "shared" / "datasets" / "azure_llm_trace_2023"
                    / "AzureLLMInferenceTrace_conv.csv", help="Azure 2023 trace CSV of the azure section")
    ap.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"], help="ShareGPT requests per run")
    ap.add_argument("--num-prompts-alpaca", type=int, default=DEFAULTS["num_prompts_alpaca"])
    ap.add_argument("--scales", default="opt-13b,opt-13b-80gb,opt-66b,opt-175b",
                    help=f"comma-separated of {','.join(SCALES)} for the SLO table ({MAIN}, the figures' scale, "
                         "is always run)")
    ap.add_argument("--bisect", type=int, default=3, help="bisection steps after the rate grid")
    ap.add_argument("--span", type=float, default=20.0, help="arrivals span at least this many seconds")
    ap.add_argument("--max-prompts", type=int, default=2000, help="cap on requests per simulated run")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=2000, help="requests per point of the long-trace search")
    ap.add_argument("--io-total", type=int, default=1024)
    ap.add_argument("--io-load", type=float, default=1.5)
    ap.add_argument("--io-prompts", type=int, default=120)
    ap.add_argument("--io-spread", type=float, default=0.5, help="Fig. 14: lengths uniform over [1 - s, 1 + s] x "
                                                                  "their mean")
    ap.add_argument("--fig15-device-blocks", type=int, default=None, help="default: the profile's capacity")
    ap.add_argument("--no-live", action="store_true", help="skip the live measurements")
    ap.add_argument("--live-prompts", type=int, default=30, help="requests per rate in the live sweep")
    for ds, rates in LIVE_RATES.items():
        ap.add_argument(f"--live-rates-{ds.lower()}", default=rates, help="live sweep rates (req/s)")
    ap.add_argument("--live-max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overload-prompts", type=int, default=1500, help="requests per point of the overload, "
                    "ablation and alpha sections")
    ap.add_argument("--ablation-load", type=float, default=1.0, help="load of the ENST ablation (x capacity)")
    ap.add_argument("--update", action="store_true", help="with --only: replace those sections in --out")
    args = ap.parse_args(argv)
    args.scales = [MAIN] + [s for s in args.scales.split(",") if s != MAIN]
    if set(args.scales) - set(SCALES):
        ap.error(f"unknown scales {sorted(set(args.scales) - set(SCALES))}; choose from {list(SCALES)}")
    names = args.only.split(",") if args.only else [f for f in FIGURES if not (f.startswith("live") and args.no_live)]
    unknown = set(names) - set(FIGURES)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {FIGURES}")
    ctx = Ctx(args)
    t0 = time.perf_counter()
    parts = {}
    for name in run_order(names):
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        parts[name] = section(name)(ctx)
        print(f"   {name}: {time.perf_counter() - t:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    if args.only:
        print("\n\n".join(parts.values()))
        if args.update:
            update_doc(args.out, parts)
            print(f"updated {', '.join(parts)} in {args.out}")
        return 0
    head = ["# Experiments: FastServe's figures, simulated and measured", "",
            "Generated by `make experiments` (`python scripts/experiments.py`); every number below comes from "
            f"that run ({ctx.sim_runs} simulations, {wall / 60:.1f} min on this 2-core shared machine). Do not "
            "edit by hand.", "",
            "What these are: the paper's experiments run through engine/simulation.py, which drives the real "
            "engine, scheduler and KV manager on a virtual clock with iteration costs from a job profile. The "
            "profiles for OPT-13B/66B/175B on A100s (profiles/sim/, scripts/make_sim_profiles.py) are "
            "**roofline estimates from datasheet numbers, not measurements**: we have no A100. Absolute numbers "
            "therefore differ from the paper's; the comparisons between policies on the same profile and trace "
            "are what these runs show. The live section measures the real engine on this CPU.", "",
            f"Settings shared by all runs unless a section says otherwise: seed {args.seed}, max_num_seqs "
            f"{args.max_num_seqs}, block size 16, float16 KV, starvation threshold 0.3 s, proactive KV policy.", ""]
    args.out.write_text("\n".join(head) + "\n" + "\n".join(parts[k] for k in FIGURES if k in parts))
    print(f"wrote {args.out} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
