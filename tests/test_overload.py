"""The overload remedies, with hand-computed schedules: admission of new jobs
by the KV that started jobs hold (memory/kv_manager.py may_start), and the
starvation factor (scheduler/skip_join_mlfq.py).

Costs as in test_scheduler_rules.py: t_init(L) = L/8 s, t_dec = 1 s, quanta
[1, 2, 4, 8]; 8 tokens -> Q1, 64 -> Q4. A job is demoted when its service in
a queue exceeds the quantum.
"""

from __future__ import annotations

import pytest

from memory.kv_manager import KVManager, Residency
from memory.residency import Allocation
from scheduler import Job
from tests.test_scheduler_rules import mlfq, step


def job(job_id: str, prompt_len: int = 7, output: int = 1, arrival: float = 0.0) -> Job:
    return Job(job_id, prompt_len, output, arrival, true_output_len=output)


def test_may_start_counts_the_kv_of_started_jobs_on_both_tiers():
    """8 device + 8 host blocks of 4 tokens, at most 12 started blocks. Started: a (6 blocks, then on the
    host) and b (4 blocks on the device): 10. A new job of 2 blocks may start (12), one of 3 may not (13)."""
    kv = KVManager(8, 4, num_host_blocks=8, policy="proactive", max_started_blocks=12)
    a, b = job("a", 24), job("b", 16)
    kv.allocate(a, 24)
    a.num_computed = 24
    kv.evict(a)  # no copy backend: the offload completes at once
    assert kv.residency("a") is Residency.HOST
    kv.allocate(b, 16)
    b.num_computed = 16
    assert kv.started_blocks() == 10
    assert kv.may_start(job("c", 8), 8) and not kv.may_start(job("d", 9), 9)
    assert kv.may_start(a, 1)  # a job that holds KV may always go on
    kv.allocate(job("f", 8), 8)  # now 12 blocks are started: nothing new fits
    assert not kv.may_start(job("c", 8), 8) and kv.may_start(b, 1)
    assert KVManager(8, 4, max_started_blocks=None).may_start(job("e", 999), 999)  # the paper: no limit


def test_admission_holds_new_jobs_until_started_ones_finish():
    """One-token jobs of 7-token prompts (2 blocks each); 20 device blocks but at most 6 started. Tick 0:
    a, b, c start (6 blocks); d is refused and, being fresh, so is every later fresh job (e), though
    the device has room. They finish; tick 1: d and e start."""
    policy = mlfq(max_num_seqs=8)
    kv = KVManager(20, 4, policy="recompute", max_started_blocks=6)
    jobs = [job(x) for x in "abcde"]
    for j in jobs:
        policy.add(j, 0.0)
    ids, t = step(policy, kv, 0.0)
    assert ids == ["a", "b", "c"]
    for j in jobs[:3]:
        policy.remove(j)
        kv.free(j.job_id)
    assert step(policy, kv, t)[0] == ["d", "e"]


def test_admission_counts_a_partly_prefilled_prompt_whole():
    """Chunked prefill: a (40 tokens: 10 blocks of 4) has run one 8-token chunk and holds 2 blocks, but admission
    counts all 10 of its prompt until its prefill is done, on either tier: with at most 12 started blocks a job of
    2 blocks may start (12), one of 3 may not (13). Once its prompt is computed it counts what it holds; dropped,
    nothing."""
    kv = KVManager(16, 4, num_host_blocks=16, policy="proactive", max_started_blocks=12)
    a = job("a", 40)
    kv.allocate(a, 8)
    a.num_computed = 8
    assert len(kv.block_table("a")) == 2 and kv.started_blocks() == 10
    assert kv.may_start(job("c", 8), 8) and not kv.may_start(job("d", 12), 12)
    kv.evict(a)  # no copy backend: the offload completes at once
    assert kv.residency("a") is Residency.HOST and kv.started_blocks() == 10
    assert not kv.may_start(job("d", 12), 12)
    kv.allocate(a, 32)  # back up (at once) and the rest of the prompt: the same 10 blocks, held now
    a.num_computed = 40
    assert kv.residency("a") is Residency.DEVICE and kv.started_blocks() == 10
    kv.allocate(a, 1)  # its first decode: a new block, counted as held
    assert kv.started_blocks() == 11
    kv.check_invariants()
    drop = KVManager(16, 4, policy="recompute", max_started_blocks=12)
    b = job("b", 40)
    drop.allocate(b, 8)
    b.num_computed = 8
    assert drop.started_blocks() == 10
    drop.evict(b)  # dropped: it holds nothing, and is counted whole again when it asks to start
    assert b.num_computed == 0 and drop.started_blocks() == 0
    drop.check_invariants()


