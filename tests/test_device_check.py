"""scripts/device_check.sh, the one GPU run, tested here without a GPU: its step runner
(scripts/device_check_steps.sh) on fake steps that pass, fail and hang; the whole check on this GPU-less machine
(fails at once, says why, still archives its table); the whole check with a stand-in Python that passes every
step (the steps run in order, the kernel tests first with --durations, nothing read from outside the repository);
and the parts of the benchmarks it calls that decide its verdict (bench_attention's tolerance, bench_engine's
lengths from the repository)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def run_steps(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess:
    """Bash that sources the step runner, then `body`; results in tmp_path/res, the archive tmp_path/out/a.tar.gz."""
    script = f"source {shlex.quote(str(ROOT / 'scripts/device_check_steps.sh'))}\n{body}\n"
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def archived(archive: Path) -> dict[str, str]:
    """name -> text of every file in the archive."""
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def table_rows(table: str) -> dict[str, list[str]]:
    """step -> [status, seconds, limit, compiles, exit, note...] from the printed table."""
    lines = table.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "status"])
    rows = {}
    for line in lines[start + 1:]:
        if line.split()[0] in ("PASS", "FAIL", "TIMEOUT", "SKIP") or "steps:" in line:
            break
        rows[line.split()[0]] = line.split()[1:]
    return rows


def test_steps_pass_fail_and_time_out_into_one_table_and_archive(tmp_path):
    t0 = time.monotonic()
    run = run_steps(tmp_path, """
        dc_begin res 100
        dc_step ok 10 true
        dc_step broken 10 bash -c 'echo boom; exit 3'
        dc_step hangs 1 bash -c 'sleep 60 & sleep 60'
        dc_step after 10 bash -c 'echo still run'
        dc_finish out/a.tar.gz""")
    assert run.returncode == 1, run.stdout + run.stderr
    assert time.monotonic() - t0 < 30  # the hanging step and its child were killed at 1 s
    rows = table_rows(run.stdout)
    assert [(step, r[0], r[4]) for step, r in rows.items()] == [
        ("ok", "PASS", "0"), ("broken", "FAIL", "3"), ("hangs", "TIMEOUT", "124"), ("after", "PASS", "0")]
    assert int(rows["hangs"][1]) <= 3 and rows["hangs"][2] == "1" and "killed at its 1 s limit" in " ".join(
        rows["hangs"])
    assert "4 steps: 2 passed, 1 failed, 1 timed out, 0 skipped" in run.stdout
    assert "boom" in run.stdout  # a failing step's last lines are printed
    files = archived(tmp_path / "out/a.tar.gz")
    assert set(files) == {f"res/{n}" for n in ("table.txt", "summary.json", "ok.log", "broken.log", "hangs.log",
                                               "after.log")}
    assert table_rows(files["res/table.txt"]) == rows and "boom" in files["res/broken.log"]
    summary = json.loads(files["res/summary.json"])
    assert [(s["step"], s["status"], s["exit"]) for s in summary["steps"]] == [
        ("ok", "PASS", 0), ("broken", "FAIL", 3), ("hangs", "TIMEOUT", 124), ("after", "PASS", 0)]


def test_all_passing_steps_exit_zero_and_a_spent_budget_or_a_stop_skips(tmp_path):
    run = run_steps(tmp_path, "dc_begin res 100\ndc_step a 10 true\ndc_step b 10 true\ndc_finish out/a.tar.gz")
    assert run.returncode == 0 and "every step passed" in run.stdout
    # 3 s of budget: the long step's limit is cut to what is left and it times out; the next one is not run.
    run = run_steps(tmp_path, """
        dc_begin res 3
        dc_step long 60 sleep 30
        dc_step next 60 true
        dc_finish out/b.tar.gz""", DC_RESERVE_S="0", DC_MIN_STEP_S="1")
    rows = table_rows(run.stdout)
    assert run.returncode == 1
    assert rows["long"][:5] == ["TIMEOUT", rows["long"][1], "3", "-", "124"] and "cut from 60 s" in run.stdout
    assert rows["next"][0] == "SKIP" and "budget is spent" in " ".join(rows["next"])
    run = run_steps(tmp_path, """
        dc_begin res 100
        dc_step first 10 false || dc_stop "no GPU"
        dc_step second 10 true
        dc_finish out/c.tar.gz""")
    rows = table_rows(run.stdout)
    assert run.returncode == 1 and rows["first"][0] == "FAIL"
    assert rows["second"][0] == "SKIP" and rows["second"][5:] == ["not", "run:", "no", "GPU"]


def test_the_check_fails_at_once_without_a_gpu_and_still_archives_its_table(tmp_path):
    t0 = time.monotonic()
    run = subprocess.run(["bash", str(ROOT / "scripts/device_check.sh")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
                                               CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp_path)))
    assert run.returncode != 0
    assert time.monotonic() - t0 < 60  # the time to import torch once, nothing more
    assert "no CUDA device" in run.stdout and "this check needs a GPU" in run.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device_check.tar.gz"]  # one file comes back
    files = archived(tmp_path / "out/device_check.tar.gz")
    rows = table_rows(files["device_check/table.txt"])
    assert rows.pop("env")[0] == "FAIL"
    assert list(rows) == ["kernels", "cuda_tests", "reference", "bench_attention", "bench_gpu", "bench_engine",
                          "control_plane"]
    assert {r[0] for r in rows.values()} == {"SKIP"}
    env = json.loads(files["device_check/env.json"])
    assert env["cuda_available"] is False and env["pinned_torch"] == "2.13.0" and env["torch"]
    assert "triton" in env and env["pinned_triton"]  # the machine's Triton beside the pinned one
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("fastserve-device-check")] == []  # cleaned up


def test_every_step_runs_in_order_and_reads_nothing_outside_the_repository(tmp_path):
    """A stand-in python3 that logs its arguments and succeeds: every step passes, in order, the kernel tests
    first (after the environment) with --durations, and every path a step is given is inside the repository or
    in the check's own scratch folder."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python3"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {shlex.quote(str(calls))}\n')
    fake.chmod(0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = subprocess.run(["bash", str(ROOT / "scripts/device_check.sh")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake),
                                               TMPDIR=str(scratch)))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = calls.read_text().splitlines()
    steps = [line for line in lines if line != "-c import xdist"]
    assert [line.split()[0] for line in steps] == ["scripts/device_env.py", "-m", "-m", "-m",
                                                   "scripts/bench_attention.py", "scripts/bench_gpu.py",
                                                   "scripts/bench_engine.py", "scripts/bench_control_plane.py"]
    kernels = steps[1].split()
    assert "--durations=0" in kernels and kernels[-1] == "tests/test_triton_kernels.py" and "-n" in kernels
    assert "tests/test_triton_kernels.py" not in steps[2] and "tests/test_cuda.py" in steps[2]
    assert "--lengths tests/data/sharegpt_fig15_trace.json" in steps[-2]
    assert "--device cuda" in steps[-1] and steps[-1].split("--model ")[1].split()[0] == \
        steps[-2].split("--model ")[1].split()[0]  # the model bench_engine wrote
    for line in steps:
        for arg in line.split():
            if "/" in arg:  # a path: in the repository (relative, no ..) or the check's scratch folder
                assert ".." not in arg and (not arg.startswith("/") or arg.startswith(str(scratch))), line
                if not arg.startswith("/"):
                    assert (ROOT / arg).exists(), arg
    rows = table_rows(run.stdout)
    assert len(rows) == 8 and {r[0] for r in rows.values()} == {"PASS"}
    assert "budget 480 s" in run.stdout  # 8 minutes at most, so that a second run fits in a 15-minute lease


