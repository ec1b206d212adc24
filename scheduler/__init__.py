"""scheduler/: which jobs run each iteration. Pure policy over Job state and
profiled costs; no tensors, no block ids, no torch.

    policy = make_policy(SchedulerConfig(...), ProfiledCostModel.from_json(path))
    policy.add(job, now); decision = policy.schedule(now, kv)
    cost = cost_model.iteration_cost(decision.batch)  # (both read the jobs as the policy left them)
    charges = dict(zip(decision.batch, step_charges(decision.batch, cost)))
    ... run the iteration ...; policy.on_step_done(decision.batch, now, cost, charges)
"""

from __future__ import annotations

from scheduler.cost_model import ProfiledCostModel
from scheduler.fcfs import FCFSPolicy
from scheduler.fixed_priority import FixedPriorityPolicy
from scheduler.gittins import GittinsPolicy
from scheduler.job import Job
from scheduler.mlfq import MLFQPolicy
from scheduler.policy import CostModel, PolicyName, ScheduleDecision, SchedulerConfig, SchedulingPolicy, step_charges
from scheduler.skip_join_mlfq import SkipJoinMLFQPolicy
from scheduler.srpt import SRPTPolicy, UnboundedSRPTPolicy

_POLICIES: dict[PolicyName, type[SchedulingPolicy]] = {
    PolicyName.FCFS: FCFSPolicy,
    PolicyName.SKIP_JOIN_MLFQ: SkipJoinMLFQPolicy,
    PolicyName.MLFQ: MLFQPolicy,
    PolicyName.FIXED_PRIORITY: FixedPriorityPolicy,
    PolicyName.SRPT: SRPTPolicy,
    PolicyName.SRPT_UNBOUNDED: UnboundedSRPTPolicy,
    PolicyName.GITTINS: GittinsPolicy,
}


def make_policy(config: SchedulerConfig, cost: CostModel) -> SchedulingPolicy:
    """The policy that config.policy names (a PolicyName or its string)."""
    try:
        name = PolicyName(config.policy)
    except ValueError:
        choices = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown scheduling policy {config.policy!r}; choose one of {choices}") from None
    return _POLICIES[name](config, cost)


__all__ = [
    "CostModel",
    "FCFSPolicy",
    "FixedPriorityPolicy",
    "GittinsPolicy",
    "Job",
    "MLFQPolicy",
    "PolicyName",
    "ProfiledCostModel",
    "SRPTPolicy",
    "ScheduleDecision",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SkipJoinMLFQPolicy",
    "UnboundedSRPTPolicy",
    "make_policy",
    "step_charges",
]
