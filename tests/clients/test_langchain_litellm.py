"""langchain-openai's ChatOpenAI (invoke and stream, messages with a `name`) and litellm (`completion` and
`text_completion`, streaming and not, through its `openai/` and `hosted_vllm/` providers) against a live
server.py. Greedy decoding, so each client's text must equal what the server answers the same request over
plain HTTP, and a stream must put together the same text as the request without it."""

from __future__ import annotations

import pytest

from tests.clients.client_helpers import SERVED_NAME
from tests.server_fixtures import post_json

MAX_TOKENS = 8
PROMPT = "Hello, my name is"


def direct(url: str, path: str, body: dict) -> dict:
    status, _, out = post_json(url + path, {"model": SERVED_NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            **body})
    assert status == 200, out
    return out


def test_langchain_chat_openai_invoke_and_stream(idle_server, tiny_model_dir):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    from engine.tokenizer import Tokenizer
    from serving.chat_template import ChatTemplate

    llm = ChatOpenAI(model=SERVED_NAME, base_url=idle_server.url + "/v1", api_key="unused", temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0, timeout=60, stream_usage=True)
    messages = [SystemMessage("You are terse."), HumanMessage("Hi there", name="alice"),
                AIMessage("Hello", name="helper"), HumanMessage("Tell me a story", name="alice")]
    wire = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi there", "name": "alice"},
            {"role": "assistant", "content": "Hello", "name": "helper"},
            {"role": "user", "content": "Tell me a story", "name": "alice"}]
    want = direct(idle_server.url, "/v1/chat/completions", {"messages": wire})

    reply = llm.invoke(messages)
    assert reply.content == want["choices"][0]["message"]["content"] and reply.content
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["output_tokens"] == MAX_TOKENS
    # The names reached the chat template ("User (alice): Hi there"): the prompt is the template's rendering
    rendered = ChatTemplate().render(wire)
    assert "User (alice): Hi there" in rendered and "Assistant (helper): Hello" in rendered
    prompt_tokens = len(Tokenizer.from_pretrained(tiny_model_dir).encode(rendered))
    assert reply.usage_metadata["input_tokens"] == want["usage"]["prompt_tokens"] == prompt_tokens

    chunks = list(llm.stream(messages))
    assert len(chunks) > MAX_TOKENS // 2
    assert "".join(c.content for c in chunks) == reply.content
    (usage,) = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage["output_tokens"] == MAX_TOKENS and usage["input_tokens"] == prompt_tokens


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_completion(idle_server, provider):
    import litellm

    kw = dict(model=f"{provider}/{SERVED_NAME}", api_base=idle_server.url + "/v1", api_key="unused",
              max_tokens=MAX_TOKENS, temperature=0, num_retries=0, timeout=60)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
    want = direct(idle_server.url, "/v1/chat/completions", {"messages": messages})

    r = litellm.completion(messages=messages, **kw)
    assert r.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.prompt_tokens == want["usage"]["prompt_tokens"]

    chunks = list(litellm.completion(messages=messages, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_text_completion(idle_server, provider):
    import litellm

    kw = dict(model=f"{provider}/{SERVED_NAME}", api_base=idle_server.url + "/v1", api_key="unused",
              max_tokens=MAX_TOKENS, temperature=0, num_retries=0, timeout=60)
    want = direct(idle_server.url, "/v1/completions", {"prompt": PROMPT})

    r = litellm.text_completion(prompt=PROMPT, **kw)
    assert r.choices[0].text == want["choices"][0]["text"] and r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS

    chunks = list(litellm.text_completion(prompt=PROMPT, stream=True, **kw))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
