"""scripts/benchmarks/control_plane.py: a step's wall time against the executor's compute time (tp = pp = 1), in
synchronous mode, with async output processing and with async scheduling."""

from __future__ import annotations

import pytest

from scripts.benchmarks import control_plane


@pytest.mark.parametrize("mode", control_plane.MODES)
def test_measure_splits_a_decode_step_into_compute_and_the_engine_around_it(tiny_model_dir, mode):
    r = control_plane.measure(str(tiny_model_dir), batch=4, steps=6, mode=mode)
    assert r["batch"] == 4 and r["steps"] >= 4 and r["mode"] == mode
    assert r["execute"] > 0 and r["wall"] > 0 and r["schedule"] > 0 and r["commit"] > 0 and r["publish"] > 0
    assert r["idle"] >= 0  # from one step's compute ending to the next one's starting, in the step thread
    if mode == "sync":  # each step's compute lies inside its engine.step(): so do the medians
        assert r["execute"] <= r["wall"] and r["outside_execute"] > 0  # scheduling, committing, the hand-off
        assert r["idle"] > 0  # the step thread waits while the engine schedules and commits
    # (With output processing or scheduling overlapped, a step commits the compute of the step before it: its
    # wall time may be shorter than that compute, and the step thread's idle time is what the benchmark measures.)
