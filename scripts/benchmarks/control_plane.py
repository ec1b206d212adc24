"""A step's wall time against the executor's compute time, at tp = pp = 1 (the control plane's share of a step):
synchronous, async output processing (EngineConfig.async_output_processing) and async scheduling
(EngineConfig.async_scheduling), interleaved.

    python -m scripts.benchmarks.control_plane [--model DIR] [--batch 32,256] [--steps 40] [--repeats 3]
        [--modes sync,async-output,async-scheduling] [--device cuda]

Starts an LLM in process (LocalExecutor), puts `batch` requests in (8-token prompts, greedy, ignore_eos), makes
the engine emit every running request's snapshot each step (as the server's AsyncEngine does) and times every
Engine.step() of the decode phase: its wall time, the executor's compute (BatchResult.execute_s: prepare +
forward + sample in the step thread) and the engine's parts: schedule_step (scheduler, KV manager, the
ModelBatch), commit_step (tokens into requests, stop checks, releases, the scheduler's bookkeeping) and
publish_step (detokenizing, output snapshots).

sync: step k+1 is scheduled after step k is finished, so everything but execute_s is on the critical path. async-
output: complete_step launches step k+1 right after committing step k, and publishes step k while step k+1
computes, so publish_step leaves the critical path; scheduling, committing and the hand-off to and from the step
thread stay on it. async-scheduling: step k+1 is scheduled and queued in the step thread while step k computes (its
jobs' tokens from placeholders the executor fills), and step k is committed and published while step k+1 computes:
nothing of the engine is left between two steps' compute but the step thread taking the next one. "outside compute"
= wall - execute: what the engine adds to each step. "executor idle" is the critical path itself, read in the step
thread: from the end of step k's compute to the start of step k+1's (what a GPU would wait for: the hand-offs, and
whatever the engine does between the two). The modes alternate (sync, async-output, async-scheduling, async-
scheduling, async-output, sync, ...) so that a change in the machine's load hits both; each row is one run.
--threads sets torch's intra-op threads (default: torch's, the cores): on CPU the step thread's compute and the
engine thread share the cores, so with every core computing the overlap only moves work from one to the other (on a
GPU the compute is the device's); --threads 1 leaves a core to the engine thread, as a GPU would.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams

PARTS = ("schedule", "commit", "publish")


MODES = ("sync", "async-output", "async-scheduling")


def measure(model: str, batch: int, steps: int, device: str = "cpu", mode: str = "sync") -> dict:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    llm = LLM(model=model, device=device, profile="analytic", max_num_seqs=batch, seed=0,
              async_output_processing=mode == "async-output", async_scheduling=mode == "async-scheduling")
    engine = llm.engine
    engine.emit_running_outputs = True  # as the server's AsyncEngine: a snapshot of every advanced request a step
    assert engine.overlaps_output == (mode != "sync") and engine.async_scheduling == (mode == "async-scheduling")
    times: dict[str, list[float]] = {"execute": [], **{p: [] for p in PARTS}}
    runs: list[tuple[float, float]] = []  # (start, end) of each step's compute, in the step thread
    executor_run = engine.executor._run

    def timed_run(batch):
        start = time.perf_counter()
        try:
            return executor_run(batch)
        finally:
            runs.append((start, time.perf_counter()))

    engine.executor._run = timed_run

    def timed(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            times[name].append(time.perf_counter() - start)
            return out
        return run

    schedule, commit = engine.schedule_step, engine.commit_step
    engine.schedule_step = timed("schedule", schedule)
    engine.publish_step = timed("publish", engine.publish_step)

    def timed_commit(plan, result, *args, **kwargs):
        times["execute"].append(result.execute_s)
        return timed("commit", commit)(plan, result, *args, **kwargs)

    engine.commit_step = timed_commit
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [2] + [(7 * i + j) % 1000 + 10 for j in range(7)], params)
    rows = []
    try:
        while engine.has_unfinished():
            for key in times:
                times[key].clear()
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            if len(times["execute"]) == 1:
                rows.append(dict(wall=wall, execute=times["execute"][0], **{p: sum(times[p]) for p in PARTS}))
    finally:
        llm.close()
    decode = rows[2:steps + 1]  # past the prefill step(s), the batch whole
    med = {k: statistics.median(r[k] for r in decode) for k in ("wall", "execute", *PARTS)}
    med["outside_execute"] = statistics.median(r["wall"] - r["execute"] for r in decode)
    med["idle"] = statistics.median(b[0] - a[1] for a, b in zip(runs[2:steps + 1], runs[3:steps + 2]))
    return dict(batch=batch, steps=len(decode), mode=mode, **med)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "tiny-opt"))
    ap.add_argument("--batch", default="32,256", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode per batch size, interleaved")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval seconds: how long a thread may hold the GIL while another waits "
                         "(0: Python's default, 0.005)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    modes = args.modes.split(",")
    print("| batch | mode | step wall (ms) | executor compute (ms) | wall - compute (ms) | executor idle (ms) | "
          "schedule_step (ms) | commit_step (ms) | publish_step (ms) | outside compute |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        for rep in range(args.repeats):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                r = measure(args.model, batch, args.steps, args.device, mode=mode)
                ms = {k: v * 1e3 for k, v in r.items() if isinstance(v, float)}
                print(f"| {batch} | {mode} | {ms['wall']:.2f} | {ms['execute']:.2f} | {ms['outside_execute']:.2f} | "
                      f"{ms['idle']:.2f} | {ms['schedule']:.2f} | {ms['commit']:.2f} | {ms['publish']:.2f} | "
                      f"{ms['outside_execute'] / ms['wall']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
