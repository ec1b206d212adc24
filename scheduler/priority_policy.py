"""The shared machinery of the preemptive priority policies (skip-join MLFQ,
naive MLFQ, fixed priority, SRPT): one batch-formation loop, one eviction
rule, one preempted list. A subclass says only how jobs are ordered.

Rule (FastServe section 4.1, Algorithm 1: "the batch is the highest-priority
ready jobs"), applied every iteration, so any job may be preempted after any
output token:
- walk the jobs from the highest priority down and take each *ready* job
  while the batch has a slot (max_num_seqs) and the batched-token budget
  allows it (a job too large for the budget runs alone when it comes first);
- each job must get device KV room (`kv.can_fit` then `kv.allocate`); when it
  does not fit, jobs of *lower* priority that are not in the batch and hold
  device KV are evicted, largest estimated wait first, until it fits or the
  room is being freed by offloads in flight (then the job waits for them,
  `kv.wait_for_room`); a job that still does not fit is skipped (and a job
  evicted this tick does not run this tick);
- a job that is not ready (its KV moving), or that allocate() left not ready
  (its upload just started), waits: it keeps its place and skips this tick;
- jobs that ran last iteration but not in this one are the preempted ones.

What it is not: a ranking of its own. Subclasses give `_priority_order()`
(highest first) and `_wait_estimate()`; KeyedPriorityPolicy below is the
variant for a per-job sort key (fixed priority, SRPT).
"""

from __future__ import annotations

import bisect
import itertools
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

from scheduler.job import Job
from scheduler.policy import CostModel, KVAdmission, ScheduleDecision, SchedulerConfig, SchedulingPolicy


class PriorityPolicy(SchedulingPolicy):
    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._running: dict[Job, None] = {}  # the batch of the last schedule(), in order
        self.num_policy_preemptions = 0  # jobs that ran and then did not, over the policy's life

    # -- what a subclass defines ---------------------------------------------------------
    @abstractmethod
    def _priority_order(self) -> Iterable[Job]:
        """Every job the policy holds, highest priority first."""

    @abstractmethod
    def _wait_estimate(self, job: Job, now: float) -> float:
        """Estimated time until the job runs, as if it were not running now."""

    def _before_schedule(self, now: float) -> None:
        """Reorder before the batch is formed (promotion, re-sorting)."""

    def _on_preempted(self, jobs: list[Job]) -> None:
        """These jobs ran last iteration and not in this one."""

    # -- the SchedulingPolicy verbs --------------------------------------------------------
    @property
    def jobs(self) -> Sequence[Job]:
        return list(self._priority_order())

    def has_work(self) -> bool:
        return next(iter(self._priority_order()), None) is not None

    def estimated_wait(self, job: Job, now: float) -> float:
        return 0.0 if job in self._running else self._wait_estimate(job, now)

    def schedule(self, now: float, kv: KVAdmission) -> ScheduleDecision:
        self._before_schedule(now)
        max_seqs, budget = self.config.max_num_seqs, self.config.max_num_batched_tokens
        batch: list[Job] = []
        chosen: dict[Job, None] = {}  # ordered, so `preempted` comes out in a deterministic order
        victims = _Victims(self, now, chosen)
        evicted, can_fit, allocate = victims.evicted, kv.can_fit, kv.allocate  # hot loop: bound once
        tokens = 0
        for job in self._priority_order():
            # This loop may visit every job when the token budget runs out early, so the two
            # checks that reject most are inlined: job.num_new_tokens, and the rule of
            # SchedulingPolicy._fits_token_budget (a job too large for the budget runs alone).
            n = job.prompt_len + job.num_generated - job.num_computed
            if batch and tokens + n > budget:
                continue
            if job in evicted:
                continue
            if not job.ready:
                kv.note_blocked(job)
                continue
            if not can_fit(job, n) and not (kv.may_evict_for(job) and victims.make_room(job, n, kv)):
                continue
            allocate(job, n)
            if not job.ready:  # its KV was on the host: the upload started, it runs when it lands
                continue
            batch.append(job)
            chosen[job] = None
            tokens += n
            if len(batch) >= max_seqs or tokens >= budget:
                break

        decision = ScheduleDecision(batch=batch)
        preempted = decision.preempted
        for job in self._running:
            if job not in chosen:
                job.num_preemptions += 1
                preempted.append(job)
        if preempted:
            self.num_policy_preemptions += len(preempted)
            self._on_preempted(preempted)
        self._running = chosen
        for job in batch:
            if job.first_scheduled_time is None:
                job.first_scheduled_time = now
            job.last_scheduled_time = now
        return decision

    def on_step_done(self, batch: Sequence[Job], now: float, cost: float) -> None:
        for job in batch:
            job.service_in_queue += cost
            job.service_total += cost
            job.last_scheduled_time = now


