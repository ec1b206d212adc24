"""Scheduler tick benchmark: what one scheduling decision costs under load,
against the model step it schedules.

    python -m scripts.benchmarks.scheduler             # 1,000 and 10,000 waiting + 256 running jobs
    python -m scripts.benchmarks.scheduler --waiting 1000 --ticks 200 --model DIR

One tick is the scheduler's share of an engine step: policy.schedule(), the
batch's profiled cost (cost_model.iteration_cost) and policy.on_step_done();
each part is also shown alone. The jobs never finish (huge max_tokens), KV
admission always fits (a fake), and time is virtual (each tick advances it by
the profiled cost), so the queues churn as they would live: demotions,
starvation promotions, new prefills. Baseline, measured in the same run: the
tiny model's decode step at batch 1 through the live engine (Engine.step()).
Aim: a tick under 0.2 ms with 1,000 waiting, under 0.5 ms with 10,000; the
verdict is printed for each policy (the aim is the default policy's, skip-join
MLFQ; FCFS is the baseline beside it).

The policies get the engine's defaults (EngineConfig: the service ladder, age
promotion, no alpha); jobs finish after 16-512 tokens and a new one takes each
finished job's place, so the queues keep their size. With the paper's rule
(--starvation-threshold 0.3 --starvation-factor none) and the tiny CPU profile a
256-job iteration costs 0.14 s against alpha 0.3 s, so every waiting job is
promoted every ~3 iterations and ~230 jobs are promoted, demoted and
preempted per tick: the worst case of churn, not the engine's steady state.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from memory.residency import GREW_BY_NOTHING, Allocation
from scheduler import Job, SchedulerConfig, SchedulingPolicy, make_policy
from scheduler.policy import MLFQ_LADDERS, CostModel

AIM_MS = {1000: 0.2, 10000: 0.5}  # waiting jobs -> aim for the median tick (ms); other sizes: the larger


class AlwaysFits:
    """KV admission that never runs out: the tick measures the policy alone."""

    def can_fit(self, job: Job, num_new_tokens: int) -> bool:
        return True

    def allocate(self, job: Job, num_new_tokens: int) -> Allocation:
        return GREW_BY_NOTHING  # (in place: the policy keeps its admission refusals)

    victims_by_priority = False

    def may_evict_for(self, job: Job) -> bool:
        return True

    def may_start(self, job: Job, num_new_tokens: int) -> bool:
        return True

    def room_for(self, num_tokens: int) -> bool:
        return True

    def wait_for_room(self, job: Job, num_new_tokens: int) -> bool:
        return False  # evictions free their blocks at once: no copy is ever in flight

    def note_blocked(self, job: Job) -> None:
        pass

    def evict(self, job: Job) -> None:
        job.num_computed = 0

    def parked(self) -> tuple[Job, ...]:
        return ()  # nothing is parked on a host

    def parked_unfit(self) -> tuple[Job, ...]:
        return ()


def none_or_float(value: str) -> float | None:
    return None if value == "none" else float(value)


def summary(times: list[float]) -> tuple[float, float]:
    """(median, best) in seconds."""
    return statistics.median(times), min(times)


def decode_step_times(llm: LLM, steps: int) -> list[float]:
    """Wall seconds of each Engine.step() of one decoding request (batch 1, ~16-token context), after its prefill."""
    engine, times = llm.engine, []
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    engine.add_request("baseline", [2, *range(10, 25)], params)
    engine.step()  # the prefill
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return times


def loaded_policy(name: str, cost: CostModel, waiting: int, running: int, seed: int,
                  alpha: float | None = 0.3, factor: float | None = None, ladder: str = "service",
                  age: float | None = None) -> SchedulingPolicy:
    config = SchedulerConfig(policy=name, max_num_seqs=running, max_prompt_len=2048, starvation_threshold=alpha,
                             starvation_factor=factor, mlfq_ladder=ladder, starvation_age=age)
    policy = make_policy(config, cost)
    rng = random.Random(seed)
    for i in range(waiting + running):
        arrival = i * 1e-4
        policy.add(new_job(rng, f"j{i}", arrival), arrival)
    return policy


def new_job(rng: random.Random, job_id: str, arrival: float) -> Job:
    """A prompt of 8-512 tokens and 16-512 output tokens (it finishes, so completions feed age promotion)."""
    return Job(job_id, rng.randint(8, 512), max_new_tokens=rng.randint(16, 512), arrival_time=arrival)


def tick_times(policy: SchedulingPolicy, cost: CostModel, warmup: int, ticks: int) -> dict[str, list[float]]:
    """Seconds of each timed tick, whole and by part (schedule, cost, done), and each batch size."""
    kv, now = AlwaysFits(), 1.0
    rng, arrivals = random.Random(1), 0
    out: dict[str, list[float]] = {"tick": [], "schedule": [], "cost": [], "done": [], "batch": []}
    for i in range(warmup + ticks):
        t0 = time.perf_counter()
        batch = policy.schedule(now, kv).batch
        t1 = time.perf_counter()
        step_cost = cost.iteration_cost(batch)
        t2 = time.perf_counter()
        policy.on_step_done(batch, now + step_cost, step_cost)
        t3 = time.perf_counter()
        if i >= warmup:
            for part, seconds in (("tick", t3 - t0), ("schedule", t1 - t0), ("cost", t2 - t1), ("done", t3 - t2),
                                  ("batch", len(batch))):
                out[part].append(seconds)
        now += step_cost
        for job in batch:  # the engine's part: the step computed these tokens and sampled one
            job.num_computed = job.context_len
            job.num_generated += 1
            if job.num_generated >= job.max_new_tokens:  # finished: a new request takes its place
                job.finished = True  # (what the engine sets: a policy that learns from finished jobs sees it)
                policy.remove(job)
                arrivals += 1
                policy.add(new_job(rng, f"new{arrivals}", now), now)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model for the baseline decode step (default: the built-in tiny model)")
    p.add_argument("--profile", default="analytic", help="job profile for the engine and the policies")
    p.add_argument("--waiting", default="1000,10000", help="comma-separated waiting-job counts")
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--ticks", type=int, default=500, help="timed ticks per policy")
    p.add_argument("--warmup", type=int, default=50, help="untimed ticks first (the batch fills up)")
    p.add_argument("--decode-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    defaults = EngineConfig()
    p.add_argument("--starvation-threshold", type=none_or_float, default=defaults.starvation_threshold,
                   help="alpha in seconds, or 'none' (default: the engine's, %(default)s)")
    p.add_argument("--starvation-factor", type=none_or_float, default=defaults.starvation_factor,
                   help="promotion after max(alpha, f x W), or 'none': the paper's rule, which with the tiny "
                        "profile promotes every waiting job every ~3 iterations (default: the engine's, %(default)s)")
    p.add_argument("--starvation-age", type=none_or_float, default=defaults.starvation_age,
                   help="age promotion, or 'none' (default: the engine's, %(default)s)")
    p.add_argument("--mlfq-ladder", default=defaults.mlfq_ladder, choices=MLFQ_LADDERS)
    p.add_argument("--policies", default="skip-join-mlfq,fcfs", help="comma-separated policies to time "
                   "(e.g. add gittins)")
    args = p.parse_args(argv)

    llm = LLM(model=args.model, profile=args.profile, kv_policy="recompute", num_gpu_blocks_override=256)
    cost = llm.engine.cost_model
    step_med, step_best = summary(decode_step_times(llm, args.decode_steps))
    print(f"baseline: {llm.engine.model_config.name} decode step, batch 1: median {step_med * 1e3:.3f} ms, "
          f"best {step_best * 1e3:.3f} ms ({args.decode_steps} steps)")
    for waiting in (int(w) for w in args.waiting.split(",")):
        aim = AIM_MS.get(waiting, max(AIM_MS.values()))
        print(f"scheduler tick, {waiting} waiting + {args.running} running jobs, {args.ticks} ticks, "
              f"alpha {args.starvation_threshold}, starvation factor {args.starvation_factor}, "
              f"ladder {args.mlfq_ladder}, age promotion {args.starvation_age}:")
        print(f"  {'policy':<16}{'median ms':>10}{'best ms':>9}{'median/step':>13}{'best/step':>11}"
              f"   median ms of schedule / cost / done   batch")
        medians: dict[str, float] = {}
        for name in args.policies.split(","):
            policy = loaded_policy(name, cost, waiting, args.running, args.seed, args.starvation_threshold,
                                   args.starvation_factor, args.mlfq_ladder, args.starvation_age)
            t = tick_times(policy, cost, args.warmup, args.ticks)
            med, best = summary(t["tick"])
            medians[name] = med
            parts = " / ".join(f"{statistics.median(t[k]) * 1e3:.3f}" for k in ("schedule", "cost", "done"))
            print(f"  {name:<16}{med * 1e3:>10.3f}{best * 1e3:>9.3f}{med / step_med:>13.4f}{best / step_best:>11.4f}"
                  f"   {parts:<34}  {statistics.median(t['batch']):.0f}")
            churn = {k: getattr(policy, k) for k in ("num_promotions", "num_demotions", "num_policy_preemptions")
                     if hasattr(policy, k)}
            if churn:
                counts = ", ".join(f"{k.removeprefix('num_')} {v}" for k, v in churn.items())
                print(f"  {'':<16}over {args.warmup + args.ticks} ticks: {counts}")
        verdicts = ", ".join(f"{name} {'within the aim' if med * 1e3 <= aim else 'OVER'}"
                             for name, med in medians.items())
        print(f"aim <= {aim} ms per tick (median) with {waiting} waiting: {verdicts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
