"""Same decisions, as a hash: one sha256 per simulated run over everything the engine loop decided.

    python -m scripts.benchmarks.schedule_digest                     # the full table (3,000 requests a run)
    python -m scripts.benchmarks.schedule_digest --requests 500      # a shorter trace
    python -m scripts.benchmarks.schedule_digest --only skip-join-mlfq/proactive

A run is the simulator (engine/simulation.py: the real engine loop, scheduler and KV manager on a virtual clock)
on the ShareGPT lengths trace (vLLM's length filter, Poisson arrivals, seed 0) with the OPT-13B A100-40GB
profile, at about 1.0C and 1.5C (C = FCFS's sustained capacity there, 2.980 req/s). Its digest covers, for every
tick, the clock, the batch (job ids and the tokens each computes), the preempted job ids and every copy the KV
manager ordered (direction, block pairs), in order; then each request's finish time. Two versions of the code
that make the same decisions print the same table: run it before a change that must not change behaviour and
after, and diff the two (timings go to stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# ../shared/datasets beside the repository (a worktree's: beside the folder of worktrees)
DATASET = next((d / "shared" / "datasets" / "sharegpt_lengths.csv" for d in (REPO.parent, REPO.parent.parent)
                if (d / "shared" / "datasets").is_dir()), REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv")
PROFILE = REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"
SHAPE = "opt-13b"
CAPACITY = 2.980  # C: FCFS's sustained capacity on this profile and trace (req/s)
LOADS = (1.0, 1.5)
POLICIES = ("fcfs", "skip-join-mlfq", "mlfq", "fixed-priority", "srpt", "gittins")
# (workload, scheduling policy, kv policy) of every run: each policy with the default kv policy, and the swapping
# and recompute baselines for skip-join MLFQ and FCFS, on the trace's single requests; and chats (the trace's
# requests as the turns of conversations, each turn's prompt the whole history: the prefix cache's hits, on both
# tiers) for a few.
RUNS = tuple(("requests", p, "proactive") for p in POLICIES) + tuple(
    ("requests", p, kv) for p in ("skip-join-mlfq", "fcfs") for kv in ("reactive", "reactive-blocking", "recompute")
) + tuple(("chat", p, kv) for p, kv in (("skip-join-mlfq", "proactive"), ("skip-join-mlfq", "reactive"),
                                        ("fcfs", "proactive")))
TURNS = 4  # turns of a chat
THINK_S = 5.0  # a chat's mean think time between an answer and the next turn
REQUESTS = 3000
SEED = 0


def model_dir() -> Path:
    """A config-only OPT-13B directory (config.json: the simulator reads the shape alone), written on first use."""
    from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config, write_opt_checkpoint

    out = REPO / ".cache" / "schedule_digest" / SHAPE
    if not (out / "config.json").is_file():
        write_opt_checkpoint(out, opt_config(**OPT_SHAPES[SHAPE]), weight_format="none")
    return out


def trace(rate: float, n: int, seed: int = SEED) -> list[tuple[float, int, int]]:
    from fastserve.bench.workload import LengthFilter, load_workload

    items = load_workload("lengths", n, path=DATASET, rate=rate, seed=seed, length_filter=LengthFilter())
    return [(it.arrival_s, it.prompt_len, it.output_len) for it in items]


class Recorder:
    """Feeds a sha256 with what the engine decides, by wrapping the scheduler's schedule() and the transfer
    backend's copy() of one engine (instance attributes: the classes are untouched)."""

    def __init__(self, engine) -> None:
        self.sha = hashlib.sha256()
        self.ticks = 0
        schedule = engine.scheduler.schedule

        def recorded_schedule(now, kv):
            decision = schedule(now, kv)
            batch = ",".join(f"{j.job_id}:{j.num_scheduled}" for j in decision.batch)
            preempted = ",".join(j.job_id for j in decision.preempted)
            self.feed(f"T{now!r}|{batch}|{preempted}")
            self.ticks += 1
            return decision

        engine.scheduler.schedule = recorded_schedule
        swapper = getattr(engine.executor, "swapper", None)
        if swapper is not None:
            copy = swapper.copy

            def recorded_copy(direction, pairs):
                self.feed(f"C{direction.value}|{pairs}")
                return copy(direction, pairs)

            swapper.copy = recorded_copy

    def feed(self, line: str) -> None:
        self.sha.update(line.encode())
        self.sha.update(b"\n")


def run_digest(policy: str, kv_policy: str, requests: Sequence[tuple[float, int, int]], workload: str = "requests",
               seed: int = SEED) -> tuple[str, int]:
    """Simulate one run of `requests` ((arrival s, prompt tokens, output tokens), e.g. trace()'s); with workload
    "chat", each TURNS consecutive requests are the turns of a conversation that opens at the first one's arrival.
    Returns (the run's digest, ticks)."""
    from engine.simulation import run_conversations, run_trace, simulated_engine
    from modelmaker.tiny_model import ensure_tiny_model

    engine = simulated_engine(model_dir(), PROFILE, tokenizer=str(ensure_tiny_model()), scheduling_policy=policy,
                              kv_policy=kv_policy, enable_chunked_prefill=False, seed=seed)
    recorder = Recorder(engine)
    if workload == "chat":
        chats = [requests[i:i + TURNS] for i in range(0, len(requests), TURNS)]
        result = run_conversations(engine, [[(p, o) for _, p, o in chat] for chat in chats],
                                   [chat[0][0] for chat in chats], think_time_s=THINK_S, seed=seed)
        outputs = [turn.output for turn in result.turns]
    else:
        outputs = run_trace(engine, requests).outputs
    for out in outputs:
        recorder.feed(f"F{out.request_id}|{out.metrics.finished_time!r}")
    return recorder.sha.hexdigest(), recorder.ticks


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=REQUESTS, help="requests per run (default: %(default)s)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only these (repeatable): a workload, a scheduling policy, policy/kv-policy or "
                         "workload/policy/kv-policy")
    args = ap.parse_args(argv)
    runs = [run for run in RUNS if not args.only or {run[0], run[1], "/".join(run[1:]), "/".join(run)} & {*args.only}]
    if not runs:
        ap.error(f"--only matches no run; runs: {', '.join('/'.join(run) for run in RUNS)}")
    total = time.perf_counter()
    for workload, policy, kv_policy in runs:
        for load in LOADS:
            rate = round(load * CAPACITY, 2)
            t = time.perf_counter()
            digest, ticks = run_digest(policy, kv_policy, trace(rate, args.requests), workload)
            print(f"{workload:8} {policy:15} {kv_policy:17} {rate:5.2f} {args.requests:5d} {digest}", flush=True)
            print(f"  {workload}/{policy}/{kv_policy} at {rate}: {ticks} ticks, {time.perf_counter() - t:.1f} s",
                  file=sys.stderr, flush=True)
    print(f"total {time.perf_counter() - total:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
