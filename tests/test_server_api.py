"""The OpenAI-compatible API over real HTTP: the official client, SSE framing, choices, logprobs,
extras (metrics, X-Request-Id), a responsive loop during a long prefill, and 64 concurrent streams."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import ValidationError
from engine.tokenizer import Tokenizer
from serving.chat_template import ChatTemplate
from tests.server_fixtures import (
    DEFAULT_ARGS,
    PARALLEL_ARGS,
    get_json,
    post_json,
    shared_server,
    sse_chunks,
    streamed_text,
    wait_idle,
)

METRIC_KEYS = {"arrival_time", "first_scheduled_time", "first_token_time", "finished_time", "queued_s",
               "executing_s", "swap_wait_s", "preemptions", "ttft_s", "e2e_s"}


@pytest.fixture(scope="module", params=[DEFAULT_ARGS, PARALLEL_ARGS], ids=["tp1", "tp2xpp2"])
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, request.param)
    yield srv
    wait_idle(srv.url)


def test_completion_streamed_equals_non_streamed(client, model):
    kw = dict(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens == 12 and chunks[-1].usage.completion_tokens == 12
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"


def test_chat_streamed_equals_non_streamed_with_a_seed(client, model):
    kw = dict(model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
              max_tokens=10, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens == 10
    assert full.object == "chat.completion" and chunks[1].object == "chat.completion.chunk"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])


def test_sse_framing_byte_for_byte(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "sse-1"}) as r:
                return r.status, r.headers, await r.read()

    status, headers, raw = asyncio.run(run())
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    assert headers["X-Request-Id"] == "sse-1"
    chunks = sse_chunks(raw)
    # Every event is exactly `data: <compact JSON>\n\n`, and the stream ends with `data: [DONE]\n\n`.
    assert raw == b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    finals = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(finals) == 1 and set(finals[0]["metrics"]) == METRIC_KEYS


def test_n_and_several_prompts_map_to_choices(server):
    url = server.url + "/v1/completions"
    single = {p: post_json(url, {"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True})[2]
              for p in ("Apples", "Bananas are")}
    status, _, body = post_json(url, {"prompt": ["Apples", "Bananas are"], "n": 2, "max_tokens": 4,
                                      "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts == [single["Apples"]["choices"][0]["text"]] * 2 + [single["Bananas are"]["choices"][0]["text"]] * 2
    prompt_tokens = sum(s["usage"]["prompt_tokens"] for s in single.values())
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16,  # (prompts shorter than a block: nothing cached)
                             "prompt_tokens_details": {"cached_tokens": 0}}

    async def stream():  # the same, streamed: every choice index gets its own text and one finish
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"prompt": ["Apples", "Bananas are"], "n": 2, "max_tokens": 4,
                                         "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                return sse_chunks(await r.read())

    chunks = asyncio.run(stream())
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [streamed_text(chunks, i) for i in range(4)] == texts
    finishes = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"] == "length")
    assert finishes == [0, 1, 2, 3]


def test_token_id_prompts_logprobs_and_echo(server):
    url = server.url + "/v1/completions"
    status, _, body = post_json(url, {"prompt": [[2, 100, 200], [2, 300]], "max_tokens": 3, "temperature": 0,
                                      "ignore_eos": True, "logprobs": 2, "echo": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == 5
    for choice, prompt_len in zip(body["choices"], (3, 2)):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == prompt_len + 3
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])
        # echo: the text is the prompt's text, then the output's.
        assert choice["text"].endswith("".join(lp["tokens"][prompt_len:]))


def test_stop_string_cuts_the_text_streamed_or_not(server):
    url = server.url + "/v1/completions"
    base = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post_json(url, base)[2]["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.index(stop)]
    status, _, body = post_json(url, dict(base, stop=[stop]))
    assert status == 200 and body["choices"][0]["text"] == cut
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == stop

    async def stream():
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=dict(base, stop=[stop], stream=True)) as r:
                return await r.read()

    assert streamed_text(sse_chunks(asyncio.run(stream()))) == cut


def test_models_version_and_request_ids(server, model):
    status, models = get_json(server.url + "/v1/models")
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"] == model
    assert models["data"][0]["max_model_len"] == 2048 and models["data"][0]["vocab_size"] == 4096
    status, version = get_json(server.url + "/version")
    assert status == 200 and isinstance(version["version"], str)
    status, headers, _ = post_json(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                                   headers={"X-Request-Id": "my-id-42"})
    assert status == 200 and headers["X-Request-Id"] == "my-id-42"
    status, headers, _ = post_json(server.url + "/v1/completions", {"prompt": ""}, headers={"X-Request-Id": "bad-1"})
    assert status == 400 and headers["X-Request-Id"] == "bad-1"
    status, headers, _ = post_json(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert len(headers["X-Request-Id"]) >= 16


def test_every_choice_carries_request_metrics(server):
    status, _, body = post_json(server.url + "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "n": 2})
    assert status == 200
    for choice in body["choices"]:
        m = choice["metrics"]
        assert set(m) == METRIC_KEYS
        assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["finished_time"]
        assert 0 < m["ttft_s"] <= m["e2e_s"] and m["preemptions"] == 0


def test_chat_template_default_and_from_a_file(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate().render(messages) == "System: Be brief.\nUser: Hi\nAssistant:"
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                    "messages') }}{% endif %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}")
    template = ChatTemplate.from_file(path, eos_token="</s>")
    assert template.render(messages[1:]) == "[Hi]</s>"
    with pytest.raises(ValidationError, match="no system messages"):
        template.render(messages)


@settings(max_examples=200, deadline=None)
@given(answer=st.text(max_size=20), user=st.text(min_size=1, max_size=20))
def test_chat_template_generation_prompt_is_a_prefix_of_the_next_turn(answer, user):
    """The next turn renders the model's answer right after the generation prompt (one space only when the
    answer has no leading white space), so the previous turn's prompt and answer are a prefix of the next one."""
    template = ChatTemplate()
    history = [{"role": "user", "content": user}]
    prompt = template.render(history)
    after = template.render([*history, {"role": "assistant", "content": answer},
                             {"role": "user", "content": user}])
    joiner = "" if answer[:1].isspace() else " "
    assert after.startswith(prompt + joiner + answer + "\n")


