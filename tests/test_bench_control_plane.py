"""scripts/bench_control_plane.py: a step's wall time against the executor's compute time (tp = pp = 1)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_control_plane  # noqa: E402


def test_measure_splits_a_decode_step_into_compute_and_the_engine_around_it(tiny_model_dir):
    r = bench_control_plane.measure(str(tiny_model_dir), batch=4, steps=6)
    assert r["batch"] == 4 and r["steps"] >= 4
    assert 0 < r["execute"] <= r["wall"] and r["schedule"] > 0 and r["finish"] > 0
    assert r["outside_execute"] > 0  # scheduling, finishing and the hand-off to the step thread
