"""Skip-join's alike-lengths mode (scheduler/skip_join_mlfq.py, set_alike_lengths): once the output lengths of the
finished jobs say a started job is the nearer to finishing (scheduler.gittins.index_growth > 1: the Gittins
index rises with service), jobs keep their entry queue (no demotion) and a fresh job waits behind a started one that
waits for KV; on heavy tails the service ladder stays. Naive MLFQ (a baseline) never changes.

Costs (tests/scheduler_sim.make_cost): t_init(L) = L/8 s, t_dec = 1 s; quanta [1, 2, 4, 8] with max_prompt_len 64.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Job, MLFQPolicy, SchedulerConfig, SkipJoinMLFQPolicy
from scheduler.gittins import REFRESH_EVERY, index_growth
from scheduler.skip_join_mlfq import ALIKE_MIN_HISTORY, ALIKE_OFF, ALIKE_ON
from tests.scheduler_sim import FakeKV, make_cost

COST = make_cost()
RNG = np.random.default_rng(0)
ALIKE = [int(x) for x in RNG.integers(80, 121, 4 * ALIKE_MIN_HISTORY)]  # 80-120 tokens: alike
HEAVY = [max(1, int(x)) for x in RNG.lognormal(5.0, 1.2, 4 * ALIKE_MIN_HISTORY)]  # ShareGPT-like heavy tail
BETWEEN = [int(x) for x in RNG.integers(2, 7, 4 * ALIKE_MIN_HISTORY)]  # 2-6 tokens: the index grows, but little


def policy(cls=SkipJoinMLFQPolicy, on: bool = True) -> SkipJoinMLFQPolicy:
    return cls(SchedulerConfig(max_prompt_len=64, starvation_threshold=None, starvation_age=None,
                               adapt_to_alike_lengths=on), COST)


def finish(p: SkipJoinMLFQPolicy, lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        j = Job(f"done{i}-{p.num_mode_changes}-{len(p._lengths)}", 8, 4096, 0.0)
        p.add(j, 0.0)
        j.num_generated, j.finished = n, True
        p.remove(j)


def test_the_index_test_reads_alike_and_heavy_tailed_lengths_apart() -> None:
    assert index_growth(ALIKE) > 1.0 and index_growth(ALIKE) >= ALIKE_ON
    assert not index_growth(HEAVY) > 1.0 and index_growth(HEAVY) <= ALIKE_OFF
    assert ALIKE_OFF < index_growth(BETWEEN) < ALIKE_ON


def test_the_mode_is_read_from_256_finished_jobs_on_at_a_growth_of_2_off_at_1(monkeypatch) -> None:
    """The index growth of the finished lengths (stubbed here) is first read when 256 jobs have finished, then
    every 128: the mode turns on at 2 or more and off again at 1 or less."""
    reading = [2.0]
    monkeypatch.setattr("scheduler.skip_join_mlfq.index_growth", lambda lengths, censored=(): reading[0])
    early = policy()
    finish(early, [5] * 255)
    assert not early.alike_lengths
    finish(early, [5])
    assert early.alike_lengths
    p, seen = policy(), []
    for growth, jobs in ((1.99, 256), (2.0, 127), (2.0, 1), (1.01, 128), (1.0, 128)):
        reading[0] = growth
        finish(p, [5] * jobs)
        seen.append(p.alike_lengths)
    assert seen == [False, False, True, True, False]


def test_between_the_thresholds_the_mode_keeps_what_it_was() -> None:
    """Hysteresis: lengths whose index grows by less than ALIKE_ON do not turn the mode on, and do not turn it off."""
    off = policy()
    finish(off, BETWEEN)
    assert not off.alike_lengths
    on = policy()
    on.set_alike_lengths(True)
    finish(on, BETWEEN)
    assert on.alike_lengths and on.num_mode_changes == 1


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


def test_in_the_mode_a_started_job_runs_to_completion_ahead_of_a_shorter_newcomer() -> None:
    """One slot: a 32-token prompt (Q3) starts, then an 8-token one (Q1) arrives. In the mode the started job moves
    to Q1 ahead of it and keeps running; on the ladder the newcomer's higher queue takes the slot."""
    for alike in (True, False):
        p = SkipJoinMLFQPolicy(SchedulerConfig(max_prompt_len=64, max_num_seqs=1, starvation_threshold=None,
                                               starvation_age=None, adapt_to_alike_lengths=True), COST)
        p.set_alike_lengths(alike)
        kv = FakeKV(num_blocks=10_000)
        a = Job("a", 32, 100, 0.0)
        p.add(a, 0.0)
        d = p.schedule(0.0, kv)
        assert [j.job_id for j in d.batch] == ["a"]
        a.num_computed, a.num_generated = a.context_len, 1
        p.on_step_done(d.batch, 4.0, 4.0)
        p.add(Job("b", 8, 100, 1.0), 1.0)
        assert [j.job_id for j in p.schedule(4.0, kv).batch] == (["a"] if alike else ["b"])


