"""The simulator: the real engine, scheduler and KV manager on a virtual
clock. Deterministic, and in agreement with schedules computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.simulation import run_trace, simulated_engine
from tests.conftest import settle_kv_copies

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sim_dirs(flat_sim_model):
    return flat_sim_model


def e2e(result) -> dict[str, float]:
    return {o.request_id: round(o.metrics.e2e_s, 6) for o in result.outputs}


def test_fcfs_schedule_by_hand(sim_dirs):
    """Batch of one. A (t=0, 3 tokens): prefill 0-1.0, decodes to 1.2. B (t=0.5, 1 token): 1.2-2.2."""
    model, profile = sim_dirs
    eng = simulated_engine(model, profile, num_device_blocks=1000, scheduling_policy="fcfs", max_num_seqs=1)
    res = run_trace(eng, [(0.0, 10, 3), (0.5, 10, 1)])
    assert e2e(res) == {"0": 1.2, "1": 1.7}
    assert res.duration_s == pytest.approx(2.2)
    assert res.busy_s == pytest.approx(2.2)


def test_skip_join_preempts_a_long_job_for_a_short_one(sim_dirs):
    """q1 = 0.1 s; a prefill (1.0 s) skips to the queue with quantum 1.6 s. A (t=0, 30 tokens) runs its
    prefill (0-1.0) and decodes; at t=1.7 its service (1.7 s) exceeds the 1.6 s quantum and it is demoted;
    B (t=0.5) then runs: prefill 1.7-2.7, and its single token finishes it at 2.7 (the paper's rules:
    that queue is the last, and the last queue is round robin). Under FCFS B waits for all of A (to 3.9),
    and so it does under the overload rules with the paper's ladder, where the last queue keeps its order;
    the engine's default ladder covers the whole service, so A is demoted past B's queue and B goes first."""
    model, profile = sim_dirs
    trace = [(0.0, 10, 30), (0.5, 10, 1)]
    sj = run_trace(simulated_engine(model, profile, num_device_blocks=1000, scheduling_policy="skip-join-mlfq",
                                    max_num_seqs=1, starvation_threshold=100.0, starvation_factor=None), trace)
    fc = run_trace(simulated_engine(model, profile, num_device_blocks=1000, scheduling_policy="fcfs",
                                    max_num_seqs=1), trace)
    assert e2e(fc) == {"0": 3.9, "1": 4.4}
    assert e2e(sj)["1"] == pytest.approx(2.7 - 0.5)
    assert e2e(sj)["0"] == pytest.approx(4.9)  # A pays for B's prefill: 3.9 + 1.0
    in_order = run_trace(simulated_engine(model, profile, num_device_blocks=1000, max_num_seqs=1,
                                          scheduling_policy="skip-join-mlfq", starvation_threshold=100.0,
                                          mlfq_ladder="prefill"), trace)
    assert e2e(in_order) == e2e(fc)
    default = run_trace(simulated_engine(model, profile, num_device_blocks=1000, max_num_seqs=1,
                                         scheduling_policy="skip-join-mlfq", starvation_threshold=100.0), trace)
    assert e2e(default) == pytest.approx(e2e(sj))


def test_the_engine_charges_each_job_its_share_of_a_step(sim_dirs):
    """A (t=0, 10-token prompt) prefills (0-1.0, entering the queue of quantum 1.6 s) and decodes; B (t=1.05,
    10 tokens) joins it at 1.1: that step costs 1.0 s (B's prefill), of which A's one token is charged 1/11 and
    B's ten tokens 10/11. A keeps its queue (1.0 + 0.1 + 1/11 < 1.6 s). Charged the whole step, A had 2.1 s
    there and was demoted."""
    model, profile = sim_dirs
    eng = simulated_engine(model, profile, num_device_blocks=1000, scheduling_policy="skip-join-mlfq",
                           max_num_seqs=2)
    steps = []
    charge = eng.scheduler.on_step_done

    def record(batch, now, cost, charges=None):
        charge(batch, now, cost, charges)
        steps.append((cost, {j.job_id: (round(charges[j], 6), j.queue) for j in batch} if charges else None))

    eng.scheduler.on_step_done = record
    run_trace(eng, [(0.0, 10, 5), (1.05, 10, 3)])
    assert steps[:3] == [(1.0, {"0#0": (1.0, 4)}), (pytest.approx(0.1), {"0#0": (0.1, 4)}),
                         (1.0, {"0#0": (round(1 / 11, 6), 4), "1#0": (round(10 / 11, 6), 4)})]


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive", "recompute"])
def test_simulation_is_deterministic_and_finishes_under_memory_pressure(sim_dirs, kv_policy):
    model, profile = sim_dirs
    trace = [(0.05 * i, 20 + (37 * i) % 200, 5 + (13 * i) % 60) for i in range(60)]

    def run():
        eng = simulated_engine(model, profile, num_device_blocks=60, num_host_blocks=200, kv_policy=kv_policy,
                               scheduling_policy="skip-join-mlfq", max_num_seqs=8)
        return run_trace(eng, trace, max_steps=100_000)

    a, b = run(), run()
    assert e2e(a) == e2e(b)
    for o in a.outputs:  # the breakdown adds up: copy waits are swap wait, not execution
        m = o.metrics
        assert m.executing_s + m.swap_wait_s <= m.e2e_s + 1e-9
        assert m.queued_s + m.executing_s + m.swap_wait_s == pytest.approx(m.e2e_s)
    assert len(a.outputs) == 60 and all(len(o.outputs[0].token_ids) == t[2] for o, t in zip(a.outputs, trace))
    kv = a.engine.kv
    assert kv.stats.num_offloads + kv.stats.num_drops > 0
    kv.poll()
    kv.check_invariants()
    assert kv.device.num_free == kv.device.num_blocks


def test_starvation_promotion_under_memory_overload_does_not_thrash(sim_dirs):
    """120 equal jobs, room for ~30: promotions rotate jobs through Q1, but a job whose KV is on the host
    only comes back into free room, so each job is offloaded about once, not on every promotion."""
    model, profile = sim_dirs
    trace = [(0.01 * i, 400, 40) for i in range(120)]
    eng = simulated_engine(model, profile, num_device_blocks=1000, num_host_blocks=100_000,
                           scheduling_policy="skip-join-mlfq", kv_policy="proactive", starvation_threshold=0.3)
    res = run_trace(eng, trace, max_steps=200_000)
    assert len(res.outputs) == 120
    assert eng.kv.stats.num_offloads <= 3 * 120
    assert sum(o.metrics.swap_wait_s for o in res.outputs) < 0.2 * sum(o.metrics.e2e_s for o in res.outputs)


def test_copy_waits_count_as_swap_wait_not_execution(sim_dirs, tmp_path):
    """Reactive swapping with slow copies: the waits land in swap_wait_s, and the breakdown adds up."""
    model, flat = sim_dirs
    profile = tmp_path / "slow-copies.json"
    data = json.loads(flat.read_text())
    data["transfer"] = {"host_to_device_bytes_per_s": 2e9, "device_to_host_bytes_per_s": 2e9}
    profile.write_text(json.dumps(data))
    trace = [(0.05 * i, 100 + (37 * i) % 200, 20 + (13 * i) % 40) for i in range(40)]
    eng = simulated_engine(model, profile, num_device_blocks=60, num_host_blocks=2000, kv_policy="reactive",
                           scheduling_policy="skip-join-mlfq", max_num_seqs=8)
    submit, charged = eng.executor.submit, []

    def recording_submit(batch):  # compute seconds x requests in the batch, step by step
        future = submit(batch)  # the simulator's future is done at once
        charged.append(future.result().execute_s * len({s.job_id.split("#")[0] for s in batch.seqs}))
        return future

    eng.executor.submit = recording_submit
    res = run_trace(eng, trace, max_steps=100_000)
    assert sum(o.metrics.swap_wait_s for o in res.outputs) > 0
    assert sum(o.metrics.executing_s for o in res.outputs) == pytest.approx(sum(charged))
    for o in res.outputs:
        m = o.metrics
        assert m.executing_s + m.swap_wait_s <= m.e2e_s + 1e-9
        assert m.queued_s + m.executing_s + m.swap_wait_s == pytest.approx(m.e2e_s)


@pytest.mark.parametrize(("in_flight", "expected"), [(1, {"0": 2.0, "1": 4.0, "2": 6.0}),
                                                     (2, {"0": 2.0, "1": 3.0, "2": 4.0})])
def test_pipeline_stages_overlap_micro_batches(sim_dirs, in_flight, expected):
    """Two stages, each taking the profiled 1.0 s per prefill; batches of one; three one-token jobs at t=0.
    One batch at a time: each passes both stages alone (2 s apiece). Two in flight: stage 0 takes the next
    job while stage 1 finishes the previous one, so after the first, one job completes every second."""
    model, profile = sim_dirs
    eng = simulated_engine(model, profile, num_device_blocks=1000, scheduling_policy="fcfs", max_num_seqs=1,
                           pipeline_parallel_size=2, max_in_flight=in_flight)
    res = run_trace(eng, [(0.0, 10, 1)] * 3)
    assert e2e(res) == expected
    assert res.busy_s == pytest.approx(3.0)  # stage 0's work: three prefills


def overloaded_run(sim_dirs, policy: str, max_started_blocks: int | None = None) -> tuple:
    """80 requests past capacity on a 40-block device with a host tier (proactive): the schedule's fingerprint
    (every request's latency, the preemptions, the offloads), for runs that must decide alike. max_started_blocks:
    the admission limit instead of the engine's (a higher one leaves the started jobs less room to grow: drops)."""
    model, profile = sim_dirs
    trace = [(0.02 * i, 20 + (37 * i) % 200, 5 + (13 * i) % 60) for i in range(80)]
    eng = simulated_engine(model, profile, num_device_blocks=40, num_host_blocks=400, kv_policy="proactive",
                           scheduling_policy=policy, max_num_seqs=8)
    if max_started_blocks is not None:
        eng.kv.max_started_blocks = max_started_blocks
    res = run_trace(eng, trace, max_steps=100_000)
    return e2e(res), sum(o.metrics.preemptions for o in res.outputs), eng.kv.stats.num_offloads


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq"])
def test_parked_shortcuts_change_no_decision(sim_dirs, monkeypatch, policy):
    """Past capacity memory/ lets the walk pass over host-parked jobs and the proactive planner skip sorting
    them when not even the smallest host copy fits (KVManager.parked_unfit, smallest_host_copy): the same
    run with both shortcuts off (the floor reported as never binding) gives the same schedule, to the
    microsecond, and the shortcuts did fire."""
    from memory.kv_manager import KVManager

    def run():
        return overloaded_run(sim_dirs, policy)

    fired = []
    parked_unfit = KVManager.parked_unfit
    monkeypatch.setattr(KVManager, "parked_unfit", lambda self: fired.append(bool(p := parked_unfit(self))) or p)
    fast = run()
    assert any(fired), "no tick had every host job too large for the free room: the test shows nothing"
    monkeypatch.setattr(KVManager, "smallest_host_copy", lambda self: -(10**9))
    assert run() == fast


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq", "fixed-priority"])
def test_fresh_gate_changes_no_decision(sim_dirs, monkeypatch, policy):
    """Past capacity a refused new job closes the walk's fresh gate once nothing is left to evict and no later
    new job can fit (PriorityPolicy.schedule: the smallest new prompt against KVManager.room_for, and fixed
    priority's own rule): the same run with the gate never closed that way gives the same schedule, and the
    gate did close."""
    from memory.kv_manager import KVManager
    from scheduler.fixed_priority import FixedPriorityPolicy

    def run():
        return overloaded_run(sim_dirs, policy)

    closed = []
    room_for = KVManager.room_for
    monkeypatch.setattr(KVManager, "room_for", lambda self, n: closed.append(not (r := room_for(self, n))) or r)
    gated = run()
    assert any(closed), "the gate never closed: the test shows nothing"
    monkeypatch.setattr(KVManager, "room_for", lambda self, n: True)
    monkeypatch.setattr(FixedPriorityPolicy, "_later_fresh_need_at_least", lambda self, job, n: False)
    assert run() == gated


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq"])
def test_admission_refusal_kept_past_a_resident_jobs_allocate_changes_no_decision(sim_dirs, monkeypatch, policy):
    """The walk keeps admission's refusal of a job with no KV past an allocate that says the KV it counts only
    grew (KVManager.allocate's Allocation in_place: a device-resident job's next blocks) instead of asking every
    such job again: the same run with allocate never saying so (ask again) gives the same schedule, and a refusal
    was kept that way (an allocate in place after a refusal in the same tick)."""
    from memory.kv_manager import KVManager

    allocate, may_start, plan = KVManager.allocate, KVManager.may_start, KVManager.plan
    refused, kept = [False], []

    def refusing(self, job, n):
        ok = may_start(self, job, n)
        refused[0] |= not ok
        return ok

    def recorded(self, job, n):
        got = allocate(self, job, n)
        kept.append(got is not None and got.in_place and refused[0])
        return got

    def never_in_place(self, job, n):
        got = allocate(self, job, n)
        return got and got._replace(in_place=False)

    def tick_over(self, *args):
        refused[0] = False
        return plan(self, *args)

    monkeypatch.setattr(KVManager, "may_start", refusing)
    monkeypatch.setattr(KVManager, "allocate", recorded)
    monkeypatch.setattr(KVManager, "plan", tick_over)
    fast = overloaded_run(sim_dirs, policy)
    assert any(kept), "no refusal was kept past an allocate: the test shows nothing"
    monkeypatch.setattr(KVManager, "allocate", never_in_place)
    assert overloaded_run(sim_dirs, policy) == fast


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq"])
def test_walk_leaving_out_parked_jobs_changes_no_decision(sim_dirs, monkeypatch, policy):
    """Past capacity the walk leaves out the started jobs schedule() would pass over (Gate: the host-parked
    jobs once memory/ says none of them fits or a job was refused room, and the jobs with their KV dropped once
    admission refused one as large): the same run with the walk yielding every job gives the same schedule,
    and the walk was told to leave jobs out both ways."""
    from scheduler import priority_policy

    told = set()

    def gate(keep: bool):
        class Recorded(priority_policy.Gate):
            __slots__ = ()

            def __setattr__(self, name, value):
                if (name == "skip" and value) or (name == "no_kv_from" and value != priority_policy.NEVER):
                    told.add(name)
                    value = value if keep else {"skip": (), "no_kv_from": priority_policy.NEVER}[name]
                super().__setattr__(name, value)

        return Recorded

    monkeypatch.setattr(priority_policy, "Gate", gate(keep=True))
    fast = overloaded_run(sim_dirs, policy)
    assert told == {"skip", "no_kv_from"}, f"the walk was told to leave jobs out only by {told}: it shows less"
    monkeypatch.setattr(priority_policy, "Gate", gate(keep=False))
    assert overloaded_run(sim_dirs, policy) == fast


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "mlfq"])
def test_walk_leaving_out_known_dropped_jobs_changes_no_decision(sim_dirs, monkeypatch, policy):
    """The walk leaves out in C the dropped jobs the policy keeps (PriorityPolicy._dropped: started jobs an eviction
    left with no KV, sorted by context) once admission refused a job with no KV as large: at every tick each job
    kept there has no KV and the context it was kept with, in order; the same run with none left out that way
    (every dropped job tested in the interpreter, as before) gives the same schedule; and jobs were kept while a
    refusal covered them."""
    from scheduler import priority_policy

    schedule, covered = priority_policy.PriorityPolicy.schedule, []

    def checked(self, now, kv):
        for job, (context, _) in self._dropped.items():
            assert job.num_computed == 0 and job.prompt_len + job.num_generated == context, job.job_id
        assert [(c, s) for c, s, _ in self._dropped_order] == sorted(self._dropped.values())
        assert [j for _, _, j in self._dropped_order] == sorted(self._dropped, key=self._dropped.__getitem__)
        return schedule(self, now, kv)

    class Recorded(priority_policy.Gate):
        __slots__ = ()
        policy = None

        def __setattr__(self, name, value):
            if name == "no_kv_from" and value != priority_policy.NEVER and Recorded.policy is not None:
                covered.append(any(c >= value for c, _ in Recorded.policy._dropped.values()))
            super().__setattr__(name, value)

    init = priority_policy.PriorityPolicy.__init__

    def remembered(self, *args):
        init(self, *args)
        Recorded.policy = self

    monkeypatch.setattr(priority_policy.PriorityPolicy, "schedule", checked)
    monkeypatch.setattr(priority_policy.PriorityPolicy, "__init__", remembered)
    monkeypatch.setattr(priority_policy, "Gate", Recorded)
    tight = 440 - 40 // 8  # both tiers less an eighth of the device: too little room to grow, so evictions drop
    kept = overloaded_run(sim_dirs, policy, tight)
    assert any(covered), "no refusal covered a kept dropped job: the test shows nothing"

    def forgetful(self, *args):
        init(self, *args)
        self._dropped_in = lambda lo, hi=priority_policy.NEVER: iter(())  # nothing left out: each job tested

    monkeypatch.setattr(priority_policy.PriorityPolicy, "__init__", forgetful)
    assert overloaded_run(sim_dirs, policy, tight) == kept


