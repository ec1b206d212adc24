"""Failure isolation, in process: aiohttp's test server around a real AsyncEngine on the tiny model,
with failures injected by monkeypatching. A failure while handling one request fails that request
alone (a 500, or an error chunk then [DONE] once its stream started); a failed forward step fails
its batch and the engine goes on; a dead engine loop ends every waiting request with a 5xx at once
and /health says 503."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server import ServerConfig, create_app
from serving.openai_protocol import ResponseBuilder
from tests.server_fixtures import sse_events


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine.engine import Engine

    return Engine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=256, kv_policy="recompute",
                               profile="analytic"))


def serve(engine, scenario):
    """Run `scenario(client)` against a fresh app on the shared engine, which must end up clean."""
    async def main():
        app = create_app(AsyncEngine(engine), ServerConfig(served_model_names=("tiny",), shutdown_timeout=1))
        async with TestClient(TestServer(app)) as client:
            return await asyncio.wait_for(scenario(client), 60)

    result = asyncio.run(main())
    assert not engine.requests  # even a dead loop leaves nothing behind
    engine.kv.check_invariants()
    assert engine.kv.device.num_free == engine.kv.device.num_blocks
    return result


async def post(client, body: dict, path: str = "/v1/completions") -> tuple[int, dict | list]:
    r = await client.post(path, json=body)
    raw = await r.read()
    if body.get("stream") and r.status == 200:
        return r.status, [json.loads(e) if e != b"[DONE]" else "[DONE]" for e in sse_events(raw)]
    return r.status, json.loads(raw)


async def health(client) -> tuple[int, dict]:
    r = await client.get("/health")
    return r.status, await r.json()


def test_a_failure_while_handling_one_request_is_a_500_for_it_alone(engine, monkeypatch):
    original = ResponseBuilder.response

    def response(self, outputs):
        if self.req.user == "boom":
            raise RuntimeError("injected failure")
        return original(self, outputs)

    monkeypatch.setattr(ResponseBuilder, "response", response)

    async def scenario(client):
        body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
        results = await asyncio.gather(*(post(client, dict(body, user=u)) for u in ("a", "boom", "b")))
        return results, await health(client)

    (ok_a, boom, ok_b), (status, h) = serve(engine, scenario)
    assert ok_a[0] == ok_b[0] == 200 and ok_a[1]["usage"]["completion_tokens"] == 8
    assert boom[0] == 500 and boom[1]["error"]["type"] == "server_error"
    assert "RuntimeError" in boom[1]["error"]["message"] and "injected" not in boom[1]["error"]["message"]
    assert status == 200 and h["kv_free_blocks"] == h["kv_total_blocks"]


def test_a_failure_mid_stream_is_an_error_chunk_then_done(engine, monkeypatch):
    original = ResponseBuilder.chunks

    def chunks(self, prompt_index, out):
        if self.req.user == "boom" and len(out.outputs[0].token_ids) >= 3:
            raise RuntimeError("injected failure")
        return original(self, prompt_index, out)

    monkeypatch.setattr(ResponseBuilder, "chunks", chunks)

    async def scenario(client):
        body = {"prompt": "Hi", "max_tokens": 30, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        return await asyncio.gather(post(client, dict(body, user="boom")), post(client, dict(body, user="fine")))

    (status, boom), (ok_status, fine) = serve(engine, scenario)
    assert status == 200 and boom[-1] == "[DONE]"
    assert set(boom[-2]) == {"error"} and boom[-2]["error"]["code"] == "internal_error"
    assert all("choices" in c for c in boom[:-2])  # real chunks came first
    assert ok_status == 200 and fine[-1] == "[DONE]" and fine[-2]["usage"]["completion_tokens"] == 30


def test_a_failed_forward_step_fails_its_batch_and_the_engine_goes_on(engine, monkeypatch):
    original = engine.executor.submit

    def submit(batch):
        if any(s.params.seed == 666 for s in batch.seqs):
            failed = Future()
            failed.set_exception(RuntimeError("injected forward failure"))
            return failed
        return original(batch)

    monkeypatch.setattr(engine.executor, "submit", submit)

    async def scenario(client):
        doomed = await post(client, {"prompt": "Hi", "max_tokens": 4, "seed": 666})
        doomed_stream = await post(client, {"prompt": "Hi", "max_tokens": 4, "seed": 666, "stream": True})
        after = await post(client, {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        return doomed, doomed_stream, after, await health(client)

    doomed, doomed_stream, after, (status, h) = serve(engine, scenario)
    assert doomed[0] == 500 and "forward pass" in doomed[1]["error"]["message"]
    assert doomed_stream[0] == 200 and doomed_stream[1][-1] == "[DONE]"
    assert "forward pass" in doomed_stream[1][-2]["error"]["message"]
    assert after[0] == 200 and after[1]["usage"]["completion_tokens"] == 4
    assert status == 200 and h["kv_free_blocks"] == h["kv_total_blocks"]


def test_a_dead_engine_loop_ends_every_request_with_a_5xx_and_health_says_503(engine, monkeypatch):
    dead = {"now": False}
    original = engine.schedule_step

    def schedule_step():
        if dead["now"]:
            raise RuntimeError("injected loop failure")
        return original()

    monkeypatch.setattr(engine, "schedule_step", schedule_step)

    async def scenario(client):
        long = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}
        stream = await client.post("/v1/completions", json=dict(long, stream=True))
        await stream.content.readuntil(b"\n\n")  # it is running
        waiting = asyncio.create_task(post(client, long))
        await asyncio.sleep(0.05)
        dead["now"] = True
        rest = await stream.read()
        return rest, await waiting, await health(client), await post(client, {"prompt": "Hi"})

    rest, waiting, (status, h), refused = serve(engine, scenario)
    events = sse_events(b"data: {}\n\n" + rest)
    assert events[-1] == b"[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert waiting[0] == 500 and waiting[1]["error"]["code"] == "engine_dead"
    assert status == 503 and h["status"] == "engine_dead"
    assert h["kv_free_blocks"] == h["kv_total_blocks"]  # the dead loop's requests gave their blocks back
    assert refused[0] == 503 and refused[1]["error"]["code"] == "engine_unavailable"
