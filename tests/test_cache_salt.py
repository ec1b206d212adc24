"""The cache_salt request field (vLLM's; docs/kv-cache.md, "Prefix caching"): requests with different salts never share
cached KV blocks, requests with the same salt (or none) do. In the engine, and over real HTTP on both endpoints, with
its validation (a non-empty string, else a 400 naming the field)."""

from __future__ import annotations

import uuid

import pytest

from engine.errors import ValidationError
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_PRE_LN
from tests.test_prefix_caching import BS, engine_of, tokens

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def run_one(engine, rid, prompt, salt=None):
    engine.add_request(rid, prompt, PARAMS, cache_salt=salt)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out = o
        engine.kv.check_invariants()
    return out


def test_salts_separate_cached_prefixes_in_the_engine(small_checkpoint):
    engine = engine_of(small_checkpoint(SMALL_PRE_LN), enable_prefix_caching=True)
    prompt = tokens(6 * BS + 1, 11)
    full = 6 * BS  # every whole block of the prompt (never its last token)
    assert run_one(engine, "a1", prompt, "tenant-a").num_cached_tokens == 0
    assert run_one(engine, "a2", prompt, "tenant-a").num_cached_tokens == full  # same salt: shared
    assert run_one(engine, "b1", prompt, "tenant-b").num_cached_tokens == 0  # another salt: nothing shared
    assert run_one(engine, "n1", prompt).num_cached_tokens == 0  # no salt is a chain of its own
    assert run_one(engine, "n2", prompt).num_cached_tokens == full  # ... shared by every unsalted request
    assert run_one(engine, "b2", prompt, "tenant-b").num_cached_tokens == full
    dev = engine.kv.device
    assert dev.num_refs == 0 and dev.num_free == dev.num_blocks


@pytest.mark.parametrize("salt", ["", 7, ["a"], {"a": 1}, True])
def test_a_bad_salt_is_refused_and_changes_nothing(small_checkpoint, salt):
    engine = engine_of(small_checkpoint(SMALL_PRE_LN), enable_prefix_caching=True)
    with pytest.raises(ValidationError) as e:
        engine.add_request("r", tokens(9, 1), PARAMS, cache_salt=salt)
    assert e.value.param == "cache_salt" and "non-empty string" in e.value.message
    assert not engine.has_unfinished() and not engine.requests


# -- over real HTTP --------------------------------------------------------------------------------------------

@pytest.fixture
def caching_server(request, tiny_model_dir):
    from tests.server_fixtures import DEFAULT_ARGS, shared_server, wait_idle

    srv = shared_server(request, tiny_model_dir, (*DEFAULT_ARGS, "--enable-prefix-caching"))
    wait_idle(srv.url)
    return srv


def answer(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_http_same_salt_hits_and_another_salt_misses(caching_server, endpoint):
    from tests.server_fixtures import post_json

    url = caching_server.url + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions")
    text = f"A long shared preamble {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 8

    def send(salt=None):
        body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        if endpoint == "completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        if salt is not None:
            body["cache_salt"] = salt
        status, _, out = post_json(url, body)
        assert status == 200, out
        return out

    a = uuid.uuid4().hex
    first = send(a)
    assert cached_tokens(first) == 0
    again = send(a)
    assert cached_tokens(again) > first["usage"]["prompt_tokens"] - 2 * 16  # its whole blocks but the last token's
    assert answer(again) == answer(first)  # the same greedy answer from the cached blocks
    assert cached_tokens(send(uuid.uuid4().hex)) == 0  # salt B: nothing of A's
    assert cached_tokens(send()) == 0  # unsalted: nothing of A's either
    assert cached_tokens(send()) > 0  # ... but unsalted requests share with each other


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 7, ["a"], False])
def test_http_bad_salt_is_a_400(caching_server, endpoint, salt):
    from tests.server_fixtures import post_json

    body = {"max_tokens": 2, "cache_salt": salt}
    body |= {"prompt": "hello"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, _, out = post_json(caching_server.url + endpoint, body)
    assert status == 400, out
    assert out["error"]["param"] == "cache_salt" and "non-empty string" in out["error"]["message"]
    assert out["error"]["type"] == "invalid_request_error"


def test_http_null_salt_is_no_salt(caching_server):
    from tests.server_fixtures import post_json

    status, _, out = post_json(caching_server.url + "/v1/completions",
                               {"prompt": "hello", "max_tokens": 2, "cache_salt": None})
    assert status == 200, out
