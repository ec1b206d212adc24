"""Hostile clients over real sockets, against a real server process.

A body of deeply nested brackets gets a 400 with OpenAI's error body (json_too_deep), never a 500. A body
that trickles in gets a 408 once --request-body-timeout has passed since its headers (a total: a byte every
quarter second, far inside the timeout as a gap between reads, does not keep it open), its connection is
closed and the server's socket released, /health answers throughout, the 408 is counted in /metrics, and the
server goes on serving with every KV block free. A large body at a normal pace is not affected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_fixtures import (
    QUICK_ARGS,
    REPO,
    chat_nesting,
    get_json,
    metric_samples,
    nested_json,
    open_sockets,
    post_json,
    post_paced,
    shared_server,
    wait_idle,
)

BODY_TIMEOUT = 1.5
ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "256", "--request-body-timeout", str(BODY_TIMEOUT))


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    return shared_server(request, tiny_model_dir, ARGS)


def assert_openai_error(body: dict, code: str) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code, body
    return body["error"]["message"]


def body_timeouts(url: str) -> float:
    return sum(v for (name, _), v in metric_samples(url).items() if name == "fastserve:request_body_timeouts_total")


@pytest.mark.parametrize("path,body", [
    ("completions", nested_json(100_000)),  # 200 KB of brackets
    ("completions", nested_json(100_000, '{"k": ')),
    ("completions", f'{{"prompt": {nested_json(5_000)}, "max_tokens": 2}}'),
    ("chat/completions", chat_nesting(65)),
], ids=["arrays", "objects", "in a prompt", "one level too deep"])
def test_a_deeply_nested_body_is_a_400_naming_the_limit(server, path, body):
    status, headers, err = post_json(f"{server.url}/v1/{path}", body.encode())
    assert status == 400 and headers["Content-Type"].startswith("application/json"), (status, err)
    message = assert_openai_error(err, "json_too_deep")
    assert "nests" in message and "64 levels" in message, message
    wait_idle(server.url)


def test_nesting_up_to_the_limit_is_served(server):
    status, _, out = post_json(f"{server.url}/v1/chat/completions", chat_nesting(64).encode())
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


@pytest.mark.parametrize("gap", [1.0, 0.25], ids=["a byte a second", "a byte every quarter second"])
def test_a_trickling_body_gets_a_408_in_time_and_its_connection_is_released(server, gap):
    wait_idle(server.url)
    counted, pid = body_timeouts(server.url), server.proc.pid
    idle_sockets = min(open_sockets(pid) for _ in range(10) if not time.sleep(0.05))  # once they all closed
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post_paced, server.port, "/v1/completions", b" " * 100_000, 100_000, gap)
        held, health_s = [], []
        while not slow.done():  # the slow client is stalled: the server answers others at once
            held.append(open_sockets(pid))
            start = time.monotonic()
            status, h = get_json(server.url + "/health")
            health_s.append(time.monotonic() - start)
            assert status == 200 and h["status"] == "ok", h
            time.sleep(0.1)
        status, resp, data, elapsed, closed = slow.result()
    assert len(health_s) >= 5 and max(health_s) < 0.5, health_s
    assert max(held) > idle_sockets, (held, idle_sockets)  # the slow client's connection, while it lasted
    assert status == 408 and resp.getheader("Connection") == "close", (status, data)
    message = assert_openai_error(json.loads(data), "request_timeout")
    assert f"{BODY_TIMEOUT:g} s" in message and "--request-body-timeout" in message, message
    assert BODY_TIMEOUT - 0.05 < elapsed < BODY_TIMEOUT + 1.0, elapsed
    assert closed  # the server closed the connection, without reading the rest of the body first
    deadline = time.monotonic() + 2.0
    while open_sockets(pid) > idle_sockets and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_sockets(pid) == idle_sockets
    assert body_timeouts(server.url) == counted + 1
    status, _, out = post_json(server.url + "/v1/completions", {"prompt": "Still fine", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    wait_idle(server.url)


@pytest.mark.parametrize("pieces", [1, 16], ids=["at once", "over half the timeout"])
def test_a_large_body_at_a_normal_pace_is_served(server, pieces):
    body = json.dumps({"prompt": "Hi", "max_tokens": 2, "user": "u" * 900_000}).encode()  # the limit is 1 MiB
    counted = body_timeouts(server.url)
    status, _, data, elapsed, _ = post_paced(server.port, "/v1/completions", body, pieces, BODY_TIMEOUT / 2 / pieces)
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2, data[:300]
    assert body_timeouts(server.url) == counted


def test_the_flag_is_in_help_with_its_default_and_says_it_is_a_total():
    out = subprocess.run([sys.executable, str(REPO / "server.py"), "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={**os.environ, "COLUMNS": "400"}).stdout
    entry = " ".join(out.split("  --request-body-timeout ", 1)[1].split("\n  -", 1)[0].split())
    assert entry.startswith("REQUEST_BODY_TIMEOUT") and entry.endswith("(default: 60.0)"), entry
    assert "in all" in entry and "not nginx's gap" in entry and "408" in entry, entry
