"""Clients that go away or stop reading: their requests are aborted, every KV block comes back, and
everyone else's streams complete unchanged."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.server_fixtures import (
    DEFAULT_ARGS,
    PARALLEL_ARGS,
    finished_count,
    get_json,
    open_raw,
    post_json,
    shared_server,
    sse_chunks,
    streamed_text,
    wait_idle,
)

LONG = 1500  # output tokens a quitter asks for: far more than the test waits for


@pytest.fixture(scope="module", params=[DEFAULT_ARGS, PARALLEL_ARGS], ids=["tp1", "tp2xpp2"])
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, request.param)
    wait_idle(srv.url)
    yield srv
    wait_idle(srv.url)


async def stream_text(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, int]:
    async with s.post(url + "/v1/completions", json=dict(body, stream=True,
                                                         stream_options={"include_usage": True})) as r:
        assert r.status == 200
        chunks = sse_chunks(await r.read())
    return streamed_text(chunks), chunks[-1]["usage"]["completion_tokens"]


def test_20_clients_disconnect_mid_stream(server):
    keepers = [{"prompt": f"Keeper {i}", "max_tokens": 24, "temperature": 0, "ignore_eos": True} for i in range(4)]
    expected = [post_json(server.url + "/v1/completions", k)[2]["choices"][0]["text"] for k in keepers]
    aborted_before = finished_count(server.url, "abort")

    async def quitter(i: int) -> None:
        body = {"prompt": f"Quitter {i}", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        reader, writer = await open_raw(server.port, "/v1/completions", body)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await reader.readuntil(b"\n\n")  # the first chunk: it is streaming
        writer.close()
        await writer.wait_closed()

    async def run():
        async with aiohttp.ClientSession() as s:
            keep = [asyncio.create_task(stream_text(s, server.url, k)) for k in keepers]
            await asyncio.gather(*(quitter(i) for i in range(20)))
            return await asyncio.gather(*keep)

    results = asyncio.run(run())
    assert [text for text, _ in results] == expected  # the others are unaffected, token for token
    assert [n for _, n in results] == [24] * 4
    wait_idle(server.url)  # every block back long before 1500 tokens could have been generated
    assert finished_count(server.url, "abort") == aborted_before + 20


def test_non_streaming_client_that_disconnects_is_aborted(server):
    aborted_before = finished_count(server.url, "abort")

    async def run():
        reader, writer = await open_raw(server.port, "/v1/completions",
                                        {"prompt": "Wait for me", "max_tokens": LONG, "ignore_eos": True})
        deadline = time.monotonic() + 10
        while get_json(server.url + "/health")[1]["running"] == 0:  # it is generating
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        writer.close()
        await writer.wait_closed()

    asyncio.run(run())
    wait_idle(server.url)
    assert finished_count(server.url, "abort") == aborted_before + 1


def test_client_that_stops_reading_is_aborted_without_stalling_others(server):
    """A stream whose client never reads fills the socket buffers; the engine keeps going (the stream
    keeps only the newest snapshot), others finish, and after --stream-write-timeout (2 s) the stalled
    request is aborted and its connection dropped."""
    aborted_before = finished_count(server.url, "abort")
    # echo + logprobs of a 1000-token prompt make each choice's first chunk ~0.65 MB; six choices fill the
    # kernel's socket buffers (up to 4 MB on Linux) at once.
    stalled = {"prompt": [2] + list(range(10, 1009)), "n": 6, "max_tokens": 1000, "ignore_eos": True,
               "stream": True, "echo": True, "logprobs": 20}
    other = {"prompt": "I keep reading", "max_tokens": 20, "ignore_eos": True}

    async def run():
        reader, writer = await open_raw(server.port, "/v1/completions", stalled, rcvbuf=4096)
        head = await reader.readuntil(b"\r\n\r\n")  # the headers go out once the request is admitted
        assert head.startswith(b"HTTP/1.1 200"), head
        async with aiohttp.ClientSession() as s:
            text, n = await stream_text(s, server.url, other)
        running_after_other = get_json(server.url + "/health")[1]["running"]
        deadline = time.monotonic() + 30  # far sooner than 6 x 1000 tokens take
        while finished_count(server.url, "abort") == aborted_before:
            assert time.monotonic() < deadline, "the stalled stream was not aborted"
            await asyncio.sleep(0.1)
        # What the server managed to send ends without [DONE]: the connection was dropped.
        received = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(1 << 16), 10):
                received += chunk
        except ConnectionResetError:
            pass
        writer.close()
        return n, running_after_other, received

    n, running_after_other, received = asyncio.run(run())
    assert n == 20  # the reading client finished while the stalled one was still being generated
    assert running_after_other == 1
    assert b"data: {" in received[:100] and b"data: [DONE]" not in received  # (chunked encoding)
    wait_idle(server.url)
    assert finished_count(server.url, "abort") == aborted_before + 1
    assert "is gone (TimeoutError)" in server.log()


def test_streams_after_the_disconnects_still_work(server):
    status, _, body = post_json(server.url + "/v1/completions", {"prompt": "After", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert json.loads(json.dumps(body))["choices"][0]["finish_reason"] in ("length", "stop")