def test_chunked_prefill_asks_admission_for_the_whole_prompt():
    """Budget 24 tokens, 4-token blocks, at most 14 started blocks (device room for all). a and b have 40-token
    prompts (10 blocks each). Tick 0: a's first chunk (24). Tick 1: the rest of a's (16), and 8 tokens of the
    budget left for b's first chunk, whose 2 blocks would fit beside a's 10; but admission is asked for b's whole
    prompt (10 + 10 > 14), so b waits until a is done. Each asks as a whole prompt, never as its chunk."""
    policy = mlfq(max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=24)
    kv = KVManager(40, 4, policy="recompute", max_started_blocks=14)
    asked: list[tuple[str, int]] = []
    may_start = kv.may_start

    def spy(j, n):
        asked.append((j.job_id, n))
        return may_start(j, n)

    kv.may_start = spy
    a, b = job("a", 40, output=2), job("b", 40, output=2)
    policy.add(a, 0.0)
    policy.add(b, 0.0)
    batches, now = [], 0.0
    while policy.has_work() and len(batches) < 10:
        decision = policy.schedule(now, kv)
        batches.append([(j.job_id, j.num_scheduled) for j in decision.batch])
        now += 1.0
        for j in decision.batch:
            if j.num_computed + j.num_scheduled < j.context_len:
                j.num_computed += j.num_scheduled
            else:
                j.num_computed, j.num_generated = j.context_len, j.num_generated + 1
            j.num_scheduled = 0
        policy.on_step_done(decision.batch, now, 1.0)
        for j in decision.batch:
            if j.num_generated >= j.true_output_len:
                policy.remove(j)
                kv.free(j.job_id)
        kv.check_invariants()
    assert batches[:3] == [[("a", 24)], [("a", 16)], [("a", 1)]]
    assert ("b", 24) in batches[3] and not any(x == "b" for batch in batches[:3] for x, _ in batch)
    assert {n for _, n in asked} == {40}


def test_starvation_factor_holds_back_promotion_of_jobs_that_never_ran():
    """One slot, alpha 1 s. x (8-token prompt, long output) runs from t=0; y (64 tokens: Q4) waits.
    Paper's rule: y has waited > alpha at t=2 and is promoted to Q1 ahead of x (now in Q2): it runs at
    t=2. With factor 2 and a recent wait to first run W = 5 s, y is promoted only after 10 s; x sinks
    (2 iterations in Q1, 3 in Q2, 5 in Q3) and reaches Q4 behind y at t=10: y runs then, unpromoted."""
    for factor, first_run, promotions in ((None, 2.0, 1), (2.0, 10.0, 0)):
        policy = mlfq(max_num_seqs=1, starvation_threshold=1.0, starvation_factor=factor)
        x, y = job("x", 8, output=100), job("y", 64, output=1)
        policy.add(x, 0.0)
        policy.add(y, 0.0)
        t = 0.0
        while y.first_scheduled_time is None:
            if t == 1.0:
                policy.start_wait_ema = 5.0  # as if jobs had recently waited 5 s to start (x waited 0)
            _, t = step(policy, _Roomy(), t)
        assert (y.first_scheduled_time, y.num_promotions) == (first_run, promotions), factor


