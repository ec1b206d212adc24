"""scripts/device_check.sh, the one GPU run, tested here without a GPU: its step runner
(scripts/device_check_steps.sh) on fake steps that pass, fail and hang; the whole check on this GPU-less machine
(fails at once, says why, still archives its table); a dry run of the whole check with a stand-in Python that
makes every step's command succeed (every step PASS, in order, the plan inside 8 minutes, the archive rewritten
after every step, each step's time and compile count printed, nothing read from outside the repository);
`--only`; the reference step on a machine that claims CUDA; and the parts of the benchmarks it calls that decide
its verdict (bench_attention's tolerance, bench_engine's lengths from the repository, its floor's bandwidth)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from scripts.benchmarks import engine as bench_engine

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "kernels", "bench_gpu", "bench_attention", "cuda_tests", "control_plane", "bench_engine",
         "reference"]


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
    assert list(rows) == STEPS[1:]
    assert {r[0] for r in rows.values()} == {"SKIP"}
    env = json.loads(files["device_check/env.json"])
    assert env["cuda_available"] is False and env["pinned_torch"] == "2.13.0" and env["torch"]
    assert "triton" in env and env["pinned_triton"]  # the machine's Triton beside the pinned one
    assert env["c_compiler"]  # Triton builds its launchers with it: a path, or "none found"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("fastserve-device-check")] == []  # cleaned up


def stand_in_python(tmp_path: Path) -> tuple[Path, Path]:
    """A python3 for a dry run: it logs its arguments and the archive's members at the moment it is called, leaves
    three compiled kernels in the Triton cache when it runs the kernel tests, and succeeds. Returns (it, its log)."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python3"
    fake.write_text(f"""#!/usr/bin/env bash
log={shlex.quote(str(calls))}
printf 'CALL %s\n' "$*" >> "$log"
archive="$OUT/device_check.tar.gz"
[ -f "$archive" ] && tar -tzf "$archive" | sed 's/^/ARCHIVED /' >> "$log"
case "$*" in *tests/test_triton_kernels.py*)
  mkdir -p "$TRITON_CACHE_DIR/a" && touch "$TRITON_CACHE_DIR"/a/{{1,2,3}}.cubin ;;
esac
exit 0
""")
    fake.chmod(0o755)
    return fake, calls


def dry_run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[tuple[str, list]]]:
    """The whole check with the stand-in python3; returns the run and [(arguments, archive members then)]."""
    fake, calls = stand_in_python(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    run = subprocess.run(["bash", str(ROOT / "scripts/device_check.sh"), *args], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake),
                                               TMPDIR=str(scratch), **env))
    seen: list[tuple[str, list]] = []
    for line in calls.read_text().splitlines() if calls.exists() else []:
        if line.startswith("CALL "):
            seen.append((line[5:], []))
        else:
            seen[-1][1].append(line.removeprefix("ARCHIVED "))
    return run, [(a, m) for a, m in seen if a != "-c import xdist"]


def step_args(calls: list[tuple[str, list]]) -> dict[str, str]:
    """Step name -> the arguments its python3 was called with (control_plane's model writer left out)."""
    named = {}
    for name, (arguments, _) in zip(STEPS, [c for c in calls if "--model-only" not in c[0]]):
        named[name] = arguments
    return named


def test_a_dry_run_passes_every_step_in_order_inside_the_budget_archiving_after_each(tmp_path):
    """Every step's command succeeds: every step PASS in the planned order, the limits add up to less than 8
    minutes, each step's time and Triton compiles are printed, and when a step starts the archive already holds
    the log of every step before it (it is rewritten after each, so a run cut short keeps what it did)."""
    run, calls = dry_run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = table_rows(run.stdout)
    assert list(rows) == STEPS and {r[0] for r in rows.values()} == {"PASS"}
    planned = re.search(r"limits add up to (\d+) s \+ (\d+) s for the archive, of the 480 s budget", run.stdout)
    assert planned and int(planned[1]) + int(planned[2]) <= 480
    assert sum(int(r[2]) for r in rows.values()) == int(planned[1])  # the table's limits are the plan's
    for name in STEPS:
        assert re.search(rf"\[device_check\] {name}: PASS in \d+ s \(exit 0, \d+ Triton compiles\)", run.stdout)
    assert [r[3] for r in rows.values()] == ["3" if name == "kernels" else "0" for name in STEPS]
    step_calls = [c for c in calls if "--model-only" not in c[0]]
    assert len(step_calls) == len(STEPS)
    for i, (_, members) in enumerate(step_calls):
        logs = sorted(m.removeprefix("device_check/") for m in members if m.endswith(".log"))
        assert logs == sorted(f"{name}.log" for name in STEPS[:i]), (STEPS[i], members)
    files = archived(tmp_path / "out/device_check.tar.gz")
    assert table_rows(files["device_check/table.txt"]) == rows
    assert [s["status"] for s in json.loads(files["device_check/summary.json"])["steps"]] == ["PASS"] * len(STEPS)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device_check.tar.gz"]


