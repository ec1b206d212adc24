"""Simulator vs live engine: the same trace and policy on both, with the same measured profile.

    python -m scripts.benchmarks.sim_vs_live            # random-weight OPT-125M, fcfs + skip-join-mlfq, ~2 min
    python -m scripts.benchmarks.sim_vs_live --model tiny --num-prompts 40 --rate 4 --output-lens 8,64

The default model is OPT-125M with random weights (models/opt-125m-random, written by
`fastserve make-model --shape opt-125m` if missing): on the 4-layer tiny model an iteration costs ~4 ms
and the engine's own per-iteration work (scheduling, KV bookkeeping, asyncio), which no profile measures, is a
large share of it, so the simulator reads ~25-30% low there; on OPT-125M the model dominates each iteration.

1. Measures a job profile of the tiny model on this machine (`fastserve profile --quick`, with a grid
   that covers the trace's batch sizes and context lengths) into a temporary directory, unless --profile.
2. Runs a seeded Poisson trace of synthetic lengths on the live engine (the engine's async API, no HTTP,
   wall clock, the real model on the CPU) with that profile.
3. Runs the same trace in the simulator (engine/simulation.py: the same engine, scheduler and KV manager on a
   virtual clock, iteration costs from the same profile, the same device/host block counts).
4. Prints mean and P95 per-token latency (e2e / output tokens) of both and the ratio sim / live
   (the target is within 15%, i.e. a ratio in [0.85, 1.15]).

Torch runs single-threaded in both the profile and the live run so that they see the same per-iteration cost;
on a shared machine other processes still add noise to both measurements. What the simulator does not model:
Python overhead between iterations beyond what the profile measured, tokenization, asyncio scheduling.
--json writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.simulation import p95
from fastserve.bench.arrivals import poisson_arrivals
from fastserve.compare import ORDER_MATTERS
from modelmaker.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]

DEFAULT_MODEL = Path("models/opt-125m-random")
TARGET = 0.15  # |sim/live - 1| the simulator should stay within


def resolve_model(name: str) -> Path:
    """'tiny' -> the built-in tiny model; the default OPT-125M directory is written if missing."""
    if name == "tiny":
        return ensure_tiny_model()
    path = Path(name) if Path(name).is_absolute() else REPO / name
    if not (path / "config.json").is_file() and Path(name) == DEFAULT_MODEL:
        subprocess.run([sys.executable, "-m", "fastserve.make_model", "--shape", "opt-125m", "--out", str(path)],
                       check=True, cwd=REPO)
    return path


def make_trace(n: int, rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int],
               seed: int = 0) -> list[tuple[float, int, int]]:
    """n (arrival_s, prompt_len, output_len): Poisson arrivals, uniform lengths."""
    rng = random.Random(seed)
    times = poisson_arrivals(n, rate, seed=seed)
    return [(t, rng.randint(*prompt_range), rng.randint(*output_range)) for t in times]


def summarize(per_token: list[float]) -> dict:
    return {"mean_per_token_s": statistics.fmean(per_token), "p95_per_token_s": p95(per_token)}


def measure_profile(model_dir: Path, out: Path, max_batch: int, max_context: int, threads: int = 1) -> Path:
    """`fastserve profile --quick` over a grid covering batch sizes <= max_batch and contexts <= max_context."""
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch} | {max_batch})
    contexts = sorted({c for c in (16, 64, 128, 256, 512, 1024) if c < max_context} | {max_context})
    prompts = sorted({p for p in (1, 16, 32, 64, 128, 256, 512, 1024) if p < max_context} | {max_context})
    cmd = [sys.executable, "-m", "fastserve.profile", "--model", str(model_dir), "--quick",
           "--device", "cpu", "--quiet", "--out", str(out),
           "--prompt-lens", ",".join(map(str, prompts)), "--batch-sizes", ",".join(map(str, batches)),
           "--context-lens", ",".join(map(str, contexts))]
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return out


async def _drive_live(engine, trace) -> list:
    from engine import SamplingParams
    from engine.async_engine import AsyncEngine

    aengine = AsyncEngine(engine)
    await aengine.start()
    loop = asyncio.get_running_loop()
    start = loop.time()
    vocab = engine.model_config.vocab_size

    async def one(i: int, arrival: float, prompt_len: int, output_len: int):
        await asyncio.sleep(max(0.0, start + arrival - loop.time()))
        # the same token ids run_trace uses
        prompt = [2] + [4 + (i + k) % (vocab - 4) for k in range(max(0, prompt_len - 1))]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
        last = None
        async for out in aengine.add_request(str(i), prompt, params):
            last = out
        return last

    outs = await asyncio.gather(*(one(i, *item) for i, item in enumerate(trace)))
    await aengine.shutdown()
    return outs


def run_live(model_dir: Path, profile: Path, trace, policy: str, kv_policy: str, device_blocks: int,
             max_num_seqs: int) -> tuple[dict, dict]:
    """The real engine on the wall clock; returns (summary, block counts for the simulator)."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", profile=str(profile),
                                 scheduling_policy=policy, kv_policy=kv_policy, max_num_seqs=max_num_seqs,
                                 num_gpu_blocks_override=device_blocks, num_host_blocks_override=4 * device_blocks))
    blocks = {"num_device_blocks": engine.kv.device.num_blocks, "num_host_blocks": engine.kv.num_host_blocks}
    timed = {"execute_s": 0.0, "steps": 0}
    submit = engine.executor.submit

    def record(future) -> None:  # the part of an iteration the profile measures, as the executor timed it
        if future.exception() is None:
            timed["execute_s"] += future.result().execute_s
        timed["steps"] += 1

    def timed_submit(batch):
        future = submit(batch)
        future.add_done_callback(record)
        return future

    engine.executor.submit = timed_submit
    t = time.perf_counter()
    outs = asyncio.run(_drive_live(engine, trace))
    wall = time.perf_counter() - t
    per_token = [o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)) for o in outs]
    busy = [(o.metrics.arrival_time, o.metrics.finished_time) for o in outs]
    span = max(f for _, f in busy) - min(a for a, _ in busy)
    return summarize(per_token) | {"wall_s": wall, "steps": timed["steps"], "execute_s": timed["execute_s"],
                                   "span_s": span}, blocks


