"""The simulator's copy stalls: the virtual seconds no step ran while requests waited on a KV copy, and of those
the seconds an upload was in flight (SimulatedExecutor.note_idle; SimulationResult.summary's upload stall)."""

from __future__ import annotations

import json

import pytest

from engine.simulation import run_trace, simulated_engine, stall_share
from memory.transfers import Direction

# Every request arrives at once, so work is pending from the first step to the last finish; its prompts and outputs
# overflow 40 device blocks, so jobs move between the tiers.
TRACE = [(0.0, 40 + (37 * i) % 200, 5 + (13 * i) % 60) for i in range(40)]


@pytest.fixture(scope="module")
def slow_copies(flat_sim_model, tmp_path_factory):
    """(model, the flat profile with 1 GB/s copies each way)."""
    model, flat = flat_sim_model
    profile = tmp_path_factory.mktemp("slow-copies") / "profile.json"
    data = json.loads(flat.read_text())
    data["transfer"] = {"host_to_device_bytes_per_s": 1e9, "device_to_host_bytes_per_s": 1e9}
    profile.write_text(json.dumps(data))
    return model, profile


def measure(intervals: list[tuple[float, float]]) -> float:
    """The length of a union of intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """The length of (union of xs) intersected with (union of ys)."""
    return measure(xs) + measure(ys) - measure(xs + ys)


@pytest.mark.parametrize("kv_policy", ["reactive-blocking", "reactive", "proactive"])
def test_upload_stall_is_the_idle_time_while_an_upload_is_in_flight(slow_copies, kv_policy):
    """Recorded from outside: the steps' compute intervals and every upload's (from its issue to its completion).
    The run is computing or stalled on a copy; the upload stall is the idle time that an upload overlaps."""
    model, profile = slow_copies
    eng = simulated_engine(model, profile, num_device_blocks=40, num_host_blocks=400, kv_policy=kv_policy,
                           scheduling_policy="skip-join-mlfq", max_num_seqs=8)
    steps, uploads = [], []
    submit = eng.executor.submit

    def recording_submit(batch):
        future = submit(batch)
        steps.append((eng.clock.now(), future.end))
        return future

    eng.executor.submit = recording_submit
    swapper = eng.executor.swapper
    copy = swapper.copy

    def recording_copy(direction, pairs):
        handle = copy(direction, pairs)
        if direction is Direction.UPLOAD:
            uploads.append((eng.clock.now(), handle.end))
        return handle

    swapper.copy = recording_copy
    res = run_trace(eng, TRACE, max_steps=100_000)
    ex = eng.executor
    assert len(res.outputs) == len(TRACE) and eng.kv.stats.num_uploads > 0 and uploads
    gaps = zip([0.0] + [end for _, end in steps], [start for start, _ in steps] + [res.duration_s])
    idle = [(a, b) for a, b in gaps if b > a]
    assert res.duration_s == pytest.approx(res.busy_s + ex.copy_wait_s)  # busy or stalled, nothing else
    assert measure(idle) == pytest.approx(ex.copy_wait_s)
    assert ex.upload_wait_s == pytest.approx(overlap(idle, uploads))
    s = res.summary()
    assert s["upload_stall_s"] == ex.upload_wait_s
    assert s["upload_stall_share"] == pytest.approx(ex.upload_wait_s / (res.busy_s + ex.upload_wait_s))
    if kv_policy == "reactive-blocking":  # no step runs while a copy is in flight: every upload is waited for
        assert ex.upload_wait_s == pytest.approx(measure(uploads)) and ex.upload_wait_s > 0


def test_no_copies_no_stall(flat_sim_model):
    """Recompute moves nothing between tiers, and fast copies are never waited for: the stall is zero."""
    model, profile = flat_sim_model
    for kv_policy in ("recompute", "proactive"):
        eng = simulated_engine(model, profile, num_device_blocks=400, num_host_blocks=400, kv_policy=kv_policy,
                               scheduling_policy="fcfs", max_num_seqs=8)
        res = run_trace(eng, TRACE[:10])
        assert res.summary()["upload_stall_share"] == 0.0 and eng.executor.copy_wait_s == 0.0
    assert stall_share(0.0, 0.0) == 0.0 and stall_share(1.0, 3.0) == 0.25