def test_reactive_swapping_finishes_fig15s_first_point(sim_dirs):
    """Fig. 15's first point (300 ShareGPT-length requests at 14.7 req/s, OPT-13B on an A100 40GB's KV) with
    reactive swapping: jobs that sink and are promoted back pile up on the host, the most urgent of them too
    large for the blocks each finished copy frees. Until the rule that a refused job's room is not given to a
    lower-priority job parked on the host held for reactive too, every copy's blocks went to the next small
    host job, which evicted another: uploads and offloads without end, no step run (a livelock from step
    ~24,000 on). The same trace must finish, in about proactive's time."""
    model, _ = sim_dirs
    profile = REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"
    data = json.loads((REPO / "tests" / "data" / "sharegpt_fig15_trace.json").read_text())
    trace = [tuple(row) for row in data["trace"]]
    runs = {}
    for kv_policy in ("reactive", "proactive"):
        eng = simulated_engine(model, profile, kv_policy=kv_policy, scheduling_policy="skip-join-mlfq")
        runs[kv_policy] = run_trace(eng, trace, max_steps=30_000)
        assert len(runs[kv_policy].outputs) == 300
        eng.kv.poll()
        eng.kv.check_invariants()
    assert runs["reactive"].duration_s < 1.2 * runs["proactive"].duration_s


