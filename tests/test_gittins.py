"""The Gittins-index policy (scheduler/gittins.py): its index against a hand computation, the order it learns from
finished jobs (least attained service on a heavy tail, run-to-completion on alike lengths), that it reads no job's
own output length, that a fresh job waits behind a started one that waits for KV, age promotion, and the
distribution it learns with the started jobs counted as censored (Kaplan-Meier, a constant-hazard tail).

Costs (tests/scheduler_sim.make_cost): t_init(L) = L / 8 s, t_dec = 1 s at any batch size.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import GittinsPolicy, Job, PolicyName, SchedulerConfig, make_policy
from scheduler.gittins import MIN_HISTORY, index_growth, length_pmf, median_length
from scheduler.skip_join_mlfq import ALIKE_OFF, ALIKE_ON
from tests.scheduler_sim import FakeKV, make_cost

COST = make_cost()


def policy(**kw) -> GittinsPolicy:
    kw.setdefault("max_prompt_len", 64)
    kw.setdefault("starvation_threshold", None)
    kw.setdefault("starvation_age", None)
    kw.setdefault("max_num_seqs", 4)
    return GittinsPolicy(SchedulerConfig(**kw), COST)


def job(job_id: str, prompt_len: int = 8, arrival: float = 0.0, generated: int = 0) -> Job:
    j = Job(job_id, prompt_len, 4096, arrival)
    if generated:  # started: its prompt computed, `generated` tokens out
        j.num_generated, j.num_computed, j.first_scheduled_time = generated, prompt_len + generated - 1, arrival
    return j


def learn(p: GittinsPolicy, lengths: list[int], now: float = 0.0) -> None:
    """Finish one job per length (the history the policy may learn from)."""
    for i, n in enumerate(lengths):
        j = job(f"done{i}-{len(p._lengths)}", arrival=now)
        p.add(j, now)
        j.num_generated, j.finished = n, True
        p.remove(j)


def order(p: GittinsPolicy, jobs: list[Job], now: float = 0.0) -> list[str]:
    for j in jobs:
        p.add(j, now)
    p._before_schedule(now)
    return [j.job_id for j in p._priority_order()]


def test_make_policy_builds_it() -> None:
    assert type(make_policy(SchedulerConfig(policy="gittins"), COST)) is GittinsPolicy
    assert PolicyName("gittins") is PolicyName.GITTINS


def test_the_index_is_the_hand_computed_one() -> None:
    """Lengths 1 or 10, half each. A started job with 1 token out (no prefill left) finishes at 10 or has
    finished: conditioned on L > 1 it is L = 10, worth 1/10, for 9 more decode shares d."""
    p = policy()
    learn(p, [1, 10] * (MIN_HISTORY // 2))
    d = p._d
    assert d == pytest.approx(COST.t_dec(4, 512) / 4)
    started = job("s", generated=1)
    assert p.index(started) == pytest.approx((1 / 10) / (9 * d))
    # A fresh 8-token prompt: this profile's pass over the weights costs 1 s whatever the tokens, so the prompt adds
    # nothing to a step of 4 decoders (t_init(8) = 1 s is that pass) and its work is its share of the step, P = d.
    # Thresholds t = 1 (worth 1/2 * 1/1, work P) and t = 10 (worth 1/2 + 1/20, work P + 9 d / 2): the better.
    fresh = job("f", prompt_len=8)
    assert p._prefill_left(fresh) == pytest.approx(d)
    assert p.index(fresh) == pytest.approx(max(0.5 / d, 0.55 / (d + 4.5 * d)))
    # Past every length seen: last.
    assert p.index(job("old", generated=10)) == 0.0


def test_a_prompt_is_priced_as_it_runs_in_a_batch_not_alone() -> None:
    """t_init(L) = L / 8 s; t_dec(b) = F(b) = 1 + (b - 1) / 7 s: a step of b decoders passes the weights once, each
    token adding 1/7 s. At b = 4 (d = t_dec(4) / 4 = 10/28 s) a prompt of L tokens adds F(4 + L) - F(4) = L/7 s of
    tokens and t_init(L) - F(L) of its own attention: 8 tokens add 8/7 - 1 = 1/7 s, so P = 10/28 + 4/28 = 0.5 s
    (alone it would cost t_init(8) = 1 s); 64 tokens add 64/7 - 2 = 50/7 s, P = 7.5 s (alone 8 s). A prompt
    with 56 of its 64 tokens computed is priced by the 8 left."""
    p = GittinsPolicy(SchedulerConfig(max_prompt_len=64, max_num_seqs=4, starvation_threshold=None,
                                      starvation_age=None), make_cost(decode_at_batch_8=2.0))
    assert p._d == pytest.approx(10 / 28)
    assert p._prefill_left(job("short", 8)) == pytest.approx(0.5)
    assert p._prefill_left(job("long", 64)) == pytest.approx(7.5)
    part = job("part", 64)
    part.num_computed = 56
    assert p._prefill_left(part) == pytest.approx(0.5)


def test_before_any_history_it_is_shortest_prefill_then_least_attained() -> None:
    p = policy()
    got = order(p, [job("long-prompt", 64), job("short-prompt", 12), job("ran-5", generated=5),
                    job("ran-1", generated=1)])
    # d = t_dec(4, 512) / 4 = 0.25 s; a 12-token prompt adds its attention, t_init(12) - F(12) = 1.5 - 1 s, to a
    # step (this profile's pass over the weights costs 1 s whatever the tokens), so P = d + 0.5 s: a started job
    # with 5 tokens out (index 1 / 6d = 0.67) goes after it (1 / (P + d) = 1); one with 1 token out (1 / 2d = 2)
    # before it; the 64-token prompt (P = d + 7 s) last.
    assert got == ["ran-1", "short-prompt", "ran-5", "long-prompt"]


def test_on_a_heavy_tail_it_is_least_attained_service() -> None:
    """80% of jobs end at 2 tokens, 20% at 500: a job that has passed 2 is a long one, so it goes after a newcomer
    and after a job that may still be short (inverting to most-attained-first fails this)."""
    p = policy()
    learn(p, [2] * 80 + [500] * 20)
    got = order(p, [job("ran-50", generated=50), job("ran-1", generated=1), job("new", prompt_len=8)])
    assert got.index("ran-1") < got.index("ran-50")
    assert got.index("new") < got.index("ran-50")


def test_on_alike_lengths_a_started_job_finishes_first() -> None:
    """Every job ends between 90 and 110 tokens: the further a job is, the sooner it ends, so it keeps its place
    ahead of jobs that have done less and of a newcomer (least attained service, skip-join's order, fails this)."""
    p = policy()
    learn(p, list(range(90, 111)) * 3)
    got = order(p, [job("ran-10", generated=10), job("new", prompt_len=8), job("ran-95", generated=95),
                    job("ran-50", generated=50)])
    assert got == ["ran-95", "ran-50", "ran-10", "new"]


def test_the_batch_rule_is_on_where_started_jobs_are_nearer_their_end() -> None:
    """Fresh jobs wait behind started ones that wait for KV only where the learned index rises with service."""
    alike, heavy, none = policy(), policy(), policy()
    learn(alike, list(range(90, 111)) * 3)
    learn(heavy, [2] * 80 + [500] * 20)
    assert alike.fresh_waits_for_started and not heavy.fresh_waits_for_started
    assert not none.fresh_waits_for_started  # no history: skip-join's way


def test_it_learns_only_from_finished_jobs_and_never_reads_a_true_length() -> None:
    p = policy()
    for i in range(3 * MIN_HISTORY):  # aborted (not finished): no history
        j = job(f"a{i}")
        p.add(j, 0.0)
        j.num_generated = 7
        p.remove(j)
    assert p._learned is None
    # Identical jobs but for the true output length the SRPT oracle reads: the same index.
    learn(p, [2] * 40 + [300] * 10)
    a, b = job("a", generated=3), job("b", generated=3)
    a.true_output_len, b.true_output_len = 4, 4000
    assert p.index(a) == p.index(b)


def test_the_distribution_is_refreshed_and_every_job_reranked() -> None:
    """History first says long jobs are the exception (least attained first), then that lengths are alike (run to
    completion): a started job's place flips after enough new finished jobs."""
    p = policy()
    learn(p, [2] * 80 + [500] * 20)
    assert order(p, [job("ran-1", generated=1), job("ran-300", generated=300)]) == ["ran-1", "ran-300"]
    waiting = [job(f"w{n}", prompt_len=n) for n in (64, 16, 30, 9)]
    for j in waiting:
        p.add(j, 0.0)
    learn(p, [400] * 2000)  # the window (HISTORY) now holds only these
    p._before_schedule(0.0)
    assert [j.job_id for j in p._priority_order()][:2] == ["ran-300", "ran-1"]
    # The waiting jobs were re-ranked at the refresh (all at once) as each one's own index says.
    assert p._fresh_ranks == sorted((j.priority, -p.index(j), p._seq[j]) for j in waiting)
    assert [j.job_id for j in p._fresh] == ["w9", "w16", "w30", "w64"]


@pytest.mark.parametrize("waits", [True, False])
def test_a_fresh_job_waits_while_a_started_job_ahead_waits_for_its_kv(waits: bool) -> None:
    """The started job (ahead in the order) is not ready: its KV is moving. Under the rule no fresh job takes the
    device meanwhile; with the rule off (as skip-join runs) the fresh job that fits starts."""
    p = policy()
    p.fresh_waits_for_started = waits  # (what the learned index sets: test_the_batch_rule_is_on_where...)
    started, fresh = job("started", generated=1), job("fresh", prompt_len=8)
    p.add(started, 0.0)
    p.add(fresh, 0.0)
    started.kv_ready = False
    kv = FakeKV(num_blocks=1000)  # room to spare
    batch = [j.job_id for j in p.schedule(1.0, kv).batch]
    assert batch == ([] if waits else ["fresh"])
    started.kv_ready = True  # landed: both run
    kv.held[started] = kv.blocks(started.num_computed)
    assert sorted(j.job_id for j in p.schedule(2.0, kv).batch) == ["fresh", "started"]


def test_age_promotion_puts_the_oldest_first() -> None:
    """A long prompt that shorter ones keep passing runs first once it is older than k x the mean time in the
    system (jobs held / completion rate); with age promotion off it stays last."""
    for age, first in ((1.0, "old-long"), (None, "young-short")):
        p = policy(starvation_age=age)
        p._now = 0.0
        for i in range(40):  # 40 completions over 40 s: 1 job/s
            p._now = float(i + 1)
            learn(p, [5], now=float(i))
        old = job("old-long", prompt_len=64, arrival=0.0)
        young = job("young-short", prompt_len=8, arrival=99.0)
        p.add(old, 0.0)
        p.add(young, 99.0)
        # 2 jobs held at 1 job/s: mean time in the system 2 s; the old one has been here 100 s.
        p._before_schedule(100.0)
        assert next(iter(p._priority_order())).job_id == first
        assert p.num_promotions == (1 if age else 0)


def test_the_decode_share_is_priced_at_a_512_token_context() -> None:
    """d = t_dec(b, 512) / b, b the batch (max_num_seqs before any refresh). On a profile whose decode step grows
    with the context (8 jobs: 2 s at 16 tokens, 4 s at 512, 8 s at 2,048) d = 0.5 s, and a started job with one
    token out and nothing learned has the index 1 / (2 d) = 1."""
    cost = make_cost(decode_by_context={16: (1.0, 2.0), 512: (2.0, 4.0), 2048: (4.0, 8.0)})
    p = GittinsPolicy(SchedulerConfig(max_prompt_len=64, starvation_threshold=None, max_num_seqs=8), cost)
    assert p.index(job("a", generated=1)) == pytest.approx(1.0)


def test_a_step_is_charged_once() -> None:
    """service_total (telemetry) counts each step's cost once, as for every priority policy."""
    p = policy()
    j = job("a")
    p.add(j, 0.0)
    batch = p.schedule(0.0, FakeKV(num_blocks=100)).batch
    p.on_step_done(batch, 1.5, 1.5)
    assert batch == [j] and j.service_total == 1.5


# -- learning from censored jobs: the started jobs still held say L > g ------------------------------------------
def test_without_censored_jobs_the_distribution_is_the_finished_lengths() -> None:
    lengths = np.array([3, 1, 3, 7])
    assert length_pmf(lengths).tolist() == [0, 0.25, 0, 0.5, 0, 0, 0, 0.25]
    assert length_pmf(lengths, np.array([0, 0])).tolist() == length_pmf(lengths).tolist()  # g = 0 says nothing


def test_kaplan_meier_by_hand() -> None:
    """Finished at 1, 2, 3; one job still running with 2 tokens out. At 1: 4 at risk, 1 ends (S = 3/4); at 2: 3
    at risk (the running job among them), 1 ends (S = 1/2); at 3: 1 at risk, it ends (S = 0). Without the running
    job each length would read 1/3."""
    assert np.allclose(length_pmf(np.array([1, 2, 3]), np.array([2])), [0, 0.25, 0.25, 0.5])


def test_the_mass_past_the_longest_job_seen_ends_at_the_observed_hazard() -> None:
    """Two jobs finished at 1, two still running at 4: S(4) = 1/2 is left. Over 1..4, 2 jobs finished in 10 tokens
    at risk: 0.2 a token, so P(L = 4 + e) = 0.5 x 0.8^(e - 1) x 0.2 (on the first points, one token apart)."""
    pmf = length_pmf(np.array([1, 1]), np.array([4, 4]))
    assert pmf[1] == 0.5 and pmf[2:5].sum() == 0
    assert np.allclose(pmf[5:8], [0.1, 0.08, 0.064])
    assert abs(pmf.sum() - 1) < 1e-12 and abs(pmf[5:].sum() - 0.5) < 1e-12


def _observed(lengths: np.ndarray, horizon: float, seed: int) -> tuple[list[int], list[int]]:
    """Jobs started uniformly over the last `horizon` decode steps, one token a step: (the lengths of those finished,
    the tokens so far of those running): what a server past capacity sees of them."""
    age = np.random.default_rng(seed).uniform(0, horizon, len(lengths)).astype(int)
    done = lengths <= age
    return lengths[done].tolist(), np.minimum(age, lengths - 1)[~done].tolist()


def test_censored_jobs_undo_the_bias_of_the_finished_lengths() -> None:
    """Heavy tail (ShareGPT-like lognormal) seen over 30 steps: the finished alone are its shortest jobs and read as
    lengths that do not fall with service (index growth above 1); counting the running jobs, it reads heavy, as the
    whole sample does. Alike lengths (80-120) seen long enough read alike either way."""
    rng = np.random.default_rng(1)
    heavy = np.maximum(1, rng.lognormal(5.0, 1.2, 3000).astype(int))
    done, running = _observed(heavy, 30, 2)
    assert index_growth(done) > ALIKE_OFF  # the bias
    assert index_growth(done, running) <= ALIKE_OFF and index_growth(heavy.tolist()) <= ALIKE_OFF
    assert abs(median_length(*map(np.array, _observed(heavy, 300, 3))) / np.median(heavy) - 1) < 0.05
    alike = rng.integers(80, 121, 3000)
    assert index_growth(*_observed(alike, 300, 4)) >= ALIKE_ON


def test_the_policy_counts_its_started_jobs_as_censored() -> None:
    """Jobs held with 200 tokens out say lengths reach past 200, though every finished job had 10."""
    p = policy(max_num_seqs=64)
    for i in range(8):
        p.add(job(f"long{i}", generated=200), 0.0)
    learn(p, [10] * MIN_HISTORY)
    assert p._learned is not None and len(p._learned.table) > 201
    assert p.censored_lengths().tolist() == [200] * 8
    bare = policy()
    learn(bare, [10] * MIN_HISTORY)
    assert len(bare._learned.table) == 11
