"""Skip-join's alike-lengths mode (scheduler/skip_join_mlfq.py, set_alike_lengths): once the output lengths of the
finished jobs say a started job is the nearer to finishing (scheduler.gittins.index_rises_with_service: the Gittins
index rises with service), jobs keep their entry queue (no demotion) and a fresh job waits behind a started one that
waits for KV; on heavy tails the service ladder stays. Naive MLFQ (a baseline) never changes.

Costs (tests/scheduler_sim.make_cost): t_init(L) = L/8 s, t_dec = 1 s; quanta [1, 2, 4, 8] with max_prompt_len 64.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Job, MLFQPolicy, SchedulerConfig, SkipJoinMLFQPolicy
from scheduler.gittins import REFRESH_EVERY, index_rises_with_service
from scheduler.skip_join_mlfq import ALIKE_MIN_HISTORY
from tests.scheduler_sim import make_cost

COST = make_cost()
RNG = np.random.default_rng(0)
ALIKE = [int(x) for x in RNG.integers(80, 121, 4 * ALIKE_MIN_HISTORY)]  # 80-120 tokens: alike
HEAVY = [max(1, int(x)) for x in RNG.lognormal(5.0, 1.2, 4 * ALIKE_MIN_HISTORY)]  # ShareGPT-like heavy tail


def policy(cls=SkipJoinMLFQPolicy) -> SkipJoinMLFQPolicy:
    return cls(SchedulerConfig(max_prompt_len=64, starvation_threshold=None, starvation_age=None), COST)


def finish(p: SkipJoinMLFQPolicy, lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        j = Job(f"done{i}-{p.num_mode_changes}-{len(p._lengths)}", 8, 4096, 0.0)
        p.add(j, 0.0)
        j.num_generated, j.finished = n, True
        p.remove(j)


def test_the_index_test_reads_alike_and_heavy_tailed_lengths_apart() -> None:
    assert index_rises_with_service(ALIKE)
    assert not index_rises_with_service(HEAVY)


def test_alike_lengths_turn_the_mode_on_once_enough_jobs_finished_and_a_job_then_keeps_its_queue() -> None:
    p = policy()
    finish(p, ALIKE[:ALIKE_MIN_HISTORY - 1])
    assert not p.alike_lengths  # too few finished jobs to tell
    finish(p, ALIKE[ALIKE_MIN_HISTORY - 1:ALIKE_MIN_HISTORY])
    assert p.alike_lengths and p.fresh_waits_for_started and p.num_mode_changes == 1
    a = Job("a", 8, 100, 0.0)  # Q1, quantum 1
    p.add(a, 0.0)
    p.on_step_done([a], 3.0, 3.0)  # 3 > 1: the ladder would demote it
    assert (a.queue, a.num_demotions) == (0, 0)


def test_heavy_tailed_lengths_keep_the_service_ladder() -> None:
    p = policy()
    finish(p, HEAVY[:ALIKE_MIN_HISTORY + 2 * REFRESH_EVERY])
    assert not p.alike_lengths and not p.fresh_waits_for_started and p.num_mode_changes == 0
    a = Job("a", 8, 100, 0.0)
    p.add(a, 0.0)
    p.on_step_done([a], 3.0, 3.0)
    assert (a.queue, a.num_demotions) == (1, 1)


def test_the_mode_follows_the_lengths_back_when_they_change() -> None:
    """Checked every REFRESH_EVERY finished jobs over the last HISTORY: alike, then a heavy tail long enough to
    fill the history, turns the mode on and then off again."""
    p = policy()
    finish(p, ALIKE[:ALIKE_MIN_HISTORY])
    assert p.alike_lengths
    finish(p, HEAVY * 3)  # 3,072 heavy-tailed lengths: the history (2,000) holds only those
    assert not p.alike_lengths and p.num_mode_changes == 2
    a = Job("a", 8, 100, 0.0)
    p.add(a, 0.0)
    p.on_step_done([a], 3.0, 3.0)
    assert a.queue == 1  # demoted again


@pytest.mark.parametrize("lengths", [ALIKE, HEAVY], ids=["alike", "heavy"])
def test_naive_mlfq_never_changes_its_ladder(lengths: list[int]) -> None:
    p = policy(MLFQPolicy)
    finish(p, lengths)
    assert not p.alike_lengths and p.num_mode_changes == 0


def test_in_the_mode_a_fresh_job_waits_while_a_started_one_ahead_waits_for_kv() -> None:
    """The batch rule (priority_policy.py, fresh_waits_for_started): a started job whose KV is on the host holds
    back fresh jobs behind it, so the job near its end is not passed by newcomers; without the mode they start."""
    from tests.scheduler_sim import FakeKV

    for alike in (True, False):
        p = policy()
        p.set_alike_lengths(alike)
        s = Job("started", 8, 100, 0.0)
        p.add(s, 0.0)
        s.first_scheduled_time, s.num_generated, s.num_computed = 0.0, 5, 12
        p.on_step_done([s], 0.5, 0.5)
        s.kv_ready = False  # its KV is on its way back from the host
        f = Job("fresh", 16, 100, 1.0)  # Q2: behind the started job in Q1
        p.add(f, 1.0)
        batch = [j.job_id for j in p.schedule(1.0, FakeKV(num_blocks=10_000)).batch]
        assert batch == ([] if alike else ["fresh"])
