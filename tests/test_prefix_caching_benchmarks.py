"""The prefix-caching benchmarks (issue 28) run and count what they say: scripts/bench_prefix_caching.py (overhead
on prompts that share nothing), scripts/live_prefix_caching.py's window (checked against a hand-computed result).
Their numbers are measured by running them (docs/benchmarks.md), not here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_prefix_caching  # noqa: E402
import live_prefix_caching  # noqa: E402


@pytest.mark.slow  # loads the tiny model twice (about 10 s of CPU)
def test_overhead_bench_runs_both_parts_and_writes_its_ratios(tmp_path, capsys):
    out = tmp_path / "o.json"
    rc = bench_prefix_caching.main(["--repeats", "1", "--tick-requests", "12", "--requests", "2", "--cap", "16",
                                    "--json", str(out)])
    assert rc in (0, 1)  # 1: a goal not met on this run (a timing, not a failure of the script)
    res = json.loads(out.read_text())
    tick, tp = res["tick"], res["throughput"]
    assert tick["steps"][0] > 12 and tick["off_ms"]["median"] > 0 and tick["on_ms"]["median"] > 0
    assert tick["delta_cpu_ms"]["all"] == [pytest.approx(tick["on_cpu_ms"]["all"][0] - tick["off_cpu_ms"]["all"][0])]
    assert tp["ratio"]["median"] > 0 and tp["tokens"] > 0
    text = capsys.readouterr().out
    assert "goal <= 0.05 ms" in text and "goal >= 0.97" in text


def test_overhead_bench_passes_engine_settings_to_both_sides(tmp_path):
    out = tmp_path / "o.json"
    bench_prefix_caching.main(["--parts", "tick", "--repeats", "1", "--tick-requests", "8",
                               "--engine", "kv_policy=recompute", "--json", str(out)])
    assert json.loads(out.read_text())["engine"] == {"kv_policy": "recompute"}


def test_live_window_counts_turns_sent_in_the_middle_80_percent():
    """Arrivals span 0..10 s: the window is 1..9 s. Turns start at 0.5, 2, 4, 8.5, 9.5 s; the one at 4 s failed
    (no output). Counted for TTFT: the turns at 2 and 8.5 s; finished in the window: 2+1, 0.5+1.5 (4 s failed)."""
    result = {"start_times": [0.5, 2.0, 4.0, 8.5, 9.5], "e2els": [1.5, 1.0, 0.5, 1.0, 0.2],
              "ttfts": [0.1, 0.2, 0.3, 0.4, 0.5], "output_lens": [10, 4, 0, 5, 2],
              "multi_turn": {"prompt_tokens": 1000, "cached_tokens": 700, "turns": 5, "turns_ok": 4,
                             "conversations": 2}}
    m = live_prefix_caching.window_metrics(result, (0.0, 10.0))
    assert m["counted"] == 2 and m["failed"] == 1 and m["turns_per_conversation"] == 2
    assert m["mean_ttft_s"] == pytest.approx(0.3)
    assert m["mean_per_token_s"] == pytest.approx((1.0 / 4 + 1.0 / 5) / 2)
    assert m["served_turn_rate"] == pytest.approx(2 / 8)
    assert m["computed_share"] == pytest.approx(0.3)


def test_live_runs_send_conversations_for_the_minimum_span():
    """A run sends --num-prompts conversations, or more where they would arrive in less than --min-span seconds
    (a short run measures the ramp-up, not the steady state)."""
    assert live_prefix_caching.conversations_for(0.5, 60, 120.0) == 60
    assert live_prefix_caching.conversations_for(2.0, 60, 120.0) == 240
    assert live_prefix_caching.conversations_for(1.01, 60, 120.0) == 122
