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


def test_window_mean_counts_the_middle_80_percent_of_arrivals():
    # arrivals 0..10 s: the window is [1, 9]
    assert replay.window_mean([float(i) for i in range(11)], [100.0] + [float(i) for i in range(1, 10)] + [100.0]) \
        == 5.0


def test_matched_scale_bisects_to_the_target_and_stops_at_the_range():
    def run(scale: float) -> dict:  # a latency that rises with the costs
        return {"window_mean_per_token_s": 0.01 * scale ** 1.5}

    assert abs(replay.matched_scale(run, 0.01 * 1.7 ** 1.5) / 1.7 - 1) < 0.01
    assert replay.matched_scale(run, 1e-9) == replay.MATCH_RANGE[0]
    assert replay.matched_scale(run, 1.0) == replay.MATCH_RANGE[1]


def test_match_live_finds_the_scale_at_which_the_simulated_run_is_the_live_one(tmp_path, tiny_model_dir, capsys):
    """No queue: the simulated latency is proportional to the costs, so a live run twice as slow as the profile
    on the middle 80% is matched at scale 2."""
    flags = ["--profile", str(PROFILE), "--model", str(tiny_model_dir), "--max-num-seqs", "8",
             "--num-device-blocks", "256", "--policies", "fcfs,skip-join-mlfq"]
    assert replay.main(["--result", str(loadgen_result(tmp_path / "r.json")), *flags]) == 0
    at_one = float(capsys.readouterr().out.splitlines()[2].split()[4]) / 1e3  # fcfs, scale 1: mean, mid 80%
    result = json.loads((tmp_path / "r.json").read_text())
    result["e2els"] = [2 * at_one * n for n in result["output_lens"]]  # every request 2x that per token
    (tmp_path / "slow.json").write_text(json.dumps(result))
    assert replay.main(["--result", str(tmp_path / "slow.json"), "--match-live", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    scale = float(lines[1].split()[3])
    assert lines[1].startswith("matched cost scale: ") and abs(scale / 2 - 1) < 0.01
    fcfs = lines[3].split()
    assert fcfs[1] == "fcfs" and abs(float(fcfs[4]) / 1e3 / (2 * at_one) - 1) < 0.01


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, capsys):
    result = loadgen_result(tmp_path / "r.json")
    assert replay.main(["--result", str(result), "--profile", str(PROFILE), "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
