"""Chunked prefill (issue 25) live on this machine with the tiny model: the same mix as the simulator's
(ShareGPT lengths, 10% of the requests given a 1,500-2,000-token prompt; scripts/bench_chunked_prefill.py's
mixed_trace), chunked against unchunked, the two sides interleaved (A B, then B A, ...) because the load from
other jobs on a shared machine changes over time.

    .venv/bin/python scripts/bench_chunked_live.py throughput --budgets 512 2048 --reps 3
    .venv/bin/python scripts/bench_chunked_live.py serve --budgets 256 512 --rate 3 --reps 3
    .venv/bin/python scripts/bench_chunked_live.py replay --budgets 256 512 --rate 2 --reps 2

throughput: saturation, in process. Every request is queued at once (more than --max-num-seqs, so prompts keep
joining running decodes until the queue is empty) and the engine steps until all are done; the tokens (prompt and
generated) per second of CPU time (time.process_time: the work done, steadier than wall time under other jobs'
load) and of wall time, and the paired ratio chunked / unchunked per repetition (the goal: >= 0.97).

serve: over real HTTP. One server.py per side (the same flags but --enable-chunked-prefill --max-num-batched-tokens
B, for each B of --budgets, or --no-enable-chunked-prefill), the load generator (fastserve bench serve) replaying
the mix as token-id prompts at a Poisson --rate with streaming; P99 and median ITL (every gap between a request's
streamed chunks), the served request rate, and per repetition the ratios unchunked P99 ITL / chunked (the goal:
>= 3) and chunked served rate / unchunked (the goal: >= 0.97).

replay: the serve comparison without HTTP and without the machine's load: the engine in process on a virtual clock
that each step advances by the CPU time it took (the engine's and the model's threads), the mix's requests added
at their Poisson arrival times on that clock; ITL is then what a dedicated core would give. The served rate is
requests over the span from the first arrival to the last finish.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_chunked_prefill import mixed_trace  # noqa: E402

VOCAB = 4096  # the tiny model's; prompts are random ids in [3, VOCAB)


def spread(xs: list[float], digits: int = 3) -> str:
    return f"median {statistics.median(xs):.{digits}f} (min {min(xs):.{digits}f}, max {max(xs):.{digits}f})"


# -- saturation, in process ------------------------------------------------------------------------------------
def saturation_run(requests: list[tuple[list[int], int]], budget: int | None, max_num_seqs: int) -> dict:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(device="cpu", enable_chunked_prefill=budget is not None,
                                 max_num_batched_tokens=budget or 8192, max_num_seqs=max_num_seqs, seed=0))
    try:
        for i, (prompt, out) in enumerate(requests):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        steps = 0
        wall, cpu = time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        engine.shutdown()
    tokens = sum(len(p) + o for p, o in requests)
    return {"tokens_per_cpu_s": tokens / cpu, "tokens_per_wall_s": tokens / wall, "steps": steps, "cpu_s": cpu,
            "wall_s": wall}


def throughput(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    trace, long = mixed_trace(args.num_prompts, 1.0, args.seed, args.long_share)
    rng = random.Random(args.seed)
    requests = [([rng.randrange(3, VOCAB) for _ in range(p)], o) for _, p, o in trace]
    print(f"{len(requests)} requests ({len(long)} long), {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(o for _, o in requests)} to generate; max_num_seqs {args.max_num_seqs}, {args.threads} thread(s)",
          flush=True)
    sides: list[int | None] = [None, *args.budgets]
    runs: dict = {b: [] for b in sides}
    for rep in range(args.reps):
        for b in (sides if rep % 2 == 0 else sides[::-1]):
            r = saturation_run(requests, b, args.max_num_seqs)
            runs[b].append(r)
            side = "unchunked" if b is None else f"budget {b}"
            print(f"rep {rep} {side:>12}: {r['tokens_per_cpu_s']:7.0f} tok/CPU-s "
                  f"{r['tokens_per_wall_s']:7.0f} tok/s wall, {r['steps']} steps, {r['cpu_s']:.1f} CPU-s", flush=True)
    for b in args.budgets:
        cpu = [c["tokens_per_cpu_s"] / u["tokens_per_cpu_s"] for c, u in zip(runs[b], runs[None])]
        wall = [c["tokens_per_wall_s"] / u["tokens_per_wall_s"] for c, u in zip(runs[b], runs[None])]
        steps = [c["steps"] / u["steps"] for c, u in zip(runs[b], runs[None])]
        print(f"budget {b} / unchunked: CPU-time throughput {spread(cpu)}; wall {spread(wall)}; steps "
              f"{spread(steps)}")
    if args.json:
        args.json.write_text(json.dumps({str(b): v for b, v in runs.items()}, indent=1))
    return 0


# -- arrivals on a clock of CPU time, in process ------------------------------------------------------------------
def replay_run(trace: list[tuple[float, list[int], int]], budget: int | None, max_num_seqs: int) -> dict:
    """The engine on a virtual clock that each step advances by the CPU time it took (process_time: the engine's
    and the model's threads), requests added at their Poisson arrival times on that clock: the latencies a
    dedicated core would give, whatever share of the machine the process gets."""
    from engine.clock import VirtualClock
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    clock = VirtualClock()
    engine = Engine(EngineConfig(device="cpu", enable_chunked_prefill=budget is not None,
                                 max_num_batched_tokens=budget or 8192, max_num_seqs=max_num_seqs, seed=0),
                    clock=clock)
    engine.emit_running_outputs = False
    done = []
    try:
        nxt = 0
        while nxt < len(trace) or engine.has_unfinished():
            if not engine.has_unfinished() and trace[nxt][0] > clock.now():
                clock.advance(trace[nxt][0] - clock.now())
            while nxt < len(trace) and trace[nxt][0] <= clock.now():
                arrival, prompt, out = trace[nxt]
                engine.add_request(str(nxt), prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                                   arrival_time=arrival)
                nxt += 1
            cpu = time.process_time()
            outs = engine.step()
            clock.advance(time.process_time() - cpu)
            done += [o for o in outs if o.finished]
    finally:
        engine.shutdown()
    from engine.simulation import quantile

    itl = [g for o in done for g in o.metrics.itl_s]
    span = max(o.metrics.finished_time for o in done) - trace[0][0]
    return {"p99_itl_ms": 1e3 * quantile(itl, 0.99), "median_itl_ms": 1e3 * quantile(itl, 0.5),
            "p999_itl_ms": 1e3 * quantile(itl, 0.999), "max_itl_ms": 1e3 * max(itl),
            "request_throughput": len(done) / span, "completed": len(done)}


def replay(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    mix, long = mixed_trace(args.num_prompts, args.rate, args.seed, args.long_share)
    rng = random.Random(args.seed)
    trace = [(t, [rng.randrange(3, VOCAB) for _ in range(p)], o) for t, p, o in mix]
    print(f"{len(trace)} requests ({len(long)} long) at {args.rate} req/s of CPU time, budgets {args.budgets}",
          flush=True)
    sides = ["unchunked", *(f"chunked {b}" for b in args.budgets)]
    budget = dict(zip(sides, [None, *args.budgets]))
    runs: dict = {side: [] for side in sides}
    for rep in range(args.reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            r = replay_run(trace, budget[side], args.max_num_seqs)
            runs[side].append(r)
            print(f"rep {rep} {side:>13}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()), flush=True)
    report(runs, sides)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


def report(runs: dict, sides: list[str]) -> None:
    base = runs["unchunked"]
    for side in sides[1:]:
        itl = [u["p99_itl_ms"] / c["p99_itl_ms"] for c, u in zip(runs[side], base)]
        served = [c["request_throughput"] / u["request_throughput"] for c, u in zip(runs[side], base)]
        print(f"{side}: unchunked P99 ITL / this (goal >= 3) {spread(itl, 2)}; served rate / unchunked's "
              f"(goal >= 0.97) {spread(served)}")
    for side in sides:
        print(f"{side}: P99 ITL ms {spread([r['p99_itl_ms'] for r in runs[side]], 1)}; median ITL ms "
              f"{spread([r['median_itl_ms'] for r in runs[side]], 1)}")


# -- over HTTP ---------------------------------------------------------------------------------------------------
def write_mix(path: Path, n: int, seed: int, long_share: float) -> set[int]:
    trace, long = mixed_trace(n, 1.0, seed, long_share)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["input_tokens", "output_tokens"])
        w.writerows((p, o) for _, p, o in trace)
    return long


def serve_run(args, budget: int | None, dataset: Path, tmp: Path, label: str) -> dict:
    from server_process import ServerProcess

    flags = (["--enable-chunked-prefill", "--max-num-batched-tokens", str(budget)] if budget is not None
             else ["--no-enable-chunked-prefill"])
    threads = str(args.threads)
    server = ServerProcess([*flags, "--device", "cpu", "--max-num-seqs", str(args.max_num_seqs)], tmp, name=label,
                           env=os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    out = tmp / f"{label}.json"
    try:
        server.wait_ready(timeout=180)
        cmd = [sys.executable, "-m", "fastserve.bench.loadgen", "--base-url", server.url, "--dataset-name", "lengths",
               "--dataset-path", str(dataset), "--num-prompts", str(args.num_prompts), "--request-rate",
               str(args.rate), "--seed", str(args.seed), "--token-id-prompts", "--ignore-eos", "--disable-tqdm",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp), "--result-filename",
               out.name, "--label", label]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"loadgen failed ({label}, rc {proc.returncode}): {proc.stderr.strip()[-800:]}")
        return json.loads(out.read_text())
    finally:
        server.stop()


def serve(args) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-chunked-"))
    dataset = tmp / "mix.csv"
    long = write_mix(dataset, args.num_prompts, args.seed, args.long_share)
    print(f"{args.num_prompts} requests ({len(long)} long) at {args.rate} req/s, budgets {args.budgets}; "
          f"logs and results in {tmp}", flush=True)
    keys = ("p99_itl_ms", "median_itl_ms", "request_throughput", "output_throughput", "completed")
    sides = ["unchunked", *(f"chunked {b}" for b in args.budgets)]
    budget = dict(zip(sides, [None, *args.budgets]))
    runs: dict = {side: [] for side in sides}
    for rep in range(args.reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            r = serve_run(args, budget[side], dataset, tmp, f"{side.replace(' ', '-')}-{rep}")
            runs[side].append(r)
            print(f"rep {rep} {side:>13}: " + ", ".join(f"{k} {r[k]:.4g}" for k in keys), flush=True)
    report(runs, sides)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("throughput", help="saturation, in process")
    t.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    t.add_argument("--num-prompts", type=int, default=150)
    t.add_argument("--max-num-seqs", type=int, default=32)
    s = sub.add_parser("serve", help="over HTTP at a Poisson rate")
    r = sub.add_parser("replay", help="in process, Poisson arrivals on a clock of CPU time")
    for p in (s, r):
        p.add_argument("--budgets", type=int, nargs="+", default=[512])
        p.add_argument("--num-prompts", type=int, default=150)
        p.add_argument("--rate", type=float, default=3.0)
        p.add_argument("--max-num-seqs", type=int, default=256)
    for p in (t, s, r):
        p.add_argument("--reps", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--long-share", type=float, default=0.1)
        p.add_argument("--threads", type=int, default=1, help="torch threads (the server's OMP_NUM_THREADS)")
        p.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    return {"throughput": throughput, "serve": serve, "replay": replay}[args.mode](args)


if __name__ == "__main__":
    raise SystemExit(main())
