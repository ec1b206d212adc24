"""Compare scheduling policies live: for each policy a server (server.py) with the same flags, the load generator
(`fastserve bench serve`) against it over real HTTP, the same requests for every policy. Prints each policy's
latency per rate, its throughput at the per-token SLO, and the first policy's mean per-token latency over each
other's with a 95% interval over seeds; saves every load generator result JSON plus a summary, and can draw the
paper's Fig. 11 (per-token latency vs rate, one line per policy).

    python -m fastserve.compare --policies fcfs,skip-join-mlfq --dataset-name lengths \\
        --dataset-path ../shared/datasets/sharegpt_lengths.csv --num-prompts 600 --sweep 1C --seeds 5

The setting: unless told otherwise, every server runs with a batch of at most 16 sequences, 1,024 KV blocks of 16
tokens (16,384 tokens: 16 requests of ShareGPT's mean length fit several times over) and 8,192 host blocks
(ORDER_MATTERS). A bounded batch is what makes the comparison mean anything: with the engine's defaults (256
sequences a batch) every request of the tiny model joins the batch at once, the engine shares its iterations among
them all, and no order can change anything (docs/benchmarks.md, "Live comparisons on the CPU"). The engine flags
(the server's, engine/args.py: model, KV sizes, profile...; the model by default: tiny-opt, the built-in tiny
model, not the server's own default) are this script's too, with those defaults; they go to every server, all but
--scheduling-policy, which --policies sets per run (--seed and --tokenizer serve the load generator too).
Everything after `--` goes to every server as it is (the server's own flags too): after this setting, before the
engine flags typed here, which win. Flags this script does not know go to every load generator run (e.g. --random-
range-ratio 0.9 for synthetic).

--sweep takes request rates (req/s) or loads in units of C, FCFS's sustained capacity in this setting ("1C",
"0.8C,1C"): C is then measured first, unless --capacity gives it: FCFS's served rate (requests that finished
while arrivals were in their middle 80%, per second of that window) when offered at least 1.3x that, the offer
doubled from --capacity-start until it is; --capacity-each-seed measures it again before each seed, on that
seed's requests, so that on a shared machine, whose speed drifts, each pair runs at the C of its time. --seeds N
runs every rate N times, seeds --seed .. --seed+N-1 (a seed draws the requests and their arrival times), the
policies in turn seed by seed on servers kept up for the whole run, so a change in the machine's load falls on
both sides of a pair. Latency: mean per-token latency (end to end / output tokens) of the requests that arrive in
the middle 80% of a run; the ratios are paired per seed, with a 95% Student-t interval. Each server runs with
OMP_NUM_THREADS=--server-threads so that the load generator keeps a core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.args import add_engine_args, engine_args_given, engine_argv
from engine.model_names import TINY_OPT
from fastserve.bench.intervals import paired_ratios
from fastserve.bench.loadgen import build_parser as loadgen_parser
from fastserve.bench.loadgen import jsonable
from fastserve.bench.metrics import rate_at_slo
from fastserve.server_process import ServerProcess, with_model

POLICIES = ("fcfs", "fixed-priority", "mlfq", "skip-join-mlfq")
# The setting every server runs in unless told otherwise: a bounded batch, so that order matters.
ORDER_MATTERS = {"max_num_seqs": 16, "num_gpu_blocks_override": 1024, "num_host_blocks_override": 8192}
WINDOW = (0.1, 0.9)  # the counted requests: those arriving in the middle 80% of a run's arrival span


def window_metrics(run: dict) -> dict:
    """Of one load generator run (its per-request arrays): requests arriving in the middle 80% of the arrival span
    counted; their mean and P95 per-token latency (e2e / output tokens); the served rate (requests that finished
    inside the window, per second of it); failed requests (any)."""
    starts, e2e, outs, errors = run["start_times"], run["e2els"], run["output_lens"], run["errors"]
    done = [i for i, n in enumerate(outs) if n > 0 and not errors[i]]
    first, last = min(starts), max(starts)
    lo, hi = first + WINDOW[0] * (last - first), first + WINDOW[1] * (last - first)
    per_token = [e2e[i] / outs[i] for i in done if lo <= starts[i] <= hi]
    finished = sum(1 for i in done if lo <= starts[i] + e2e[i] <= hi)
    return {"counted": len(per_token), "failed": len(outs) - len(done),
            "mean_per_token_s": statistics.fmean(per_token) if per_token else math.nan,
            "p95_per_token_s": float(np.percentile(per_token, 95)) if per_token else math.nan,
            "served_rate": finished / (hi - lo) if hi > lo else 0.0}


def parse_sweep(text: str) -> tuple[list[float], bool]:
    """'1,2,4' -> ([1, 2, 4], False): rates in req/s; '0.8C,1C' -> ([0.8, 1.0], True): loads in units of C."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    in_c = [p.upper().endswith("C") for p in parts]
    if not parts or any(in_c) != all(in_c):
        raise ValueError(f"--sweep: rates (1,2,4) or loads in units of C (0.8C,1C), not both; got {text!r}")
    try:
        values = [float(p[:-1] if in_c[0] else p) for p in parts]
    except ValueError:
        raise ValueError(f"--sweep: expected comma-separated numbers, got {text!r}") from None
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise ValueError(f"--sweep: every rate or load must be a finite number > 0, got {text!r}")
    return values, in_c[0]


