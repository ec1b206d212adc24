"""Property-based tests: every policy driven by random workloads on a virtual
clock (tests/scheduler_sim.simulate), with a fake KV of a random block budget.

Costs: t_init(L) = L/8 s, t_dec = 1 s at batch 1 rising to 2 s at batch 8;
prompts 1..64 tokens (max_prompt_len 64: quanta [1, 2, 4, 8]).
"""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Job, PolicyName, SchedulerConfig, SkipJoinMLFQPolicy, make_policy
from scheduler.cost_model import ProfiledCostModel
from scheduler.gittins import MIN_HISTORY, STARVING_KEY
from tests.scheduler_sim import FakeKV, Spec, Tick, make_cost, simulate

COST = make_cost(decode_at_batch_8=2.0)
BLOCK = 4
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw) -> list[Spec]:
    n = draw(st.integers(1, 12))
    t, specs = 0.0, []
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0, 10.0]))  # bursts and gaps
        specs.append(Spec(f"j{i}", t, draw(st.integers(1, 64)), draw(st.integers(1, 12)), draw(st.integers(0, 2))))
    return specs


@st.composite
def setups(draw, policies=tuple(PolicyName), alphas=(None, 3.0, 6.0), factors=(None, 0.5, 2.0)):
    specs = draw(workloads())
    largest = max(-(-(s.prompt_len + s.output_len) // BLOCK) for s in specs)  # so every job can fit
    config = SchedulerConfig(
        policy=draw(st.sampled_from(policies)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(16, 128)),
        starvation_threshold=draw(st.sampled_from(alphas)),
        starvation_factor=draw(st.sampled_from(factors)),
        demotion_step=draw(st.integers(1, 2)),
        max_prompt_len=64,
        mlfq_ladder=draw(st.sampled_from(("prefill", "service"))),
        starvation_age=draw(st.sampled_from((None, 0.5, 2.0))),
    )
    kv = FakeKV(num_blocks=largest + draw(st.integers(0, 60)), block_size=BLOCK)
    return config, specs, kv


def check_batch_limits(config: SchedulerConfig, tick: Tick) -> None:
    batch = tick.decision.batch
    assert len(batch) <= config.max_num_seqs
    assert len(batch) == 1 or tick.decision.num_tokens <= config.max_num_batched_tokens
    assert len(set(batch)) == len(batch)
    assert all(j.ready for j in batch)


@SETTINGS
@given(setups(), st.booleans(), st.integers(0, 2**32))
def test_batches_respect_the_limits_and_every_job_finishes(setup, flaky: bool, seed: int) -> None:
    config, specs, kv = setup
    policy = make_policy(config, COST)
    done = simulate(
        policy,
        specs,
        kv,
        on_tick=lambda tick: check_batch_limits(config, tick),
        flaky_ready=random.Random(seed) if flaky else None,
    )
    assert set(done) == {s.job_id for s in specs}
    assert not kv.held and not policy.has_work()


@SETTINGS
@given(setups(policies=(PolicyName.SKIP_JOIN_MLFQ, PolicyName.MLFQ)))
def test_no_job_joins_a_queue_whose_quantum_is_shorter_than_its_prefill(setup) -> None:
    config, specs, kv = setup
    policy = make_policy(config, COST)
    assert isinstance(policy, SkipJoinMLFQPolicy)

    def placed(job: Job) -> None:
        t_init = COST.t_init(job.prompt_len)
        if policy.skip_join:  # the highest such queue
            assert policy.quanta[job.queue] >= t_init
            assert job.queue == 0 or policy.quanta[job.queue - 1] < t_init
        else:
            assert job.queue == 0

    simulate(policy, specs, kv, on_add=placed)


@SETTINGS
@given(setups(policies=(PolicyName.SKIP_JOIN_MLFQ, PolicyName.MLFQ), alphas=(3.0, 6.0)))
def test_no_job_starves_past_the_promotion_threshold_plus_one_iteration(setup) -> None:
    """(Request classes drawn 0..2; the starvation factor drawn None, the paper's rule, or 0.5 or 2, with
    the overload rules that come with it.) The promotion threshold of a tick is alpha under the paper's
    rule and max(alpha, f x W) with a factor, read just before schedule(). Precondition, checked on each
    tick after promotion: the ready jobs of Q1 fit one batch: at most max_num_seqs of them, their new
    tokens within max_num_batched_tokens (or just one job), their KV within the device blocks. (Q1 jobs
    have the smallest ENST, so every other job's KV is evicted before theirs.) Then every job that had
    waited longer than the threshold runs in that tick; and if it held on every tick, no job waited longer
    than the largest threshold plus the longest iteration."""
    config, specs, kv = setup
    policy = make_policy(config, COST)
    thresholds: list[float] = []
    schedule = policy.schedule

    def schedule_noting_the_threshold(now, kv_manager):
        thresholds.append(policy.promotion_threshold())
        return schedule(now, kv_manager)

    policy.schedule = schedule_noting_the_threshold
    held_always, longest_wait, longest_iteration = True, 0.0, 0.0

    def on_tick(tick: Tick) -> None:
        nonlocal held_always, longest_wait, longest_iteration
        longest_iteration = max(longest_iteration, COST.iteration_cost(tick.decision.batch))
        threshold = thresholds[-1]
        if config.starvation_factor is None:
            assert threshold == config.starvation_threshold
        q1 = [j for j in policy.jobs if j.queue == 0 and j.ready]
        fits = (
            len(q1) <= config.max_num_seqs
            and (len(q1) == 1 or sum(j.num_new_tokens for j in q1) <= config.max_num_batched_tokens)
            and sum(kv.blocks(j.context_len) for j in q1) <= kv.num_blocks
        )
        held_always &= fits
        batch = set(tick.decision.batch)
        for job, waited in tick.starve_before.items():
            if job in batch:
                longest_wait = max(longest_wait, waited)
            elif fits:
                assert waited <= threshold, f"{job.job_id} waited {waited} s > {threshold} and did not run"

    simulate(policy, specs, kv, on_tick=on_tick)
    if held_always:
        assert longest_wait <= max(thresholds) + longest_iteration + 1e-9


@SETTINGS
@given(setups(policies=(PolicyName.SKIP_JOIN_MLFQ, PolicyName.MLFQ)))
def test_enst_equals_the_papers_formula_on_every_tick(setup) -> None:
    """The policy keeps T_execute per queue between changes of the queues; after any mix of arrivals,
    promotions, demotions and finishes it must equal DESIGN.md's formula computed from scratch (with
    request classes: a job of a more urgent class in Q_a adds q_a + ... + q_max(a,b)). With a starvation
    factor f, alpha in the formula is the promotion threshold max(alpha, f x W) of that moment."""
    config, specs, kv = setup
    policy = make_policy(config, COST)
    assert isinstance(policy, SkipJoinMLFQPolicy)
    alpha, seqs, quanta = config.starvation_threshold, config.max_num_seqs, policy.quanta

    def check(now: float) -> None:
        jobs = policy.jobs
        band = policy._band_of  # the class whose queues a job sits in (a promoted job: the top class's)
        for job in jobs:
            b = job.queue
            same = sum(sum(quanta[a:b]) for other in jobs if band[other] == band[job] and (a := other.queue) < b)
            ahead = sum(sum(quanta[other.queue:max(other.queue, b) + 1]) for other in jobs if band[other] < band[job])
            t_exec = (same + ahead) / (len(policy._running) or seqs)  # B: the batch running now
            threshold = policy.promotion_threshold()
            if alpha is not None:
                assert threshold == (alpha if config.starvation_factor is None else
                                     max(alpha, config.starvation_factor * policy.start_wait_ema))
            want = t_exec if alpha is None else min(threshold - (now - job.last_scheduled_time), t_exec)
            got = policy.estimated_wait(job, now)
            assert got == 0.0 if job in policy._running else abs(got - want) <= 1e-9 * max(1.0, abs(want))

    simulate(policy, specs, kv, on_add=lambda job: check(job.arrival_time), on_tick=lambda tick: check(tick.now))


# t_dec grows with the context too (1 s at batch 1 and 16 tokens, 3 s at 80), so a stale estimate shows.
CONTEXT_COST = ProfiledCostModel.from_dict({
    "schema": "fastserve.profile/1", "key": {"model": "test"},
    "prefill": {"prompt_lens": [0, 64], "seconds": [0.0, 8.0]},
    "decode": {"batch_sizes": [1, 8], "context_lens": [16, 80], "seconds": [[1.0, 3.0], [2.0, 6.0]]},
})


@SETTINGS
@given(setups(policies=(PolicyName.FIXED_PRIORITY, PolicyName.SRPT, PolicyName.GITTINS)), st.booleans(),
       st.integers(0, 2**32), st.booleans())
def test_keyed_order_and_wait_estimates_equal_a_ranking_from_scratch(setup, flaky: bool, seed: int,
                                                                     learned: bool) -> None:
    """Fixed priority, SRPT and gittins keep ranks, positions and wait estimates cached between changes (SRPT
    and gittins re-rank only the jobs a step ran; gittins every job at a refresh of its table and a promoted one);
    on every tick the walk must be every held job sorted by (class, key, arrival) computed afresh, and each
    waiting job's estimate (its place in that order, in batches of max_num_seqs, times one decode step at its
    context) must match; fixed priority's also as each job arrives."""
    config, specs, kv = setup
    policy = make_policy(config, CONTEXT_COST)
    srpt = config.policy is not PolicyName.FIXED_PRIORITY  # a dynamic key: SRPT's or gittins'
    arrival: dict[Job, int] = {}
    arrivals = itertools.count()
    running: list[Job] = []  # the last tick's batch
    if learned and config.policy is PolicyName.GITTINS:  # a history of finished jobs: its index read from the table
        lengths = random.Random(seed)
        for i in range(MIN_HISTORY):
            done = Job(f"history{i}", 8, 4096, 0.0)
            policy.add(done, 0.0)
            done.num_generated, done.finished = lengths.randint(1, 12), True
            policy.remove(done)
        assert policy._learned is not None

    def check() -> None:
        for job in [j for j in arrival if j.finished]:
            del arrival[job]
        if config.policy is PolicyName.GITTINS:  # its index from the job's state and the learned table
            def key(j: Job) -> float:
                return STARVING_KEY + j.arrival_time if j in policy._starving else -policy.index(j)
        else:
            key = (lambda j: j.remaining_tokens()) if srpt else (lambda j: j.prompt_len)
        order = sorted(arrival, key=lambda j: (j.priority, key(j), arrival[j]))
        assert policy.jobs == order
        seqs = config.max_num_seqs
        for place, job in enumerate(order):
            step = CONTEXT_COST.t_dec(min(seqs, len(order)), job.context_len)
            want = 0.0 if job in running else (place // seqs + 1) * step
            assert policy.estimated_wait(job, 0.0) == want

    def on_add(job: Job) -> None:
        arrival[job] = next(arrivals)  # (not len(arrival): finished jobs leave it)
        if not srpt:  # SRPT re-sorts at the tick: between ticks its started jobs keep the last tick's order
            check()

    def on_tick(tick: Tick) -> None:
        running[:] = tick.decision.batch
        check()

    simulate(policy, specs, kv, on_add=on_add, on_tick=on_tick,
             flaky_ready=random.Random(seed) if flaky else None)
