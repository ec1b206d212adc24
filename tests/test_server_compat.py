"""What real clients send, over real HTTP to server.py: vLLM benchmark_serving's payloads (the old
completions backend, the new one, the chat backend), guidellm's (continuous_usage_stats),
lm-evaluation-harness's local-completions payloads (loglikelihood also as max_tokens 0), and
the official `openai` client with content parts, the `developer` role, max_completion_tokens, penalties,
logit_bias, min_p and priority. Every one is served; the penalties and logit_bias change the output the way
they should. Priority reaching the scheduler's jobs is checked in process (aiohttp's test server)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server import ServerConfig, create_app
from tests.server_fixtures import DEFAULT_ARGS, post_json, shared_server, sse_chunks, streamed_text, wait_idle

PROMPT = "Scheduling at token granularity"


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, DEFAULT_ARGS)
    yield srv
    wait_idle(srv.url)


def stream(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    """POST a streaming body as vLLM's benchmark does (aiohttp, its headers) and return the SSE chunks."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=body, headers=headers or {}) as r:
                raw = await r.read()
                assert r.status == 200, raw[:500]
                return sse_chunks(raw)

    return asyncio.run(go())


# vLLM's benchmark_serving sends `Authorization: Bearer {OPENAI_API_KEY}`, i.e. "Bearer None" when unset.
VLLM_HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer None"}


def test_vllm_benchmark_old_completions_payload(server, model):
    body = {"model": model, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": 6,
            "logprobs": None, "stream": True, "ignore_eos": True}
    chunks = stream(server.url + "/v1/completions", body, VLLM_HEADERS)
    assert streamed_text(chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_vllm_benchmark_new_completions_payload(server, model):
    body = {"model": model, "prompt": PROMPT, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 6,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks = stream(server.url + "/v1/completions", body, VLLM_HEADERS)
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    plain = post_json(server.url + "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 6,
                                                       "ignore_eos": True})[2]
    assert streamed_text(chunks) == plain["choices"][0]["text"]  # repetition_penalty 1.0 is off


def test_vllm_benchmark_chat_payload_with_content_parts(server, model):
    body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            "temperature": 0.0, "repetition_penalty": 1.0, "max_completion_tokens": 7, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks = stream(server.url + "/v1/chat/completions", body, VLLM_HEADERS)
    assert chunks[-1]["usage"]["completion_tokens"] == 7
    as_string = dict(body, messages=[{"role": "user", "content": PROMPT}], stream=False)
    del as_string["stream_options"]
    status, _, full = post_json(server.url + "/v1/chat/completions", as_string)
    assert status == 200 and streamed_text(chunks) == full["choices"][0]["message"]["content"]


def test_guidellm_payloads_with_continuous_usage_stats(server, model):
    """guidellm's OpenAI HTTP backend: stream_options with continuous_usage_stats on every streaming request,
    stop null + ignore_eos for a fixed output length; it reads the usage of the chunks as they come."""
    body = {"model": model, "prompt": PROMPT, "stream": True, "max_tokens": 5, "stop": None, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream(server.url + "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # [1, 2, 3, 4, 5, 5] unless steps merged
    assert counts[-2:] == [5, 5] and all(b > a for a, b in zip(counts[:-1], counts[1:-1])) and counts[0] >= 1
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_completion_tokens": 5, "stop": None, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream(server.url + "/v1/chat/completions", chat)
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # [0, 1, 2, 3, 4, 5, 5] unless steps merged
    assert counts[0] == 0 and counts[-2:] == [5, 5] and all(b > a for a, b in zip(counts[:-1], counts[1:-1]))


def test_lm_eval_local_completions_payloads(server, model):
    """lm-evaluation-harness's local-completions: loglikelihood (echo + logprobs 1, max_tokens 1, a batch of
    token-id prompts) and generate_until (stop sequences, seed)."""
    url = server.url + "/v1/completions"
    status, _, body = post_json(url, {"model": model, "prompt": [[2, 50, 60, 70], [2, 80, 90]], "temperature": 0,
                                      "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200 and len(body["choices"]) == 2
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 5 and lp["token_logprobs"][0] is None
    # A scoring-only variant (max_tokens 0): the prompt's logprobs and nothing generated.
    status, _, body = post_json(url, {"model": model, "prompt": [[2, 50, 60, 70], [2, 80, 90]], "temperature": 0,
                                      "max_tokens": 0, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 0
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [4, 3]
    assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:4], abs=1e-5)
    status, _, body = post_json(url, {"model": model, "prompt": ["Question: 2+2?\nAnswer:"], "max_tokens": 8,
                                      "temperature": 0.0, "stop": ["\n\n", "</s>"], "seed": 1234})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_client_chat_parts_developer_role_and_max_completion_tokens(client, model):
    def reply(messages):
        r = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 6
        return r.choices[0].message.content

    plain = reply([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}])
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert reply(parts) == plain  # developer = system; text parts joined with "\n"
    with pytest.raises(openai.BadRequestError) as e:
        reply([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages[0].content[0].type" and "image_url" in e.value.message


def test_openai_client_penalties_logit_bias_min_p_and_priority(client, model):
    def text(**kw):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, **kw)
        return r.choices[0]

    plain = text(extra_body={"ignore_eos": True})
    penalized = text(presence_penalty=1.5, frequency_penalty=1.5, extra_body={"ignore_eos": True})
    assert penalized.text != plain.text
    repeated = text(extra_body={"ignore_eos": True, "repetition_penalty": 3.0})
    assert repeated.text != plain.text
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                       logit_bias={"77": 100}, logprobs=0, extra_body={"ignore_eos": True})
    token_77 = client.completions.create(model=model, prompt=[77], max_tokens=1, temperature=0, echo=True,
                                         logprobs=0).choices[0].logprobs.tokens[0]
    assert forced.choices[0].logprobs.tokens == [token_77] * 5
    # min_p 1.0 keeps only the top token: sampling at temperature 1 gives the greedy text.
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5,
                                        extra_body={"ignore_eos": True, "min_p": 1.0})
    assert sampled.choices[0].text == plain.text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"priority": -5})
    assert chat.usage.completion_tokens <= 2
    assert text(extra_body={"priority": 3, "ignore_eos": True}).text == plain.text


def test_priority_reaches_every_job_of_the_request(tiny_model_dir):
    """In process, so the scheduler's jobs can be read: each job of each prompt carries the request's class."""
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=128, profile="analytic"))
    seen: list[tuple[str, int]] = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda job, now: (seen.append((job.job_id, job.priority)), add(job, now))[1]

    async def main():
        app = create_app(AsyncEngine(engine), ServerConfig(served_model_names=("tiny",)))
        async with TestClient(TestServer(app)) as c:
            r = await c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "priority": 7})
            assert r.status == 200, await r.text()
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                           "max_tokens": 2, "priority": -1})
            assert r.status == 200, await r.text()
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert r.status == 200, await r.text()
            r = await c.post("/v1/completions", json={"prompt": "a", "priority": True})
            assert r.status == 400 and json.loads(await r.text())["error"]["param"] == "priority"

    asyncio.run(main())
    assert [p for _, p in seen] == [7, 7, 7, 7, -1, 0]
