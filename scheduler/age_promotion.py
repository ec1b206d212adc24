"""Age promotion for the policies ordered by a per-job key (SRPT, Gittins): the starvation bound of the engine's
defaults, as skip-join's (scheduler/skip_join_mlfq.py).

Rule (starvation_age k; None = off): a job whose time in the system exceeds k x the mean time in the system (jobs
held / completion rate over the last AGE_WINDOW completions: Little's law, PriorityPolicy.age_limit) goes ahead of
every other job of its request class, oldest first, and stays there until it leaves: it runs to completion. The
threshold grows with the backlog as FCFS's waits do, so past capacity it does not turn the order into round robin,
and no job waits without bound however many shorter ones keep coming.
"""

from __future__ import annotations

import bisect
from abc import abstractmethod
from collections import deque
from typing import ClassVar

from scheduler.job import Job
from scheduler.policy import CostModel, SchedulerConfig
from scheduler.priority_policy import KeyedPriorityPolicy

STARVING_KEY = -1e18  # key offset of age-promoted jobs (oldest first within it)


class AgePromotedPolicy(KeyedPriorityPolicy):
    """A keyed order (_order_key, smaller first) under age promotion."""

    promotes_by_age: ClassVar[bool] = True  # False: the key alone, whatever starvation_age says

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._ages = self.promotes_by_age and config.starvation_age is not None
        self._starving: set[Job] = set()
        self._by_arrival: deque[Job] = deque()
        self._now = 0.0
        self.num_promotions = 0  # age promotions

    @abstractmethod
    def _order_key(self, job: Job) -> float:
        """The job's key before age promotion: smaller runs first (within a request class)."""

    def _key(self, job: Job) -> float:
        if job in self._starving:
            return STARVING_KEY + job.arrival_time
        return self._order_key(job)

    def add(self, job: Job, now: float) -> None:
        super().add(job, now)
        if self._ages:
            self._by_arrival.append(job)

    def remove(self, job: Job) -> None:
        held = job in self._seq
        super().remove(job)
        if held:
            self._starving.discard(job)
            if self._ages:
                self._completions.append(self._now)

    def _before_schedule(self, now: float) -> None:
        self._now = now
        if self._by_arrival:
            self._promote_by_age(now)
        super()._before_schedule(now)

    def _promote_by_age(self, now: float) -> None:
        limit = self.age_limit(now)
        if limit is None:
            return
        queue = self._by_arrival
        while queue and (queue[0] not in self._seq or now - queue[0].arrival_time > limit):
            job = queue.popleft()
            if job not in self._seq:
                continue
            self._starving.add(job)
            job.num_promotions += 1
            self.num_promotions += 1
            if job.first_scheduled_time is None:  # fresh: its rank is fixed while fresh; place it anew
                i = self._fresh_index(job)
                del self._fresh[i], self._fresh_ranks[i]
                rank = (job.priority, self._key(job), self._seq[job])
                self._fixed_rank[job] = rank
                k = bisect.bisect_right(self._fresh_ranks, rank)
                self._fresh.insert(k, job)
                self._fresh_ranks.insert(k, rank)
            else:
                self._ranks_moved((job,))
                self._sorted = False
            self._positions = None
