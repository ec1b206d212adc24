"""Simulate a serving run: the real engine, scheduler and KV manager on a
virtual clock, with costs from a job profile (engine/simulation.py).

    python scripts/simulate.py --model models/opt-13b-config --profile profiles/sim/opt-13b-a100-40gb-x1.json \
        --dataset-name lengths --dataset-path ../shared/datasets/sharegpt_lengths.csv \
        --num-prompts 1000 --request-rate 2 --scheduling-policy skip-join-mlfq --kv-policy proactive

Prints the paper's metrics (mean and P95 per-token latency), TTFT, the
queued / executing / swap-wait breakdown, and simulation speed; --json writes
them. Same seed, same result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import DATASETS, load_workload  # noqa: E402  (scripts/ is this script's folder)

from engine.simulation import run_trace, simulated_engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an OPT directory (config.json + tokenizer; weights unused)")
    ap.add_argument("--profile", required=True, help="job profile JSON (+ optional transfer/capacity fields)")
    ap.add_argument("--dataset-name", default="lengths", choices=sorted(DATASETS))
    ap.add_argument("--dataset-path", help="dataset file")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson rate (default: trace times / all at 0)")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheduling-policy", default="skip-join-mlfq")
    ap.add_argument("--kv-policy", default="proactive")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--starvation-threshold", type=float, default=0.3)
    none_or_float = lambda v: None if v.lower() == "none" else float(v)  # noqa: E731
    ap.add_argument("--kv-overcommit", type=none_or_float, default=2.0,
                    help="overload admission: started jobs' KV may total this many device caches; 'none' = no limit "
                         "(the paper)")
    ap.add_argument("--fresh-starvation-factor", type=none_or_float, default=None,
                    help="a job that never ran is promoted after max(alpha, this x the recent wait to a first run); "
                         "'none' = alpha (the paper)")
    ap.add_argument("--num-device-blocks", type=int, default=None, help="override the profile's capacity")
    ap.add_argument("--num-host-blocks", type=int, default=None)
    ap.add_argument("--json", type=Path, help="write the summary here")
    args = ap.parse_args(argv)

    items = load_workload(args.dataset_name, args.num_prompts, path=args.dataset_path, rate=args.request_rate,
                          burstiness=args.burstiness, seed=args.seed)
    engine = simulated_engine(args.model, args.profile, num_device_blocks=args.num_device_blocks,
                              num_host_blocks=args.num_host_blocks, scheduling_policy=args.scheduling_policy,
                              kv_policy=args.kv_policy, max_num_seqs=args.max_num_seqs,
                              starvation_threshold=args.starvation_threshold, kv_overcommit=args.kv_overcommit,
                              fresh_starvation_factor=args.fresh_starvation_factor)
    limit = engine.max_model_len
    trace = [(it.arrival_s, max(1, min(it.prompt_len, limit - 1)), max(1, min(it.output_len, limit - it.prompt_len)))
             for it in items]
    t = time.perf_counter()
    result = run_trace(engine, trace)
    wall = time.perf_counter() - t
    kv = engine.kv.stats
    summary = result.summary() | {"offloads": kv.num_offloads, "thrash": kv.num_thrash, "drops": kv.num_drops,
                                   "recomputed_tokens": kv.num_recomputed_tokens, "wall_s": wall,
                                   "policy": args.scheduling_policy, "kv_policy": args.kv_policy,
                                   "rate": args.request_rate}
    for k, v in summary.items():
        print(f"{k:>20}: {v:.4f}" if isinstance(v, float) else f"{k:>20}: {v}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
