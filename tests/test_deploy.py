"""deploy/: the Dockerfile, parsed by BuildKit's own parser (the `dockerfile` package wraps it; there is no Docker
engine here to build it), checked against the repository (what it copies exists and is the whole package, the
torch pin is requirements.txt's, the health check asks /health, the entry point is a valid `fastserve serve`);
and the systemd unit, checked by `systemd-analyze verify` and run: its ExecStart serves, and its ExecStartPost
says ready once /health answers."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest

import server
from tests.server_fixtures import REPO
from tests.test_packaging import our_top_level_names

DEPLOY = REPO / "deploy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


@pytest.fixture(scope="module")
def commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DEPLOY / "Dockerfile")))


def by_name(commands, name: str) -> list[dockerfile.Command]:
    return [c for c in commands if c.cmd == name]


def test_the_dockerfile_parses_and_uses_only_real_instructions(commands):
    assert commands[0].cmd == "FROM" or (commands[0].cmd == "ARG" and by_name(commands, "FROM"))
    unknown = [(c.start_line, c.cmd) for c in commands if c.cmd not in INSTRUCTIONS]
    assert not unknown, f"not Dockerfile instructions: {unknown}"
    for c in by_name(commands, "ENTRYPOINT") + by_name(commands, "CMD"):  # exec form: signals reach the process
        assert c.json, f"line {c.start_line}: {c.cmd} should be a JSON array"
    assert len(by_name(commands, "ENTRYPOINT")) == 1 and len(by_name(commands, "HEALTHCHECK")) == 1
    assert (DEPLOY / "Dockerfile").read_text().startswith("# syntax=docker/dockerfile:1")
    declared = {c.value[0].split("=")[0] for c in by_name(commands, "ARG")}
    declared |= {name for c in by_name(commands, "ENV") for name in c.value[::2]}
    used = {v for c in commands for part in c.value for v in re.findall(r"\$\{(\w+)\}", part)}
    assert used and used <= declared, f"used but never declared (ARG or ENV): {sorted(used - declared)}"


def test_the_dockerfile_copies_the_whole_package_and_pins_the_cpu_torch(commands):
    copied = []
    for c in by_name(commands, "COPY"):
        *sources, _dest = c.value
        for src in sources:
            assert (REPO / src).exists(), f"line {c.start_line}: COPY {src}: no such path in the repository"
            copied.append(src.rstrip("/"))
    top_level = our_top_level_names()
    assert top_level <= {Path(c).stem if c.endswith(".py") else c for c in copied}, \
        f"pyproject lists {sorted(top_level)}, the Dockerfile copies {sorted(copied)}"
    args = dict(c.value[0].split("=", 1) for c in by_name(commands, "ARG") if "=" in c.value[0])
    pinned = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert args["TORCH_VERSION"] == pinned and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    # the build context: everything left out ("**"), then what is copied let back in
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    let_in = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    assert "**" in ignore and set(copied) <= let_in, sorted(set(copied) - let_in)


def test_the_health_check_asks_health_and_the_entry_point_is_a_valid_serve(commands):
    (check,) = by_name(commands, "HEALTHCHECK")
    assert check.json and check.value[0] == "CMD" and "/health" in " ".join(check.value)
    flags = dict(f.lstrip("-").split("=", 1) for f in check.flags)
    assert set(flags) <= {"interval", "timeout", "start-period", "start-interval", "retries"}
    # the check's own command, against a server that is not there: it fails (exit status non-zero), quietly
    port = free_port()
    code = check.value[-1].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    r = subprocess.run([sys.executable, *check.value[2:-1], code], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    (entry,) = by_name(commands, "ENTRYPOINT")
    argv = list(entry.value)
    assert argv[:4] == ["tini", "--", "fastserve", "serve"]
    args = server.build_parser().parse_args(argv[4:])  # what `fastserve serve` will be given
    assert args.host == "0.0.0.0" and args.port == int(by_name(commands, "EXPOSE")[0].value[0])
    assert f"127.0.0.1:{args.port}/health" in check.value[-1]
    # `docker run IMAGE MODEL FLAGS` appends them to the entry point (deploy/README.md's example)
    args = server.build_parser().parse_args([*argv[4:], "/models/opt-1.3b", "--max-model-len", "2048"])
    assert args.model_tag == "/models/opt-1.3b" and args.max_model_len == 2048


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "fastserve.service")
    return parser


def local_unit(tmp_path: Path, port: int, model: Path) -> tuple[Path, list[str], list[str]]:
    """The example unit with this machine's paths: the clone's virtualenv, its folder, a free port, a model here."""
    text = (DEPLOY / "fastserve.service").read_text()
    text = text.replace("/opt/fastserve/.venv/bin/", str(Path(sys.executable).parent) + "/")
    text = text.replace("WorkingDirectory=/opt/fastserve", f"WorkingDirectory={REPO}")
    text = text.replace("/models/opt-1.3b", str(model)).replace("8000", str(port))
    path = tmp_path / "fastserve.service"
    path.write_text(text)
    section = configparser.ConfigParser(strict=False, interpolation=None)
    section.optionxform = str
    section.read_string(text)
    service = section["Service"]
    return path, shlex.split(service["ExecStart"]), shlex.split(service["ExecStartPost"])


def test_the_unit_restarts_on_failure_and_stops_the_server_alone():
    service = unit()["Service"]
    assert service["Restart"] == "on-failure"  # the server exits 1 when its engine dies
    assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 30  # past the server's default --shutdown-timeout
    assert "/health" in service["ExecStartPost"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path, tiny_model_dir):
    path, _, _ = local_unit(tmp_path, 8000, tiny_model_dir)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr


def test_the_units_commands_serve_and_say_ready(tmp_path, tiny_model_dir):
    port = free_port()
    _, start, ready = local_unit(tmp_path, port, tiny_model_dir)
    assert Path(start[0]).is_file() and start[1] == "serve"
    assert shutil.which(ready[0]), f"{ready[0]} is missing"
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([*start, "--profile", "analytic", "--num-gpu-blocks-override", "64",
                             "--num-host-blocks-override", "64"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        r = subprocess.run(ready, capture_output=True, text=True, timeout=300)  # systemd's ExecStartPost
        assert r.returncode == 0, r.stderr + (tmp_path / "server.log").read_text()[-3000:]
        models = json.loads(subprocess.run([ready[0], "-s", f"http://127.0.0.1:{port}/v1/models"],
                                           capture_output=True, text=True, timeout=30).stdout)
        assert models["data"][0]["id"] == str(tiny_model_dir)
        proc.send_signal(signal.SIGTERM)  # systemctl stop (KillMode=mixed: the server alone)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
