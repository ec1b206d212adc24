"""A hand-computed scenario: three jobs, batch size 1, where skip-join MLFQ
beats FCFS and naive MLFQ on average completion time and the SRPT oracle
beats it.

Costs (tests/scheduler_sim.make_cost): t_init(L) = L/8 s, t_dec = 1 s.
max_prompt_len 64, ratio 2 -> quanta q = [1, 2, 4, 8]; eta 1; alpha off.
All three arrive at t=0, added in the order A, B, C. A job of output length o
runs one prefill and o - 1 decode iterations.

    job  prompt  t_init  output  service
    A    64      8       5       8 + 4 = 12
    B    8       1       4       1 + 3 = 4
    C    8       1       1       1

FCFS: A 0-8 prefill, 8-12 decodes -> 12; B 12-16 -> 16; C 16-17 -> 17.
    mean = (12 + 16 + 17) / 3 = 45/3
Skip-join MLFQ: A skips to Q4 (t_init 8 <= q4 = 8); B, C enter Q1.
    B 0-1 (service 1, not over q1), B 1-2 (service 2 > 1: to Q2),
    C 2-3 done; B 3-4, 4-5 done (service 2, not over q2);
    A 5-13 prefill (8, not over q4), 13-17 decodes -> 17.
    mean = (3 + 5 + 17) / 3 = 25/3
Naive MLFQ: A, B, C all enter Q1, A first.
    A 0-8 prefill (8 > 1: to Q2); B 8-9, 9-10 (2 > 1: to Q2, behind A);
    C 10-11 done; A 11-12, 12-13, 13-14 (3 > 2: to Q3); B 14-15, 15-16 done;
    A 16-17 done.   mean = (11 + 16 + 17) / 3 = 44/3
SRPT (remaining output tokens: A 5, B 4, C 1): C 0-1; B 1-5; A 5-17.
    mean = (1 + 5 + 17) / 3 = 23/3
Fixed priority (shorter prompt first, B before C by arrival): B 0-4; C 4-5;
    A 5-17.   mean = (4 + 5 + 17) / 3 = 26/3
"""

from __future__ import annotations

import pytest

from scheduler import PolicyName, SchedulerConfig, make_policy
from tests.scheduler_sim import FakeKV, Spec, make_cost, simulate

SPECS = [Spec("A", 0.0, 64, 5), Spec("B", 0.0, 8, 4), Spec("C", 0.0, 8, 1)]

EXPECTED = {
    PolicyName.FCFS: {"A": 12.0, "B": 16.0, "C": 17.0},
    PolicyName.SKIP_JOIN_MLFQ: {"A": 17.0, "B": 5.0, "C": 3.0},
    PolicyName.MLFQ: {"A": 17.0, "B": 16.0, "C": 11.0},
    PolicyName.SRPT: {"A": 17.0, "B": 5.0, "C": 1.0},
    PolicyName.FIXED_PRIORITY: {"A": 17.0, "B": 4.0, "C": 5.0},
}


def run(policy: PolicyName) -> dict[str, float]:
    config = SchedulerConfig(policy=policy, max_num_seqs=1, starvation_threshold=None, max_prompt_len=64)
    return simulate(make_policy(config, make_cost()), SPECS, FakeKV(num_blocks=1000))


def mean(times: dict[str, float]) -> float:
    return sum(times.values()) / len(times)


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_completion_times_match_the_hand_computation(policy: PolicyName) -> None:
    assert run(policy) == pytest.approx(EXPECTED[policy])


def test_skip_join_sits_between_the_oracle_and_the_baselines() -> None:
    srpt, skip_join = mean(run(PolicyName.SRPT)), mean(run(PolicyName.SKIP_JOIN_MLFQ))
    fcfs, mlfq = mean(run(PolicyName.FCFS)), mean(run(PolicyName.MLFQ))
    assert (srpt, skip_join, mlfq, fcfs) == pytest.approx((23 / 3, 25 / 3, 44 / 3, 45 / 3))
    assert srpt <= skip_join < mlfq
    assert skip_join < fcfs
