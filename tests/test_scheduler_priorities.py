"""Request classes (Job.priority, vLLM's priority: lower runs first) in every
policy, with hand-computed schedules.

Costs as in test_scheduler_rules.py: t_init(L) = L/8 s, t_dec = 1 s, quanta
[1, 2, 4, 8]; a prompt of 8 tokens enters Q1, 16 -> Q2, 32 -> Q3, 64 -> Q4;
a job is demoted when its service in a queue exceeds the quantum (so a Q1
job runs twice, at 1 s each, before it drops to Q2).
"""

from __future__ import annotations

import pytest

from scheduler import Job, PolicyName, make_policy, step_charges
from tests.scheduler_sim import FakeKV
from tests.test_scheduler_rules import COST, config, mlfq, roomy, step


def job(job_id: str, prompt_len: int = 8, priority: int = 0, output: int = 10, arrival: float = 0.0) -> Job:
    return Job(job_id, prompt_len, output, arrival, true_output_len=output, priority=priority)


def run(policy, jobs: list[Job], ticks: int, kv: FakeKV | None = None) -> list[list[str]]:
    """Add the jobs at t=0, then `ticks` iterations; a job that reaches its output length leaves."""
    kv = kv or roomy()
    for j in jobs:
        policy.add(j, 0.0)
    t, out = 0.0, []
    for _ in range(ticks):
        decision = policy.schedule(t, kv)
        ids, t = step_done(policy, decision.batch, t)
        out.append(ids)
        for j in decision.batch:
            if j.num_generated >= j.max_new_tokens:
                policy.remove(j)
                kv.release(j)
    return out


def step_done(policy, batch: list[Job], now: float) -> tuple[list[str], float]:
    cost = COST.iteration_cost(batch)
    charges = dict(zip(batch, step_charges(batch, cost)))
    for j in batch:
        j.num_computed = j.context_len
        j.num_generated += 1
    policy.on_step_done(batch, now + cost, cost, charges)
    return [j.job_id for j in batch], now + cost


@pytest.mark.parametrize("name", list(PolicyName))
def test_a_more_urgent_class_goes_first_in_every_policy(name: PolicyName) -> None:
    """Same prompts and outputs, one slot, no alpha; the class-1 job was added first, yet the class-0
    job runs to its end first (in MLFQ it drops to Q2 after two iterations, still ahead of class 1)."""
    policy = make_policy(config(policy=name, max_num_seqs=1), COST)
    late, urgent = job("late", priority=1, output=3), job("urgent", priority=0, output=3)
    assert run(policy, [late, urgent], 6) == [["urgent"]] * 3 + [["late"]] * 3
    assert policy.jobs_by_priority() == {}


def test_skip_join_orders_by_class_then_queue() -> None:
    """Class 0: a long prompt (Q4). Class 1: a short one (Q1). The class comes before the queue."""
    policy = mlfq(max_num_seqs=1)
    long0, short1 = job("long0", 64, priority=0), job("short1", 8, priority=1)
    assert run(policy, [short1, long0], 1) == [["long0"]]
    assert (long0.queue, short1.queue) == (3, 0)


def test_inside_a_class_skip_join_orders_as_without_classes() -> None:
    """Class 5 holds a Q3 and a Q1 job: Q1 first, as with one class; class 9's Q1 job waits for both."""
    policy = mlfq(max_num_seqs=1)
    a, b, c = job("a", 32, priority=5, output=1), job("b", 8, priority=5, output=1), job("c", 8, priority=9)
    assert run(policy, [a, b, c], 2) == [["b"], ["a"]]  # b (1 token) leaves after its run


def test_starvation_promotion_bounds_a_less_urgent_class_hand_computed() -> None:
    """alpha 2.5 s, one slot. t=0,1: a (class 0, Q1) runs and drops to Q2 at t=2; t=2: a runs in Q2
    (class 0 comes first); t=3: b (class 1) has waited 3 s > alpha and is promoted to Q1 of the most
    urgent class present, ahead of a in Q2: b runs at t=3 = alpha + one iteration, not after a ends."""
    policy = mlfq(max_num_seqs=1, starvation_threshold=2.5)
    a, b = job("a", priority=0, output=20), job("b", priority=1, output=2)
    assert run(policy, [a, b], 5) == [["a"], ["a"], ["a"], ["b"], ["b"]]
    assert b.first_scheduled_time == 3.0 and b.num_promotions == 1
    # b used its promoted Q1 quantum at t=3 and t=4 (2 s > q1): had it more to do, it would sink into
    # class 1's own Q2, behind class 0 again.


def test_without_classes_the_same_jobs_share_q1_fifo() -> None:
    """The reference for the test above: both class 0, b runs as soon as a leaves Q1 (t=2)."""
    policy = mlfq(max_num_seqs=1, starvation_threshold=2.5)
    a, b = job("a", output=20), job("b", output=2)
    assert run(policy, [a, b], 3) == [["a"], ["a"], ["b"]]


