"""Naive MLFQ: the baseline that skip-join MLFQ improves on (FastServe
section 4.1, "naive MLFQ").

Rule: exactly skip-join MLFQ (scheduler/skip_join_mlfq.py: same quanta,
demotion, starvation promotion, batch and ENST) except that every new job
enters Q1, whatever its prompt; a long prompt's prefill then overruns q1
in its first iteration and the job sinks one eta at a time, blocking the
short jobs of Q1 while it does.
"""

from __future__ import annotations

from scheduler.policy import PolicyName
from scheduler.skip_join_mlfq import SkipJoinMLFQPolicy


class MLFQPolicy(SkipJoinMLFQPolicy):
    name = PolicyName.MLFQ
    skip_join = False
    learns_length_shape = False  # the paper's naive MLFQ: the service ladder always