def test_the_mode_is_off_by_flag() -> None:
    p = policy(on=False)
    finish(p, ALIKE)
    assert not p.alike_lengths and p.num_mode_changes == 0


@pytest.mark.parametrize("adapt", [True, False])
def test_the_simulated_engine_learns_the_mode_from_what_it_serves(flat_sim_model, adapt: bool) -> None:
    """300 requests of 20-30 output tokens through the real engine (simulated clock): with the setting on the
    skip-join order turns the mode on; with it off (the default) it keeps the ladder."""
    from engine.simulation import run_trace, simulated_engine

    rng = np.random.default_rng(1)
    trace = [(i * 0.01, 16, int(rng.integers(20, 31))) for i in range(300)]
    engine = simulated_engine(*flat_sim_model, num_device_blocks=4096, adapt_to_alike_lengths=adapt)
    run_trace(engine, trace)
    assert engine.scheduler.alike_lengths is adapt


def test_the_server_takes_the_flag() -> None:
    import server
    from engine.config import EngineConfig

    assert EngineConfig().adapt_to_alike_lengths is False  # opt-in
    assert server.build_parser().parse_args([]).adapt_to_alike_lengths is False
    assert server.build_parser().parse_args(["--adapt-to-alike-lengths"]).adapt_to_alike_lengths is True
    assert server.build_parser().parse_args(["--no-adapt-to-alike-lengths"]).adapt_to_alike_lengths is False


def test_when_the_mode_turns_on_the_jobs_already_started_move_to_q1_in_their_order() -> None:
    p = policy()
    jobs = [Job(f"s{i}", 8 * (i + 1), 100, float(i)) for i in range(4)]  # Q1, Q2, Q3 and Q3 (prompts 8-32)
    for j in jobs:
        p.add(j, j.arrival_time)
    d = p.schedule(4.0, FakeKV(num_blocks=10_000))
    for j in d.batch:
        j.num_computed, j.num_generated = j.context_len, 1
    p.on_step_done(d.batch, 8.0, 4.0)  # 4 s: every one used its quantum, demoted a queue
    assert sorted(j.queue for j in jobs) == [1, 2, 2, 2]
    before = [j.job_id for j in p._priority_order()]
    finish(p, ALIKE[:ALIKE_MIN_HISTORY])
    assert p.alike_lengths
    assert [j.queue for j in jobs] == [0, 0, 0, 0]
    assert [j.job_id for j in p._priority_order() if j in jobs] == before  # their order kept


def test_in_the_mode_a_started_job_keeps_its_place_ahead_of_fresh_q1_jobs_that_came_after_it() -> None:
    """One slot, five 8-token jobs (Q1) arriving together: in the mode the first runs to completion before the next
    starts (a started job keeps its entry, ahead of the later fresh ones); on the ladder it sinks after its quantum
    and the others take turns."""
    runs = {}
    for alike in (True, False):
        p = SkipJoinMLFQPolicy(SchedulerConfig(max_prompt_len=64, max_num_seqs=1, starvation_threshold=None,
                                               starvation_age=None, adapt_to_alike_lengths=True), COST)
        p.set_alike_lengths(alike)
        kv = FakeKV(num_blocks=10_000)
        for name in "abcde":
            p.add(Job(name, 8, 100, 0.0), 0.0)
        order, now = [], 0.0
        for _ in range(4):
            d = p.schedule(now, kv)
            order += [j.job_id for j in d.batch]
            for j in d.batch:
                j.num_computed, j.num_generated = j.context_len, j.num_generated + 1
            now += 1.0
            p.on_step_done(d.batch, now, 1.0)
        runs[alike] = order
    assert runs[True] == ["a", "a", "a", "a"]
    assert runs[False][:3] == ["a", "a", "b"]  # the ladder: a sinks once it has had its 1 s quantum twice over


def test_started_jobs_still_held_count_as_censored_lengths() -> None:
    """256 finished jobs of 80-120 tokens read alike; 300 jobs held with 500 tokens out say the lengths reach far
    past them (L > 500), and with them counted the mode stays off."""
    bare = policy()
    finish(bare, ALIKE[:ALIKE_MIN_HISTORY])
    assert bare.alike_lengths
    p = policy()
    for i in range(300):
        j = Job(f"long{i}", 8, 4096, 0.0)
        p.add(j, 0.0)
        j.num_generated, j.num_computed, j.first_scheduled_time = 500, 507, 0.0
    finish(p, ALIKE[:ALIKE_MIN_HISTORY])
    assert not p.alike_lengths and p.num_mode_changes == 0