def test_the_recent_wait_to_a_first_run_is_an_average_weighing_each_start_1_in_20():
    """W moves 1/20 of the way to each started job's wait: a job that waited 10 s makes it 0.5 s (with factor 1 a
    job is then promoted after max(alpha 0.3 s, W)), the next one, which waited 2.5 s, 0.6 s."""
    policy = mlfq(max_num_seqs=1, starvation_threshold=0.3, starvation_factor=1.0)
    a, b = job("a", 8, output=5), job("b", 8, output=5, arrival=8.0)
    policy.add(a, 0.0)
    policy.schedule(10.0, _Roomy())
    assert policy.start_wait_ema == pytest.approx(0.5) and policy.promotion_threshold() == pytest.approx(0.5)
    policy.remove(a)
    policy.add(b, 8.0)
    policy.schedule(10.5, _Roomy())
    assert policy.start_wait_ema == pytest.approx(0.6)


def test_starvation_factor_holds_back_promotion_of_preempted_jobs():
    """One slot, alpha 1 s. x (64-token prompt: Q4, quantum 8, t_init 8 s) runs from t=0 to 8; y (8 tokens:
    Q1) arrives at t=0.5 and takes the slot at t=8 (ends 9). x last ran at t=0. Paper's rule: at t=9 x has
    waited 9 s > alpha and goes to the tail of Q1, behind y, which runs at 9 (service 2 > quantum 1: to
    Q2); x runs at t=10, promoted once. With factor 2 and W = 10 s (set once y started), x is promoted only
    after 20 s; y sinks: Q1 (t=8, 9), Q2 (10, 11, 12: service 3 > 2), Q3 (13..17: service 5 > 4), and
    enters Q4 behind x at t=18: x runs at t=18, unpromoted."""
    for factor, resumed, promotions in ((None, 10.0, 1), (2.0, 18.0, 0)):
        policy = mlfq(max_num_seqs=1, starvation_threshold=1.0, starvation_factor=factor)
        x, y = job("x", 64, output=100), job("y", 8, output=100, arrival=0.5)
        policy.add(x, 0.0)
        assert step(policy, _Roomy(), 0.0) == (["x"], 8.0)
        policy.add(y, 0.5)
        assert step(policy, _Roomy(), 8.0) == (["y"], 9.0)
        policy.start_wait_ema = 10.0  # as if jobs had recently waited 10 s to start
        t = 9.0
        while True:
            ids, t_next = step(policy, _Roomy(), t)
            if ids == ["x"]:
                break
            t = t_next
        assert (t, x.num_promotions) == (resumed, promotions), factor


def test_overload_rules_keep_the_last_queue_in_order():
    """One slot, alpha 100 s (no promotion). x and y (64-token prompts: Q4, the last queue, quantum 8 s;
    5 tokens each) arrive at t=0 and 0.5. x's prefill runs 0-8 (service 8, within the quantum), its first
    decode 8-9 (service 9). Paper's rules: the last queue is round robin, x goes to its tail and y runs at
    t=9. Overload rules (a starvation factor): the last queue keeps its order, x runs to its end (4 decodes:
    t=12) and y starts then."""
    for factor, y_starts in ((None, 9.0), (1.0, 12.0)):
        policy = mlfq(max_num_seqs=1, starvation_threshold=100.0, starvation_factor=factor)
        x, y = job("x", 64, output=5), job("y", 64, output=5, arrival=0.5)
        policy.add(x, 0.0)
        t = 0.0
        while y.first_scheduled_time is None:
            if t >= 0.5 and not policy._holds(y):
                policy.add(y, 0.5)
            ids, t = step(policy, _Roomy(), t)
            if x.num_generated >= 5 and policy._holds(x):
                policy.remove(x)
        assert y.first_scheduled_time == y_starts, factor