class Live:
    """One server per policy, started on first use and kept up until stop(); load generator runs against them."""

    def __init__(self, args: argparse.Namespace, server_args: list[str], loadgen_args: list[str]) -> None:
        self.args, self.server_args, self.loadgen_args = args, server_args, loadgen_args
        self.servers: dict[str, ServerProcess] = {}

    def server(self, policy: str) -> ServerProcess:
        if policy not in self.servers:
            threads = str(self.args.server_threads)
            env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
            self.servers[policy] = ServerProcess(["--scheduling-policy", policy, *self.server_args],
                                                 self.args.result_dir, name=policy, env=env)
            self.servers[policy].wait_ready(timeout=180)
        return self.servers[policy]

    def run(self, policy: str, rates: Sequence[float], seed: int, name: str) -> dict:
        """One load generator invocation (--sweep rates, --seed seed) against the policy's server; its result JSON,
        saved as result_dir/name."""
        args, out = self.args, self.args.result_dir / name
        cmd = [sys.executable, "-m", "fastserve.bench.loadgen", "--base-url", self.server(policy).url,
               "--dataset-name", args.dataset_name, "--num-prompts", str(args.num_prompts),
               "--sweep", ",".join(f"{r:.6g}" for r in rates), "--slo-per-token", str(args.slo_per_token),
               "--seed", str(seed), "--label", policy, "--disable-tqdm", "--save-result",
               "--result-dir", str(args.result_dir), "--result-filename", name]
        if args.dataset_path:
            cmd += ["--dataset-path", str(args.dataset_path)]
        if args.tokenizer:  # the servers' tokenizer counts the text datasets' tokens too
            cmd += ["--tokenizer", args.tokenizer]
        cmd += self.loadgen_args
        out.unlink(missing_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)  # here: --result-dir is relative to it
        (args.result_dir / f"loadgen-{Path(name).stem}.log").write_text(proc.stdout + proc.stderr)
        if not out.exists():
            raise RuntimeError(f"loadgen failed for {policy} (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
        return json.loads(out.read_text())

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def measure_capacity(live: Live, seeds: Sequence[int], start: float) -> dict:
    """FCFS's sustained capacity: its served rate (the mean over the seeds' runs) once the offer is at least 1.3x
    it, the offer doubled (or raised to 1.5x the served rate) from `start` until it is."""
    offered = start
    while True:
        served = statistics.fmean(
            window_metrics(live.run("fcfs", [offered], s, f"capacity-{offered:.3f}-seed{s}.json")["runs"][0])
            ["served_rate"] for s in seeds)
        print(f"capacity search: offered {offered:.3f} req/s, FCFS served {served:.3f}", flush=True)
        if served <= 0:
            raise RuntimeError("no request finished while arrivals lasted: give more --num-prompts or a lower "
                               "--capacity-start")
        if offered >= 1.3 * served:
            return {"C": served, "offered": offered}
        offered = max(offered * 2, 1.5 * served)


def summarize(results: dict[str, list[dict]], slo: float) -> dict:
    """{policy: {rates, per rate: mean (over seeds) of the windowed mean and P95 per-token latency, failed
    requests (all seeds), served rate, each seed's windowed mean; throughput at the SLO from the means}}."""
    out = {}
    for policy, per_seed in results.items():  # the seeds' rates differ when C was measured before each seed
        rates = [statistics.fmean(float(res["rates"][i]) for res in per_seed) for i in range(len(per_seed[0]["rates"]))]
        rows = [[window_metrics(res["runs"][i]) for res in per_seed] for i in range(len(rates))]
        s = {"rates": rates,
             "mean_per_token_s": [statistics.fmean(m["mean_per_token_s"] for m in row) for row in rows],
             "p95_per_token_s": [statistics.fmean(m["p95_per_token_s"] for m in row) for row in rows],
             "failed": [sum(m["failed"] for m in row) for row in rows],
             "served_rate": [statistics.fmean(m["served_rate"] for m in row) for row in rows],
             "seed_mean_per_token_s": [[m["mean_per_token_s"] for m in row] for row in rows]}
        for which in ("mean", "p95"):
            points = [(r, None if f else x) for r, x, f in zip(rates, s[f"{which}_per_token_s"], s["failed"])]
            s[f"throughput_at_slo_{which}"] = rate_at_slo(points, slo)
        out[policy] = s
    return out


def ratios(summary: dict) -> dict:
    """{other policy: [paired_ratios(first policy's seed means, its own) per rate]}: the first policy's mean
    per-token latency over each other's, paired per seed."""
    first, *others = list(summary)
    return {p: [paired_ratios(a, b) for a, b in zip(summary[first]["seed_mean_per_token_s"],
                                                    summary[p]["seed_mean_per_token_s"])] for p in others}


def format_table(summary: dict, slo: float) -> str:
    lines = [f"{'policy':>16} {'rate':>6} {'mean s/tok':>11} {'p95 s/tok':>10} {'failed':>6}"]
    for policy, s in summary.items():
        for rate, mean, p95, failed in zip(s["rates"], s["mean_per_token_s"], s["p95_per_token_s"], s["failed"]):
            lines.append(f"{policy:>16} {float(rate):>6g} {mean:>11.4f} {p95:>10.4f} {failed:>6}")
        lines.append(f"{policy:>16} throughput at SLO {slo:g} s/token: mean {s['throughput_at_slo_mean']}, "
                     f"p95 {s['throughput_at_slo_p95']} req/s")
    return "\n".join(lines)


def format_ratio(r: dict) -> str:
    """'1.50x' (one seed) or '2.10x [1.70, 2.50]' (the 95% interval)."""
    if math.isnan(r["half"]):
        return f"{r['mean']:.2f}x"
    return f"{r['mean']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"


def format_side_by_side(summary: dict) -> str:
    """Per rate: each policy's mean / P95 per-token latency in ms, then the first policy's mean over each other's
    (with its 95% interval over seeds when there are several)."""
    policies = list(summary)
    first = policies[0]
    by = ratios(summary)
    head = f"{'rate':>6}" + "".join(f" {p + ' ms':>22}" for p in policies)
    head += "".join(f" {first + ' / ' + p:>28}" for p in policies[1:])
    lines = ["per-token latency, mean / P95 (ms)", head]
    for i, rate in enumerate(summary[first]["rates"]):
        cells = [f"{float(rate):>6g}"]
        for p in policies:
            s = summary[p]
            cell = f"{1e3 * s['mean_per_token_s'][i]:.1f} / {1e3 * s['p95_per_token_s'][i]:.1f}"
            cell += f" ({s['failed'][i]} failed)" if s["failed"][i] else ""
            cells.append(f" {cell:>22}")
        cells += [f" {format_ratio(by[p][i]):>28}" for p in policies[1:]]
        lines.append("".join(cells))
    return "\n".join(lines)


def format_verdict(summary: dict, loads: list[float] | None, setting: list[str], cap: dict | None = None) -> str:
    """One line per other policy and rate: the ratio, its interval and spread, the seeds; then C when it was
    measured before each seed, and the setting."""
    first = list(summary)[0]
    lines = []
    for p, per_rate in ratios(summary).items():
        for i, r in enumerate(per_rate):
            rate = summary[first]["rates"][i]
            where = f"{loads[i]:g}C = {rate:.3f} req/s" if loads else f"{rate:g} req/s"
            spread = ("one seed, no interval" if math.isnan(r["half"]) else
                      f"95% interval [{r['low']:.2f}, {r['high']:.2f}] over {len(r['values'])} seeds; per seed "
                      + ", ".join(f"{v:.2f}" for v in r["values"]))
            lines.append(f"{first} / {p} mean per-token latency at {where}: {r['mean']:.2f}x ({spread})")
    if cap and cap.get("per_seed"):
        lines.append("C measured before each seed (req/s): " + ", ".join(f"{c:.3f}" for c in cap["per_seed"])
                     + "; rates above: their mean")
    lines.append(f"setting (every server): {' '.join(setting)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated scheduling policies")
    ap.add_argument("--dataset-name", default="lengths")
    ap.add_argument("--dataset-path", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=60, help="requests per run")
    ap.add_argument("--sweep", required=True,
                    help="comma-separated request rates (1,2,4) or loads in units of C, FCFS's capacity (0.8C,1C)")
    ap.add_argument("--seeds", type=int, default=1, help="runs per rate and policy, seeds --seed, --seed+1, ...")
    ap.add_argument("--capacity", type=float, default=None,
                    help="C in req/s for a --sweep in units of C (default: measured first)")
    ap.add_argument("--capacity-start", type=float, default=4.0, help="first offered rate of C's search (req/s)")
    ap.add_argument("--capacity-seeds", type=int, default=2, help="seeds of each step of C's search")
    ap.add_argument("--capacity-each-seed", action="store_true",
                    help="measure C again before each seed's runs, on that seed's requests (the offer from 1.5x the "
                         "previous seed's C), so that the load follows a shared machine's speed")
    ap.add_argument("--slo-per-token", type=float, default=0.3, help="seconds")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--result-dir", type=Path, default=Path("results/live-sweep"))
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of latency vs rate per policy (first seed)")
    add_engine_args(ap, exclude=("scheduling_policy",))  # given ones go to every server; --policies sets this one
    ap.set_defaults(**ORDER_MATTERS)
    return ap


def server_flags(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """Every server's flags but its policy: ORDER_MATTERS's (those not typed), those after `--`, then the engine
    flags typed here (the server keeps the last of a flag); the built-in tiny model in front unless they name a
    model."""
    given = engine_args_given(args)
    setting = {k: v for k, v in ORDER_MATTERS.items() if k not in given}
    return with_model([*engine_argv(setting), *passthrough, *engine_argv(given)], TINY_OPT)


def check(args: argparse.Namespace, policies: list[str]) -> str | None:
    """What is wrong with the flags (one line), or None."""
    unknown = set(policies) - set(POLICIES)
    if unknown:
        return f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}"
    if args.seeds < 1 or args.capacity_seeds < 1 or args.num_prompts < 1:
        return "--seeds, --capacity-seeds and --num-prompts must be >= 1"
    if (args.capacity is not None and not args.capacity > 0) or not args.capacity_start > 0:
        return "--capacity and --capacity-start must be > 0"
    try:
        parse_sweep(args.sweep)
    except ValueError as e:
        return str(e)
    return None


def run_all(live: Live, args: argparse.Namespace, policies: list[str]) -> tuple[dict, dict | None]:
    """Measures C when the sweep is in units of it (once, or before each seed), then runs every seed, the
    policies in turn; (results per policy, capacity or None)."""
    values, in_c = parse_sweep(args.sweep)
    each = in_c and args.capacity_each_seed and not args.capacity
    cap, per_seed = None, []
    if in_c and not each:
        cap = ({"C": args.capacity, "offered": None} if args.capacity else
               measure_capacity(live, range(args.seed, args.seed + args.capacity_seeds), args.capacity_start))
        print(f"capacity C = {cap['C']:.3f} req/s" + (" (given)" if args.capacity else ""), flush=True)
    results: dict[str, list[dict]] = {p: [] for p in policies}
    for seed in range(args.seed, args.seed + args.seeds):
        if each:
            c = measure_capacity(live, [seed], 1.5 * per_seed[-1] if per_seed else args.capacity_start)["C"]
            per_seed.append(c)
            print(f"seed {seed}: capacity C = {c:.3f} req/s", flush=True)
        rates = [v * (per_seed[-1] if each else cap["C"]) for v in values] if in_c else values
        for policy in policies:
            t = time.perf_counter()
            results[policy].append(live.run(policy, rates, seed, f"{policy}-seed{seed}.json"))
            print(f"{policy} seed {seed}: {time.perf_counter() - t:.0f} s", flush=True)
    if each:
        cap = {"C": statistics.fmean(per_seed), "offered": None, "per_seed": per_seed}
    return results, cap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = build_parser()
    args, loadgen_args = parser.parse_known_args(ours)
    _, unknown = loadgen_parser().parse_known_args(loadgen_args)  # checked now, not after a server has started
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (neither this script's nor the load generator's)")
    policies = [p for p in args.policies.split(",") if p]
    problem = check(args, policies)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    setting = server_flags(args, passthrough)
    print(f"setting (every server): {' '.join(setting)}", flush=True)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    live = Live(args, setting, loadgen_args)
    try:
        results, cap = run_all(live, args, policies)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        live.stop()
    summary = summarize(results, args.slo_per_token)
    values, in_c = parse_sweep(args.sweep)
    (args.result_dir / "summary.json").write_text(json.dumps(jsonable(
        {"slo_per_token_s": args.slo_per_token, "num_prompts": args.num_prompts, "dataset": args.dataset_name,
         "dataset_path": str(args.dataset_path), "server_args": setting, "sweep": args.sweep, "capacity": cap,
         "seeds": list(range(args.seed, args.seed + args.seeds)), "policies": summary,
         "ratios": ratios(summary) if len(summary) > 1 else {}}), indent=1))
    print(format_table(summary, args.slo_per_token))
    if len(summary) > 1:
        print(format_side_by_side(summary))
        print(format_verdict(summary, values if in_c else None, setting, cap))
    if args.plot:
        from fastserve.bench.plot import plot_results

        plot_results([res[0] for res in results.values()], args.plot, args.slo_per_token)
        print(f"plot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
