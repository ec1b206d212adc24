"""FCFS: iteration-level, run-to-completion batching, as vLLM and Orca do it.

Rule (docs/scheduling.md, "Policies"):
- a running job is never preempted by policy;
- waiting jobs join in arrival order while batch slots, the batched-token
  budget and device KV memory allow (admission stops at the first that does
  not fit: no overtaking);
- when a running job cannot grow because device KV is exhausted, the newest
  running job is preempted (memory/ drops it for recompute, or offloads it
  under a swapping kv-policy) and goes back to the head of the waiting queue;
  when an offload in flight will free the room, the job waits for it instead
  of preempting more (kv.wait_for_room), and no new job is admitted;
- a job that is not ready (its KV moving) keeps its place and skips the tick;
- request classes (Job.priority, lower first): the waiting queue is ordered
  by class, then arrival; a running job is still never preempted by policy,
  and when memory runs out the victim is the newest job of the least urgent
  class running (with one class: the newest, as vLLM);
  a preempted job whose KV is on the host is admitted back in its turn, runs
  once its upload lands, and no one overtakes it meanwhile.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

from scheduler.job import Job
from scheduler.policy import KVAdmission, PolicyName, ScheduleDecision, SchedulingPolicy, charged


class FCFSPolicy(SchedulingPolicy):
    name = PolicyName.FCFS

    def __init__(self, config, cost) -> None:
        super().__init__(config, cost)
        self._running: list[Job] = []  # in admission order (oldest first)
        self._waiting: list[Job] = []  # by (class, arrival sequence)
        self._seq: dict[Job, int] = {}  # job -> arrival sequence
        self._counter = itertools.count()
        self._classes: Counter[int] = Counter()
        self.started_by_priority: Counter[int] = Counter()

    @property
    def jobs(self) -> Sequence[Job]:
        return self._running + self._waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def jobs_by_priority(self) -> dict[int, int]:
        """Unfinished jobs per request class (Job.priority), most urgent first."""
        return dict(sorted(self._classes.items()))

    def _key(self, job: Job) -> tuple[int, int]:
        return (job.priority, self._seq[job])

    def add(self, job: Job, now: float) -> None:
        if job in self._seq:
            raise ValueError(f"job {job.job_id} was already added")
        self._seq[job] = next(self._counter)
        bisect.insort(self._waiting, job, key=self._key)
        self._classes[job.priority] += 1

    def remove(self, job: Job) -> None:
        if job not in self._seq:
            return
        if job in self._running:
            self._running.remove(job)
        else:
            i = bisect.bisect_left(self._waiting, self._key(job), key=self._key)
            del self._waiting[i if self._waiting[i] is job else self._waiting.index(job)]
        del self._seq[job]
        self._classes[job.priority] -= 1
        if not self._classes[job.priority]:
            del self._classes[job.priority]

    def schedule(self, now: float, kv: KVAdmission) -> ScheduleDecision:
        decision = ScheduleDecision()
        tokens = 0
        room_wait = False  # a running job waits for room an offload in flight is freeing
        # Chunked prefill: running jobs that decode keep a token each of the budget ahead of a chunk.
        reserve = 0
        if self.config.enable_chunked_prefill:
            reserve = sum(1 for j in self._running if not j.in_flight and j.num_computed and j.num_new_tokens == 1)
        # 1. Running jobs grow, oldest first (a partly prefilled one by its next chunk); the newest gives way when
        # KV runs out.
        i = 0
        while i < len(self._running):
            job = self._running[i]
            n = job.num_new_tokens
            decoder = n == 1 and job.num_computed > 0 and not job.in_flight
            if decoder:
                reserve -= 1  # its token is in the batch now, or it cannot run: kept for it no longer
            # The slot check matters when running jobs were skipped (not ready) and more joined.
            full = len(decision.batch) >= self.config.max_num_seqs
            n = self.chunk(n, tokens, len(decision.batch), max(0, reserve))
            if full or not n:
                i += 1
                continue
            if job.in_flight:  # still running in a later pipeline stage
                i += 1
                continue
            if not job.ready:
                kv.note_blocked(job)
                i += 1
                continue
            fits = kv.can_fit(job, n)
            while not fits and not kv.wait_for_room(job, n):
                victim = self._victim(i)
                if victim is None:  # (async scheduling: every candidate's KV is being written) it waits
                    break
                self._preempt(victim, kv, decision)
                if victim is job:
                    break
                fits = kv.can_fit(job, n)
            if job not in self._running[i : i + 1]:  # it was the victim, and gave way
                continue
            i += 1
            if not fits:
                room_wait = True
                continue
            kv.allocate(job, n)
            if job.ready:
                decision.batch.append(job)
                job.num_scheduled = n
                tokens += n
        # 2. Waiting jobs join in arrival order, unless memory just forced a preemption or a wait.
        while (not decision.preempted and not room_wait and self._waiting
               and len(decision.batch) < self.config.max_num_seqs):
            job = self._waiting[0]
            n = self.chunk(job.num_new_tokens, tokens, len(decision.batch))
            if not n:
                break
            if not job.ready:
                kv.note_blocked(job)
                break
            if not kv.can_fit(job, n):
                break
            kv.allocate(job, n)
            self._waiting.pop(0)
            self._running.append(job)
            if job.first_scheduled_time is None:
                self.started_by_priority[job.priority] += 1
            if not job.ready:  # its KV was on the host: it runs when the upload lands; no one overtakes
                break
            decision.batch.append(job)
            job.num_scheduled = n
            tokens += n
        for job in decision.batch:
            if job.first_scheduled_time is None:
                job.first_scheduled_time = now
            job.last_scheduled_time = now
        return decision

    def _victim(self, start: int) -> Job | None:
        """The newest job of the least urgent class among running jobs not yet given room this tick
        (self._running[start:], which holds the job asking), leaving out jobs whose KV a launched step writes
        (in flight in a pipeline stage, or kv_busy with async scheduling); None if every one is such a job."""
        rest = [job for job in self._running[start:] if not job.in_flight and not job.kv_busy]
        if not rest:
            return None
        worst = max(job.priority for job in rest)
        return next(job for job in reversed(rest) if job.priority == worst)

    def _preempt(self, victim: Job, kv: KVAdmission, decision: ScheduleDecision) -> None:
        self._running.remove(victim)
        kv.evict(victim)
        victim.num_preemptions += 1
        decision.preempted.append(victim)
        # Back into the queue at its arrival place in its class: it was admitted before every waiter
        # of its class that arrived after it (or with it), so it goes ahead of them.
        bisect.insort(self._waiting, victim, key=self._key)

    def on_step_done(self, batch: Sequence[Job], now: float, cost: float,
                     charges: Mapping[Job, float] | None = None) -> None:
        for job, charge in charged(batch, cost, charges):
            job.service_total += charge
            job.last_scheduled_time = now

    def estimated_wait(self, job: Job, now: float) -> float:
        """Queue position times the cost of one decode step (0 when running)."""
        if job in self._running:
            return 0.0
        pos = bisect.bisect_left(self._waiting, self._key(job), key=self._key) if job in self._seq else 0
        return (pos + 1) * self.cost.t_dec(max(1, len(self._running)), job.context_len)
