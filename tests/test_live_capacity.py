"""scripts/live_capacity.py: the steady-state window of a load generator result (as steady_state computes it
for a simulation), and the whole script end to end on a short run (real servers, the real load generator)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # scripts/ is not a package

import live_capacity  # noqa: E402

ALPACA = REPO / "tests" / "data" / "alpaca_lengths_head20.csv"  # the first 20 rows of ../shared's


def test_window_counts_arrivals_in_the_middle_80_percent_and_finishes_inside_it():
    """Arrivals at 0, 10, ..., 100 s: the window is [10, 90]. Counted: the arrivals at 10-90 (9 requests, one of
    them failed with no tokens). Finished inside: those with start + e2e in [10, 90]."""
    starts = [10.0 * i for i in range(11)]
    e2e = [5.0, 5.0, 100.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    outs = [10] * 11
    outs[5] = 0  # failed
    result = {"start_times": starts, "e2els": e2e, "output_lens": outs, "ttfts": [1.0] * 11}
    m = live_capacity.window_metrics(result)
    assert m["counted"] == 8 and m["failed"] == 1
    # finished in [10, 90]: the starts 10, 30, 40, 60, 70, 80 (not 0: ends at 5; not 20: at 120; not 50: failed;
    # not 90 or 100: at 95, 105)
    assert m["served_rate"] == pytest.approx(6 / 80)
    per_token = [e2e[i] / 10 for i in (1, 2, 3, 4, 6, 7, 8, 9)]
    assert m["mean_per_token_s"] == pytest.approx(sum(per_token) / 8)


def test_the_interval_it_prints_is_a_95_percent_t_interval():
    mean, half = live_capacity.stat([1.0, 2.0, 3.0]).mean, live_capacity.stat([1.0, 2.0, 3.0]).half
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5)
    assert live_capacity.stat([5.0]).mean == 5.0


def test_live_capacity_end_to_end(tiny_model_dir, tmp_path, capsys):
    """Two seeds of FCFS to find capacity (one offer is enough: 20 requests at 40 req/s overload the tiny model),
    then FCFS and skip-join at 1.0C on the same traces; the summary holds both with paired data."""
    out = tmp_path / "live"
    rc = live_capacity.main(["--seeds", "2", "--capacity-seeds", "1", "--num-prompts", "20", "--start-rate", "40",
                             "--dataset-path", str(ALPACA), "--result-dir", str(out),
                             "--", "--model", str(tiny_model_dir), "--profile", "analytic",
                             "--num-gpu-blocks-override", "256"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["capacity"] > 0 and summary["rate"] == pytest.approx(summary["capacity"])
    assert set(summary["data"]) == {"fcfs", "skip-join-mlfq"}
    assert all(len(v) == 2 and all(d["failed"] == 0 and d["counted"] > 0 for d in v)
               for v in summary["data"].values())
    assert "FCFS / skip-join-mlfq mean per-token latency, paired per seed" in capsys.readouterr().out