def run_sim(model_dir: Path, profile: Path, trace, policy: str, kv_policy: str, blocks: dict,
            max_num_seqs: int) -> dict:
    from engine.simulation import run_trace, simulated_engine

    engine = simulated_engine(model_dir, profile, dtype="float32", scheduling_policy=policy, kv_policy=kv_policy,
                              max_num_seqs=max_num_seqs, **blocks)
    t = time.perf_counter()
    res = run_trace(engine, trace)
    return summarize(res.per_token_latencies()) | {"wall_s": time.perf_counter() - t, "steps": engine.num_steps,
                                                   "execute_s": res.busy_s, "span_s": res.duration_s}


def compare(model_dir: Path, profile: Path, trace, policies: list[str], kv_policy: str = "proactive",
            device_blocks: int = 512, max_num_seqs: int = ORDER_MATTERS["max_num_seqs"], log=print) -> list[dict]:
    """For each policy: live and simulated mean/P95 per-token latency and the ratio sim / live."""
    import torch

    torch.set_num_threads(1)  # the profile was measured single-threaded
    rows = []
    for policy in policies:
        live, blocks = run_live(model_dir, profile, trace, policy, kv_policy, device_blocks, max_num_seqs)
        sim = run_sim(model_dir, profile, trace, policy, kv_policy, blocks, max_num_seqs)
        row = {"policy": policy, "live": live, "sim": sim,
               "ratio_mean": sim["mean_per_token_s"] / live["mean_per_token_s"],
               "ratio_p95": sim["p95_per_token_s"] / live["p95_per_token_s"]}
        rows.append(row)
        log(f"{policy:>16}: live mean {live['mean_per_token_s'] * 1e3:8.2f} ms/token (P95 "
            f"{live['p95_per_token_s'] * 1e3:7.2f}), sim mean {sim['mean_per_token_s'] * 1e3:8.2f} ms/token "
            f"(P95 {sim['p95_per_token_s'] * 1e3:7.2f}); sim/live mean {row['ratio_mean']:.3f}, "
            f"P95 {row['ratio_p95']:.3f} [{'within' if abs(row['ratio_mean'] - 1) <= TARGET else 'OUTSIDE'} "
            f"{TARGET:.0%}]")
        log(f"{'':>16}  iterations live {live['steps']} / sim {sim['steps']}; model time live "
            f"{live['execute_s']:.2f} s / sim {sim['execute_s']:.2f} s; first arrival to last finish live "
            f"{live['span_s']:.2f} s / sim {sim['span_s']:.2f} s; live wall {live['wall_s']:.1f} s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL),
                    help="model directory, or 'tiny' for the built-in tiny model (default: %(default)s)")
    ap.add_argument("--profile", type=Path, default=None, help="a measured profile (default: measure one now)")
    ap.add_argument("--policies", default="fcfs,skip-join-mlfq", help="comma-separated scheduling policies")
    ap.add_argument("--kv-policy", default="proactive")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson arrival rate, requests/s")
    ap.add_argument("--prompt-lens", default="16,128", help="uniform prompt length range lo,hi")
    ap.add_argument("--output-lens", default="8,48", help="uniform output length range lo,hi")
    ap.add_argument("--max-num-seqs", type=int, default=ORDER_MATTERS["max_num_seqs"],
                    help="batch bound (default: fastserve compare's, %(default)s)")
    ap.add_argument("--device-blocks", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    prompt_range = tuple(int(x) for x in args.prompt_lens.split(","))
    output_range = tuple(int(x) for x in args.output_lens.split(","))
    model_dir = resolve_model(args.model)
    trace = make_trace(args.num_prompts, args.rate, prompt_range, output_range, args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sim-vs-live-") as tmp:
        profile = args.profile
        if profile is None:
            print("measuring the profile (fastserve profile --quick, single-threaded) ...", flush=True)
            profile = measure_profile(model_dir, Path(tmp) / "profile.json", args.max_num_seqs,
                                      prompt_range[1] + output_range[1])
        print(f"# {args.num_prompts} requests, Poisson {args.rate}/s, prompt {prompt_range}, output {output_range}, "
              f"max_num_seqs {args.max_num_seqs}, kv-policy {args.kv_policy}", flush=True)
        rows = compare(model_dir, profile, trace, args.policies.split(","), args.kv_policy, args.device_blocks,
                       args.max_num_seqs)
    print(f"total wall {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
