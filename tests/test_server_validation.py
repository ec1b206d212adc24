"""Bad input over real HTTP: each case gets the right status and an OpenAI error body that names the
field and says what is allowed; afterwards the server is healthy and every KV block is free.
Bad command-line flags: one line on stderr, exit code 2."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.server_fixtures import DEFAULT_ARGS, REPO, get_json, post_json, shared_server, wait_idle

CHAT_MSG = [{"role": "user", "content": "Hi"}]
CONTEXT = 2048  # the tiny model's context
VOCAB = 4096  # the tiny model's vocabulary

# (name, path, body, status, param, words the message must contain)
CASES = [
    ("not json", "completions", b'{"prompt": "Hi",', 400, None, ["not valid JSON"]),
    ("not an object", "completions", [1, 2], 400, None, ["JSON object"]),
    ("missing prompt", "completions", {"max_tokens": 2}, 400, "prompt", ["required"]),
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt", ["empty"]),
    ("empty prompt list", "completions", {"prompt": []}, 400, "prompt", ["empty"]),
    ("empty prompt in a list", "completions", {"prompt": ["a", ""]}, 400, "prompt", ["empty"]),
    ("prompt of a wrong type", "completions", {"prompt": 5}, 400, "prompt", ["string", "token ids"]),
    ("mixed prompt list", "completions", {"prompt": [1, "a"]}, 400, "prompt", ["list of strings"]),
    ("max_tokens a string", "completions", {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens", ["integer"]),
    ("temperature a string", "completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature",
     ["number"]),
    ("stream not a bool", "completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream", ["true or false"]),
    ("echo not a bool", "completions", {"prompt": "Hi", "echo": 1}, 400, "echo", ["true or false"]),
    ("stop a number", "completions", {"prompt": "Hi", "stop": 5}, 400, "stop", ["string"]),
    ("n a float", "completions", {"prompt": "Hi", "n": 1.5}, 400, "n", ["integer"]),
    ("prompt over the context", "completions", {"prompt": [5] * 2100}, 400, "prompt", ["2100", str(CONTEXT)]),
    ("prompt + max_tokens over the context", "completions", {"prompt": [5] * 2000, "max_tokens": 100}, 400,
     "max_tokens", ["2000", "100", str(CONTEXT)]),
    ("max_tokens 0", "completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", [">= 1"]),
    ("temperature negative", "completions", {"prompt": "Hi", "temperature": -0.5}, 400, "temperature",
     [">= 0"]),
    ("temperature NaN", "completions", b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature", ["finite"]),
    ("temperature infinite", "completions", b'{"prompt": "Hi", "temperature": Infinity}', 400, "temperature",
     ["finite"]),
    ("top_p 0", "completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ("top_p over 1", "completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    ("top_k -2", "completions", {"prompt": "Hi", "top_k": -2}, 400, "top_k", ["-1", ">= 1"]),
    ("top_k a float", "completions", {"prompt": "Hi", "top_k": 2.5}, 400, "top_k", ["integer"]),
    ("n 0", "completions", {"prompt": "Hi", "n": 0}, 400, "n", ["between 1 and"]),
    ("n 1000", "completions", {"prompt": "Hi", "n": 1000}, 400, "n", ["between 1 and"]),
    ("logprobs 21", "completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", ["between 0 and 20"]),
    ("logprobs negative", "completions", {"prompt": "Hi", "logprobs": -1}, 400, "logprobs", ["between 0 and 20"]),
    ("min_tokens over max_tokens", "completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens", ["between 0 and 2"]),
    ("seed over 64 bits", "completions", {"prompt": "Hi", "seed": 2**70}, 400, "seed", ["64 bits"]),
    ("negative token id", "completions", {"prompt": [-1, 5]}, 400, "prompt", ["-1", f"[0, {VOCAB})"]),
    ("token id past the vocabulary", "completions", {"prompt": [5, VOCAB]}, 400, "prompt",
     [str(VOCAB), f"[0, {VOCAB})"]),
    ("stream_options without stream", "completions", {"prompt": "Hi", "stream_options": {"include_usage": True}},
     400, "stream_options", ["stream: true"]),
    ("stream_options malformed", "completions", {"prompt": "Hi", "stream": True, "stream_options": {"x": 1}},
     400, "stream_options", ["include_usage"]),
    ("unknown fields", "completions", {"prompt": "Hi", "foo": 1, "bar": 2}, 400, "bar", ["bar, foo", "allowed"]),
    ("best_of", "completions", {"prompt": "Hi", "best_of": 2}, 400, "best_of", ["not supported"]),
    ("logit_bias over 100", "completions", {"prompt": "Hi", "logit_bias": {"5": 200}}, 400, "logit_bias",
     ["between -100 and 100"]),
    ("logit_bias past the vocabulary", "completions", {"prompt": "Hi", "logit_bias": {str(VOCAB): 1}}, 400,
     "logit_bias", [str(VOCAB), f"[0, {VOCAB})"]),
    ("logit_bias key not an id", "completions", {"prompt": "Hi", "logit_bias": {"the": 1}}, 400, "logit_bias",
     ["token ids"]),
    ("presence_penalty 3", "completions", {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty",
     ["between -2 and 2"]),
    ("frequency_penalty a string", "chat/completions", {"messages": CHAT_MSG, "frequency_penalty": "1"}, 400,
     "frequency_penalty", ["number"]),
    ("repetition_penalty 0", "completions", {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty",
     ["> 0"]),
    ("min_p 2", "completions", {"prompt": "Hi", "min_p": 2}, 400, "min_p", ["between 0 and 1"]),
    ("priority a string", "completions", {"prompt": "Hi", "priority": "high"}, 400, "priority", ["integer"]),
    ("priority a float, chat", "chat/completions", {"messages": CHAT_MSG, "priority": 0.5}, 400, "priority",
     ["integer"]),
    ("suffix", "completions", {"prompt": "Hi", "suffix": "end"}, 400, "suffix", ["not supported"]),
    ("tools", "chat/completions", {"messages": CHAT_MSG, "tools": [{"type": "function"}]}, 400, "tools",
     ["not supported"]),
    ("tool_choice", "chat/completions", {"messages": CHAT_MSG, "tool_choice": "auto"}, 400, "tool_choice",
     ["not supported"]),
    ("functions", "chat/completions", {"messages": CHAT_MSG, "functions": [{"name": "f"}]}, 400, "functions",
     ["not supported"]),
    ("response_format", "chat/completions", {"messages": CHAT_MSG, "response_format": {"type": "json_object"}},
     400, "response_format", ["not supported"]),
    ("chat field on completions", "completions", {"prompt": "Hi", "messages": CHAT_MSG}, 400, "messages",
     ["unknown"]),
    ("missing messages", "chat/completions", {"max_tokens": 2}, 400, "messages", ["non-empty list"]),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages", ["non-empty list"]),
    ("message not an object", "chat/completions", {"messages": ["Hi"]}, 400, "messages[0]", ["object"]),
    ("bad role", "chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role",
     ["system, developer, user, assistant", "robot"]),
    ("text part without text", "chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages[0].content[0].text", ["must be a string"]),
    ("image part", "chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages[0].content[1].type", ["'image_url'", "only text parts"]),
    ("empty content parts", "chat/completions", {"messages": [{"role": "user", "content": []}]}, 400,
     "messages[0].content", ["non-empty list"]),
    ("chat over the context", "chat/completions", {"messages": [{"role": "user", "content": "word " * 2100}]}, 400,
     "messages", ["tokens", str(CONTEXT)]),
    ("chat max_completion_tokens over the context", "chat/completions",
     {"messages": [{"role": "user", "content": "word " * 1000}], "max_completion_tokens": 1500}, 400,
     "max_completion_tokens", ["1500", str(CONTEXT)]),
    ("extra message field", "chat/completions", {"messages": [{"role": "user", "content": "Hi", "x": 1}]}, 400,
     "messages[0].x", ["role, content, name"]),
    ("top_logprobs without logprobs", "chat/completions", {"messages": CHAT_MSG, "top_logprobs": 2}, 400,
     "top_logprobs", ["logprobs: true"]),
    ("top_logprobs 30", "chat/completions", {"messages": CHAT_MSG, "logprobs": True, "top_logprobs": 30}, 400,
     "logprobs", ["between 0 and 20"]),
    ("stream_options continuous_usage_stats not a bool", "completions",
     {"prompt": "Hi", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, 400,
     "stream_options.continuous_usage_stats", ["true or false"]),
    ("skip_special_tokens not a bool", "completions", {"prompt": "Hi", "skip_special_tokens": "no"}, 400,
     "skip_special_tokens", ["boolean"]),
    ("include_stop_str_in_output not a bool, chat", "chat/completions",
     {"messages": CHAT_MSG, "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output", ["boolean"]),
    ("truncate_prompt_tokens 0", "completions", {"prompt": "Hi", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens", [">= 1"]),
    ("truncate_prompt_tokens over the context, chat", "chat/completions",
     {"messages": CHAT_MSG, "truncate_prompt_tokens": CONTEXT + 1}, 400, "truncate_prompt_tokens",
     [str(CONTEXT + 1), str(CONTEXT)]),
    ("add_special_tokens not a bool", "completions", {"prompt": "Hi", "add_special_tokens": "yes"}, 400,
     "add_special_tokens", ["true or false"]),
    ("prompt_logprobs 21", "completions", {"prompt": "Hi", "prompt_logprobs": 21}, 400, "prompt_logprobs",
     ["between 0 and 20"]),
    ("prompt_logprobs with stream", "chat/completions", {"messages": CHAT_MSG, "prompt_logprobs": 1,
                                                         "stream": True}, 400, "prompt_logprobs", ["stream"]),
    ("message name not a string", "chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": 1}]},
     400, "messages[0].name", ["string"]),
    ("continue_final_message with add_generation_prompt", "chat/completions",
     {"messages": CHAT_MSG, "continue_final_message": True}, 400, "continue_final_message",
     ["add_generation_prompt"]),
    ("documents not a list of objects", "chat/completions", {"messages": CHAT_MSG, "documents": ["text"]}, 400,
     "documents", ["list of objects"]),
    ("chat_template_kwargs not an object", "chat/completions", {"messages": CHAT_MSG, "chat_template_kwargs": [1]},
     400, "chat_template_kwargs", ["object"]),
    ("echo on chat not a bool", "chat/completions", {"messages": CHAT_MSG, "echo": "yes"}, 400, "echo",
     ["true or false"]),
    ("guided_regex", "completions", {"prompt": "Hi", "guided_regex": "a+"}, 400, "guided_regex",
     ["not supported", "guided"]),
    ("per-request chat_template", "chat/completions", {"messages": CHAT_MSG, "chat_template": "{{ 1 }}"}, 400,
     "chat_template", ["not supported", "--chat-template"]),
    ("use_beam_search", "completions", {"prompt": "Hi", "use_beam_search": True}, 400, "use_beam_search",
     ["not supported", "beam search"]),
    ("max_tokens 0 with echo but a chat", "chat/completions", {"messages": CHAT_MSG, "max_tokens": 0, "echo": True},
     400, "max_tokens", [">= 1"]),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "Hi"}, 404, "model", ["gpt-9", "serves"]),
    ("unknown model, chat", "chat/completions", {"model": "gpt-9", "messages": CHAT_MSG}, 404, "model", ["gpt-9"]),
]


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, DEFAULT_ARGS)
    yield srv
    wait_idle(srv.url)


def assert_error_body(body: dict, param: str | None = None, words: tuple[str, ...] = ()) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    message = body["error"]["message"]
    assert body["error"]["param"] == param, body
    for word in words:
        assert word in message, (word, message)
    assert str(REPO) not in message and ".py" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("name,path,body,status,param,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(server, name, path, body, status, param, words):
    got, headers, err = post_json(f"{server.url}/v1/{path}", body)
    assert got == status, err
    assert headers["Content-Type"].startswith("application/json")
    assert_error_body(err, param, words)


def test_wrong_content_type_is_400(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", data=b'{"prompt": "Hi"}',
                              headers={"Content-Type": "text/plain"}) as r:
                return r.status, await r.json()

    status, body = asyncio.run(run())
    assert status == 400
    assert_error_body(body, None, ("application/json", "text/plain"))


def test_body_over_the_limit_is_413_with_or_without_content_length(server):
    big = b'{"prompt": "' + b"a" * 70_000 + b'"}'  # the server runs with --max-request-bytes 65536

    async def chunked():
        yield big[:30_000]
        yield big[30_000:]

    async def run():
        async with aiohttp.ClientSession() as s:
            results = []
            for data in (big, chunked()):
                async with s.post(server.url + "/v1/completions", data=data,
                                  headers={"Content-Type": "application/json"}) as r:
                    results.append((r.status, await r.json()))
            return results

    for status, body in asyncio.run(run()):
        assert status == 413
        assert_error_body(body, None, ("65536",))


def test_wrong_method_and_unknown_route_are_json_errors(server):
    status, body = get_json(server.url + "/v1/completions")
    assert status == 405
    assert_error_body(body)
    status, body = get_json(server.url + "/v2/nothing")
    assert status == 404
    assert_error_body(body)


def test_server_is_healthy_and_all_blocks_free_after_bad_input(server):
    health = wait_idle(server.url)
    assert health["status"] == "ok" and health["kv_free_blocks"] == health["kv_total_blocks"] == 1024
    status, _, body = post_json(server.url + "/v1/completions", {"prompt": "Still fine", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("args,words", [
    (["--max-num-seqs", "0"], ["max_num_seqs", ">= 1"]),
    (["--port", "http"], ["--port", "invalid int"]),
    (["--scheduling-policy", "random"], ["--scheduling-policy", "fcfs"]),
    (["--model", "/nonexistent/model", "--port", "0"], ["/nonexistent/model"]),
    (["--chat-template", "/nonexistent/template.jinja"], ["--chat-template", "/nonexistent/template.jinja"]),
    (["--request-body-timeout", "0"], ["--request-body-timeout", "> 0"]),
], ids=["range", "type", "choice", "missing model", "missing template", "body timeout"])
def test_bad_flag_is_one_line_and_exit_code_2(args, words):
    r = subprocess.run([sys.executable, str(REPO / "server.py"), *args], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("server.py: error:"), r.stderr
    assert "Traceback" not in r.stderr and all(w in lines[0] for w in words), lines[0]


def test_a_port_in_use_is_reported_before_the_model_loads(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        r = subprocess.run([sys.executable, str(REPO / "server.py"), "--model", str(tiny_model_dir), "--port",
                            str(port)], capture_output=True, text=True, timeout=60, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"server.py: error: cannot listen on 127.0.0.1:{port}") and "--port" in lines[0]
    assert "job profile" not in r.stderr and time.monotonic() - start < 30  # no model was loaded


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, str(REPO / "server.py"), "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO).stdout
    flags = ("model dtype host port served-model-name tensor-parallel-size pipeline-parallel-size max-num-seqs "
             "max-num-batched-tokens max-model-len block-size gpu-memory-utilization num-gpu-blocks-override "
             "swap-space scheduling-policy seed api-key kv-policy starvation-threshold quantum-ratio "
             "reserved-blocks profile max-queued-requests shutdown-timeout max-request-bytes device "
             "chat-template allowed-origins log-level request-body-timeout").split()
    for f in flags:
        assert f"--{f} " in out, f