@st.composite
def _memory_bound_runs(draw):
    """A burst of requests on a small device with a host tier and copies that take a few decode steps."""
    n = draw(st.integers(4, 30))
    t, trace = 0.0, []
    for _ in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.05, 0.2, 1.0]))
        trace.append((t, draw(st.integers(1, 400)), draw(st.integers(1, 80))))
    need = max(-(-(p + o) // 16) for _, p, o in trace)  # so that every job can fit alone
    kv_policy = draw(st.sampled_from(["proactive", "reactive", "reactive-blocking", "recompute"]))
    return (trace, need + draw(st.integers(0, 40)), kv_policy,
            draw(st.sampled_from(["skip-join-mlfq", "mlfq", "srpt", "fixed-priority"])),
            draw(st.sampled_from([None, 1.0])), draw(st.sampled_from([5e8, 2e9, 1e12])), draw(st.booleans()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(_memory_bound_runs())
@example(([(0.0, p, o) for p, o in ((207, 19), (1, 76), (106, 20), (160, 3), (157, 80), (227, 58), (249, 60),
                                   (226, 21), (113, 32), (285, 18), (162, 12), (303, 8), (125, 62), (209, 48),
                                   (102, 57), (257, 28), (101, 65), (205, 77), (106, 31), (249, 29))]
          + [(0.0, 1, 1)] * 4, 20, "proactive", "skip-join-mlfq", None, 5e8, False))  # found by this test: the
# planner uploaded host jobs into the room a fresh job waited for, which then evicted them again, without end
@example(([(0.0, 172, 62), (0.05, 128, 64), (0.05, 189, 43), (0.05, 115, 4), (0.05, 35, 5), (0.05, 311, 24),
           (0.1, 255, 10), (1.1, 355, 38), (1.1, 244, 73), (2.1, 103, 69), (2.1, 342, 37), (2.1, 399, 54),
           (2.1, 163, 80), (2.1, 17, 76)], 39, "proactive", "mlfq", 1.0, 5e8, True))  # found by this test with
# prefix caching: the host full, an evicted job was dropped and the room it left was short of what a new job
# needed, so it was promised to no one and the planner uploaded host jobs into it, which the new job then evicted
# again, without end (KVManager.owed_free_blocks now counts a short job's room)
def test_every_request_finishes_under_every_kv_policy_with_slow_copies(sim_dirs, tmp_path_factory, run):
    """The real engine, scheduler and KV manager on random memory-bound bursts, each KV policy with copies of
    a few decode steps (13 MB blocks at 0.5-2 GB/s against 0.1 s steps), with and without the overload rules and
    prefix caching:
    every request finishes with all its tokens (no stall, no livelock: run_trace stops at max_steps) and memory
    ends empty and consistent."""
    trace, blocks, kv_policy, policy, factor, bandwidth, caching = run
    model, flat = sim_dirs
    profile = tmp_path_factory.mktemp("copies") / "profile.json"
    data = json.loads(flat.read_text())
    data["transfer"] = {"host_to_device_bytes_per_s": bandwidth, "device_to_host_bytes_per_s": bandwidth}
    profile.write_text(json.dumps(data))
    eng = simulated_engine(model, profile, num_device_blocks=blocks, num_host_blocks=4 * blocks,
                           kv_policy=kv_policy, scheduling_policy=policy, max_num_seqs=8,
                           starvation_threshold=0.3, starvation_factor=factor, enable_prefix_caching=caching)
    res = run_trace(eng, trace, max_steps=50_000)
    assert [len(o.outputs[0].token_ids) for o in res.outputs] == [o for _, _, o in sorted(trace, key=lambda r: r[0])]
    settle_kv_copies(eng)  # (the prefix cache's own copies of finished requests' blocks)
    eng.kv.check_invariants()
    assert eng.kv.device.num_free == eng.kv.device.num_blocks and eng.kv.host.num_used == 0


# Found by the property test above: 30 requests, 28 device blocks, 0.5 GB/s copies.
LIVELOCK_TRACE = [(0.0, 397, 43), (0.0, 305, 23), (0.0, 200, 72), (0.0, 174, 16), (0.2, 8, 6), (1.2, 194, 62),
                  (1.4, 44, 53), (2.4, 128, 66), (3.4, 26, 23), (3.4, 274, 7), (3.4, 1, 77), (3.6, 10, 71),
                  (3.6, 325, 28), (3.65, 46, 8), (3.85, 64, 55), (4.85, 146, 24), (4.85, 273, 58), (5.05, 100, 53),
                  (6.05, 184, 6), (6.05, 277, 32), (6.05, 400, 39), (6.05, 52, 12), (6.05, 1, 5), (6.1, 282, 77),
                  (6.3, 131, 17), (7.3, 22, 55), (7.3, 220, 27), (7.3, 73, 1), (7.3, 85, 18), (7.3, 313, 34)]


@pytest.mark.parametrize("caching", [False, True])
def test_reactive_blocking_with_prefix_caching_finishes(sim_dirs, tmp_path_factory, caching):
    """The paper's blocking reactive baseline finishes a memory-bound burst, with and without prefix caching.
    With it, a decision dropped for its copies used to be formed anew once they landed: the new one evicted
    the dropped one's job for the jobs just swapped in (the host full, its KV dropped and found again in the
    cache), the next one evicted those again, and no step ran after ~300 (run_trace stopped at max_steps).
    A held decision now runs as it was decided (engine/engine.py, schedule_step)."""
    test_every_request_finishes_under_every_kv_policy_with_slow_copies.hypothesis.inner_test(
        sim_dirs, tmp_path_factory, (LIVELOCK_TRACE, 28, "reactive-blocking", "skip-join-mlfq", None, 5e8, caching))


def test_reactive_with_prefix_caching_runs_every_upload_on_demand(sim_dirs, tmp_path_factory):
    """Found by the property test above at 600 examples (it fails before as well): 20 requests, 27
    device blocks, MLFQ, 0.5 GB/s copies. Each tick the policy picked a job on the host (a swap miss, or a new
    job whose prefix is on the host) and evicted for it the job whose upload had just landed, which the tick's
    order (changed by starvation promotion while every job waited) no longer picked: no step ran. A job uploaded
    on demand is now evicted only for another such job until it has run (Job.kv_pinned)."""
    trace = [(0.0, 272, 3), (0.0, 33, 69), (1.0, 171, 11), (1.0, 100, 41), (1.0, 255, 8), (1.0, 172, 36),
             (1.0, 100, 76), (2.0, 11, 39), (2.0, 80, 66), (2.05, 255, 70), (2.25, 40, 25), (2.45, 1, 7),
             (2.65, 5, 48), (3.65, 48, 35), (3.85, 121, 41), (3.85, 341, 39), (3.9, 162, 78), (4.9, 167, 80),
             (5.9, 126, 14), (5.95, 103, 79)]
    for factor in (1.0, None):
        test_every_request_finishes_under_every_kv_policy_with_slow_copies.hypothesis.inner_test(
            sim_dirs, tmp_path_factory, (trace, 27, "reactive", "mlfq", factor, 5e8, True))


def test_a_cache_copy_that_lands_after_the_last_poll_is_reaped(sim_dirs, tmp_path_factory):
    """Found by the property test above in a review (12 requests, 66 device blocks, 2 GB/s copies): a
    cache copy of a finished request's blocks lands after the engine's last poll. It was thought a copy the
    simulated executor did not know; it was settle_kv_copies asking for the next completion before reaping the
    copies already done (it now polls first)."""
    trace = [(0.0, 1, 1), (0.0, 362, 67), (0.05, 113, 45), (1.05, 195, 22), (1.05, 148, 77), (1.05, 49, 2),
             (1.05, 353, 80), (1.05, 273, 9), (1.1, 196, 80), (1.3, 206, 21), (1.3, 1, 39), (2.3, 198, 59)]
    test_every_request_finishes_under_every_kv_policy_with_slow_copies.hypothesis.inner_test(
        sim_dirs, tmp_path_factory, (trace, 66, "reactive", "skip-join-mlfq", 1.0, 2e9, True))


def test_engine_admission_and_pipeline_share_defaults(sim_dirs):
    """With a host tier and no --kv-overcommit, started jobs may hold both tiers less an eighth of both;
    --kv-overcommit N sets N device caches (within both tiers); recompute has no host and no limit. With two
    batches in flight a batch's share of KV is half the device's tokens; one batch at a time has no share."""
    model, profile = sim_dirs
    kv = simulated_engine(model, profile, num_device_blocks=64, num_host_blocks=200).kv
    assert kv.max_started_blocks == 264 - 264 // 8
    assert simulated_engine(model, profile, num_device_blocks=64, num_host_blocks=200,
                            kv_overcommit=2).kv.max_started_blocks == 128
    assert simulated_engine(model, profile, num_device_blocks=64, num_host_blocks=200,
                            kv_policy="recompute").kv.max_started_blocks is None
    for in_flight, share in [(2, 64 * 16 // 2), (1, None)]:
        eng = simulated_engine(model, profile, num_device_blocks=64, pipeline_parallel_size=2,
                               max_in_flight=in_flight)
        assert eng.scheduler.config.max_batch_kv_tokens == share


def test_past_capacity_admission_bounds_drops(sim_dirs):
    """A preemptive policy past capacity on a small host tier (40 device blocks, 60 host; prompts of 2-12
    blocks): without the admission limit new jobs keep starting until evictions find the host full and drop
    contexts, each rebuilt by a prefill: 838 drops, mean e2e 642 s. The engine's default admits a job only while
    the started jobs' KV fits both tiers less an eighth of both (88 blocks): 36 drops, mean e2e 183 s. Less an
    eighth of the device alone (95 blocks) leaves too little room for the started jobs to grow as they decode:
    129 drops, mean e2e 260 s."""
    model, profile = sim_dirs
    trace = [(0.01 * i, 30 + (37 * i) % 150, 20 + (13 * i) % 90) for i in range(120)]

    def run(limit: int | None | str) -> tuple[int, float]:
        eng = simulated_engine(model, profile, num_device_blocks=40, num_host_blocks=60, kv_policy="proactive",
                               scheduling_policy="skip-join-mlfq", max_num_seqs=8)
        if limit != "default":
            eng.kv.max_started_blocks = limit
        else:
            assert eng.kv.max_started_blocks == 88
        res = run_trace(eng, trace, max_steps=200_000)
        assert len(res.outputs) == len(trace)
        return eng.kv.stats.num_drops, sum(o.metrics.e2e_s for o in res.outputs) / len(trace)

    (drops_off, e2e_off), (drops_on, e2e_on) = run(None), run("default")
    assert drops_on * 10 < drops_off
    assert e2e_on * 3 < e2e_off
    assert run(40 + 60 - 40 // 8)[0] > 3 * drops_on


def test_the_blocking_reactive_baseline_starts_no_step_while_a_copy_is_in_flight(sim_dirs, tmp_path_factory):
    """The paper's reactive baseline (reactive-blocking) swaps as reactive does, but the batch waits for every
    copy: no step is submitted while one is in flight. Non-blocking reactive overlaps them (here 40+ steps
    start during copies); the blocking one takes longer on the same memory-bound trace."""
    model, flat = sim_dirs
    profile = tmp_path_factory.mktemp("slow-copies") / "profile.json"
    data = json.loads(flat.read_text())
    data["transfer"] = {"host_to_device_bytes_per_s": 1e9, "device_to_host_bytes_per_s": 1e9}
    profile.write_text(json.dumps(data))
    trace = [(0.05 * i, 40 + (37 * i) % 200, 5 + (13 * i) % 60) for i in range(40)]
    overlapped, duration = {}, {}
    for kv_policy in ("reactive", "reactive-blocking"):
        eng = simulated_engine(model, profile, num_device_blocks=40, num_host_blocks=400, kv_policy=kv_policy,
                               scheduling_policy="skip-join-mlfq", max_num_seqs=8)
        submit, count = eng.executor.submit, [0]

        def counting_submit(batch, eng=eng, submit=submit, count=count):
            count[0] += eng.kv.pending_transfers() > 0
            return submit(batch)

        eng.executor.submit = counting_submit
        res = run_trace(eng, trace, max_steps=100_000)
        assert len(res.outputs) == len(trace) and eng.kv.stats.num_uploads > 0
        overlapped[kv_policy], duration[kv_policy] = count[0], res.duration_s
    assert overlapped["reactive-blocking"] == 0 and overlapped["reactive"] > 40
    assert duration["reactive-blocking"] > duration["reactive"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99, 1.0]))
def test_quantile_is_numpys_percentile(values, q):
    """One quantile rule in the project: the simulator's and the experiments' P95/P99 are numpy.percentile's linear
    interpolation, as the load generator's (and vLLM's benchmark) are."""
    import numpy as np

    from engine.simulation import quantile

    assert quantile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)), rel=1e-9, abs=1e-6)
    assert quantile([], q) == 0.0


def test_a_profile_without_a_host_capacity_gets_the_live_engines_host_tier(tiny_model_dir):
    """tests/data/tiny_profile.json (what `fastserve replay` replays live runs with) names no host tier:
    the simulated engine then has the live engine's (swap_space GiB), not none. With none, every preemption
    dropped its KV and the oracle, which preempts most, recomputed 3.6x the work and read 4-7x worse than FCFS."""
    from engine.config import EngineConfig

    profile = REPO / "tests" / "data" / "tiny_profile.json"
    assert "capacity" not in json.loads(profile.read_text())
    eng = simulated_engine(tiny_model_dir, profile, dtype="float32", num_device_blocks=64)
    assert eng.kv.num_host_blocks == int(EngineConfig.swap_space * (1 << 30)) // eng.executor.kv_block_bytes > 0
    assert simulated_engine(tiny_model_dir, profile, dtype="float32", num_device_blocks=64,
                            num_host_blocks=0).kv.num_host_blocks == 0  # an explicit count still wins
