"""The eviction candidates of one PriorityPolicy.schedule() tick (scheduler/priority_policy.py): which started
job gives its device KV back when a more urgent one needs room."""

from __future__ import annotations

from collections.abc import Container, Iterable
from itertools import filterfalse
from typing import Protocol

from scheduler.job import Job
from scheduler.policy import KVAdmission


class RankedPolicy(Protocol):
    """What the candidates read of their policy (scheduler/priority_policy.py's PriorityPolicy)."""

    _dropped: Container[Job]  # started jobs an eviction left with no KV (none holds device KV)

    def _rank(self, job: Job) -> tuple:
        """The job's sort key in the walk's order (smaller comes first)."""
        ...

    def _wait_estimate(self, job: Job, now: float) -> float:
        """Estimated time until the job runs."""
        ...

    def _started_jobs(self) -> Iterable[Job]:
        """Jobs that have run at least once (only they can hold KV)."""
        ...


class Victims:
    """Eviction candidates of one schedule() tick: the started jobs that hold
    device KV (ready, num_computed > 0, not parked on the host: kv.parked())
    and are not in the batch, largest
    estimated wait first (ties: lowest priority first), or, when memory/ drops
    what it evicts (kv.victims_by_priority), lowest priority first, as vLLM
    picks the job it will recompute. Built on first need, so
    a tick without memory pressure pays nothing; each candidate is looked at
    once per tick, because the jobs that need room come in falling priority.
    A pinned job (job.kv_pinned: uploaded on demand for a pick, not run since)
    is evicted only to make room for another pinned job; passed over for the
    others, it is kept aside for the pinned jobs later in the walk."""

    def __init__(self, policy: RankedPolicy, now: float, chosen: dict[Job, None]) -> None:
        self._policy, self._now, self._chosen = policy, now, chosen
        self._order: list[Job] | None = None
        self._next = 0
        self.evicted: set[Job] = set()
        self.spent = False  # the last make_room failed with no candidate left and the job not waiting for room
        self._pinned: list[Job] = []  # pinned candidates passed over for unpinned jobs, largest wait first

    def _build(self, kv: KVAdmission) -> list[Job]:
        rank, wait, chosen, on_host = self._policy._rank, self._policy._wait_estimate, self._chosen, kv.parked()
        # (the host-parked and the kept dropped jobs, none of which holds device KV, left out in C first: past
        # capacity most started jobs are one or the other)
        started = filterfalse(self._policy._dropped.__contains__, self._policy._started_jobs())
        held = [j for j in filterfalse(on_host.__contains__, started)
                if j.kv_ready and not j.in_flight and not j.kv_busy and j.num_computed > 0
                and j not in chosen]  # (j.ready, inlined; kv_busy: a launched step writes its KV)
        if kv.victims_by_priority:
            return sorted(held, key=rank, reverse=True)
        return sorted(held, key=lambda j: (wait(j, self._now), rank(j)), reverse=True)

    def make_room(self, job: Job, num_new_tokens: int, kv: KVAdmission) -> bool:
        """Evict until the job fits now (True) or its room is being freed by copies in flight (the job
        waits for them: False, as when nothing more may go)."""
        self.spent = False
        if kv.wait_for_room(job, num_new_tokens):
            return False
        if self._order is None:
            self._order = self._build(kv)
        rank = self._policy._rank
        mine = rank(job)
        pinned = job.kv_pinned
        if pinned and self._pinned:
            kept, self._pinned = self._pinned, []
            for i, victim in enumerate(kept):
                if victim in self._chosen or rank(victim) <= mine:  # (in the batch since, or of higher priority
                    continue  # than this job: so than every later one too)
                if self._evict(victim, job, num_new_tokens, kv):
                    self._pinned = kept[i + 1:]
                    return True
                if kv.wait_for_room(job, num_new_tokens):
                    self._pinned = kept[i + 1:]
                    return False
        while self._next < len(self._order):
            victim = self._order[self._next]
            self._next += 1  # in the batch or of higher priority now: so for every later job too
            if victim in self._chosen or rank(victim) <= mine:
                continue
            if victim.kv_pinned and not pinned:
                self._pinned.append(victim)
                continue
            if self._evict(victim, job, num_new_tokens, kv):
                return True
            if kv.wait_for_room(job, num_new_tokens):
                return False
        self.spent = not self._pinned  # (a pinned job later in the walk may still take the kept ones)
        return False

    def _evict(self, victim: Job, job: Job, num_new_tokens: int, kv: KVAdmission) -> bool:
        """Evict one candidate; whether the job fits now."""
        kv.evict(victim)
        self.evicted.add(victim)
        return kv.can_fit(job, num_new_tokens)
