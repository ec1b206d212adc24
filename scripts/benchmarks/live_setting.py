"""Which live setting makes the order of jobs matter: for each setting (a batch bound and a device KV size), the
tiny model's CPU profile in the simulator finds FCFS's capacity C and runs FCFS, skip-join MLFQ and the SRPT oracle
at a load of C; prints each one's gain over FCFS, paired per seed, and skip-join's share of the oracle's.

    python -m scripts.benchmarks.live_setting --settings 256:1024,16:1024,8:1024,256:160 --seeds 5

A setting is MAX_NUM_SEQS:DEVICE_BLOCKS (16-token blocks; 8,192 host blocks). With every request in the batch at
once (the engine's default of 256 sequences and a KV cache that holds them all) the engine shares its iterations
among all jobs and no order can change anything; `fastserve compare` runs in a setting this picks (fastserve/compare.py,
ORDER_MATTERS). The profile's costs are multiplied by --cost-scale: the live engine's per-iteration work that no
profile measures makes live iterations slower (`fastserve replay --match-live` measures the factor on a live run).
The method is the simulator's (docs/scheduling.md, "How policies are compared"): ShareGPT lengths, Poisson
arrivals, a seed draws both; C is FCFS's served rate when offered at least 1.3x it; the requests arriving in the
middle 80% count; mean and 95% interval over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from engine.simulation import run_trace, simulated_engine
from fastserve.bench.workload import LengthFilter, load_workload
from fastserve.replay import scaled_profile
from scripts.experiments.steady_state import DATASETS, fmt, stat, windowed_metrics

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "docs" / "data" / "live-capacity-traces" / "tiny-opt-cpu-profile.json"
POLICIES = ("fcfs", "skip-join-mlfq", "srpt")


def run(profile: Path, setting: tuple[int, int], policy: str, rate: float, seed: int, n: int) -> dict:
    """One simulation of n ShareGPT-length requests at a Poisson rate; its windowed metrics."""
    items = load_workload("lengths", n, path=DATASETS["sharegpt"], rate=rate, seed=seed,
                          length_filter=LengthFilter(), stats={})
    trace = [(it.arrival_s, it.prompt_len, it.output_len) for it in items]
    seqs, blocks = setting
    engine = simulated_engine(REPO / "models" / "tiny-opt", profile, dtype="float32", scheduling_policy=policy,
                              max_num_seqs=seqs, num_device_blocks=blocks, num_host_blocks=8192)
    return windowed_metrics(run_trace(engine, trace).outputs, [a for a, _, _ in trace])


def capacity(profile: Path, setting: tuple[int, int], n: int, seeds: int, start: float) -> float:
    offered = start
    while True:
        served = statistics.fmean(run(profile, setting, "fcfs", offered, s, n)["served_rate"] for s in range(seeds))
        if offered >= 1.3 * served:
            return served
        offered = max(offered * 2, 1.5 * served)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="256:1024,16:1024,8:1024,256:160",
                    help="comma-separated MAX_NUM_SEQS:DEVICE_BLOCKS")
    ap.add_argument("--profile", type=Path, default=PROFILE, help="the tiny model's job profile on this CPU")
    ap.add_argument("--cost-scale", type=float, default=1.2)
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--capacity-seeds", type=int, default=2)
    ap.add_argument("--capacity-start", type=float, default=4.0)
    args = ap.parse_args(argv)
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    t0 = time.perf_counter()
    print(f"{'seqs:blocks':>12} {'C req/s':>8} {'FCFS / skip-join':>18} {'FCFS / oracle':>16} "
          f"{'skip-join gain / oracle gain, per seed':>40}")
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        profile.write_text(json.dumps(scaled_profile(json.loads(args.profile.read_text()), args.cost_scale)))
        for setting in settings:
            cap = capacity(profile, setting, args.num_prompts, args.capacity_seeds, args.capacity_start)
            means = {p: [run(profile, setting, p, cap, s, args.num_prompts)["mean_per_token_s"]
                         for s in range(args.seeds)] for p in POLICIES}
            sj = stat([f / x for f, x in zip(means["fcfs"], means["skip-join-mlfq"])])
            oracle = stat([f / x for f, x in zip(means["fcfs"], means["srpt"])])
            share = stat([a / b for a, b in zip(sj.values, oracle.values)])
            print(f"{setting[0]:>7}:{setting[1]:<4} {cap:>8.3f} {fmt(sj):>18} {fmt(oracle):>16} "
                  f"{fmt(share):>12} ({', '.join(f'{v:.2f}' for v in share.values)})", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
