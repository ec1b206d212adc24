"""Chunked prefill (issue 25) in the simulator: ShareGPT lengths with a share of the requests replaced by long
prompts, chunked and unchunked, per policy and budget; P99 / median ITL, the short requests' mean per-token
latency and P99 TTFT, and the served rate.

    .venv/bin/python scripts/bench_chunked_prefill.py --rate 2.0 --seeds 0 1 2 --budgets 256 512 2048

A request is "long" when its prompt was replaced (1,500-2,000 tokens, output capped at 2,048 in all); the short
ones are the rest. Only requests arriving in the middle 80% of the trace count (DESIGN.md's steady state). ITL is
every gap between a request's successive tokens over the counted requests. --capacity runs FCFS unchunked at
--rate and prints the served rate (requests finished per second over the run), which is C when --rate is past
it. One line per (policy, chunking, budget), each metric the mean over the seeds with its spread (min-max).

Not the issue's full measurement (5 seeds at 0.8C and 3,000 requests a point, in scripts/experiments.py): a
smaller run of the same shape, what its report quotes with this command.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.simulation import quantile, run_trace, simulated_engine  # noqa: E402
from fastserve.bench.workload import LengthFilter, load_workload  # noqa: E402

PROFILE = REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"
LENGTHS = REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv"


def mixed_trace(n: int, rate: float, seed: int, long_share: float) -> tuple[list[tuple[float, int, int]], set[int]]:
    items = load_workload("lengths", n, path=LENGTHS, rate=rate, seed=seed,
                          length_filter=LengthFilter(max_prompt_len=1024, max_total_len=2048))
    rng = random.Random(seed + 1000)
    trace, long = [], set()
    for i, it in enumerate(items):
        prompt, out = it.prompt_len, it.output_len
        if rng.random() < long_share:
            prompt = rng.randint(1500, 2000)
            out = max(1, min(out, 2048 - prompt))
            long.add(i)
        trace.append((it.arrival_s, prompt, out))
    return trace, long


def one_run(args, policy: str, chunked: bool, budget: int, seed: int) -> dict:
    from make_tiny_model import config_only_model

    trace, long = mixed_trace(args.num_prompts, args.rate, seed, args.long_share)
    engine = simulated_engine(config_only_model("opt-13b"), PROFILE, scheduling_policy=policy,
                              kv_policy="proactive", max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    result = run_trace(engine, trace)
    arrivals = sorted(t[0] for t in trace)
    lo, hi = arrivals[int(0.1 * len(arrivals))], arrivals[int(0.9 * len(arrivals)) - 1]
    counted = [(int(o.request_id), o) for o in result.outputs if lo <= o.metrics.arrival_time <= hi]
    short = [o for i, o in counted if i not in long]
    itl = [g for _, o in counted for g in o.metrics.itl_s]
    return {
        "p99_itl": quantile(itl, 0.99), "median_itl": quantile(itl, 0.5),
        "short_per_token": statistics.fmean(o.metrics.e2e_s / len(o.outputs[0].token_ids) for o in short),
        "short_p99_ttft": quantile([o.metrics.ttft_s for o in short], 0.99),
        "served_rate": len(result.outputs) / result.duration_s,
        "utilization": result.busy_s / result.duration_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--long-share", type=float, default=0.1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512])
    ap.add_argument("--policies", nargs="+", default=["skip-join-mlfq", "fcfs"])
    ap.add_argument("--capacity", action="store_true", help="FCFS unchunked only: the served rate at --rate")
    args = ap.parse_args(argv)
    if args.capacity:
        rates = [one_run(args, "fcfs", False, 8192, s)["served_rate"] for s in args.seeds]
        print(f"FCFS unchunked served {statistics.fmean(rates):.3f} req/s at {args.rate} req/s offered "
              f"({', '.join(f'{r:.3f}' for r in rates)})")
        return 0
    keys = ("p99_itl", "median_itl", "short_per_token", "short_p99_ttft", "served_rate", "utilization")
    print(f"{'policy':>15} {'chunked':>8} {'budget':>7} " + " ".join(f"{k:>24}" for k in keys))
    for policy in args.policies:
        configs = [(False, 8192)] + [(True, b) for b in args.budgets]
        for chunked, budget in configs:
            runs = [one_run(args, policy, chunked, budget, s) for s in args.seeds]
            cells = []
            for k in keys:
                xs = [r[k] for r in runs]
                cells.append(f"{statistics.fmean(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})")
            print(f"{policy:>15} {str(chunked):>8} {budget:>7} " + " ".join(f"{c:>24}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
