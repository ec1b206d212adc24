"""Worker processes killed with real signals. A worker that dies (SIGKILL while the server streams, SIGTERM
while it is idle): every request in flight ends with the error naming it, the server stops and reaps every
worker and exits with status 1 within 5 s (so that a supervisor restarts it, as vLLM does), logging no
traceback. Signals to the server (and Ctrl-C, which reaches its whole process group) stop it and its workers
cleanly, with status 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.server_fixtures import QUICK_ARGS, REPO, ServerProcess, post_json, start_server
from tests.test_parallel import wait_gone

EXIT_WITHIN_S = 5.0


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def exists(pid: int) -> bool:
    """Whether the process is there at all, a zombie included (a zombie is a child nobody reaped)."""
    return Path(f"/proc/{pid}").exists()


def wait_exit(proc: subprocess.Popen, since: float, timeout: float = 30.0) -> float:
    """Seconds from `since` (monotonic) until the process exited."""
    proc.wait(timeout)
    return time.monotonic() - since


def assert_reaped_and_quiet(log: str, workers: list[int]) -> None:
    assert "Traceback" not in log and "Event loop is closed" not in log, log[-4000:]
    stopped = re.search(r"workers stopped: (.*)", log)
    assert stopped, log[-3000:]  # the server waited for each worker: it knows their exit codes
    for pid in workers:
        assert f"(pid {pid}) exit code" in stopped.group(1), stopped.group(0)
    assert not any(exists(p) for p in workers), "a worker outlived the server (or is a zombie nobody reaped)"


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, (*QUICK_ARGS, "--num-gpu-blocks-override", "512",
                                        "--tensor-parallel-size", "2"), tmp_path)
    yield srv
    srv.stop()


def test_a_killed_worker_fails_every_request_then_the_server_exits_1(server):
    workers = children(server.proc.pid)
    assert len(workers) == 2, f"expected two worker processes under the server, found {workers}"

    async def scenario():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "A long story", "max_tokens": 1500, "ignore_eos": True}
            streaming = await s.post(server.url + "/v1/completions", json=dict(body, stream=True))
            assert streaming.status == 200
            await streaming.content.readuntil(b"\n\n")  # tokens are flowing
            plain = asyncio.create_task(s.post(server.url + "/v1/completions", json=body))
            await asyncio.sleep(0.3)
            killed_at = time.monotonic()
            os.kill(workers[1], signal.SIGKILL)
            rest = await asyncio.wait_for(streaming.content.read(), 10)
            stream_ended = time.monotonic() - killed_at
            plain_resp = await asyncio.wait_for(plain, 10)
            return killed_at, rest, stream_ended, plain_resp.status, await plain_resp.json()

    killed_at, rest, stream_ended, plain_status, plain_body = asyncio.run(scenario())
    assert stream_ended < EXIT_WITHIN_S, f"the stream took {stream_ended:.1f} s to end after the kill"
    events = rest.decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    assert "rank 1" in events[-2] and "engine_dead" in events[-2]
    assert plain_status == 500 and "rank 1" in plain_body["error"]["message"]
    exited = wait_exit(server.proc, killed_at)
    assert server.proc.returncode == 1 and exited < EXIT_WITHIN_S, (server.proc.returncode, exited)
    log = server.log()
    assert "exiting with status 1: the engine is dead (ExecutorDeadError: worker rank 1 died" in log
    assert_reaped_and_quiet(log, workers)


def test_a_worker_terminated_while_idle_makes_the_server_exit_1(server):
    workers = children(server.proc.pid)
    assert len(workers) == 2
    killed_at = time.monotonic()
    os.kill(workers[0], signal.SIGTERM)
    exited = wait_exit(server.proc, killed_at)
    assert server.proc.returncode == 1 and exited < EXIT_WITHIN_S, (server.proc.returncode, exited)
    log = server.log()
    assert "worker rank 0" in log and "exit code -15" in log
    assert_reaped_and_quiet(log, workers)


def test_a_signal_right_after_a_worker_death_still_stops_quietly(server):
    """A supervisor's SIGTERM racing the server's own exit after a worker died: no traceback either way."""
    workers = children(server.proc.pid)
    os.kill(workers[1], signal.SIGKILL)
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    assert server.proc.returncode in (0, 1)
    assert_reaped_and_quiet(server.log(), workers)


def test_ctrl_c_to_the_whole_process_group_stops_the_server_and_its_workers_cleanly(tiny_model_dir, tmp_path):
    """In a terminal, Ctrl-C sends SIGINT to every process of the foreground group, workers included: they leave
    stopping to the server, which drains and exits 0 (before: each worker died of KeyboardInterrupt with a
    traceback, and a failure listener raised 'Event loop is closed')."""
    srv = ServerProcess(["--model", str(tiny_model_dir), *QUICK_ARGS, "--num-gpu-blocks-override", "128",
                         "--tensor-parallel-size", "2"], tmp_path, session=True)
    try:
        srv.wait_ready()
        workers = children(srv.proc.pid)
        assert len(workers) == 2
        os.killpg(srv.proc.pid, signal.SIGINT)
        assert srv.proc.wait(30) == 0
        log = srv.log()
        assert "exit code 0" in log and "failing every request" not in log, log[-3000:]
        assert_reaped_and_quiet(log, workers)
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_and_its_workers(tiny_model_dir, tmp_path, sig):
    srv = start_server(tiny_model_dir, (*QUICK_ARGS, "--num-gpu-blocks-override", "128",
                                        "--tensor-parallel-size", "2"), tmp_path)
    try:
        workers = children(srv.proc.pid)
        assert len(workers) == 2
        status, _, body = post_json(srv.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        srv.proc.send_signal(sig)
        assert srv.proc.wait(30) == 0
        assert wait_gone(workers) == []
    finally:
        srv.stop()


def test_a_layout_that_cannot_work_is_one_line_on_the_command_line(tiny_model_dir):
    proc = subprocess.run([sys.executable, "server.py", "--model", str(tiny_model_dir), "--tensor-parallel-size", "3",
                           "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("server.py: error: the model's num_attention_heads") and "tensor_parallel_size 3" in \
        lines[-1], proc.stderr[-2000:]