def test_overload_rules_promote_a_fresh_job_to_its_arrival_place():
    """One slot, alpha 1 s, W = 0. x (8 tokens: Q1, long output) runs 0-1 and 1-2 (then, service 2 > 1,
    it sinks to Q2). a and d (64 tokens: Q4) arrive at 0.1 and 0.15, b and c (8 tokens: Q1) at 0.2 and
    0.3. At t=2 a and d have waited over alpha and are promoted to Q1. Paper's rule: to the tail of Q1,
    behind b and c: b runs. Overload rules: to their arrival places, ahead of b and c (which arrived after
    them): a runs (its 8 s prefill sinks it to Q2, behind x), and d is next."""
    for factor, runs in ((None, ["b"]), (1.0, ["a"])):
        policy = mlfq(max_num_seqs=1, starvation_threshold=1.0, starvation_factor=factor)
        x = job("x", 8, output=100)
        a, d = job("a", 64, arrival=0.1), job("d", 64, arrival=0.15)
        b, c = job("b", 8, arrival=0.2), job("c", 8, arrival=0.3)
        policy.add(x, 0.0)
        assert step(policy, _Roomy(), 0.0) == (["x"], 1.0)
        for j in (a, d, b, c):
            policy.add(j, j.arrival_time)
        assert step(policy, _Roomy(), 1.0) == (["x"], 2.0)
        assert step(policy, _Roomy(), 2.0)[0] == runs, factor
        assert (a.num_promotions, d.num_promotions) == (1, 1)
        if factor is not None:  # a promoted fresh job leaves cleanly
            assert [j.job_id for j in policy.jobs] == ["d", "b", "c", "x", "a"]
            policy.remove(d)
            assert [j.job_id for j in policy.jobs] == ["b", "c", "x", "a"]
            assert policy.queue_lengths() == [2, 2, 0, 0]


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive"])
def test_a_parked_job_does_not_take_the_room_a_more_urgent_job_waits_for(kv_policy):
    """Proactive or reactive KV, 4 device blocks of 4 tokens. v (not the policy's: say it finished its turn) holds 2
    blocks whose offload is in flight; p (class 1) is parked on the host with 4 tokens and needs 2 blocks to
    go on; h (class 0, new, 12 tokens) needs 3. First tick: h waits for the room v's copy frees (2 free + 2
    coming); p would fit in the 2 free blocks, but an upload on demand would take the room h waits for, so
    p stays on the host (reactive too: there p may evict, but its on-demand upload would take the same room;
    until this held for reactive, such uploads livelocked Fig. 15's reactive run). Between ticks the
    proactive planner may bring p's block back (within its watermark); when v's copy lands, h runs, and p,
    needing a second block, does not fit beside it."""
    from tests.test_kv_manager import ManualBackend, grow

    be = ManualBackend()
    kv = KVManager(4, 4, num_host_blocks=8, policy=kv_policy, transfers=be)
    p = Job("p", 4, 10, 0.0, true_output_len=10, priority=1)
    grow(kv, p, 4)
    p.num_generated, p.first_scheduled_time, p.last_scheduled_time = 1, 0.0, 0.0
    kv.evict(p)
    be.complete_all()
    kv.poll()
    v = job("v", 8)
    grow(kv, v, 8)
    kv.evict(v)  # in flight
    h = Job("h", 12, 1, 0.1, true_output_len=1, priority=0)
    policy = mlfq(max_num_seqs=4, starvation_threshold=100.0)
    policy.add(p, 0.0)
    policy.add(h, 0.1)
    assert policy.schedule(0.1, kv).batch == []
    assert (kv.residency("p"), kv.device.num_free) == (Residency.HOST, 2)
    kv.plan([], policy.estimated_wait, 0.1)
    be.complete_all()
    kv.poll()
    assert policy.schedule(0.2, kv).batch == [h]
    # Proactive: the planner brought p's block up ahead of need. Reactive: only a pick uploads, and p's pick
    # found 1 free block against the 2 it needs, with no lower-priority job to evict.
    assert (kv.residency("p"), kv.device.num_free) == (
        (Residency.DEVICE, 0) if kv_policy == "proactive" else (Residency.HOST, 1))
    kv.check_invariants()


class _Roomy:
    """KV admission that always fits (the fresh-factor test is about order only)."""

    victims_by_priority = False

    def can_fit(self, job, n):
        return True

    def allocate(self, job, n):
        return Allocation((), True, False)

    def may_evict_for(self, job):
        return True

    def may_start(self, job, n):
        return True

    def room_for(self, n):
        return True

    def parked(self):
        return ()

    def parked_unfit(self):
        return ()

    def wait_for_room(self, job, n):
        return False

    def note_blocked(self, job):
        pass

    def evict(self, job):
        job.num_computed = 0
