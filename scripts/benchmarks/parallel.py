"""Benchmark of the multi-process executor (prints ratios; not a timed test).

    python -m scripts.benchmarks.parallel [--batches 1,32,256] [--steps 30] [--skip-sim]

1. Controller-to-worker cost of one step. The same decode steps (context 64)
   run on a MultiprocExecutor with one worker (tp = pp = 1) and then on the
   LocalExecutor (the same compute in process). The transport cost of a step is
   its wall time at the controller minus the compute time the worker measured
   around its forward pass and sampling: pickling the step's deltas, one socket
   write per rank, the worker reading and rebuilding its batch, the reply and
   its unpickling (taking the difference per step keeps CPU contention in the
   compute out of it). Printed beside the local step time, and the message's
   bytes. Aim: under 1 ms a step at batch 256. Also printed: the CPU work of
   that trip alone (pickling and unpickling a decode step's message and its
   reply, in process): the floor the trip costs on a quiet machine, where
   scheduling delays between processes do not add to it.
2. Pipeline parallelism in the simulator: OPT-175B on 16 A100s as 2 stages of
   8 (profiles/sim/opt-175b-a100-*-x16.json), ShareGPT lengths at a load past
   capacity, with up to 2 batches in flight against 1 at a time; throughput =
   requests / simulated seconds. Aim: close to 2x when memory allows (the 80GB
   profile; on 40GB the KV cache binds first).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from pathlib import Path

from engine.batch import ModelBatch, SequenceResult, SequenceWork
from engine.config import EngineConfig
from engine.executor import messages as m
from engine.executor.local import LocalExecutor
from engine.executor.multiproc import MultiprocExecutor
from engine.model.config import OPTConfig
from engine.sampling_params import SamplingParams
from modelmaker.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]

CONTEXT = 64
BLOCK = 16


def decode_batch(batch_size: int, step: int) -> ModelBatch:
    """batch_size sequences decoding one token at position CONTEXT + step (their tables hold it)."""
    per_seq = -(-(CONTEXT + 64) // BLOCK)
    seqs = []
    for i in range(batch_size):
        table = list(range(i * per_seq, (i + 1) * per_seq))
        pos = CONTEXT + step
        seqs.append(SequenceWork(f"s{i}", [5 + i % 50], pos, table[: pos // BLOCK + 1],
                                 SamplingParams(temperature=0), None, pos - 8))
    return ModelBatch(seqs, None)


def prefill_batch(batch_size: int) -> ModelBatch:
    """The jobs' first steps (the multi-process executor learns each job once)."""
    per_seq = -(-(CONTEXT + 64) // BLOCK)
    seqs = [SequenceWork(f"s{i}", [5 + (i + k) % 50 for k in range(CONTEXT)], 0,
                         list(range(i * per_seq, i * per_seq + CONTEXT // BLOCK)), SamplingParams(temperature=0),
                         None, 0) for i in range(batch_size)]
    return ModelBatch(seqs, None)


def serialization_cost(batch_size: int, repeats: int = 200) -> float:
    """Median seconds to pickle and unpickle a decode step's message (one new token per job, no new blocks)
    and its reply (one token per job): the CPU work of a step's round trip."""
    jobs = m.StepJobs(list(range(batch_size)), [100] * batch_size, [1] * batch_size, [[5]] * batch_size)
    msg = m.StepMessage(7, jobs=jobs)
    reply = m.StepReply.of(0, 7, [SequenceResult(5) for _ in range(batch_size)], 0.01, [])
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for obj in (msg, reply):
            pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def transport_cost(model_dir: Path, batches: list[int], steps: int) -> None:
    cfg = OPTConfig.from_model_dir(model_dir)
    blocks = max(batches) * -(-(CONTEXT + 64) // BLOCK)
    local = LocalExecutor(model_dir, cfg, device="cpu", dtype="float32", block_size=BLOCK,
                          num_gpu_blocks_override=blocks)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK,
                          num_gpu_blocks_override=blocks)
    remote = MultiprocExecutor(config, model_dir, cfg, cfg.max_position_embeddings)
    print(f"1. controller-to-worker cost of one decode step (tiny model, context {CONTEXT}, {steps} steps; medians)")
    print(f"{'batch':>6} {'message bytes':>14} {'worker step ms':>15} {'transport ms':>13} {'local step ms':>14} "
          f"{'transport / local':>18}")
    try:
        for b in batches:
            remote.execute(prefill_batch(b))
            transport, walls, nbytes = [], [], []
            for step in range(steps):
                batch = decode_batch(b, step)  # built before the clock starts: the engine hands it over built
                t = time.perf_counter()
                result = remote.execute(batch)
                wall = time.perf_counter() - t
                walls.append(wall)
                transport.append(wall - result.execute_s)
                nbytes.append(remote.last_message_bytes)  # the step's deltas, pickled once for every rank
            remote.release([s.job_id for s in prefill_batch(b).seqs])
            local.execute(prefill_batch(b))
            local_walls = []
            for step in range(steps):
                batch = decode_batch(b, step)
                t = time.perf_counter()
                local.execute(batch)
                local_walls.append(time.perf_counter() - t)
            tm, lm = statistics.median(transport), statistics.median(local_walls)
            print(f"{b:>6} {int(statistics.median(nbytes)):>14,} {statistics.median(walls) * 1e3:>15.2f} "
                  f"{tm * 1e3:>13.3f} {lm * 1e3:>14.2f} {tm / lm:>18.3f}   (serialization alone "
                  f"{serialization_cost(b) * 1e3:.3f} ms)")
    finally:
        remote.shutdown()
        local.shutdown()


def pipeline_throughput(num_prompts: int, rate: float, lengths: Path) -> None:
    from fastserve import simulate

    print(f"\n2. simulator: OPT-175B on 16 A100s as 2 stages x 8 GPUs, lengths from {lengths.name}, "
          f"{num_prompts} requests at {rate:g} req/s (past capacity), fcfs and skip-join-mlfq")
    print(f"{'profile':<28} {'policy':<15} {'1 in flight req/s':>18} {'2 in flight req/s':>18} {'ratio':>6}")
    for variant in ("40gb", "80gb"):
        profile = REPO / "profiles" / "sim" / f"opt-175b-a100-{variant}-x16.json"
        for policy in ("fcfs", "skip-join-mlfq"):
            served = []
            for in_flight in (1, 2):
                args = simulate.build_parser().parse_args([
                    "--model", "opt-175b", "--profile", str(profile), "--dataset-name", "lengths",
                    "--dataset-path", str(lengths), "--num-prompts", str(num_prompts), "--request-rate", str(rate),
                    "--scheduling-policy", policy, "--max-in-flight", str(in_flight)])
                summary = simulate.run(args)
                served.append(summary["requests"] / summary["duration_s"])
            print(f"{profile.name:<28} {policy:<15} {served[0]:>18.2f} {served[1]:>18.2f} "
                  f"{served[1] / served[0]:>6.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the built-in tiny model")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--lengths", type=Path, default=REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv",
                    help="(prompt, output) lengths CSV for the simulator part (ShareGPT's, or alpaca_lengths.csv)")
    ap.add_argument("--skip-sim", action="store_true")
    args = ap.parse_args(argv)
    transport_cost(args.model or ensure_tiny_model(), [int(b) for b in args.batches.split(",")], args.steps)
    if not args.skip_sim:
        pipeline_throughput(args.num_prompts, args.rate, args.lengths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