class _Victims:
    """Eviction candidates of one schedule() tick: the jobs that hold device KV
    (ready, num_computed > 0) and are not in the batch, largest estimated wait
    first (ties: lowest priority first). Built on first need, so a tick without
    memory pressure pays nothing; each candidate is looked at once per tick,
    because the jobs that need room come in falling priority."""

    def __init__(self, policy: PriorityPolicy, now: float, chosen: dict[Job, None]) -> None:
        self._policy, self._now, self._chosen = policy, now, chosen
        self._order: list[Job] | None = None
        self._pos: dict[Job, int] = {}  # job -> place in priority order (0 = highest)
        self._next = 0
        self.evicted: set[Job] = set()

    def _build(self) -> list[Job]:
        self._pos = {job: i for i, job in enumerate(self._policy._priority_order())}
        held = [j for j in self._pos if j.ready and j.num_computed > 0 and j not in self._chosen]
        wait = self._policy._wait_estimate
        return sorted(held, key=lambda j: (wait(j, self._now), self._pos[j]), reverse=True)

    def make_room(self, job: Job, num_new_tokens: int, kv: KVAdmission) -> bool:
        """Evict until the job fits now (True) or its room is being freed by copies in flight (the job
        waits for them: False, as when nothing more may go)."""
        if kv.wait_for_room(job, num_new_tokens):
            return False
        if self._order is None:
            self._order = self._build()
        rank = self._pos[job]
        while self._next < len(self._order):
            victim = self._order[self._next]
            self._next += 1  # in the batch or of higher priority now: so for every later job too
            if victim in self._chosen or self._pos[victim] <= rank:
                continue
            kv.evict(victim)
            self.evicted.add(victim)
            if kv.can_fit(job, num_new_tokens):
                return True
            if kv.wait_for_room(job, num_new_tokens):
                return False
        return False


class KeyedPriorityPolicy(PriorityPolicy):
    """Priority by a per-job key, smaller first, ties in arrival order.

    Jobs sit in one list kept sorted by (key, arrival sequence); a static key
    is placed once by binary search, a dynamic one (it changes as jobs run)
    is re-sorted before each tick (timsort: near-linear on a near-sorted list).
    The wait estimate is the job's place in that order, in batches of
    max_num_seqs, times one decode step.
    """

    dynamic_key: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._order: list[Job] = []
        self._seq: dict[Job, int] = {}  # job -> arrival sequence (tie-break)
        self._counter = itertools.count()
        self._positions: dict[Job, int] | None = None  # cache of place in _order

    @abstractmethod
    def _key(self, job: Job) -> float:
        """Smaller runs first."""

    def _sort_key(self, job: Job) -> tuple[float, int]:
        return (self._key(job), self._seq[job])

    def _priority_order(self) -> Iterable[Job]:
        return self._order

    def add(self, job: Job, now: float) -> None:
        if job in self._seq:
            raise ValueError(f"job {job.job_id} was already added")
        self._seq[job] = next(self._counter)
        bisect.insort(self._order, job, key=self._sort_key)
        self._positions = None

    def remove(self, job: Job) -> None:
        if self._seq.pop(job, None) is not None:
            self._order.remove(job)
            self._running.pop(job, None)
            self._positions = None

    def _before_schedule(self, now: float) -> None:
        if self.dynamic_key:
            self._order.sort(key=self._sort_key)
            self._positions = None

    def _wait_estimate(self, job: Job, now: float) -> float:
        if self._positions is None:
            self._positions = {j: i for i, j in enumerate(self._order)}
        seqs = self.config.max_num_seqs
        step = self.cost.t_dec(min(seqs, len(self._order)), job.context_len)
        return (self._positions[job] // seqs + 1) * step
