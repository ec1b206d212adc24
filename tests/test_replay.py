"""`fastserve replay` (fastserve/replay.py): a load generator result replayed in the simulator, on a real result
file."""

from __future__ import annotations

import json
from pathlib import Path

from fastserve import replay

PROFILE = Path(__file__).parent / "data" / "tiny_profile.json"


def loadgen_result(path: Path) -> Path:
    """The fields of a loadgen --save-result JSON that the replay reads: four requests far apart (no queue),
    and a fifth that failed (0 output tokens)."""
    result = {"label": "fcfs", "start_times": [100.0, 110.0, 120.0, 130.0, 140.0],
              "input_lens": [16, 64, 8, 32, 20], "output_lens": [20, 10, 40, 5, 0],
              "e2els": [0.2, 0.15, 0.3, 0.05, 0.0]}
    path.write_text(json.dumps(result))
    return path


def test_trace_is_the_completed_requests_from_the_first_arrival(tmp_path):
    result = json.loads(loadgen_result(tmp_path / "r.json").read_text())
    assert replay.trace_of(result) == [(0.0, 16, 20), (10.0, 64, 10), (20.0, 8, 40), (30.0, 32, 5)]
    mean, _ = replay.live_latencies(result)
    assert abs(mean - (0.2 / 20 + 0.15 / 10 + 0.3 / 40 + 0.05 / 5) / 4) < 1e-15


def test_without_a_queue_latency_scales_with_the_costs(tmp_path, tiny_model_dir, capsys):
    """Requests 10 s apart never wait, so each one's latency is its own iterations' cost: doubling every cost
    doubles every policy's per-token latency (the virtual clock adds nothing)."""
    result = loadgen_result(tmp_path / "r.json")
    profile = json.loads(PROFILE.read_text())
    one = replay.replay(tiny_model_dir, profile, replay.trace_of(json.loads(result.read_text())),
                        "fcfs", 8, 256, 256, "float32")
    two = replay.replay(tiny_model_dir, replay.scaled_profile(profile, 2.0),
                        replay.trace_of(json.loads(result.read_text())), "fcfs", 8, 256, 256, "float32")
    assert one["mean_per_token_s"] > 0
    assert abs(two["mean_per_token_s"] / one["mean_per_token_s"] - 2.0) < 1e-9
    assert replay.main(["--result", str(result), "--profile", str(PROFILE), "--model", str(tiny_model_dir),
                        "--max-num-seqs", "8", "--num-device-blocks", "256", "--cost-scale", "1,2"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [(s, p) for s in ("1.00", "2.00") for p in replay.POLICIES]
    assert all(r[-1] == "1.00x" for r in rows)  # no queue: no policy gains anything


def test_a_bad_result_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert replay.main(["--result", str(bad), "--profile", str(PROFILE)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