def test_enst_counts_a_more_urgent_class_through_the_jobs_own_level() -> None:
    """B = 1, no alpha. Class 0: x in Q2. Class 1: y in Q1, z in Q3.
    ENST(y) = x through Q2 (from Q2 to max(Q2, Q1) = q2 = 2); ENST(z) = x's q2 + q3 (= 6) + y's q1 + q2 (= 3)."""
    policy = mlfq(max_num_seqs=1)
    x, y, z = job("x", 16, priority=0), job("y", 8, priority=1), job("z", 32, priority=1)
    for j in (x, y, z):
        policy.add(j, 0.0)
    assert [j.queue for j in (x, y, z)] == [1, 0, 2]
    assert policy.estimated_wait(y, 0.0) == pytest.approx(2.0)
    assert policy.estimated_wait(z, 0.0) == pytest.approx(6.0 + 3.0)
    assert policy.estimated_wait(x, 0.0) == pytest.approx(0.0)  # nothing of its class is above Q2


def test_fcfs_never_preempts_for_a_more_urgent_class_but_lets_it_in_first() -> None:
    policy = make_policy(config(policy=PolicyName.FCFS, max_num_seqs=2), COST)
    kv = roomy()
    a, b, c = job("a", priority=1, output=3), job("b", priority=1, output=3), job("c", priority=0, output=3)
    policy.add(a, 0.0)
    assert step(policy, kv, 0.0)[0] == ["a"]
    policy.add(b, 1.0)
    policy.add(c, 1.0)
    assert step(policy, kv, 1.0)[0] == ["a", "c"]  # c overtakes b in the queue; a keeps running
    assert policy.started_by_priority == {1: 1, 0: 1}


def test_fcfs_memory_victim_is_the_newest_of_the_least_urgent_class() -> None:
    """Running (admission order) a0, b1, c0: the victim among them is b (class 1), not the newest c;
    among jobs from c on (the ones not yet given room this tick), it is c."""
    policy = make_policy(config(policy=PolicyName.FCFS), COST)
    a, b, c = job("a", priority=0), job("b", priority=1), job("c", priority=0)
    policy._running = [a, b, c]
    assert policy._victim(0) is b and policy._victim(2) is c
    single = [job("x"), job("y"), job("z")]
    policy._running = single
    assert policy._victim(0) is single[-1]  # one class: the newest, as vLLM


def test_fixed_priority_and_srpt_order_by_class_then_key() -> None:
    for name in (PolicyName.FIXED_PRIORITY, PolicyName.SRPT):
        policy = make_policy(config(policy=name, max_num_seqs=1), COST)
        short1, long0 = job("short1", 8, priority=1, output=2), job("long0", 64, priority=0, output=9)
        assert run(policy, [short1, long0], 1) == [["long0"]], name


@pytest.mark.parametrize("name", list(PolicyName))
def test_mixed_classes_all_finish_and_counts_return_to_zero(name: PolicyName) -> None:
    policy = make_policy(config(policy=name, max_num_seqs=2, starvation_threshold=3.0), COST)
    jobs = [job(f"j{i}", 8 * (1 + i % 4), priority=i % 3, output=1 + i % 5) for i in range(15)]
    counts = {0: 5, 1: 5, 2: 5}
    assert [policy.add(j, 0.0) for j in jobs] and policy.jobs_by_priority() == counts
    for j in jobs:
        policy.remove(j)
    assert policy.jobs_by_priority() == {} and not policy.has_work()
    policy = make_policy(config(policy=name, max_num_seqs=2, starvation_threshold=3.0), COST)
    jobs = [job(f"j{i}", 8 * (1 + i % 4), priority=i % 3, output=1 + i % 5) for i in range(15)]
    schedule = run(policy, jobs, 40)
    assert sum(len(b) for b in schedule) == sum(j.max_new_tokens for j in jobs)
    assert policy.jobs_by_priority() == {} and sum(policy.started_by_priority.values()) == 15


def test_a_job_starving_in_q1_of_its_class_is_promoted_when_a_more_urgent_class_arrives() -> None:
    """One slot, alpha 3 s, class 1 only: a, b, c, d, j (all Q1) run two iterations each in turn (then
    drop to Q2). At t=4, d and j have waited 4 s > alpha but sit in Q1 of the most urgent class present,
    so they stay. At t=5 a class-0 job u arrives: d and j, still starving, are promoted into class 0's
    Q1 behind u (their heap entries were spent at t=4), so they run before class 1's queues."""
    policy = mlfq(max_num_seqs=1, starvation_threshold=3.0)
    jobs = [job(x, priority=1, output=50) for x in "abcdj"]
    for x in jobs:
        policy.add(x, 0.0)
    t, kv = 0.0, roomy()
    while t < 5.0:
        _, t = step(policy, kv, t)
    j = jobs[-1]
    assert j.first_scheduled_time is None and j.num_promotions == 0 and policy._band_of[j] == 1
    u = job("u", priority=0, output=1, arrival=t)
    policy.add(u, t)
    ids, t = step(policy, kv, t)
    assert ids == ["u"] and policy._band_of[j] == 0 and j.num_promotions == 1
    assert [x.job_id for x in policy.jobs][:3] == ["u", "d", "j"]  # then the promoted, in order
