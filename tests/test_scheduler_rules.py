"""One test per scheduling rule (DESIGN.md; FastServe section 4.1-4.2).

Costs (tests/scheduler_sim.make_cost): t_init(L) = L/8 s, t_dec = 1 s, so with
max_prompt_len 64 and ratio 2 the quanta are [1, 2, 4, 8]: a prompt of
8 tokens enters Q1 (index 0), 16 -> Q2, 32 -> Q3, 64 -> Q4.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from scheduler import (
    FCFSPolicy,
    FixedPriorityPolicy,
    Job,
    MLFQPolicy,
    PolicyName,
    SchedulerConfig,
    SkipJoinMLFQPolicy,
    SRPTPolicy,
    UnboundedSRPTPolicy,
    make_policy,
    step_charges,
)
from scheduler.policy import step_tokens
from tests.scheduler_sim import FakeKV, make_cost

COST = make_cost()


def config(**kw) -> SchedulerConfig:
    kw.setdefault("max_prompt_len", 64)
    kw.setdefault("starvation_threshold", None)
    return SchedulerConfig(**kw)


def mlfq(**kw) -> SkipJoinMLFQPolicy:
    return SkipJoinMLFQPolicy(config(**kw), COST)


def job(job_id: str, prompt_len: int = 8, arrival: float = 0.0, output: int = 10) -> Job:
    return Job(job_id, prompt_len, output, arrival, true_output_len=output)


def step(policy, kv: FakeKV, now: float) -> tuple[list[str], float]:
    """One engine iteration: schedule at `now`, run, charge; returns (batch ids, end time)."""
    decision = policy.schedule(now, kv)
    cost = COST.iteration_cost(decision.batch)
    charges = dict(zip(decision.batch, step_charges(decision.batch, cost)))
    for j in decision.batch:
        j.num_computed = j.context_len
        j.num_generated += 1
    policy.on_step_done(decision.batch, now + cost, cost, charges)
    return [j.job_id for j in decision.batch], now + cost


def roomy() -> FakeKV:
    return FakeKV(num_blocks=10_000)


# -- package --------------------------------------------------------------------------------


def test_scheduler_never_imports_torch() -> None:
    code = (
        "import sys, scheduler, scheduler.fcfs, scheduler.skip_join_mlfq, scheduler.mlfq, "
        "scheduler.fixed_priority, scheduler.srpt, scheduler.cost_model; "
        "assert 'torch' not in sys.modules, 'scheduler imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "name, cls",
    [
        (PolicyName.FCFS, FCFSPolicy),
        (PolicyName.SKIP_JOIN_MLFQ, SkipJoinMLFQPolicy),
        (PolicyName.MLFQ, MLFQPolicy),
        (PolicyName.FIXED_PRIORITY, FixedPriorityPolicy),
        (PolicyName.SRPT, SRPTPolicy),
        (PolicyName.SRPT_UNBOUNDED, UnboundedSRPTPolicy),
    ],
)
def test_make_policy_builds_the_named_policy(name: PolicyName, cls: type) -> None:
    assert type(make_policy(config(policy=name), COST)) is cls
    assert type(make_policy(config(policy=name.value), COST)) is cls


def test_make_policy_rejects_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy(config(policy="lifo"), COST)


def test_config_rejects_a_non_positive_max_prompt_len() -> None:
    with pytest.raises(ValueError, match="max_prompt_len"):
        SchedulerConfig(max_prompt_len=0)


# -- quanta and skip-join ------------------------------------------------------------------


@pytest.mark.parametrize("ratio, expected", [(2.0, [1, 2, 4, 8]), (3.0, [1, 3, 9]), (10.0, [1, 10])])
def test_quanta_are_geometric_until_the_longest_prompt_fits(ratio: float, expected: list[float]) -> None:
    # q1 = t_dec(1, 16) = 1; the last quantum is the first that covers t_init(64) = 8.
    assert mlfq(quantum_ratio=ratio).quanta == pytest.approx(expected)


def test_q1_is_a_decode_step_of_one_job_at_a_short_context() -> None:
    """q1 = t_dec(1, 16). On a profile whose decode step grows with the batch and the context (one job: 1 s at 16
    tokens, 2 s at 512; eight jobs: 3 s and 4 s) the ladder starts at 1 s."""
    cost = make_cost(decode_by_context={16: (1.0, 3.0), 512: (2.0, 4.0)})
    assert SkipJoinMLFQPolicy(config(max_num_seqs=8), cost).quanta == [1, 2, 4, 8]


def test_a_new_job_skips_to_the_highest_queue_that_covers_its_prefill() -> None:
    policy = mlfq()
    placed = {}
    for prompt_len in (1, 8, 9, 16, 17, 32, 33, 64, 500):
        j = job(f"p{prompt_len}", prompt_len)
        policy.add(j, 0.0)
        placed[prompt_len] = j.queue
    # t_init = L/8 against quanta [1, 2, 4, 8]; a prompt past max_prompt_len gets the last queue.
    assert placed == {1: 0, 8: 0, 9: 1, 16: 1, 17: 2, 32: 2, 33: 3, 64: 3, 500: 3}
    assert policy.queue_lengths() == [2, 2, 2, 3]


def test_a_follow_up_over_a_long_cached_history_enters_by_its_uncached_work() -> None:
    """Prefix caching: a 64-token prompt whose first 56 tokens were cached when it was added enters by its first
    iteration's real work, the cost model's price of an 8-token chunk over a 56-token prefix (F(8) = 1 plus the
    attention tokens 56..64 add, (8 - 1) - (7 - 1) = 1: 2 s, Q2), not t_init(64) = 8 s (Q4). It runs before an
    uncached 64-token prompt that came first, and its ENST is the shorter (nothing above it; the other waits
    for its q2 + q3)."""
    policy, kv = mlfq(max_num_seqs=1), roomy()
    fresh, follow = job("fresh", 64), job("follow", 64, arrival=0.5)
    follow.num_cached_prompt_tokens = 56
    policy.add(fresh, 0.0)
    policy.add(follow, 0.5)
    assert policy.first_iteration_cost(64, 56) == pytest.approx(COST.batch_cost((), (), [(56, 8)])) == 2.0
    assert (fresh.queue, follow.queue) == (3, 1)
    assert policy.estimated_wait(follow, 1.0) == 0.0 < policy.estimated_wait(fresh, 1.0) == pytest.approx(6.0)
    assert step(policy, kv, 1.0)[0] == ["follow"]
    # Never priced above the whole prompt; nothing cached (or naive MLFQ) is the plain rule.
    for n in (2, 9, 33, 64):
        for c in range(0, n, 3):
            assert policy.first_iteration_cost(n, c) <= COST.t_init(n)
            assert policy.entry_queue(n, c) <= policy.entry_queue(n)
    # (F(n) = 1 s here at every n: 32 cached leave 1 + 7 - 3 = 5 s (Q4), 63 leave 1 + 7 - 6.875 (Q2).)
    assert [policy.entry_queue(64, c) for c in (0, 8, 32, 56, 63)] == [3, 3, 3, 1, 1]
    assert MLFQPolicy(config(), COST).entry_queue(64, 0) == 0


def test_naive_mlfq_puts_every_new_job_in_q1() -> None:
    policy = MLFQPolicy(config(), COST)
    jobs = [job(str(n), n) for n in (8, 20, 64)]
    for j in jobs:
        policy.add(j, 0.0)
    assert [j.queue for j in jobs] == [0, 0, 0]


# -- demotion and promotion -------------------------------------------------------------------


def test_demotion_once_the_quantum_is_used() -> None:
    policy, kv = mlfq(), roomy()
    a = job("a", 8)  # Q1, quantum 1
    policy.add(a, 0.0)
    _, t = step(policy, kv, 0.0)  # prefill: charged 1, not over 1
    assert (a.queue, a.service_in_queue) == (0, 1.0)
    step(policy, kv, t)  # charged 1 more: 2 > 1
    assert (a.queue, a.service_in_queue, a.num_demotions, a.service_total) == (1, 0.0, 1, 2.0)
    assert policy.num_demotions == 1


def test_a_decode_beside_a_long_prompt_is_charged_its_share_and_keeps_its_queue() -> None:
    """a (4-token prompt, Q1) has had its prefill alone (t_init = 0.5 s of q1 = 1 s). Next it decodes in one
    iteration with a new 64-token prompt b (Q4): the iteration costs 8 s (the prompt's pass), and each job is
    charged its tokens' share, a 1/65, b 64/65. a keeps Q1 and b its entry queue. Charged the whole iteration
    (the paper's rule), a would have used q1 8 times over in one token and sunk below b."""
    policy, kv = mlfq(max_num_seqs=2), roomy()
    a, b = job("a", 4, output=10), job("b", 64)
    policy.add(a, 0.0)
    _, t = step(policy, kv, 0.0)
    assert (a.queue, a.service_in_queue) == (0, 0.5)
    policy.add(b, t)
    batch, end = step(policy, kv, t)
    assert batch == ["a", "b"] and end - t == 8.0
    assert a.service_in_queue == pytest.approx(0.5 + 8 / 65) and b.service_in_queue == pytest.approx(8 * 64 / 65)
    assert (a.queue, b.queue, a.num_demotions, policy.num_demotions) == (0, 3, 0, 0)
    assert a.service_total + b.service_total == pytest.approx(0.5 + 8.0)  # the charges add up to the time run


def test_a_job_is_charged_by_the_tokens_it_computes() -> None:
    """A first chunk of 16 of 64 prompt tokens; the 16 left after a 48-token prefix found cached at allocation
    (it was given the whole prompt); a recompute of 8 prompt and 8 output tokens; a decode: 16, 16, 16 and 1
    of the iteration's 49 tokens."""
    chunk, rest, redo, decode = job("chunk", 64), job("rest", 64), job("redo", 8), job("decode", 8)
    chunk.num_scheduled = 16
    rest.num_computed, rest.num_scheduled = 48, 64
    redo.num_generated, redo.num_scheduled = 8, 16
    decode.num_generated, decode.num_computed, decode.num_scheduled = 3, 10, 1
    jobs = [chunk, rest, redo, decode]
    assert [step_tokens(j) for j in jobs] == [16, 16, 16, 1]
    assert step_charges(jobs, 9.8) == pytest.approx([3.2, 3.2, 3.2, 0.2])


def test_demotion_needs_service_past_the_quantum_beyond_float_noise() -> None:
    """Q2's quantum is 2 s. Ten charges of 0.1 s after 1 s add up to 2.000000000000001 s in floats: not past
    the quantum; 2.001 s is (demotion needs more than the quantum x (1 + 1e-9))."""
    for charges, queue in (([1.0] + [0.1] * 10, 1), ([2.001], 2)):
        policy = mlfq()
        a = job("a", 16)
        policy.add(a, 0.0)
        for charge in charges:
            policy.on_step_done([a], 0.0, charge)
        assert a.queue == queue, charges


@pytest.mark.parametrize("name", list(PolicyName))
def test_every_policy_charges_each_job_its_share(name: PolicyName) -> None:
    """Two prompts, 4 and 64 tokens, in one 8 s iteration (the 64-token prompt's pass): 8 x 4/68 and 8 x 64/68."""
    policy = make_policy(config(policy=name, max_num_seqs=2), COST)
    a, b = job("a", 4), job("b", 64)
    policy.add(a, 0.0)
    policy.add(b, 0.0)
    batch, end = step(policy, roomy(), 0.0)
    assert sorted(batch) == ["a", "b"] and end == 8.0
    assert (a.service_total, b.service_total) == pytest.approx((8 * 4 / 68, 8 * 64 / 68))


def test_demotion_drops_eta_queues_and_stops_at_the_last() -> None:
    policy = mlfq(demotion_step=2)
    a, b = job("a", 8), job("b", 64)  # Q1 and Q4
    policy.add(a, 0.0)
    policy.add(b, 0.0)
    policy.on_step_done([a, b], 1.5, 1.5)
    assert a.queue == 2 and a.num_demotions == 1  # Q1 -> Q3
    policy.on_step_done([b], 10.0, 8.5)  # over q4 = 8, already in the last queue
    assert (b.queue, b.service_in_queue, b.num_demotions) == (3, 0.0, 0)
    assert policy.num_demotions == 1


def test_a_job_starved_past_alpha_is_promoted_to_q1() -> None:
    policy, kv = mlfq(max_num_seqs=1, starvation_threshold=3.0), roomy()
    h, low = job("h", 8, output=100), job("low", 64)  # low waits in Q4
    policy.add(h, 0.0)
    policy.add(low, 0.0)
    t = 0.0
    while t < 3.0:
        batch, t = step(policy, kv, t)
        assert batch == ["h"] and low.queue == 3
    assert t == 3.0 and h.queue == 1  # h was demoted after 2 s of service
    assert policy.schedule(3.0, kv).batch == [h] and low.queue == 3  # starved exactly alpha: not yet
    low.service_in_queue = 0.5  # as if it had run a little in Q4
    decision = policy.schedule(3.0 + 1e-9, kv)  # now low has waited longer than alpha
    assert (low.queue, low.service_in_queue, low.num_promotions, policy.num_promotions) == (0, 0.0, 1, 1)
    assert decision.batch == [low] and decision.preempted == [h]


def test_a_starving_job_already_in_q1_stays_put() -> None:
    policy, kv = mlfq(max_num_seqs=1, starvation_threshold=0.5), roomy()
    a, b = job("a", 8), job("b", 8)  # both Q1; b waits behind a for 2 s
    policy.add(a, 0.0)
    policy.add(b, 0.0)
    _, t = step(policy, kv, 0.0)
    assert step(policy, kv, t)[0] == ["a"]  # b has starved 1 s > alpha
    assert [j.job_id for j in policy.schedule(2.0, kv).batch] == ["b"]  # a was demoted
    assert b.num_promotions == 0 and policy.num_promotions == 0


def test_no_promotion_without_alpha() -> None:
    policy, kv = mlfq(max_num_seqs=1, starvation_threshold=None), roomy()
    low = job("low", 64)
    policy.add(low, 0.0)
    t = 0.0
    for i in range(50):  # a stream of one-token jobs in Q1 keeps low waiting 50 s
        short = job(f"s{i}", 8, arrival=t, output=1)
        policy.add(short, t)
        batch, t = step(policy, kv, t)
        assert batch == [short.job_id]
        policy.remove(short)
    assert low.queue == 3 and policy.num_promotions == 0


# -- the service ladder, ENST's batch size, age promotion (the engine's defaults) --------------------------


def test_the_service_ladder_covers_a_whole_job_decode_included() -> None:
    """Prefill ladder: the last quantum covers t_init(64) = 8. Service ladder: it covers t_init(64) plus 64
    decode steps alone (64 x 1 s): 72 s, so [1, 2, ..., 128]; skip-join's entry is the same."""
    prefill, service = mlfq(), mlfq(mlfq_ladder="service")
    assert prefill.quanta == [1, 2, 4, 8]
    assert service.quanta == [1, 2, 4, 8, 16, 32, 64, 128]
    assert [service.entry_queue(n) for n in (8, 16, 32, 64)] == [0, 1, 2, 3]
    # A job's share of a decode step is largest when it runs alone: a slower step of a full batch (4 s at 8 jobs,
    # 0.5 s each) does not raise the ladder.
    slow_batch = SkipJoinMLFQPolicy(config(mlfq_ladder="service", max_num_seqs=8), make_cost(decode_at_batch_8=4.0))
    assert slow_batch.quanta == service.quanta
    with pytest.raises(ValueError, match="mlfq_ladder"):
        SchedulerConfig(mlfq_ladder="tokens")


def test_on_the_service_ladder_jobs_keep_sinking_as_they_decode_and_the_least_served_runs_first() -> None:
    """A job that has decoded 30 steps is in Q5, below one that has decoded 3 (Q2): the queues order jobs by
    the service they have had. On the paper's ladder the old job stopped sinking at the last queue (Q4)."""
    for ladder, levels in (("service", (4, 1)), ("prefill", (3, 1))):
        policy, kv = mlfq(mlfq_ladder=ladder, max_num_seqs=1), roomy()
        old = job("old", 8, output=100)
        policy.add(old, 0.0)
        t = 0.0
        for _ in range(30):
            _, t = step(policy, kv, t)
        young = job("young", 8, arrival=t, output=100)
        policy.add(young, t)
        for _ in range(3):
            assert step(policy, kv, t)[0] == ["young"]
            t += 1
        assert (old.queue, young.queue) == levels
        assert [j.job_id for j in policy.schedule(t, kv).batch] == ["young"]


def test_enst_divides_by_the_batch_running_now_not_the_batch_limit() -> None:
    """Two jobs in Q1 ahead of a Q4 job; max_num_seqs 8 but memory lets one run at a time: T_execute is
    2 x (q1 + q2 + q3) / 1 = 14, not / 8 = 1.75."""
    policy = mlfq(max_num_seqs=8)
    kv = FakeKV(num_blocks=3)  # one 8-token job's context (2 blocks of 4) at a time
    a, b, t = job("a", 8), job("b", 8), job("t", 64)
    for j in (a, b, t):
        policy.add(j, 0.0)
    assert policy.estimated_wait(t, 0.0) == pytest.approx(2 * 7 / 8)  # nothing runs yet: the limit
    assert [j.job_id for j in policy.schedule(0.0, kv).batch] == ["a"]
    assert policy.estimated_wait(t, 0.0) == pytest.approx(2 * 7 / 1)  # one at a time


def beside_a_stream(policy, long: Job, shorts: int) -> tuple[float | None, float]:
    """One-token jobs of 8-token prompts (1 s each) arrive back to back from t=0, each when the one before it
    ends, `shorts` of them; the long job is added at its arrival time (max_num_seqs 1 keeps one job running).
    Returns when the long job finished (None: not while the stream lasted) and its longest wait (starve time
    at a tick) until then."""
    kv, t, finished, longest = roomy(), 0.0, None, 0.0
    for i in range(shorts):
        if long.arrival_time <= t and long not in policy.jobs and finished is None:
            policy.add(long, long.arrival_time)
        short = job(f"s{i}", 8, arrival=t, output=1)
        policy.add(short, t)
        while short.num_generated < 1:
            if long in policy.jobs:
                longest = max(longest, long.starve_time(t))
            _, t = step(policy, kv, t)
            if long.num_generated >= long.max_new_tokens and finished is None:
                finished = t
                policy.remove(long)
        policy.remove(short)
    return finished, longest


def test_age_promotion_runs_an_old_job_to_completion_ahead_of_new_ones() -> None:
    """A stream of one-token jobs (Q1) keeps a long job (Q4) waiting under least-attained-service order.
    With starvation_age 2, once 32 jobs have finished and the long job is older than 2x the mean time in
    the system (jobs held / completion rate), it moves above every queue and runs to completion while the
    stream goes on. Without it, it waits for the whole stream."""
    for age in (2.0, None):
        policy = mlfq(max_num_seqs=1, mlfq_ladder="service", starvation_age=age)
        long = job("long", 64, output=20)
        finished, longest = beside_a_stream(policy, long, 80)
        if age is None:
            assert finished is None and long.num_generated == 0 and policy.num_promotions == 0
        else:  # promoted at t=32, it runs its prefill (8 s) and 19 decodes (1 s each) without a break
            assert (finished, longest) == (59.0, 32.0)
            assert long.num_promotions == 1 and long.num_demotions == 0  # promoted once, never demoted


@pytest.mark.parametrize("name", [PolicyName.SKIP_JOIN_MLFQ, PolicyName.SRPT, PolicyName.GITTINS])
def test_age_promotion_takes_a_job_older_than_k_times_the_mean_time_in_the_system(name: PolicyName) -> None:
    """At t=T the stream has finished T jobs at one a second and holds 2 (the one running and the long one):
    the mean time in the system is 2 / 1 = 2 s, so with starvation_age 2 a job older than 4 s is promoted. The
    long job arrives at 40, behind every short one in each order: at 44 it is exactly 4 s old and waits; at 45
    it is promoted and starts."""
    policy = make_policy(config(policy=name, max_num_seqs=1, mlfq_ladder="service", starvation_age=2.0), COST)
    long = job("long", 64, arrival=40.0, output=20)
    beside_a_stream(policy, long, 60)
    assert policy.age_limit(45.0) is not None and long.num_promotions == 1
    assert long.first_scheduled_time == 45.0


# -- batch formation ----------------------------------------------------------------------------


def test_batch_takes_the_highest_queues_fifo_up_to_max_num_seqs() -> None:
    policy = mlfq(max_num_seqs=3)
    for name, prompt in [("long", 64), ("a", 8), ("mid", 20), ("b", 8), ("c", 8)]:
        policy.add(job(name, prompt), 0.0)
    assert [j.job_id for j in policy.schedule(0.0, roomy()).batch] == ["a", "b", "c"]
    policy = mlfq(max_num_seqs=4)
    for name, prompt in [("long", 64), ("a", 8), ("mid", 20), ("b", 8)]:
        policy.add(job(name, prompt), 0.0)
    assert [j.job_id for j in policy.schedule(0.0, roomy()).batch] == ["a", "b", "mid", "long"]


def test_batch_respects_the_token_budget_and_lets_a_smaller_job_through() -> None:
    policy = mlfq(max_num_batched_tokens=20)
    for name, prompt in [("a", 8), ("b", 8), ("c", 8), ("d", 4)]:
        policy.add(job(name, prompt), 0.0)
    decision = policy.schedule(0.0, roomy())
    assert [j.job_id for j in decision.batch] == ["a", "b", "d"]  # c (8) would make 24 > 20
    assert decision.num_tokens == 20


def test_a_prompt_larger_than_the_token_budget_runs_alone() -> None:
    policy = mlfq(max_num_batched_tokens=16)
    big, small = job("big", 40), job("small", 8)  # big: Q3; small: Q1
    policy.add(big, 0.0)
    policy.add(small, 0.0)
    assert [j.job_id for j in policy.schedule(0.0, roomy()).batch] == ["small"]
    policy.remove(small)
    assert [j.job_id for j in policy.schedule(1.0, roomy()).batch] == ["big"]


@pytest.mark.parametrize("name", [PolicyName.SKIP_JOIN_MLFQ, PolicyName.MLFQ, PolicyName.FIXED_PRIORITY,
                                  PolicyName.SRPT])
def test_with_batches_in_flight_a_batch_holds_at_most_its_share_of_kv(name: PolicyName) -> None:
    """Pipeline parallelism, two batches in flight, each batch's share 32 tokens of KV. Six jobs of 7-token
    prompts run their prefill, then hold 8 tokens each. The first batch takes four (32 tokens, though
    max_num_seqs allows all six); with them in flight the second batch takes the other two.
    Without the share the first batch takes all six and the second slot of the pipe stays empty."""
    for share, first, second in [(32, 4, 2), (None, 6, 0)]:
        policy = make_policy(config(policy=name, max_num_seqs=8, max_batch_kv_tokens=share), COST)
        kv = FakeKV(num_blocks=64)
        jobs = [job(f"j{i}", 7) for i in range(6)]
        for j in jobs:
            policy.add(j, 0.0)
        step(policy, kv, 0.0)  # every job runs its prefill (48 tokens fit one batch of any share)
        a = policy.schedule(1.0, kv).batch
        for j in a:
            j.in_flight = True
        b = policy.schedule(1.0, kv).batch
        assert (len(a), len(b)) == (first, second), share
        assert not set(a) & set(b)
        assert share is None or sum(j.context_len for j in a) <= share


def test_config_rejects_a_non_positive_batch_kv_share() -> None:
    with pytest.raises(ValueError, match="max_batch_kv_tokens"):
        config(max_batch_kv_tokens=0)


@pytest.mark.parametrize("name", list(PolicyName))
def test_a_job_that_is_not_ready_is_never_scheduled(name: PolicyName) -> None:
    policy, kv = make_policy(config(policy=name, max_num_seqs=4), COST), roomy()
    a, b = job("a", 8), job("b", 8)  # a comes first in every policy's order
    policy.add(a, 0.0)
    policy.add(b, 0.0)
    a.ready = False
    # FCFS lets nobody overtake the head of its queue; the priority policies take the next job.
    expected = [] if name is PolicyName.FCFS else ["b"]
    assert [j.job_id for j in policy.schedule(0.0, kv).batch] == expected
    a.ready = True
    assert [j.job_id for j in policy.schedule(1.0, kv).batch] == ["a", "b"]


def test_a_high_priority_job_evicts_lower_priority_kv_largest_wait_first() -> None:
    policy = mlfq(max_num_seqs=1)
    kv = FakeKV(num_blocks=25, block_size=4)
    q3, q4 = job("q3", 32), job("q4", 64)  # Q3 and Q4, holding 8 and 16 blocks after their prefill
    for j in (q4, q3):
        j.first_scheduled_time = 0.0  # they ran before (only started jobs hold KV)
        policy.add(j, 0.0)
        kv.allocate(j, j.prompt_len)
        j.num_computed = j.prompt_len
    new = job("new", 8)  # Q1, needs 2 blocks; 1 is free
    policy.add(new, 0.0)
    # ENST(q4) = (q1+q2+q3) + q3 = 11 (new in Q1, q3 in Q3); ENST(q3) = q1 + q2 = 3.
    assert (policy.estimated_wait(q4, 0.0), policy.estimated_wait(q3, 0.0)) == (11.0, 3.0)
    decision = policy.schedule(0.0, kv)
    assert [j.job_id for j in decision.batch] == ["new"]
    assert q4.num_computed == 0 and q3.num_computed == 32  # only the largest-wait job was evicted
    assert kv.num_evictions == 1


def test_recompute_evicts_the_lowest_priority_job_swapping_the_largest_enst() -> None:
    """Alpha 12 s. q4 (Q4, 16 blocks) last ran at -11.5 s: due for promotion in 0.5 s, so its ENST is 0.5;
    q3 (Q3, 8 blocks) last ran at 0: ENST = q1 + q2 = 3. A new Q1 job needs 2 blocks, 1 is free. Swapping
    (memory/ offloads the victim; it comes back when due) evicts the largest ENST: q3. Recompute (the victim
    loses its whole context) evicts as vLLM does, the lowest priority: q4."""
    for by_priority, victim, kept in ((False, "q3", "q4"), (True, "q4", "q3")):
        policy = mlfq(max_num_seqs=1, starvation_threshold=12.0)
        kv = FakeKV(num_blocks=25, block_size=4, victims_by_priority=by_priority)
        jobs = {"q3": job("q3", 32), "q4": job("q4", 64)}
        for j, last in ((jobs["q4"], -11.5), (jobs["q3"], 0.0)):
            j.first_scheduled_time = j.last_scheduled_time = last
            policy.add(j, 0.0)
            kv.allocate(j, j.prompt_len)
            j.num_computed = j.prompt_len
        policy.add(job("new", 8), 0.0)
        assert (policy.estimated_wait(jobs["q4"], 0.0), policy.estimated_wait(jobs["q3"], 0.0)) == (0.5, 3.0)
        assert [j.job_id for j in policy.schedule(0.0, kv).batch] == ["new"]
        assert jobs[victim].num_computed == 0 and jobs[kept].num_computed == jobs[kept].prompt_len, by_priority
        assert kv.num_evictions == 1


def test_a_job_that_cannot_fit_is_skipped_and_higher_priority_kv_is_kept() -> None:
    policy = mlfq(max_num_seqs=2)
    kv = FakeKV(num_blocks=4, block_size=4)
    a, big = job("a", 8), job("big", 24)  # a: Q1, 3 blocks with its next token; big: Q3, 6 blocks
    policy.add(a, 0.0)
    policy.add(big, 0.0)
    kv.allocate(a, 8)
    a.num_computed, a.num_generated = 8, 1
    assert [j.job_id for j in policy.schedule(0.0, kv).batch] == ["a"]
    assert kv.num_evictions == 0 and a.num_computed == 8


def test_jobs_displaced_by_higher_priority_ones_are_reported_preempted() -> None:
    policy, kv = mlfq(max_num_seqs=1), roomy()
    low = job("low", 64)
    policy.add(low, 0.0)
    assert step(policy, kv, 0.0)[0] == ["low"]
    policy.add(job("short", 8), 8.0)
    decision = policy.schedule(8.0, kv)
    assert [j.job_id for j in decision.batch] == ["short"]
    assert decision.preempted == [low] and low.num_preemptions == 1
    assert policy.num_policy_preemptions == 1
    assert low.first_scheduled_time == 0.0 and low.last_scheduled_time == 8.0  # end of its last run


# -- ENST ----------------------------------------------------------------------------------------


def test_estimated_wait_is_the_papers_enst() -> None:
    policy, kv = mlfq(max_num_seqs=2, starvation_threshold=12.0), roomy()
    a, b, c = job("a", 8), job("b", 8), job("c", 16)  # Q1, Q1, Q2
    target = job("t", 64, arrival=0.0)  # Q4 (index 3)
    for j in (a, b, c, target):
        policy.add(j, 0.0)
    # T_execute(t) = (1/B) * [2 jobs in Q1 x (q1+q2+q3) + 1 job in Q2 x (q2+q3)]
    #              = (2 * (1 + 2 + 4) + 1 * (2 + 4)) / 2 = 10
    assert policy.estimated_wait(target, 1.0) == pytest.approx(10.0)  # T_promote = 12 - 1 = 11
    assert policy.estimated_wait(target, 5.0) == pytest.approx(7.0)  # T_promote = 12 - 5 = 7
    assert policy.estimated_wait(c, 1.0) == pytest.approx(2 * 1 / 2)  # two Q1 jobs x q1, over B
    policy.schedule(0.0, kv)  # a and b run
    assert policy.estimated_wait(a, 0.0) == 0.0
    no_alpha = mlfq(max_num_seqs=2)
    for j in (job("a", 8), job("b", 8), job("c", 16), target):
        no_alpha.add(j, 0.0)
    assert no_alpha.estimated_wait(target, 100.0) == pytest.approx(10.0)


# -- fixed priority and SRPT ----------------------------------------------------------------------


def test_fixed_priority_preempts_for_a_shorter_prompt_and_never_promotes() -> None:
    policy, kv = FixedPriorityPolicy(config(max_num_seqs=1, starvation_threshold=0.5), COST), roomy()
    long = job("long", 40)
    policy.add(long, 0.0)
    assert step(policy, kv, 0.0)[0] == ["long"]
    t = 5.0
    for i in range(20):  # a stream of shorter prompts keeps it waiting 20 s, alpha or not
        short = job(f"s{i}", 8, arrival=t, output=1)
        policy.add(short, t)
        batch, t = step(policy, kv, t)
        assert batch == [short.job_id]
        policy.remove(short)
    assert (long.num_preemptions, long.num_promotions, long.num_generated) == (1, 0, 1)


def test_srpt_runs_the_fewest_remaining_tokens_first() -> None:
    policy, kv = SRPTPolicy(config(max_num_seqs=1), COST), roomy()
    a, b = job("a", 8, output=3), job("b", 8, output=5)
    policy.add(b, 0.0)
    policy.add(a, 0.0)
    batch, t = step(policy, kv, 0.0)
    assert batch == ["a"]  # 3 left against b's 5
    c = job("c", 8, output=1)
    policy.add(c, t)
    decision = policy.schedule(t, kv)
    assert decision.batch == [c] and decision.preempted == [a]  # 1 left against a's 2


def test_the_completion_rate_is_read_over_the_last_256_completions() -> None:
    """400 jobs finish, one a second from t=0 to 299, then two a second to t=350. At t=351 the last 256
    completions (from t=144) came at 256 / 207 per second; with one job held and starvation_age 1 the age limit
    is 1 x 1 / that rate."""
    policy, kv = make_policy(config(policy=PolicyName.SRPT, starvation_age=1.0), COST), roomy()
    for i, done in enumerate([float(i) for i in range(300)] + [300 + 0.5 * i for i in range(1, 101)]):
        j = job(f"j{i}", 8, arrival=done)
        policy.add(j, done)
        policy.schedule(done, kv)
        policy.remove(j)
    policy.add(job("held", 8, arrival=350.0), 350.0)
    assert policy.age_limit(351.0) == pytest.approx(207 / 256)


def test_the_srpt_oracle_bounds_the_longest_wait_and_the_unbounded_one_does_not() -> None:
    """A long job beside a stream of one-token jobs. srpt (starvation_age 2, the bound of the defaults) promotes
    it once 32 jobs have finished: its longest wait is 32 s however long the stream. srpt-unbounded never runs
    it while the stream lasts: its wait is the stream's length."""
    waits = {}
    for name in (PolicyName.SRPT, PolicyName.SRPT_UNBOUNDED):
        for shorts in (80, 160):
            policy = make_policy(config(policy=name, max_num_seqs=1, starvation_age=2.0), COST)
            long = job("long", 64, output=20)
            finished, waits[(name, shorts)] = beside_a_stream(policy, long, shorts)
            assert (finished is None) == (name is PolicyName.SRPT_UNBOUNDED)
    assert waits == {(PolicyName.SRPT, 80): 32.0, (PolicyName.SRPT, 160): 32.0,
                     (PolicyName.SRPT_UNBOUNDED, 80): 79.0, (PolicyName.SRPT_UNBOUNDED, 160): 159.0}


# -- FCFS ----------------------------------------------------------------------------------------


def fcfs(**kw) -> FCFSPolicy:
    return FCFSPolicy(config(policy=PolicyName.FCFS, **kw), COST)


def test_fcfs_admits_in_arrival_order_without_overtaking() -> None:
    policy = fcfs(max_num_seqs=4)
    kv = FakeKV(num_blocks=5, block_size=4)
    first, big, small = job("first", 8, 0.0), job("big", 16, 1.0), job("small", 4, 2.0)  # 2, 4, 1 blocks
    for j in (first, big, small):
        policy.add(j, j.arrival_time)
    # big does not fit beside first (2 + 4 > 5); small would, but may not overtake it.
    assert [j.job_id for j in policy.schedule(0.0, kv).batch] == ["first"]


def test_fcfs_preempts_the_newest_running_job_when_kv_runs_out() -> None:
    policy = fcfs(max_num_seqs=4)
    kv = FakeKV(num_blocks=6, block_size=4)
    a, b, c, w = job("a", 8, 0.0), job("b", 8, 1.0), job("c", 8, 2.0), job("w", 4, 3.0)
    for j in (a, b, c):
        policy.add(j, j.arrival_time)
    assert step(policy, kv, 3.0)[0] == ["a", "b", "c"]  # 6 blocks, all used
    policy.add(w, 3.0)
    # a grows to 9 tokens: needs a 3rd block; c, the newest, gives its KV back.
    decision = policy.schedule(5.0, kv)
    assert [j.job_id for j in decision.batch] == ["a", "b"] and decision.preempted == [c]
    assert c.num_preemptions == 1 and c.num_computed == 0
    assert [j.job_id for j in policy.jobs] == ["a", "b", "c", "w"]  # c back at the head, before w


def test_fcfs_preempted_job_goes_ahead_of_waiters_that_arrived_with_it() -> None:
    # The offline API adds every prompt at t=0: arrival-time ties are the normal case.
    policy = fcfs(max_num_seqs=2)
    kv = FakeKV(num_blocks=4, block_size=4)
    a, b, c = job("a", 8), job("b", 8), job("c", 8)
    for j in (a, b, c):
        policy.add(j, 0.0)
    step(policy, kv, 0.0)  # a, b run; c waits
    decision = policy.schedule(1.0, kv)
    assert decision.preempted == [b]
    assert [j.job_id for j in policy.jobs] == ["a", "b", "c"]


def test_fcfs_batch_never_exceeds_max_num_seqs_after_unready_running_jobs() -> None:
    policy, kv = fcfs(max_num_seqs=2), roomy()
    a, b, c, d = (job(x, 8) for x in "abcd")
    for j in (a, b, c, d):
        policy.add(j, 0.0)
    step(policy, kv, 0.0)  # a, b run
    a.ready = False
    assert [j.job_id for j in policy.schedule(1.0, kv).batch] == ["b", "c"]
    a.ready = True
    assert len(policy.schedule(2.0, kv).batch) == 2