def test_chat_template_keeps_a_byte_level_bpe_answer_s_tokens(tiny_model_dir):
    """With the tiny model's byte-level BPE, prompt tokens + the answer's tokens (" Hello there", as the model
    writes a word after "Assistant:") are a token prefix of the next turn: a prefix cache hits the whole turn."""
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate()
    history = [{"role": "user", "content": "Tell me a story."}]
    answer = " Once upon a time there was a cat."
    first = tokenizer.encode(template.render(history)) + tokenizer.encode(answer, add_special_tokens=False)
    second = tokenizer.encode(template.render([*history, {"role": "assistant", "content": answer},
                                               {"role": "user", "content": "More."}]))
    assert second[:len(first)] == first


def test_health_answers_during_a_long_prefill(server):
    """/health keeps answering while a ~2000-token prefill runs, each time in a small fraction of it."""
    prompt = [2] + list(range(10, 2009))  # 2000 tokens: one long first iteration on the tiny model

    async def run():
        async with aiohttp.ClientSession() as s:
            async def long_request():
                async with s.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
                    return r.status, await r.json()

            task = asyncio.create_task(long_request())
            latencies = []
            while not task.done():
                t0 = time.perf_counter()
                async with s.get(server.url + "/health") as r:
                    assert r.status == 200
                    await r.read()
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.005)
            return await task, latencies

    (status, body), latencies = asyncio.run(run())
    assert status == 200 and body["usage"]["prompt_tokens"] == 2000
    prefill = body["choices"][0]["metrics"]["executing_s"]  # the engine's own time for that one step
    assert len(latencies) >= 5, "the health checks did not get through while the prefill ran"
    # All but the slowest answer in a small fraction of the prefill. One outlier is allowed: in one full-suite run
    # of many (2026-12-02) the first check took 0.42 s against a 0.18 s prefill, the others 1-3 ms; never alone
    # (10 runs), cause not found. A loop blocked by the prefill would answer once after it instead of 5+ times.
    slowest_but_one = sorted(latencies)[-2]
    assert slowest_but_one < prefill / 5, (sorted(latencies)[-3:], prefill)


def test_64_concurrent_streams_get_their_token_counts(server):
    async def one(s, i):
        n_tokens = 3 + i % 6
        body = {"prompt": f"Request number {i}", "max_tokens": n_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "seed": i}
        async with s.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            chunks = sse_chunks(await r.read())
        finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        return n_tokens, chunks[-1]["usage"]["completion_tokens"], finals

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*(one(s, i) for i in range(64)))

    for want, got, finals in asyncio.run(run()):
        assert got == want and finals == ["length"]
    wait_idle(server.url)
