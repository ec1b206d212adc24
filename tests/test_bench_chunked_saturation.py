"""scripts/bench_chunked_saturation.py (docs/benchmarks.md, "Chunked prefill, session 14"): each chunked run is
paired with the unchunked run of the same trace, and the ratio it prints is that pair's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_chunked_saturation  # noqa: E402


@pytest.mark.datasets  # (its trace is drawn from ../shared/datasets/sharegpt_lengths.csv)
def test_prints_each_budgets_ratio_to_unchunked_on_the_same_trace(tmp_path, capsys):
    argv = ["--num-prompts", "120", "--seeds", "0", "--budgets", "256", "--policies", "skip-join-mlfq",
            "--jobs", "1", "--cache", str(tmp_path)]
    assert bench_chunked_saturation.main(argv) == 0
    out = capsys.readouterr().out
    line = r"\| skip-join-mlfq \| (\w+) \| 0 \| ([\d.]+)( \([\d.]+\))? \| ([\d.]+)( \([\d.]+\))? \|"
    rows = {m[0]: (float(m[1]), m[2], float(m[3]), m[4]) for m in re.findall(line, out)}
    assert set(rows) == {"unchunked", "256"}
    ratio = rows["256"][0] / rows["unchunked"][0]  # every token made in the window: the goal's measure
    finished = rows["256"][2] / rows["unchunked"][2]  # the tokens of the requests that finished in it
    assert rows["256"][1] == f" ({ratio:.3f})" and rows["unchunked"][1] == ""
    assert rows["256"][3] == f" ({finished:.3f})" and rows["unchunked"][3] == ""
    assert f"mean {ratio:.3f}, min {ratio:.3f} over 1 seeds" in out
    assert len(list(tmp_path.glob("*.json"))) == 2  # the two runs, cached
