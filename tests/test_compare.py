"""fastserve/compare.py (`fastserve compare`'s policies swept live) end to end (a real server.py per policy, the real
load generator over loopback) and scripts/tools/make_sim_profiles.py (the committed simulator profiles are what it
writes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fastserve import compare

REPO = Path(__file__).resolve().parents[1]

ALPACA = REPO / "tests" / "data" / "alpaca_lengths_head20.csv"  # the first 20 rows of ../shared's


def test_two_policies_swept_live_give_a_summary_per_policy_and_a_plot(tiny_model_dir, tmp_path, capsys):
    out, plot = tmp_path / "results", tmp_path / "fig11.png"
    rc = compare.main(["--policies", "fcfs,skip-join-mlfq", "--dataset-path", str(ALPACA), "--num-prompts", "5",
                       "--sweep", "4,8", "--slo-per-token", "10", "--result-dir", str(out), "--plot", str(plot),
                       "--max-concurrency", "3",  # not compare's: passed on to loadgen.py
                       "--", "--model", str(tiny_model_dir), "--profile", "analytic",
                       "--num-gpu-blocks-override", "256", "--num-host-blocks-override", "256"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["server_args"][:2] == ["--model", str(tiny_model_dir)]
    assert set(summary["policies"]) == {"fcfs", "skip-join-mlfq"}
    for policy, s in summary["policies"].items():
        assert s["rates"] == [4.0, 8.0]
        assert s["failed"] == [0, 0]
        assert all(0 < p95 and 0 < mean <= 10 for mean, p95 in zip(s["mean_per_token_s"], s["p95_per_token_s"]))
        assert s["throughput_at_slo_mean"] == 8.0  # a 10 s/token SLO: every rate meets it
        result = json.loads((out / f"{policy}.json").read_text())
        assert result["label"] == policy and all(run["completed"] == 5 for run in result["runs"])
        assert result["max_concurrency"] == 3
        # The server really ran that policy: its log says so.
        assert f"(scheduling {policy}, kv proactive)" in (out / f"server-{policy}.log").read_text()
    assert plot.stat().st_size > 0
    table = capsys.readouterr().out.split("per-token latency, mean / P95 (ms)\n")[1].splitlines()
    assert table[0].split() == ["rate", "fcfs", "ms", "skip-join-mlfq", "ms", "fcfs", "/", "skip-join-mlfq"]
    assert [row.split()[0] for row in table[1:3]] == ["4", "8"]


def test_side_by_side_table_by_hand():
    summary = {p: {"rates": [1.0, 2.0], "mean_per_token_s": means, "p95_per_token_s": p95s, "failed": failed}
               for p, means, p95s, failed in (("fcfs", [0.03, 0.09], [0.05, 0.2], [0, 2]),
                                              ("skip-join-mlfq", [0.02, 0.03], [0.04, 0.05], [0, 0]))}
    lines = compare.format_side_by_side(summary).splitlines()
    assert lines[2].split() == ["1", "30.0", "/", "50.0", "20.0", "/", "40.0", "1.50x"]
    assert lines[3].split() == ["2", "90.0", "/", "200.0", "(2", "failed)", "30.0", "/", "50.0", "3.00x"]


def test_bad_policy_and_unreachable_model_are_one_line_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fastserve.compare", "--policies", "lifo",
                           "--sweep", "1", "--result-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: unknown policies ['lifo']")
    proc = subprocess.run([sys.executable, "-m", "fastserve.compare", "--policies", "fcfs",
                           "--sweep", "1", "--result-dir", str(tmp_path), "--", "--model", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1 and "server exited" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_committed_simulator_profiles_are_what_the_script_writes(tmp_path):
    subprocess.run([sys.executable, "-m", "scripts.tools.make_sim_profiles", "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=REPO)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in (REPO / "profiles" / "sim").glob("*.json"))
    for name in written:
        assert (tmp_path / name).read_text() == (REPO / "profiles" / "sim" / name).read_text(), name
    # OPT-13B on one A100 40GB: the vLLM paper's Table 1 gives 12 GB of KV cache for this setup.
    kv = json.loads((tmp_path / "opt-13b-a100-40gb-x1.json").read_text())["capacity"]["device_kv_bytes"]
    assert 11e9 < kv < 14e9