def test_every_step_reads_nothing_outside_the_repository(tmp_path):
    """Each step's command: the kernel tests with --durations, the other cuda tests without them, the benchmarks
    run as modules, control_plane on the model it writes first and bench_engine reuses; every path a step is
    given is inside the repository or in the check's own scratch folder."""
    run, calls = dry_run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    args = step_args(calls)
    assert args["env"].split()[:2] == ["-m", "scripts.device_env"]
    kernels = args["kernels"].split()
    assert "--durations=0" in kernels and kernels[-1] == "tests/test_triton_kernels.py"
    assert "tests/test_triton_kernels.py" not in args["cuda_tests"] and "tests/test_cuda.py" in args["cuda_tests"]
    assert args["bench_gpu"].split()[:2] == ["-m", "scripts.benchmarks.gpu"] and "--device cuda" in args["bench_gpu"]
    assert args["bench_engine"].split()[:2] == ["-m", "scripts.benchmarks.engine"]
    assert "--lengths tests/data/sharegpt_fig15_trace.json" in args["bench_engine"]
    writer = next(a for a, _ in calls if "--model-only" in a)
    model = writer.split("--model ")[1].split()[0]
    assert args["control_plane"].split("--model ")[1].split()[0] == model and "--device cuda" in args["control_plane"]
    assert args["bench_engine"].split("--model ")[1].split()[0] == model
    assert "-k not compiled" in args["reference"] and "tests/test_model_reference.py" in args["reference"]
    scratch = str(tmp_path / "scratch")
    for line in [a for a, _ in calls]:
        for arg in line.split():
            if "/" in arg:  # a path: in the repository (relative, no ..) or the check's scratch folder
                assert ".." not in arg and (not arg.startswith("/") or arg.startswith(scratch)), line
                if not arg.startswith("/"):
                    assert (ROOT / arg).exists(), arg


def test_only_runs_env_and_the_named_steps(tmp_path):
    """--only reruns what failed: env (the GPU's check) and the named steps, in the check's order; the exit is
    theirs. An unknown name stops the check before it starts."""
    run, calls = dry_run(tmp_path, "--only", "reference,cuda_tests")
    assert run.returncode == 0, run.stdout + run.stderr
    assert list(table_rows(run.stdout)) == ["env", "cuda_tests", "reference"] and len(calls) == 3
    (tmp_path / "unknown").mkdir()
    run, calls = dry_run(tmp_path / "unknown", "--only", "kernel")
    assert run.returncode == 2 and "unknown step 'kernel'" in run.stderr and calls == []


def test_a_plan_past_the_budget_is_refused_before_anything_runs(tmp_path):
    run, calls = dry_run(tmp_path, DEVICE_CHECK_BUDGET_S="300")
    assert run.returncode == 2 and "do not fit the 300 s budget" in run.stderr and calls == []


def test_the_kernels_steps_compile_count_is_the_one_its_tests_launch():
    """The kernels step's limit counts 32 compiles: the distinct specializations its tests launch (recorded on
    meta tensors as the host code makes them; scripts/triton_registers.py --count-kernel-tests)."""
    from scripts import triton_registers

    keys = triton_registers.specializations(triton_registers.kernel_test_launches(triton_registers.attention_module()))
    planned = re.search(r"\[kernels\]=(\d+)", (ROOT / "scripts/device_check.sh").read_text().split("COMPILES=")[1])
    assert len(keys) == int(planned[1]) == 32


CLAIMS_CUDA = """import torch
torch.cuda.is_available = lambda: True  # a GPU machine, as the engine's defaults see it
"""


def test_the_reference_step_runs_on_the_cpu_on_a_machine_with_cuda(tmp_path):
    """The reference step as the check runs it (FASTSERVE_CPU_KERNEL=0, its pytest selection), where CUDA is
    available to the engine's defaults (auto: CUDA, float16): it passes, so it ran on the CPU at 1e-4."""
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "claims_cuda.py").write_text(CLAIMS_CUDA)
    wrapper = tmp_path / "python3"
    wrapper.write_text(f"""#!/usr/bin/env bash
case "$*" in *scripts.device_env*) exit 0 ;; esac
export PYTHONPATH="$PYTHONPATH:{plugin}" PYTEST_ADDOPTS="-p claims_cuda"
exec {shlex.quote(sys.executable)} "$@"
""")
    wrapper.chmod(0o755)
    run = subprocess.run(["bash", str(ROOT / "scripts/device_check.sh"), "--only", "reference"], capture_output=True,
                         text=True, timeout=280, env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(wrapper),
                                                          TMPDIR=str(tmp_path)))
    log = archived(tmp_path / "out/device_check.tar.gz")["device_check/reference.log"]
    assert run.returncode == 0, run.stdout + log
    assert " passed" in log and "failed" not in log and " deselected" in log


def test_bench_attention_fails_past_its_tolerance(tmp_path):
    from scripts.benchmarks import attention as bench_attention

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
    ins, outs = bench_engine.sharegpt_lengths(16, 128, ROOT / "tests/data" / name)
    assert len(ins) == len(outs) == 16
    assert all(2 <= i <= 128 for i in ins) and all(1 <= o <= 128 for o in outs)
    with pytest.raises(SystemExit, match="--lengths tests/data/sharegpt_fig15_trace.json"):
        bench_engine.sharegpt_lengths(16, 128, ROOT / "tests/data/absent.csv")


def test_bench_engines_floor_reads_the_kv_at_the_bandwidth_of_the_engines_device(tiny_model_dir, monkeypatch):
    """The floor's KV read is timed on the memory the KV cache is in: the executor's device (the GPU's memory on
    CUDA), not host DRAM whatever the device."""
    import torch

    from engine import LLM

    assert bench_engine.memory_read_gbps(torch.device("cpu"), gib=1 / 64, repeats=1) > 0
    asked = []
    monkeypatch.setattr(bench_engine, "memory_read_gbps", lambda device: asked.append(device) or 100.0)
    with LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=64, profile="analytic") as llm:
        r = bench_engine.decode_step_vs_matmul(llm, batch=2, context=8, steps=1, repeats=1)
        assert asked == [llm.engine.executor.device] and r["memory_read_gbps"] == 100.0


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
