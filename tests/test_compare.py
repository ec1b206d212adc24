"""fastserve/compare.py (`fastserve compare`'s policies compared live) end to end (a real server.py per policy, the
real load generator over loopback), its interval, window and sweep by hand, and scripts/tools/make_sim_profiles.py
(the committed simulator profiles are what it writes)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_names import TINY_OPT
from fastserve import compare
from fastserve.bench import intervals

REPO = Path(__file__).resolve().parents[1]

ALPACA = REPO / "tests" / "data" / "alpaca_lengths_head20.csv"  # the first 20 rows of ../shared's


def test_two_policies_over_two_seeds_print_the_ratio_its_interval_and_the_setting(tiny_model_dir, tmp_path, capsys):
    out, plot = tmp_path / "results", tmp_path / "fig11.png"
    rc = compare.main(["--policies", "fcfs,skip-join-mlfq", "--dataset-path", str(ALPACA), "--num-prompts", "5",
                       "--sweep", "0.5C,1C", "--capacity", "8", "--seeds", "2", "--slo-per-token", "10",
                       "--result-dir", str(out), "--plot", str(plot),
                       "--max-concurrency", "3",  # not compare's: passed on to loadgen.py
                       "--", "--model", str(tiny_model_dir), "--profile", "analytic",
                       "--num-host-blocks-override", "256"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    # the order-matters setting first, then the flags after `--`
    assert summary["server_args"] == ["--max-num-seqs", "16", "--num-gpu-blocks-override", "1024",
                                      "--num-host-blocks-override", "8192", "--model", str(tiny_model_dir),
                                      "--profile", "analytic", "--num-host-blocks-override", "256"]
    assert summary["capacity"] == {"C": 8.0, "offered": None} and summary["seeds"] == [0, 1]
    assert set(summary["policies"]) == {"fcfs", "skip-join-mlfq"}
    seed_means = {}
    for policy, s in summary["policies"].items():
        assert s["rates"] == [4.0, 8.0]  # 0.5C and 1C of the given C
        assert s["failed"] == [0, 0]
        assert all(0 < p95 and 0 < mean <= 10 for mean, p95 in zip(s["mean_per_token_s"], s["p95_per_token_s"]))
        assert s["throughput_at_slo_mean"] == 8.0  # a 10 s/token SLO: every rate meets it
        for seed in (0, 1):
            result = json.loads((out / f"{policy}-seed{seed}.json").read_text())
            assert result["label"] == policy and result["seed"] == seed
            assert all(run["completed"] == 5 for run in result["runs"]) and result["max_concurrency"] == 3
        # each seed's mean is over the requests arriving in the middle 80% of the run (4 of 5 here at most)
        seed_means[policy] = s["seed_mean_per_token_s"]
        # The server really ran that policy, in the setting: its log says so.
        log = (out / f"server-{policy}.log").read_text()
        assert f"(scheduling {policy}, kv proactive)" in log
    ratio = summary["ratios"]["skip-join-mlfq"][1]  # at 1C, paired per seed
    assert ratio["values"] == pytest.approx([f / s for f, s in zip(seed_means["fcfs"][1],
                                                                     seed_means["skip-join-mlfq"][1])])
    assert ratio["low"] < ratio["mean"] < ratio["high"]
    assert plot.stat().st_size > 0
    printed = capsys.readouterr().out
    table = printed.split("per-token latency, mean / P95 (ms)\n")[1].splitlines()
    assert table[0].split() == ["rate", "fcfs", "ms", "skip-join-mlfq", "ms", "fcfs", "/", "skip-join-mlfq"]
    assert [row.split()[0] for row in table[1:3]] == ["4", "8"]
    assert (f"fcfs / skip-join-mlfq mean per-token latency at 1C = 8.000 req/s: {ratio['mean']:.2f}x (95% interval "
            f"[{ratio['low']:.2f}, {ratio['high']:.2f}] over 2 seeds; per seed "
            + ", ".join(f"{v:.2f}" for v in ratio["values"]) + ")") in printed.splitlines()
    assert printed.splitlines()[-2] == "setting (every server): " + " ".join(summary["server_args"])


def test_capacity_each_seed_measures_c_again_before_each_seeds_pair(tiny_model_dir, tmp_path, capsys):
    """One request at a time (--max-concurrency 1, the load generator's): FCFS serves far less than the 50 req/s
    offered, so seed 0's search stops at its first step; seed 1's starts at 1.5x the C before it."""
    out = tmp_path / "results"
    rc = compare.main(["--policies", "fcfs,skip-join-mlfq", "--dataset-path", str(ALPACA), "--num-prompts", "12",
                       "--sweep", "1C", "--capacity-each-seed", "--capacity-start", "50", "--seeds", "2",
                       "--result-dir", str(out), "--max-concurrency", "1",
                       "--", "--model", str(tiny_model_dir), "--profile", "analytic"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    c0, c1 = summary["capacity"]["per_seed"]
    assert 0 < c0 < 50 / 1.3 and c1 > 0
    assert summary["capacity"]["C"] == pytest.approx((c0 + c1) / 2)
    for seed, start, c in ((0, 50.0, c0), (1, 1.5 * c0, c1)):
        steps = sorted((json.loads(f.read_text()) for f in out.glob(f"capacity-*-seed{seed}.json")),
                       key=lambda r: r["rates"][0])  # the offers of that seed's search, from `start` up
        assert all(r["label"] == "fcfs" for r in steps) and steps[0]["rates"] == [pytest.approx(start, rel=1e-5)]
        assert compare.window_metrics(steps[-1]["runs"][0])["served_rate"] == c
        for policy in ("fcfs", "skip-join-mlfq"):  # the pair ran at that seed's C
            assert json.loads((out / f"{policy}-seed{seed}.json").read_text())["rates"] == [pytest.approx(c, rel=1e-5)]
    assert summary["policies"]["fcfs"]["rates"] == [pytest.approx((c0 + c1) / 2, rel=1e-5)]
    printed = capsys.readouterr().out.splitlines()
    assert f"seed 1: capacity C = {c1:.3f} req/s" in printed
    assert f"C measured before each seed (req/s): {c0:.3f}, {c1:.3f}; rates above: their mean" in printed


def test_interval_is_the_student_t_95_percent_interval():
    r = intervals.interval([1.0, 2.0, 3.0])  # sd 1, 2 degrees of freedom: t = 4.303
    assert r["mean"] == 2.0 and r["half"] == pytest.approx(4.303 / math.sqrt(3))
    assert (r["low"], r["high"]) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    five = intervals.interval([1.8, 2.2, 1.5, 2.5, 2.0])  # 4 degrees of freedom: t = 2.776
    assert five["half"] == pytest.approx(2.776 * statistics.stdev([1.8, 2.2, 1.5, 2.5, 2.0]) / math.sqrt(5))
    assert math.isnan(intervals.interval([1.5])["half"])  # one seed: no interval
    assert intervals.t_975(22) == 2.086 and intervals.t_975(40) == 1.96  # past the table's rows: the row below; 1.96
    paired = intervals.paired_ratios([0.3, 0.2, 0.1], [0.1, 0.1, 0.0])  # a zero denominator is left out
    assert paired["values"] == pytest.approx([3.0, 2.0]) and paired["mean"] == pytest.approx(2.5)
    assert paired["half"] == pytest.approx(12.706 * statistics.stdev([3.0, 2.0]) / math.sqrt(2))


def test_window_metrics_count_the_middle_80_percent_of_arrivals():
    # 11 requests sent at 0..10 s: the window is [1, 9] s; request 5 failed
    run = {"start_times": [float(i) for i in range(11)], "e2els": [2.0] * 11,
           "output_lens": [4] * 5 + [0] + [4] * 5, "errors": [""] * 5 + ["boom"] + [""] * 5}
    m = compare.window_metrics(run)
    assert m["counted"] == 8 and m["failed"] == 1  # arrivals 1..9 but 5
    assert m["mean_per_token_s"] == 0.5
    assert m["served_rate"] == 7 / 8  # finished at 2..9 s (not 7, the failed one's): 7 in 8 s


def test_sweep_is_rates_or_loads_in_units_of_capacity():
    assert compare.parse_sweep("1,2,4") == ([1.0, 2.0, 4.0], False)
    assert compare.parse_sweep("0.8C, 1c") == ([0.8, 1.0], True)
    for bad in ("1,1C", "x", "0C", "", "inf"):
        with pytest.raises(ValueError, match="--sweep"):
            compare.parse_sweep(bad)


def test_setting_defaults_to_a_bounded_batch_and_flags_given_win():
    args = compare.build_parser().parse_args(["--sweep", "1"])
    assert args.max_num_seqs == 16  # what --help shows, too
    assert compare.server_flags(args, ["--max-model-len", "512"]) == [
        "--model", TINY_OPT, "--max-num-seqs", "16", "--num-gpu-blocks-override", "1024",
        "--num-host-blocks-override", "8192", "--max-model-len", "512"]
    args = compare.build_parser().parse_args(["--sweep", "1", "--max-num-seqs", "256"])
    assert compare.server_flags(args, ["--max-num-seqs", "12"]) == [
        "--model", TINY_OPT, "--num-gpu-blocks-override", "1024", "--num-host-blocks-override", "8192",
        "--max-num-seqs", "12", "--max-num-seqs", "256"]  # the server keeps the last: the flag typed here
    assert "(default: 16)" in " ".join(compare.build_parser().format_help().split())


def test_bad_policy_and_unreachable_model_are_one_line_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fastserve.compare", "--policies", "lifo",
                           "--sweep", "1", "--result-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: unknown policies ['lifo']")
    proc = subprocess.run([sys.executable, "-m", "fastserve.compare", "--sweep", "1,1C", "--result-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: --sweep: rates (1,2,4) or loads in units of C "
                                                            "(0.8C,1C), not both; got '1,1C'")
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
