"""Prefix caching's overhead (issue 28's goal: at most 3% throughput and 0.05 ms per scheduler tick) on a workload
with no shared prefix, caching on against off in the same run.

    python scripts/bench_prefix_caching.py                       # both parts, 5 interleaved repeats
    python scripts/bench_prefix_caching.py --parts tick --repeats 3

1. tick: the simulator (engine/simulation.py: the real Engine, scheduler and KVManager, costs from the OPT-13B
   A100-40GB profile, no model computing) replays one Poisson trace of random prompts (ShareGPT lengths, a fresh
   random token sequence per request, so no two share a block) past capacity, so the queues stay full and
   blocks churn. The engine's own work is all there is to time: wall and CPU seconds per engine step with
   caching on minus off is the cache's cost per scheduler tick (admission's lookup, naming blocks as they fill,
   the evictable list). No two requests share a block; the only hits are a preempted job's own blocks, found
   again when it restarts (the schedule may then differ by a few steps, so each side is divided by its own
   step count).
2. throughput: the tiny model live on the CPU (LLM.generate, continuous batching), random prompts with ShareGPT
   lengths (capped), output tokens per second on / off. The tiny model computes little, so the bookkeeping's
   share of a step is larger than with any real model: an upper bound on the throughput cost. Each repeat uses
   new prompts (the same for both sides), so the cache never hits across repeats (a preempted job may find its
   own blocks again); the outputs of the two sides must be identical.

On and off alternate within each repeat (on first in even repeats); each number is the median over repeats with
its range. CPU seconds (time.process_time) count the work done, wall seconds also the time other processes held
the cores: on a shared machine the CPU ratio is the steadier one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from steady_state import engine_arg  # noqa: E402  (--engine NAME=VALUE, as the steady-state harness reads it)

from fastserve.bench.workload import LengthFilter, load_workload  # noqa: E402

PARTS = ("tick", "throughput")
GOAL_TICK_MS = 0.05
GOAL_THROUGHPUT = 0.97  # on / off
LENGTHS = REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv"
FALLBACK_LENGTHS = REPO / "tests" / "data" / "sharegpt_fig15_trace.json"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def fmt(s: dict, digits: int = 4) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f} .. {s['max']:.{digits}f}]"


def sharegpt_trace(n: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    if LENGTHS.exists():
        items = load_workload("lengths", n, path=str(LENGTHS), rate=rate, seed=seed, length_filter=LengthFilter())
        return [(it.arrival_s, it.prompt_len, it.output_len) for it in items]
    rows = json.loads(FALLBACK_LENGTHS.read_text())["trace"]
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        _, p, o = rows[i % len(rows)]
        t += rng.expovariate(rate)
        out.append((t, int(p), int(o)))
    return out


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [2] + [rng.randrange(4, vocab) for _ in range(max(0, n - 1))]


# -- 1. the scheduler tick in the simulator ----------------------------------------------------------------------
def simulate_once(model_dir: Path, profile: Path, trace, seed: int, caching: bool, engine_args: dict) -> dict:
    from engine.clock import VirtualClock  # noqa: F401  (the simulated engine's clock)
    from engine.sampling_params import SamplingParams
    from engine.simulation import _advance_to_next_event, simulated_engine

    engine = simulated_engine(model_dir, profile, scheduling_policy="skip-join-mlfq",
                              enable_prefix_caching=caching, **engine_args)
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    prompts = [random_prompt(rng, p, vocab) for _, p, _ in trace]
    clock = engine.clock
    clock.advance(trace[0][0])
    nxt, step_wall, step_cpu = 0, 0.0, 0.0
    while nxt < len(trace) or engine.has_unfinished():
        while nxt < len(trace) and trace[nxt][0] <= clock.now():
            arrival, _, out = trace[nxt]
            engine.add_request(str(nxt), prompts[nxt], SamplingParams(temperature=0, max_tokens=out, ignore_eos=True,
                                                                      detokenize=False), arrival_time=arrival)
            nxt += 1
        before = engine.num_steps
        if engine.has_unfinished():
            w, c = time.perf_counter(), time.process_time()
            engine.step()
            step_wall += time.perf_counter() - w
            step_cpu += time.process_time() - c
        if engine.num_steps == before:
            _advance_to_next_event(engine, clock, trace[nxt][0] if nxt < len(trace) else None)
    dev = engine.kv.device
    return {"steps": engine.num_steps, "wall_s": step_wall, "cpu_s": step_cpu,
            "hits": getattr(dev, "num_hits", 0), "evictions": getattr(dev, "num_evictions", 0),
            "end_s": clock.now()}


def tick_part(args) -> dict:
    from make_tiny_model import config_only_model

    model = config_only_model("opt-13b")
    profile = REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"
    rows = []
    for rep in range(args.repeats):
        trace = sharegpt_trace(args.tick_requests, args.tick_rate, seed=rep)
        order = (True, False) if rep % 2 == 0 else (False, True)
        res = {c: simulate_once(model, profile, trace, rep, c, args.engine_args) for c in order}
        on, off = res[True], res[False]
        row = {"steps": on["steps"], "steps_off": off["steps"], "evictions": on["evictions"], "hits": on["hits"],
               "off_ms": off["wall_s"] / off["steps"] * 1e3, "on_ms": on["wall_s"] / on["steps"] * 1e3,
               "off_cpu_ms": off["cpu_s"] / off["steps"] * 1e3, "on_cpu_ms": on["cpu_s"] / on["steps"] * 1e3}
        row["delta_ms"] = row["on_ms"] - row["off_ms"]
        row["delta_cpu_ms"] = row["on_cpu_ms"] - row["off_cpu_ms"]
        rows.append(row)
        print(f"  tick repeat {rep}: {row['steps']} steps on, {row['steps_off']} off; {row['evictions']} evictions, "
              f"{row['hits']} tokens hit (a preempted job's own blocks); per step off "
              f"{row['off_ms']:.4f} ms, on {row['on_ms']:.4f} ms (cpu {row['off_cpu_ms']:.4f} / "
              f"{row['on_cpu_ms']:.4f})", flush=True)
    out = {k: spread([r[k] for r in rows]) for k in ("off_ms", "on_ms", "delta_ms", "off_cpu_ms", "on_cpu_ms",
                                                       "delta_cpu_ms")}
    out["ratio_cpu"] = spread([r["on_cpu_ms"] / r["off_cpu_ms"] for r in rows])
    out["steps"] = [r["steps"] for r in rows]
    out["requests"], out["rate"] = args.tick_requests, args.tick_rate
    return out


# -- 2. throughput of the tiny model live --------------------------------------------------------------------------
def throughput_part(args) -> dict:
    from engine import LLM, SamplingParams

    llms = {c: LLM(model=args.model, enable_prefix_caching=c, num_gpu_blocks_override=args.blocks,
                   device="cpu", dtype="float32", **args.engine_args) for c in (True, False)}
    vocab = llms[True].engine.model_config.vocab_size
    rows, hits_before = [], 0
    for rep in range(args.repeats + 1):  # repeat 0 warms both engines up and is not counted
        trace = sharegpt_trace(args.requests, 1.0, seed=100 + rep)
        rng = random.Random(100 + rep)
        prompts = [random_prompt(rng, min(args.cap, p), vocab) for _, p, _ in trace]
        params = [SamplingParams(temperature=0, max_tokens=max(1, min(args.cap, o)), ignore_eos=True)
                  for _, _, o in trace]
        order = (True, False) if rep % 2 == 0 else (False, True)
        res = {}
        for c in order:
            w, cpu = time.perf_counter(), time.process_time()
            outs = llms[c].generate(prompts, params)
            res[c] = (time.perf_counter() - w, time.process_time() - cpu,
                      [list(o.outputs[0].token_ids) for o in outs])
        if res[True][2] != res[False][2]:
            raise SystemExit(f"repeat {rep}: outputs differ with caching on")
        hits = llms[True].engine.kv.device.num_hits - hits_before
        hits_before += hits
        tokens = sum(len(t) for t in res[True][2])
        if rep == 0:
            continue
        row = {"tokens": tokens, "hits": hits, "off_tok_s": tokens / res[False][0], "on_tok_s": tokens / res[True][0],
               "ratio": res[False][0] / res[True][0], "ratio_cpu": res[False][1] / res[True][1]}
        rows.append(row)
        print(f"  throughput repeat {rep}: {tokens} tokens, {hits} tokens hit; off {row['off_tok_s']:.1f} tok/s, on "
              f"{row['on_tok_s']:.1f} tok/s; on/off wall {row['ratio']:.4f}, cpu {row['ratio_cpu']:.4f}", flush=True)
    for llm in llms.values():
        llm.close()
    out = {k: spread([r[k] for r in rows]) for k in ("off_tok_s", "on_tok_s", "ratio", "ratio_cpu")}
    out["requests"], out["cap"], out["tokens"] = args.requests, args.cap, rows[0]["tokens"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tick-requests", type=int, default=600, help="simulated requests per tick run")
    ap.add_argument("--tick-rate", type=float, default=4.5,
                    help="their Poisson rate, req/s (default 4.5: ~1.5x FCFS's capacity on the profile)")
    ap.add_argument("--model", default=None, help="throughput: model directory (default: the built-in tiny model)")
    ap.add_argument("--requests", type=int, default=64, help="throughput: requests per run")
    ap.add_argument("--cap", type=int, default=256, help="throughput: prompt and output lengths capped here")
    ap.add_argument("--blocks", type=int, default=1024, help="throughput: device KV blocks")
    ap.add_argument("--engine", action="append", default=[],
                    help="NAME=VALUE, an engine setting for both sides (e.g. kv_policy=recompute); repeatable")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.engine_args = dict(engine_arg(a) for a in args.engine)
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        raise SystemExit(f"--parts: choose from {', '.join(PARTS)}")
    results: dict = {"repeats": args.repeats, "engine": args.engine_args}
    ok = True
    if "tick" in parts:
        print(f"# tick: simulated OPT-13B A100-40GB, {args.tick_requests} random-prompt requests at "
              f"{args.tick_rate} req/s, skip-join MLFQ", flush=True)
        t = results["tick"] = tick_part(args)
        met = t["delta_cpu_ms"]["median"] <= GOAL_TICK_MS
        ok &= met
        print(f"tick per engine step, ms: off {fmt(t['off_ms'])}, on {fmt(t['on_ms'])}; on - off wall "
              f"{fmt(t['delta_ms'])}, cpu {fmt(t['delta_cpu_ms'])} (cpu ratio {fmt(t['ratio_cpu'], 3)}); "
              f"goal <= {GOAL_TICK_MS} ms: {'met' if met else 'NOT met'}")
    if "throughput" in parts:
        print(f"# throughput: tiny model on CPU, {args.requests} random-prompt requests (ShareGPT lengths capped at "
              f"{args.cap}) per run", flush=True)
        t = results["throughput"] = throughput_part(args)
        met = t["ratio_cpu"]["median"] >= GOAL_THROUGHPUT
        ok &= met
        print(f"throughput tok/s: off {fmt(t['off_tok_s'], 1)}, on {fmt(t['on_tok_s'], 1)}; on/off wall "
              f"{fmt(t['ratio'], 3)}, cpu {fmt(t['ratio_cpu'], 3)}; goal >= {GOAL_THROUGHPUT}: "
              f"{'met' if met else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
