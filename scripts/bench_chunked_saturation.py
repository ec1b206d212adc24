"""Chunked prefill's throughput past capacity (issue 25's goal: chunked serves at least 0.97x the generated tokens
per second of unchunked at saturation), in the simulator, by scripts/steady_state.py's method: the issue's mix
(scripts/experiment_sections/chunked.py mix_setup: ShareGPT lengths, 10% of the prompts 1,500-2,000 tokens),
OPT-13B on the A100 40GB profile, offered --rate req/s (4.0 = 1.69x FCFS's capacity on the mix), chunked at each
--budgets and unchunked on the same traces, per policy and seed.

    .venv/bin/python scripts/bench_chunked_saturation.py --seeds 0 1 2 --budgets 256 --policies skip-join-mlfq fcfs

One line per (policy, budget, seed): the tokens generated inside the middle-80% window by every request, per second
(the goal's measure: steady_state's window_tokens_per_s), its ratio to unchunked on the same trace, the tokens of
the requests that finished in the window per second (what this script measured before session 19: it depends on
which requests a policy lets finish there), the served rate and the KV manager's offloads and drops; then the
ratios' mean and min per (policy, budget).
Results are cached as steady_state.Runner caches them (by parameters and simulation code version).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiment_sections.chunked import mix_setup  # noqa: E402
from steady_state import Runner  # noqa: E402

GOAL = 0.97
MEASURE = "window_tokens_per_s"  # every token generated inside the window, per second (steady_state.windowed_metrics)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0, help="offered req/s (default 4.0, 1.69x capacity)")
    ap.add_argument("--num-prompts", type=int, default=3000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256])
    ap.add_argument("--policies", nargs="+", default=["skip-join-mlfq", "fcfs"])
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: the machine's cores)")
    ap.add_argument("--cache", type=Path, default=None, help="result cache (default .cache/steady/)")
    args = ap.parse_args(argv)
    runner = Runner(args.jobs, args.cache)
    budgets: list[int | None] = [None, *args.budgets]
    keys = [(p, b, s) for p in args.policies for b in budgets for s in args.seeds]
    res = dict(zip(keys, runner.many([(mix_setup(args.num_prompts, b), p, args.rate, s) for p, b, s in keys])))
    print(f"offered {args.rate:g} req/s, {args.num_prompts} requests, simulation code version {runner.version}")
    print("| policy | budget | seed | tok/s (/ unchunked) | finished requests' tok/s (/ unchunked) | served req/s | "
          "offloads | drops |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.policies:
        for b in budgets:
            for s in args.seeds:
                r, u = res[(p, b, s)], res[(p, None, s)]
                cells = []
                for key in (MEASURE, "generated_tokens_per_s"):
                    ratio = "" if b is None else f" ({r[key] / u[key]:.3f})"
                    cells.append(f"{r[key]:.1f}{ratio}")
                print(f"| {p} | {b or 'unchunked'} | {s} | {cells[0]} | {cells[1]} | "
                      f"{r['served_rate']:.3f} | {r['offloads']:,} | {r['drops']:,} |")
    for p in args.policies:
        for b in args.budgets:
            ratios = [res[(p, b, s)][MEASURE] / res[(p, None, s)][MEASURE] for s in args.seeds]
            verdict = "met" if min(ratios) >= GOAL else "NOT met"
            print(f"{p} budget {b} / unchunked, tok/s in the window: mean {statistics.fmean(ratios):.3f}, "
                  f"min {min(ratios):.3f} over {len(ratios)} seeds (goal >= {GOAL} on every seed: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