def test_bench_attention_fails_past_its_tolerance(tmp_path):
    import bench_attention

    cases = {"decode": {"max_abs_diff": 2e-3}, "prefill": {"max_abs_diff": 3e-2},
             "chunked": {"max_abs_diff": float("nan")}}
    assert bench_attention.disagreements(cases, 1e-2) == ["prefill", "chunked"]
    out = tmp_path / "b.json"
    assert bench_attention.report(cases, "opt-13b", "float16", 1e-2, str(out)) == 1
    assert json.loads(out.read_text())["agree"] is False
    assert bench_attention.report({"decode": {"max_abs_diff": 2e-3}}, "opt-13b", "float16",
                                  bench_attention.TOLERANCE["float16"], str(out)) == 0
    assert json.loads(out.read_text())["agree"] is True


@pytest.mark.parametrize("name", ["sharegpt_fig15_trace.json", "alpaca_lengths_head20.csv"])
def test_bench_engine_reads_sharegpt_lengths_from_the_repository(name):
    import bench_engine

    ins, outs = bench_engine.sharegpt_lengths(16, 128, ROOT / "tests/data" / name)
    assert len(ins) == len(outs) == 16
    assert all(2 <= i <= 128 for i in ins) and all(1 <= o <= 128 for o in outs)
    with pytest.raises(SystemExit, match="--lengths tests/data/sharegpt_fig15_trace.json"):
        bench_engine.sharegpt_lengths(16, 128, ROOT / "tests/data/absent.csv")


def test_each_step_counts_the_triton_kernels_it_compiled(tmp_path):
    """The compiles column (what sizes the kernel steps' limits on the first GPU run): the new *.cubin files a
    step leaves in TRITON_CACHE_DIR; '-' without a cache folder."""
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    run = run_steps(tmp_path, f"""
        dc_begin res 100
        dc_step none 10 true
        dc_step two 10 bash -c 'mkdir -p {cache}/a {cache}/b && touch {cache}/a/k.cubin {cache}/b/k.cubin {cache}/a/p'
        dc_step one 10 bash -c 'mkdir -p {cache}/c && touch {cache}/c/k.cubin'
        dc_finish out/a.tar.gz""", TRITON_CACHE_DIR=str(cache))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = table_rows(run.stdout)
    assert [(step, r[3]) for step, r in rows.items()] == [("none", "0"), ("two", "2"), ("one", "1")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    run = subprocess.run(["bash", "-c", f"source {shlex.quote(str(ROOT / 'scripts/device_check_steps.sh'))}\n"
                          "dc_begin res 100\ndc_step x 10 true\ndc_finish out/b.tar.gz\n"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, env=env)
    assert table_rows(run.stdout)["x"][3] == "-"
