"""A step's wall time against the executor's compute time, at tp = pp = 1 (issue 26's control-plane item).

    .venv/bin/python scripts/bench_control_plane.py [--model DIR] [--batch 32,256] [--steps 40] [--device cuda]

Starts an LLM in process (LocalExecutor), puts `batch` requests in (8-token prompts, greedy, ignore_eos) and
times every Engine.step() of the decode phase: the wall time of the step, the executor's compute time
(BatchResult.execute_s: prepare + forward + sample in the step thread) and the engine's two parts on the
critical path, schedule_step (scheduler, KV manager, the ModelBatch) and finish_step (tokens into requests,
detokenizing, the scheduler's bookkeeping). The engine is synchronous: step k+1 is scheduled only after step k
finished, so everything but execute_s is on the critical path; with asynchronous scheduling (vLLM V1) the
schedule part would overlap the executor. Prints medians and the critical-path share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402


def measure(model: str, batch: int, steps: int, device: str = "cpu") -> dict:
    llm = LLM(model=model, device=device, profile="analytic", max_num_seqs=batch, seed=0)
    engine = llm.engine
    times: dict[str, list[float]] = {"schedule": [], "finish": [], "execute": []}
    schedule, finish = engine.schedule_step, engine.finish_step

    def timed_schedule():
        start = time.perf_counter()
        plan = schedule()
        times["schedule"].append(time.perf_counter() - start)
        return plan

    def timed_finish(plan, result):
        times["execute"].append(result.execute_s)
        start = time.perf_counter()
        out = finish(plan, result)
        times["finish"].append(time.perf_counter() - start)
        return out

    engine.schedule_step, engine.finish_step = timed_schedule, timed_finish
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
                rows.append(dict(wall=wall, execute=times["execute"][0], schedule=sum(times["schedule"]),
                                 finish=sum(times["finish"])))
    finally:
        llm.close()
    decode = rows[2:steps + 1]  # past the prefill step(s), the batch whole
    med = {k: statistics.median(r[k] for r in decode) for k in ("wall", "execute", "schedule", "finish")}
    med["outside_execute"] = statistics.median(r["wall"] - r["execute"] for r in decode)
    return dict(batch=batch, steps=len(decode), **med)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "tiny-opt"))
    ap.add_argument("--batch", default="32,256", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    print("| batch | step wall (ms) | executor compute (ms) | wall - compute (ms) | schedule_step (ms) | "
          "finish_step (ms) | critical path outside compute |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        r = measure(args.model, batch, args.steps, args.device)
        ms = {k: v * 1e3 for k, v in r.items() if isinstance(v, float)}
        print(f"| {batch} | {ms['wall']:.2f} | {ms['execute']:.2f} | {ms['outside_execute']:.2f} | "
              f"{ms['schedule']:.2f} | {ms['finish']:.2f} | {ms['outside_execute'] / ms['wall']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
