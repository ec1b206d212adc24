"""Property-based fuzzing of every route (hypothesis): arbitrary JSON (or raw bytes) bodies, arbitrary
headers, any method, on a real server process. The server never answers 5xx, never hangs (each request has
a deadline), and is healthy and idle afterwards, with every KV block free. Two servers: an open one, and one
with --api-key and CORS (the auth and CORS middlewares on the path). A short --max-model-len keeps any body
that happens to be valid quick to serve. Then nesting depth and the rate a body arrives at, drawn together:
each body gets exactly the answer its depth, size and pace call for (200, a 400 past 64 levels, 413, or a 408
once --request-body-timeout has passed)."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server_fixtures import (
    API_KEY,
    CLOSERS,
    QUICK_ARGS,
    chat_nesting,
    get_json,
    nested_json,
    post_paced,
    shared_server,
    wait_idle,
)

MAX_BYTES, BODY_TIMEOUT_S = 16384, 1.0
FUZZ_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "64", "--max-model-len", "64", "--max-request-bytes",
             str(MAX_BYTES), "--request-body-timeout", str(BODY_TIMEOUT_S))
LOCKED_ARGS = (*FUZZ_ARGS, "--api-key", API_KEY, "--allowed-origins", "http://allowed.example")
DEADLINE_S = 30.0  # no single request may take longer (any valid one here needs well under a second)

ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/version"),
          ("GET", "/health"), ("GET", "/metrics"), ("GET", "/dashboard"), ("GET", "/dashboard/data"),
          ("GET", "/dashboard/dashboard.js"), ("GET", "/dashboard/dashboard.css")]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
# http.client frames the request itself: a forged length or framing header would only make the client wait.
FRAMING = {"content-length", "transfer-encoding", "host", "connection"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
# Bodies near the real ones: known field names with arbitrary values, so validation is exercised deeply.
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k", "stop", "seed",
          "stream", "stream_options", "logprobs", "top_logprobs", "echo", "ignore_eos", "min_tokens",
          "stop_token_ids", "user", "best_of", "logit_bias", "max_completion_tokens", "suffix", "tools",
          "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
          "truncate_prompt_tokens", "add_special_tokens", "prompt_logprobs", "return_tokens_as_token_ids",
          "add_generation_prompt", "continue_final_message", "documents", "chat_template_kwargs", "guided_json"]
near_valid = st.fixed_dictionaries(
    {}, optional={name: json_values for name in FIELDS} | {
        "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 70000), max_size=8),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                    "content": st.text(max_size=20) | json_values}), max_size=3),
        "max_tokens": st.integers(-2, 100), "n": st.integers(-1, 40), "stream": st.booleans()})
depths = st.integers(0, 80) | st.integers(0, 3000)  # around the limit of 64 levels, and past the parser's own
nestings = st.builds(nested_json, depths, st.sampled_from(list(CLOSERS)))
bodies = (json_values.map(lambda v: json.dumps(v).encode()) | near_valid.map(lambda v: json.dumps(v).encode())
          | nestings.map(str.encode) | st.binary(max_size=200) | st.just(b""))

header_names = st.from_regex(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,24}", fullmatch=True).filter(
    lambda h: h.lower() not in FRAMING)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.characters(
    min_codepoint=0xA0, max_codepoint=0xFF), max_size=60).map(str.strip)
interesting = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from(["application/json", "application/json; charset=utf-16", "text/plain",
                                     "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", ""])
    | header_values,
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "compress"]) | header_values,
    "Authorization": st.sampled_from([f"Bearer {API_KEY}", "Bearer wrong", "Basic abc", ""]) | header_values,
    "X-Request-Id": header_values, "Accept": header_values, "Accept-Encoding": header_values,
    "Origin": st.sampled_from(["http://allowed.example", "http://evil.example", "null"]) | header_values,
    "Access-Control-Request-Method": st.sampled_from(["POST", "GET", "DELETE"]),
    "Expect": st.sampled_from(["100-continue", "200-ok"]) | header_values,
    "Range": header_values, "If-None-Match": header_values, "Cookie": header_values,
})
headers = st.tuples(interesting, st.dictionaries(header_names, header_values, max_size=4)).map(
    lambda t: {**t[1], **t[0]})
query = st.sampled_from(["", "?since=0", "?since=-1", "?since=abc", "?stream=true", "?x=%00%ff", "?since=" + "9" * 40])
targets = st.one_of(st.sampled_from(ROUTES).flatmap(lambda r: query.map(lambda q: (r[0], r[1] + q))),
                    st.tuples(st.sampled_from(METHODS), st.sampled_from([p for _, p in ROUTES] + ["/", "/v1",
                                                                                                   "/nope", "/v1/x"])))


def send(port: int, method: str, path: str, body: bytes, hdrs: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    try:
        conn.request(method, path, body=body if method not in ("GET", "HEAD") or body else None, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def fuzz(port: int, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(target=targets, body=bodies, hdrs=headers)
    @example(target=("POST", "/v1/completions"), body=b"", hdrs={"Expect": "\xa1"})  # was a 500 (aiohttp's 417)
    def one(target, body, hdrs):
        method, path = target
        status, data = send(port, method, path, body, hdrs)  # a hang raises TimeoutError
        assert status < 500, (status, data[:300])

    one()


@pytest.mark.parametrize("args", [FUZZ_ARGS, LOCKED_ARGS], ids=["open", "api-key+cors"])
def test_no_input_gets_a_5xx_or_hangs(request, tiny_model_dir, args):
    srv = shared_server(request, tiny_model_dir, args)
    fuzz(srv.port, examples=100)
    h = wait_idle(srv.url, timeout=30)  # healthy, nothing left running, every KV block free
    assert h["status"] == "ok"
    status, models = get_json(srv.url + "/v1/models", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and models["data"]


@pytest.mark.parametrize("path", ["/v1/completions", "/health", "/dashboard", "/no/such/route"])
def test_expect_header_gets_417_json_or_continues(request, tiny_model_dir, path):
    srv = shared_server(request, tiny_model_dir, FUZZ_ARGS)
    for value in ("\xa1", "200-ok"):
        status, data = send(srv.port, "POST", path, b"{}", {"Expect": value, "Content-Type": "application/json"})
        assert status == 417 and json.loads(data)["error"]["param"] == "Expect", (value, data)
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    status, data = send(srv.port, "POST", path, body, {"Expect": "100-continue", "Content-Type": "application/json"})
    assert status == {"/v1/completions": 200, "/no/such/route": 404}.get(path, 405), data


def test_nesting_depth_and_byte_rate(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, FUZZ_ARGS)

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(depth=depths.map(lambda d: d + 2), opener=st.sampled_from(list(CLOSERS)), pieces=st.integers(1, 8),
           gap=st.floats(0, 0.5))
    def one(depth, opener, pieces, gap):
        body = chat_nesting(depth, opener).encode()
        sending = (pieces - 1) * gap  # seconds the whole body takes to send
        status, _, data, elapsed, closed = post_paced(srv.port, "/v1/chat/completions", body, pieces, gap,
                                                      timeout=DEADLINE_S)
        served = 413 if len(body) > MAX_BYTES else 400 if depth > 64 else 200  # the answer to the whole body
        if served == 413 or sending < BODY_TIMEOUT_S - 0.5:
            assert status == served, (status, data[:300])
        elif sending > BODY_TIMEOUT_S + 0.5:
            assert status == 408 and closed and elapsed < BODY_TIMEOUT_S + 1, (status, elapsed, data[:300])
        else:  # too near the timeout to say which comes first
            assert status in (served, 408), (status, data[:300])
        if status == 400:
            assert json.loads(data)["error"]["code"] == "json_too_deep", data

    one()
    wait_idle(srv.url, timeout=30)
