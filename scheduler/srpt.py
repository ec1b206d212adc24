"""SRPT oracle: shortest remaining output first. Simulation and tests only.

Rule: priority = output tokens still to generate, job.remaining_tokens(),
which reads the true output length (Job.true_output_len) that no real server
knows; fewer first, ties in arrival order; preemptive at iteration
granularity; no starvation prevention. It bounds what a length-aware policy
could achieve. Batch formation and eviction: scheduler/priority_policy.py.
"""

from __future__ import annotations

from scheduler.job import Job
from scheduler.policy import PolicyName
from scheduler.priority_policy import KeyedPriorityPolicy


class SRPTPolicy(KeyedPriorityPolicy):
    name = PolicyName.SRPT
    dynamic_key = True  # remaining tokens fall as a job runs: re-sorted each tick

    def _key(self, job: Job) -> float:
        return job.remaining_tokens()
