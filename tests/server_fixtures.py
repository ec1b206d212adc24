"""Helpers for the server tests: `server.py` as a real subprocess on loopback, and small HTTP/SSE utilities.

Servers are expensive (~3 s to start), so `shared_server` starts one per distinct argument list and
reuses it across test modules for the rest of the session (stopped at the session's end). Tests
that share a server leave it idle; `wait_idle` checks that, through /health's KV block counts.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fastserve.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]

# Fast start-up: small KV tiers (16k device tokens is plenty here) and the analytic job profile (no
# start-up measurement).
QUICK_ARGS = ("--profile", "analytic", "--num-host-blocks-override", "256")
# A short stream write timeout (slow-reader test) and a small body limit (413 test).
DEFAULT_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "1024", "--stream-write-timeout", "2",
                "--max-request-bytes", "65536")
# The same server as four worker processes: tensor parallel 2 x pipeline parallel 2 (gloo on CPU). Four
# processes share this machine's cores, so a step takes longer: the slow-reader timeout is longer too.
PARALLEL_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "1024", "--stream-write-timeout", "8",
                 "--max-request-bytes", "65536", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# max-num-seqs 1 + max-queued-requests 1: one request runs, one waits, the rest get 503.
RESTRICTED_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "256", "--max-num-seqs", "1",
                   "--max-queued-requests", "1", "--api-key", API_KEY, "--allowed-origins", "http://allowed.example")


def start_server(model_dir: Path, args: tuple[str, ...], log_dir: Path) -> ServerProcess:
    """A ready `server.py --model DIR ARGS`; if it does not come up, the error carries its log."""
    srv = ServerProcess(["--model", str(model_dir), *args], log_dir)
    try:
        return srv.wait_ready()
    except RuntimeError as e:
        raise RuntimeError(f"{e}:\n{srv.log()}") from None


@contextlib.contextmanager
def served_client(model_dir: Path, args: tuple[str, ...], log_dir: Path, timeout: float = 60.0):
    """The official openai client against a server of `model_dir` started for the block and stopped after it."""
    import openai

    srv = start_server(model_dir, args, log_dir)
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    finally:
        srv.stop()


_SHARED: dict[tuple, ServerProcess] = {}


def shared_server(request: pytest.FixtureRequest, model_dir: Path, args: tuple[str, ...]) -> ServerProcess:
    """A running server with these arguments, started once per session and shared."""
    key = (str(model_dir), args)
    srv = _SHARED.get(key)
    if srv is None or srv.proc.poll() is not None:
        log_dir = request.getfixturevalue("tmp_path_factory").mktemp("server-logs")
        srv = _SHARED[key] = start_server(model_dir, args, log_dir)
        request.config.add_cleanup(srv.stop)
    return srv


def get_json(url: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_json(url: str, body: object, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a POST; `body` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def wait_idle(url: str, timeout: float = 15.0) -> dict:
    """/health once nothing runs or waits and every KV block (both tiers) is free; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        status, h = get_json(url + "/health")
        if (status == 200 and h["running"] == h["waiting"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"]
                and h["kv_host_free_blocks"] == h["kv_host_total_blocks"]):
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {status} {h}")
        time.sleep(0.05)


def sse_events(raw: bytes) -> list[bytes]:
    """The payloads of `data: ...\\n\\n` events, checking that nothing else is on the wire."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), raw[:500]
    return [e[len(b"data: "):] for e in events]


def sse_chunks(raw: bytes) -> list[dict]:
    """The JSON chunks of a stream that ends with `data: [DONE]`."""
    events = sse_events(raw)
    assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def streamed_text(chunks: list[dict], index: int = 0) -> str:
    """The text of choice `index` put together from completion or chat chunks."""
    parts = []
    for c in chunks:
        for ch in c.get("choices", []):
            if ch["index"] == index:
                parts.append(ch["text"] if "text" in ch else ch["delta"].get("content") or "")
    return "".join(parts)


def metric_samples(url: str, headers: dict | None = None) -> dict[tuple, float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def finished_count(url: str, reason: str, headers: dict | None = None) -> float:
    """vllm:request_success_total for one finish reason (0 before the first such request)."""
    return sum(v for (name, labels), v in metric_samples(url, headers).items()
               if name == "vllm:request_success_total" and ("finished_reason", reason) in labels)


async def open_raw(port: int, path: str, body: dict, rcvbuf: int | None = None):
    """A raw HTTP/1.1 POST on its own connection: (reader, writer), the response unread."""
    import asyncio

    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the TCP window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


CLOSERS = {"[": "]", '{"k": ': "}"}  # how an array or an object opens, and how it closes


def nested_json(depth: int, opener: str = "[") -> str:
    """`depth` arrays (or objects) one inside the other, around a 0: '[[[0]]]', '{"k": {"k": 0}}'."""
    return opener * depth + "0" + CLOSERS[opener] * depth


def chat_nesting(depth: int, opener: str = "[") -> str:
    """A valid chat request (2 tokens) whose JSON nests `depth` >= 2 levels, most of them in chat_template_kwargs,
    which the template ignores."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "chat_template_kwargs": {"x": "@"}}
    return json.dumps(body).replace('"@"', nested_json(depth - 2, opener))


def post_paced(port: int, path: str, body: bytes, pieces: int, gap: float,
               timeout: float = 30.0) -> tuple[int, http.client.HTTPResponse, bytes, float, bool]:
    """POST `body` on a new connection, its Content-Length declared, in `pieces` equal parts with `gap` s
    between two (sending for `timeout` s at most), reading the answer as soon as there is one (what is left of
    the body is then not sent).
    (status, response, response body, seconds from the end of the headers to the answer read, whether the
    server then closed the connection: looked for only when the answer says "Connection: close")."""
    size = max(1, -(-len(body) // max(pieces, 1)))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        start = time.monotonic()
        for i in range(0, len(body), size):
            if i and select.select([sock], [], [], gap)[0] or time.monotonic() - start > timeout:
                break  # answered before the whole body was sent; or never: then reading the answer times out
            try:
                sock.sendall(body[i:i + size])
            except (BrokenPipeError, ConnectionResetError):  # closed on us: its answer is waiting
                break
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        data = resp.read()
        elapsed = time.monotonic() - start
        closed = False
        if resp.will_close:
            sock.settimeout(2.0)
            try:
                closed = sock.recv(1) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                pass
        return resp.status, resp, data, elapsed, closed


def open_sockets(pid: int) -> int:
    """How many sockets process `pid` holds open (Linux /proc): its listener, its connections, its own pipes."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed meanwhile
            pass
    return n
