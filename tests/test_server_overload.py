"""Overload and shutdown over real HTTP: a bounded waiting queue answers 503 + Retry-After beyond its
limit without touching accepted work; SIGTERM/SIGINT drain in-flight work, abort what is left, exit 0."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.server_fixtures import (
    AUTH,
    QUICK_ARGS,
    RESTRICTED_ARGS,
    ServerProcess,
    get_json,
    shared_server,
    sse_chunks,
    start_server,
    wait_idle,
)

# FCFS: under skip-join a short request that waited preempts the long first one, runs its 8 tokens and leaves,
# and a request arriving after that finds the waiting queue empty again, so how many fit would depend on how fast
# the nine arrive. FCFS never preempts the first: the one that waits waits until it ends.
OVERLOAD_ARGS = (*RESTRICTED_ARGS, "--scheduling-policy", "fcfs")


@pytest.fixture(scope="module")
def restricted(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, OVERLOAD_ARGS)
    yield srv
    wait_idle(srv.url)


FIRST_TOKENS = 1500  # the tiny model's context is 2,048


def test_full_queue_is_503_with_retry_after_and_accepted_work_completes(restricted):
    """--max-num-seqs 1 --max-queued-requests 1 (FCFS), 10 requests: the first runs (the one batch slot),
    then 9 arrive at once: exactly one fits the waiting queue (1), so 10 - 1 running - 1 waiting = 8 get
    503. (The first is sent alone and is streaming before the others arrive: were all ten sent at the
    same instant, whether it had been scheduled yet would decide whether 1 or 2 fit. It is long enough,
    FIRST_TOKENS, to still be running when the last of the 9 arrives: with 200 tokens the faster decode
    path finished it first once, and the waiting one took its slot, so 2 fit.)"""
    url = restricted.url + "/v1/completions"

    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            first = await s.post(url, json={"prompt": "First", "max_tokens": FIRST_TOKENS, "ignore_eos": True,
                                            "stream": True, "stream_options": {"include_usage": True}})
            assert first.status == 200
            await first.content.readuntil(b"\n\n")  # it is running

            async def other(i: int):
                body = {"prompt": f"Other {i}", "max_tokens": 8, "ignore_eos": True}
                async with s.post(url, json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            others = await asyncio.gather(*(other(i) for i in range(9)))
            first_chunks = sse_chunks(b"data: {}\n\n" + await first.read())[1:]
            return first_chunks, others

    first_chunks, others = asyncio.run(run())
    assert first_chunks[-1]["usage"]["completion_tokens"] == FIRST_TOKENS
    accepted = [body for status, _, body in others if status == 200]
    refused = [(retry, body) for status, retry, body in others if status == 503]
    assert len(accepted) == 1 and len(refused) == 8
    assert accepted[0]["usage"]["completion_tokens"] == 8
    for retry_after, body in refused:
        assert retry_after is not None and int(retry_after) >= 1
        assert body["error"]["type"] == "service_unavailable_error" and body["error"]["code"] == "queue_full"
        assert "queue is full" in body["error"]["message"]


def start_drainable(model_dir, tmp_path) -> ServerProcess:
    args = (*QUICK_ARGS, "--num-gpu-blocks-override", "256", "--shutdown-timeout", "1.5")
    return start_server(model_dir, args, tmp_path)


def test_sigterm_finishes_in_flight_work_aborts_the_rest_and_exits_0(tiny_model_dir, tmp_path):
    srv = start_drainable(tiny_model_dir, tmp_path)
    url = srv.url + "/v1/completions"

    async def stream(s: aiohttp.ClientSession, max_tokens: int) -> list[dict]:
        body = {"prompt": f"Stream of {max_tokens}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with s.post(url, json=body) as r:
            assert r.status == 200
            return sse_chunks(await r.read())

    async def run():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(stream(s, n)) for n in (10, 1500, 1500)]
            deadline = time.monotonic() + 10
            while get_json(srv.url + "/health")[1]["running"] < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)  # within the 1.5 s grace period: no new work, /health says so
            async with s.post(url, json={"prompt": "Too late", "max_tokens": 2}) as r:
                late = r.status, await r.json()
            async with s.get(srv.url + "/health") as r:
                health = r.status
            return late, health, await asyncio.gather(*tasks)

    try:
        late, health, streams = asyncio.run(run())
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
    assert late[0] == 503 and late[1]["error"]["code"] == "shutting_down"
    assert health == 503
    finishes = [[ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
                for chunks in streams]
    assert finishes == [["length"], ["abort"], ["abort"]]  # every stream ended with [DONE] (sse_chunks)
    assert "reason=abort" in srv.log() and "stopped" in srv.log()


def test_sigint_on_an_idle_server_exits_0(tiny_model_dir, tmp_path):
    srv = start_drainable(tiny_model_dir, tmp_path)
    srv.proc.send_signal(signal.SIGINT)
    try:
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()
