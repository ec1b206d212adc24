"""Test helpers for scheduler/: a fixed cost model, a fake KV admission with a
block budget, and a virtual-clock loop that drives a policy as the engine
would. Not a test module (pytest collects nothing here).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memory.residency import Allocation
from scheduler import Job, ProfiledCostModel, ScheduleDecision, SchedulingPolicy, step_charges


def make_cost(decode_at_batch_8: float = 1.0, decode_by_context: dict[int, tuple[float, float]] | None = None
              ) -> ProfiledCostModel:
    """t_init(L) = L / 8 s; t_dec = 1 s at batch 1, decode_at_batch_8 at batch 8, any context.
    With max_prompt_len = 64 and ratio 2 the quanta are [1, 2, 4, 8]. decode_by_context: instead, context ->
    (t_dec at batch 1, at batch 8)."""
    by_context = decode_by_context or {16: (1.0, decode_at_batch_8)}
    return ProfiledCostModel.from_dict(
        {
            "schema": "fastserve.profile/1",
            "key": {"model": "test"},
            "prefill": {"prompt_lens": [0, 64], "seconds": [0.0, 8.0]},
            "decode": {"batch_sizes": [1, 8], "context_lens": list(by_context),
                       "seconds": [list(row) for row in zip(*by_context.values())]},
        }
    )


class FakeKV:
    """Device KV of `num_blocks` blocks of `block_size` tokens. evict() drops the
    job's KV (recompute), as memory/ does under --kv-policy recompute."""

    def __init__(self, num_blocks: int, block_size: int = 4, victims_by_priority: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.victims_by_priority = victims_by_priority  # False: largest ENST first (memory/'s swapping rule)
        self.held: dict[Job, int] = {}  # job -> blocks reserved
        self.num_evictions = 0

    @property
    def free(self) -> int:
        return self.num_blocks - sum(self.held.values())

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _extra(self, job: Job, num_new_tokens: int) -> int:
        return self.blocks(job.num_computed + num_new_tokens) - self.held.get(job, 0)

    def can_fit(self, job: Job, num_new_tokens: int) -> bool:
        return self._extra(job, num_new_tokens) <= self.free

    def allocate(self, job: Job, num_new_tokens: int) -> Allocation:
        assert self.can_fit(job, num_new_tokens), f"allocate without room for {job.job_id}"
        held = job in self.held
        self.held[job] = self.blocks(job.num_computed + num_new_tokens)
        return Allocation((), held, False)  # (block counts only: no block ids to report)

    def may_evict_for(self, job: Job) -> bool:
        return True

    def may_start(self, job: Job, num_new_tokens: int) -> bool:
        return True

    def room_for(self, num_tokens: int) -> bool:
        return self.blocks(num_tokens) <= self.free

    def parked(self) -> tuple[Job, ...]:
        return ()  # no host tier: nothing is parked

    def parked_unfit(self) -> tuple[Job, ...]:
        return ()

    def wait_for_room(self, job: Job, num_new_tokens: int) -> bool:
        return False  # evictions free their blocks at once: no copy is ever in flight

    def note_blocked(self, job: Job) -> None:
        pass

    def evict(self, job: Job) -> None:
        assert job in self.held, f"evict of {job.job_id}, which holds no blocks"
        self.release(job)
        job.num_computed = 0
        self.num_evictions += 1

    def release(self, job: Job) -> None:
        """The engine frees a finished job's blocks."""
        self.held.pop(job, None)


@dataclass(frozen=True)
class Spec:
    job_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0  # request class


@dataclass
class Tick:
    now: float
    decision: ScheduleDecision
    starve_before: dict[Job, float]  # every held job's starve time just before schedule()


def simulate(
    policy: SchedulingPolicy,
    specs: Sequence[Spec],
    kv: FakeKV,
    *,
    on_add: Callable[[Job], None] | None = None,
    on_tick: Callable[[Tick], None] | None = None,
    flaky_ready: random.Random | None = None,
    max_ticks: int = 5000,
) -> dict[str, float]:
    """Run the specs to completion on a virtual clock; return job_id -> completion time.

    Each tick: add arrived jobs (in spec order), schedule, advance the clock by
    cost.iteration_cost(batch), then update jobs as the engine does
    (num_computed = context_len, num_generated += 1) and finish those that
    reached their output length. With flaky_ready, each tick a random third of
    the jobs is not ready.
    """
    pending = sorted(specs, key=lambda s: s.arrival_time)  # stable: spec order among equal arrivals
    done: dict[str, float] = {}
    now = 0.0
    for _ in range(max_ticks):
        while pending and pending[0].arrival_time <= now:
            s = pending.pop(0)
            job = Job(s.job_id, s.prompt_len, s.output_len, s.arrival_time, true_output_len=s.output_len,
                      priority=s.priority)
            policy.add(job, now)
            if on_add is not None:
                on_add(job)
        if not policy.has_work():
            if not pending:
                return done
            now = pending[0].arrival_time
            continue
        if flaky_ready is not None:
            for job in policy.jobs:
                job.ready = flaky_ready.random() > 1 / 3
        starve = {j: j.starve_time(now) for j in policy.jobs}
        decision = policy.schedule(now, kv)
        if on_tick is not None:
            on_tick(Tick(now, decision, starve))
        if not decision.batch:
            assert flaky_ready is not None, f"empty batch at t={now} with every job ready"
            now += 0.5
            continue
        cost = policy.cost.iteration_cost(decision.batch)
        charges = dict(zip(decision.batch, step_charges(decision.batch, cost)))  # (before the jobs move on)
        now += cost
        for job in decision.batch:
            job.num_computed = job.context_len
            job.num_generated += 1
        policy.on_step_done(decision.batch, now, cost, charges)
        for job in decision.batch:
            if job.num_generated >= job.max_new_tokens:
                job.finished = True
                policy.remove(job)
                kv.release(job)
                done[job.job_id] = now
    raise AssertionError(f"not finished after {max_ticks} ticks: {len(done)} of {len(specs)} jobs done")
