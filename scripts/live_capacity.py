"""Skip-join against FCFS live, at FCFS's live capacity, measured the way scripts/steady_state.py measures the
simulator (the team's design notes, "How a comparison is measured"): real servers (server.py) over loopback HTTP,
the load generator (`fastserve bench serve`) sending ShareGPT lengths at Poisson arrivals, and

- capacity C: FCFS's served rate (requests finished while arrivals are in their middle 80%, per second of that
  window) when offered more than it serves (offered >= 1.3x served), over --capacity-seeds seeds;
- per seed, FCFS and skip-join at --load x C on the same trace (the seed draws the requests and the arrivals);
  mean per-token latency (e2e / output tokens) over the requests arriving in the middle 80%; paired ratios per
  seed with a 95% t interval.

    python scripts/live_capacity.py --seeds 5 --num-prompts 300 -- --num-gpu-blocks-override 1024

Everything after `--` goes to every server (default: the built-in tiny model; 1,024 blocks of 16 tokens are 8
contexts of its 2,048, so memory binds as on a GPU). Each server runs with --server-threads torch threads so the
load generator keeps a core. Writes every load generator result and a summary JSON to --result-dir; the summary's
traces can be replayed in the simulator with scripts/replay_in_sim.py to see the oracle on the same requests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from server_process import ServerProcess  # scripts/ is this script's folder
from steady_state import WINDOW, stat

from engine.simulation import p95

REPO = Path(__file__).resolve().parents[1]


def window_metrics(result: dict) -> dict:
    """Served rate and mean per-token latency of a load generator result, steady-state window (the middle 80% of
    the arrival span), as steady_state.windowed_metrics computes them for a simulation."""
    starts, e2e, outs = result["start_times"], result["e2els"], result["output_lens"]
    done = [i for i, n in enumerate(outs) if n > 0]
    first, last = min(starts), max(starts)
    lo, hi = first + WINDOW[0] * (last - first), first + WINDOW[1] * (last - first)
    counted = [i for i in done if lo <= starts[i] <= hi]
    finished_in = sum(1 for i in done if lo <= starts[i] + e2e[i] <= hi)
    per_token = [e2e[i] / outs[i] for i in counted]
    return {"counted": len(counted), "failed": len(outs) - len(done),
            "served_rate": finished_in / (hi - lo) if hi > lo else 0.0,
            "mean_per_token_s": statistics.fmean(per_token) if per_token else float("nan"),
            "p95_per_token_s": p95(per_token) if per_token else float("nan"),
            "mean_ttft_s": statistics.fmean(result["ttfts"][i] for i in counted) if counted else float("nan")}


class Live:
    def __init__(self, args: argparse.Namespace, server_args: list[str]) -> None:
        self.args, self.server_args = args, server_args
        self.servers: dict[str, ServerProcess] = {}

    def server(self, policy: str) -> ServerProcess:
        if policy not in self.servers:
            threads = str(self.args.server_threads)
            env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
            self.servers[policy] = ServerProcess(["--scheduling-policy", policy, *self.server_args],
                                                 self.args.result_dir, name=policy, env=env).wait_ready(timeout=180)
        return self.servers[policy]

    def run(self, policy: str, rate: float, seed: int) -> dict:
        """One load generator run against the policy's server; its result JSON (cached in --result-dir)."""
        out = self.args.result_dir / f"{policy}-rate{rate:.4f}-seed{seed}.json"
        if out.exists():
            return json.loads(out.read_text())
        cmd = [sys.executable, "-m", "fastserve.bench.loadgen", "--base-url", self.server(policy).url,
               "--dataset-name", "lengths", "--dataset-path", str(self.args.dataset_path),
               "--num-prompts", str(self.args.num_prompts), "--request-rate", f"{rate:.6f}", "--seed", str(seed),
               "--label", policy, "--disable-tqdm", "--save-result", "--result-dir", str(self.args.result_dir),
               "--result-filename", out.name]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"loadgen failed for {policy} at {rate} (rc {proc.returncode}): {proc.stderr[-500:]}")
        return json.loads(out.read_text())

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--capacity-seeds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--load", type=float, default=1.0, help="offered load in units of FCFS's live capacity")
    ap.add_argument("--start-rate", type=float, default=8.0, help="first offered rate of the capacity search")
    ap.add_argument("--policies", default="fcfs,skip-join-mlfq")
    ap.add_argument("--dataset-path", type=Path, default=REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv")
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--result-dir", type=Path, default=Path("results/live-capacity"))
    args = ap.parse_args(argv[:split])
    server_args = argv[split + 1:] or ["--num-gpu-blocks-override", "1024"]
    args.result_dir.mkdir(parents=True, exist_ok=True)
    live = Live(args, server_args)
    t0 = time.perf_counter()
    try:
        offered = args.start_rate
        while True:  # capacity: FCFS offered at least 1.3x what it serves
            served = statistics.fmean(window_metrics(live.run("fcfs", offered, s))["served_rate"]
                                      for s in range(args.capacity_seeds))
            print(f"capacity search: offered {offered:.3f} req/s, FCFS served {served:.3f}", flush=True)
            if served <= 0:
                raise SystemExit("no request finished while arrivals lasted: give more --num-prompts or a lower "
                                 "--start-rate")
            if offered >= 1.3 * served:
                break
            offered = max(offered * 2, 1.5 * served)
        cap, rate = served, args.load * served
        policies = args.policies.split(",")
        data: dict[str, list[dict]] = {p: [] for p in policies}
        for s in range(args.seeds):  # seed by seed, the policies in turn: a change in the machine's load over the
            for p in policies:       # run falls on both sides of a pair, not on one policy's runs
                data[p].append(window_metrics(live.run(p, rate, s)))
    finally:
        live.stop()
    lines = [f"live capacity C = {cap:.3f} req/s (FCFS under a {offered:.3f} req/s offer); runs at {args.load:g}C = "
             f"{rate:.3f} req/s, {args.num_prompts} requests, {args.seeds} seeds, middle 80% of arrivals",
             f"{'policy':>16} {'mean s/token':>16} {'P95':>16} {'served req/s':>16} {'failed':>6}"]
    for p in policies:
        m, q, s = (stat([d[k] for d in data[p]]) for k in ("mean_per_token_s", "p95_per_token_s", "served_rate"))
        lines.append(f"{p:>16} {m.mean:>9.4f} ± {m.half:<5.3f} {q.mean:>9.4f} ± {q.half:<5.3f} "
                     f"{s.mean:>9.3f} ± {s.half:<5.3f} "
                     f"{sum(d['failed'] for d in data[p]):>6}")
    if "fcfs" in data:
        for p in policies:
            if p != "fcfs":
                r = stat([f["mean_per_token_s"] / x["mean_per_token_s"] for f, x in zip(data["fcfs"], data[p])])
                lines.append(f"FCFS / {p} mean per-token latency, paired per seed: {r.mean:.2f} ± {r.half:.2f}x")
    lines.append(f"{time.perf_counter() - t0:.0f} s wall")
    print("\n".join(lines))
    (args.result_dir / "summary.json").write_text(json.dumps(
        {"capacity": cap, "offered": offered, "rate": rate, "seeds": args.seeds, "num_prompts": args.num_prompts,
         "server_args": server_args, "data": data}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
