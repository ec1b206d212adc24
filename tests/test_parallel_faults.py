"""A worker process killed with a real SIGKILL while the server streams: every request ends with an error
within seconds, /health answers 503 naming the dead rank, new work is refused with 503, no worker process
is left behind, and the server still shuts down cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.server_fixtures import QUICK_ARGS, get_json, post_json, start_server
from tests.test_parallel import alive, wait_gone


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


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, (*QUICK_ARGS, "--num-gpu-blocks-override", "512",
                                        "--tensor-parallel-size", "2"), tmp_path)
    yield srv
    srv.stop()


def test_a_killed_worker_fails_every_request_and_leaves_no_process(server):
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
            return rest, stream_ended, plain_resp.status, await plain_resp.json()

    rest, stream_ended, plain_status, plain_body = asyncio.run(scenario())
    assert stream_ended < 5.0, f"the stream took {stream_ended:.1f} s to end after the kill"
    events = rest.decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    assert "rank 1" in events[-2]
    assert plain_status == 500 and "rank 1" in plain_body["error"]["message"]
    status, health = get_json(server.url + "/health")
    assert status == 503 and health["status"] == "engine_dead" and "rank 1" in health["error"]
    status, _, body = post_json(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert wait_gone(workers) == [], "the surviving worker should have been stopped"
    server.stop()
    assert server.proc.returncode == 0
    assert not any(alive(p) for p in workers)


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
    import subprocess
    import sys

    from tests.server_fixtures import REPO

    proc = subprocess.run([sys.executable, "server.py", "--model", str(tiny_model_dir), "--tensor-parallel-size", "3",
                           "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("server.py: error: the model's num_attention_heads") and "tensor_parallel_size 3" in \
        lines[-1], proc.stderr[-2000:]
