"""The `fastserve` command from a wheel: built from the packages pyproject.toml lists (copied out of the checkout,
so that nothing else can leak in), installed with --no-deps into a fresh virtualenv whose dependencies come from
this one (a .pth file naming this environment's site-packages), and run from a folder outside the repository
with PYTHONPATH unset: --help of every command, then a real small run of each one (make-model, profile,
simulate, serve answering a request, bench serve against it, replay of that run, compare on one policy).
A module or data file the wheel leaves out fails here, as the first user to install it would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from fastserve.server_process import ServerProcess
from tests.server_fixtures import REPO, post_json

SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
COMMANDS = (["serve"], ["bench", "serve"], ["simulate"], ["compare"], ["replay"], ["profile"], ["make-model"])


@dataclass
class Installed:
    wheel: Path
    python: Path
    fastserve: Path
    work: Path  # the folder every command runs in, outside the repository
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.fastserve), *args], cwd=self.work, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, f"fastserve {' '.join(args)}: rc {proc.returncode}\n{proc.stdout}{proc.stderr}"
        return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", *(f"{m}.py" for m in SETUPTOOLS["py-modules"])):
        shutil.copy(REPO / name, src / name)
    for top in {p.split(".")[0] for p in SETUPTOOLS["packages"]}:
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, env=env, cwd=tmp, timeout=300)
    wheel = next((tmp / "dist").glob("fastserve-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, env=env, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "fastserve_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "work"
    work.mkdir()
    env |= {"FASTSERVE_CPU_KERNEL": "0",  # the CPU kernels' g++ build (~40 s) is not what this checks
            "FASTSERVE_DEFAULT_MODEL": str(work / "models" / "tiny-opt"),  # nothing is built into site-packages
            "FASTSERVE_PROFILE_DIR": str(work / "profiles")}
    return Installed(wheel, python, venv / "bin" / "fastserve", work, env)


@pytest.fixture(scope="module")
def tiny(installed) -> Path:
    installed.run("make-model", "--out", "tiny")
    return installed.work / "tiny"


@pytest.fixture(scope="module")
def profile(installed, tiny) -> Path:
    installed.run("profile", "--model", "tiny", "--quick", "--device", "cpu", "--quiet", "--out", "profile.json",
                  "--prompt-lens", "1,16,64", "--batch-sizes", "1,2", "--context-lens", "16,64",
                  "--forward-tokens", "1,4", "--repeats", "1", "--warmup", "0")
    return installed.work / "profile.json"


def test_the_wheel_ships_every_module_and_data_file_and_nothing_of_scripts_or_tests(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    tops = {p.split(".")[0] for p in SETUPTOOLS["packages"]}
    wanted = {p.relative_to(REPO).as_posix() for top in tops for p in (REPO / top).rglob("*.py")
              if "__pycache__" not in p.parts}
    wanted |= {"server.py", "modelmaker/tiny_corpus.txt", "serving/dashboard_assets/dashboard.js"}
    wanted |= {p.relative_to(REPO).as_posix() for p in (REPO / "fastserve_kernels" / "csrc").iterdir()
               if p.suffix in (".cpp", ".h")}
    assert not wanted - names, f"missing from the wheel: {sorted(wanted - names)}"
    assert not any(n.split("/")[0] in ("scripts", "tests") for n in names)
    where = subprocess.run([str(installed.python), "-c", "import fastserve, modelmaker, server; "
                            "print(fastserve.__file__, modelmaker.__file__, server.__file__)"],
                           cwd=installed.work, env=installed.env, capture_output=True, text=True, check=True)
    site = installed.fastserve.parents[1]  # the virtualenv
    assert all(Path(f).is_relative_to(site) for f in where.stdout.split()), where.stdout


def test_every_command_answers_help(installed):
    assert "make-model" in installed.run("--help").stdout
    for command in COMMANDS:
        assert "usage" in installed.run(*command, "--help").stdout.lower(), command


def test_make_model_profile_and_simulate(installed, tiny, profile):
    assert (tiny / "config.json").is_file() and (tiny / "tokenizer.json").is_file()
    assert json.loads(profile.read_text())["prefill"]["prompt_lens"] == [1, 16, 64]
    installed.run("simulate", "--model", "tiny", "--profile", "profile.json", "--dataset-name", "synthetic",
                  "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "5", "--request-rate",
                  "10", "--num-device-blocks", "256", "--json", "simulated.json")
    summary = json.loads((installed.work / "simulated.json").read_text())
    assert summary["requests"] == 5 and summary["mean_per_token_s"] > 0


def test_serve_answers_bench_serve_loads_it_and_replay_replays_the_run(installed, tiny, profile):
    server = ServerProcess([str(tiny), "--profile", "analytic", "--num-gpu-blocks-override", "64",
                            "--num-host-blocks-override", "64"], installed.work, name="wheel", env=installed.env,
                           command=[str(installed.fastserve), "serve"], cwd=installed.work)
    try:
        server.wait_ready(120)
        status, _, body = post_json(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        installed.run("bench", "serve", "--base-url", server.url, "--dataset-name", "random", "--random-input-len",
                      "8", "--random-output-len", "4", "--num-prompts", "5", "--request-rate", "inf",
                      "--disable-tqdm", "--save-result", "--result-dir", ".", "--result-filename", "bench.json")
    finally:
        server.stop()
    assert json.loads((installed.work / "bench.json").read_text())["completed"] == 5
    rows = installed.run("replay", "--result", "bench.json", "--profile", "profile.json", "--model", "tiny",
                         "--num-device-blocks", "64").stdout.splitlines()[2:]
    assert [row.split()[1] for row in rows] == ["fcfs", "skip-join-mlfq", "srpt"]


def test_compare_on_one_policy(installed, tiny):
    installed.run("compare", "--policies", "fcfs", "--sweep", "8", "--num-prompts", "3", "--result-dir", "compare",
                  "--", "--model", "tiny", "--profile", "analytic", timeout=300)
    summary = json.loads((installed.work / "compare" / "summary.json").read_text())
    assert list(summary["policies"]) == ["fcfs"] and summary["policies"]["fcfs"]["failed"] == [0]
