"""SRPT oracle: shortest remaining output first. Simulation and tests only.

Rule: priority = output tokens still to generate, job.remaining_tokens(),
which reads the true output length (Job.true_output_len) that no real server
knows; fewer first, ties in arrival order; preemptive at iteration
granularity. It bounds what a length-aware policy could achieve.

Two oracles. `srpt`, the yardstick of every comparison (DESIGN.md, "How a
comparison is measured"), has the same starvation bound as the defaults:
age promotion (starvation_age; scheduler/age_promotion.py), so a long job
is not left waiting for as long as shorter ones keep coming, which no policy
it is compared with may do either. `srpt-unbounded` is the order alone, no
starvation prevention: the bound on mean latency, at the price of waits that
grow without limit. Batch formation and eviction: scheduler/priority_policy.py.
"""

from __future__ import annotations

from scheduler.age_promotion import AgePromotedPolicy
from scheduler.job import Job
from scheduler.policy import PolicyName


class SRPTPolicy(AgePromotedPolicy):
    name = PolicyName.SRPT
    dynamic_key = True  # remaining tokens fall as a job runs: re-sorted each tick

    def _order_key(self, job: Job) -> float:
        return job.remaining_tokens()


class UnboundedSRPTPolicy(SRPTPolicy):
    name = PolicyName.SRPT_UNBOUNDED
    promotes_by_age = False
