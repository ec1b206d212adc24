"""Compare scheduling policies live: for each policy, start server.py with the same flags, run the load
generator (`fastserve bench serve`) --sweep against it over real HTTP, stop it. Prints each policy's latency per
rate and its throughput at the per-token SLO, saves every loadgen result JSON plus a summary, and can draw the paper's
Fig. 11 (per-token latency vs rate, one line per policy).

    python -m fastserve.compare --policies fcfs,skip-join-mlfq --dataset-name lengths \\
        --dataset-path ../shared/datasets/sharegpt_lengths.csv --num-prompts 60 --sweep 1,2,4 \\
        --slo-per-token 0.05 --result-dir results/live --plot fig11.png --num-gpu-blocks-override 990

The engine flags (the server's, engine/args.py: model, KV sizes, profile...; the model by default: the built-in
tiny model, tiny-opt, not the server's own default) are this script's too: those given go to every server, all
but --scheduling-policy, which --policies sets per run (--seed and --tokenizer serve the load generator too).
Everything after `--` goes to every server as it is (the server's own flags too), before the engine flags given
here, which win. Flags this script does not know go to every load generator run (e.g. --random-range-ratio 0.9
for synthetic).
Each server is started with OMP_NUM_THREADS=--server-threads so that the load generator keeps a core.
With two or more policies, a last table puts their latencies side by side, with the first policy's mean over
each other's (`make compare`: FCFS over skip-join MLFQ on the built-in tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.args import add_engine_args, engine_args_given, engine_argv
from engine.model_names import TINY_OPT
from fastserve.bench.loadgen import build_parser as loadgen_parser
from fastserve.server_process import ServerProcess, with_model

POLICIES = ("fcfs", "fixed-priority", "mlfq", "skip-join-mlfq")


def run_policy(policy: str, args: argparse.Namespace, server_args: list[str], loadgen_args: list[str]) -> dict:
    """One server with --scheduling-policy policy, one loadgen sweep against it; the loadgen result JSON."""
    out = args.result_dir / f"{policy}.json"
    threads = str(args.server_threads)
    server = ServerProcess(["--scheduling-policy", policy, *server_args], args.result_dir, name=policy,
                           env=os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    try:
        server.wait_ready(timeout=120)
        cmd = [sys.executable, "-m", "fastserve.bench.loadgen", "--base-url", server.url,
               "--dataset-name", args.dataset_name, "--num-prompts", str(args.num_prompts), "--sweep", args.sweep,
               "--slo-per-token", str(args.slo_per_token), "--seed", str(args.seed), "--label", policy,
               "--disable-tqdm", "--save-result", "--result-dir", str(args.result_dir),
               "--result-filename", out.name]
        if args.dataset_path:
            cmd += ["--dataset-path", str(args.dataset_path)]
        if args.tokenizer:  # the servers' tokenizer counts the text datasets' tokens too
            cmd += ["--tokenizer", args.tokenizer]
        cmd += loadgen_args
        proc = subprocess.run(cmd, capture_output=True, text=True)  # here: --result-dir is relative to it
        (args.result_dir / f"loadgen-{policy}.log").write_text(proc.stdout + proc.stderr)
        if not out.exists():
            raise RuntimeError(f"loadgen failed for {policy} (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
        return json.loads(out.read_text())
    finally:
        server.stop()


def summarize(results: dict[str, dict]) -> dict:
    """{policy: {rates, mean/p95 per-token latency per rate, failed per rate, throughput at SLO}}."""
    out = {}
    for policy, res in results.items():
        runs = res["runs"]
        out[policy] = {
            "rates": res["rates"],
            "mean_per_token_s": [r["per_token_latency_mean_s"] for r in runs],
            "p95_per_token_s": [r["per_token_latency_p95_s"] for r in runs],
            "failed": [r["failed"] for r in runs],
            "throughput_at_slo_mean": res.get("throughput_at_slo_mean"),
            "throughput_at_slo_p95": res.get("throughput_at_slo_p95"),
        }
    return out


def format_table(summary: dict, slo: float) -> str:
    lines = [f"{'policy':>16} {'rate':>6} {'mean s/tok':>11} {'p95 s/tok':>10} {'failed':>6}"]
    for policy, s in summary.items():
        for rate, mean, p95, failed in zip(s["rates"], s["mean_per_token_s"], s["p95_per_token_s"], s["failed"]):
            lines.append(f"{policy:>16} {float(rate):>6g} {mean:>11.4f} {p95:>10.4f} {failed:>6}")  # "inf" in JSON
        lines.append(f"{policy:>16} throughput at SLO {slo:g} s/token: mean {s['throughput_at_slo_mean']}, "
                     f"p95 {s['throughput_at_slo_p95']} req/s")
    return "\n".join(lines)


def format_side_by_side(summary: dict) -> str:
    """Per rate: each policy's mean / P95 per-token latency in ms, then the first policy's mean over each other's."""
    policies = list(summary)
    first = policies[0]
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
        for p in policies[1:]:
            other = summary[p]["mean_per_token_s"][i]
            ratio = summary[first]["mean_per_token_s"][i] / other if other else float("nan")
            cells.append(f" {ratio:>27.2f}x")
        lines.append("".join(cells))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated scheduling policies")
    ap.add_argument("--dataset-name", default="lengths")
    ap.add_argument("--dataset-path", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=60, help="requests per rate")
    ap.add_argument("--sweep", required=True, help="comma-separated request rates, e.g. 1,2,4")
    ap.add_argument("--slo-per-token", type=float, default=0.3, help="seconds")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--result-dir", type=Path, default=Path("results/live-sweep"))
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of latency vs rate per policy")
    add_engine_args(ap, exclude=("scheduling_policy",))  # given ones go to every server; --policies sets this one
    return ap


def server_flags(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """Every server's flags but its policy: those after `--`, then the engine flags given to this script; the
    built-in tiny model in front unless they name a model."""
    return with_model([*passthrough, *engine_argv(engine_args_given(args))], TINY_OPT)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = build_parser()
    args, loadgen_args = parser.parse_known_args(ours)
    _, unknown = loadgen_parser().parse_known_args(loadgen_args)  # checked now, not after a server has started
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (neither this script's nor the load generator's)")
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        print(f"error: unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    server_args = server_flags(args, server_args)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in policies:
        t = time.perf_counter()
        try:
            results[policy] = run_policy(policy, args, server_args, loadgen_args)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"{policy}: {time.perf_counter() - t:.0f} s", flush=True)
    summary = summarize(results)
    (args.result_dir / "summary.json").write_text(json.dumps(
        {"slo_per_token_s": args.slo_per_token, "num_prompts": args.num_prompts, "dataset": args.dataset_name,
         "dataset_path": str(args.dataset_path), "server_args": server_args, "policies": summary}, indent=1))
    print(format_table(summary, args.slo_per_token))
    if len(summary) > 1:
        print(format_side_by_side(summary))
    if args.plot:
        from fastserve.bench.plot import plot_results

        plot_results(list(results.values()), args.plot, args.slo_per_token)
        print(f"plot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
