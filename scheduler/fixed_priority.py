"""Fixed priority by input length: a baseline (FastServe section 6).

Rule: the shorter the prompt, the higher the priority (ties in arrival
order); preemptive at iteration granularity, so a newly arrived shorter job
takes a running longer job's place at the next iteration. A job's priority
never changes: no demotion, no promotion, and no starvation prevention (the
starvation threshold is ignored), so a long prompt can wait for as long as
shorter ones keep coming. That is the point of the baseline. Batch formation
and eviction: scheduler/priority_policy.py.
"""

from __future__ import annotations

from scheduler.job import Job
from scheduler.policy import PolicyName
from scheduler.priority_policy import KeyedPriorityPolicy


class FixedPriorityPolicy(KeyedPriorityPolicy):
    name = PolicyName.FIXED_PRIORITY

    def _key(self, job: Job) -> float:
        return job.prompt_len

    def _later_fresh_need_at_least(self, job: Job, n: int) -> bool:
        # A fresh job needs its whole prompt, its key: every later fresh job of its class needs as much or more.
        return self._fresh_ranks[-1][0] == job.priority
