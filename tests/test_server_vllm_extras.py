"""vLLM's request extras over real HTTP (server.py on loopback, the official `openai` client where it fits):
stream_options.continuous_usage_stats, skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output, truncate_prompt_tokens, add_special_tokens, return_tokens_as_token_ids,
prompt_logprobs, a message's `name`, chat's add_generation_prompt / continue_final_message / echo / documents /
chat_template_kwargs, and the scoring-only completion (max_tokens 0 + echo + logprobs) checked against
transformers. Each field changes what comes back, so a server that ignored it would fail here."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from server import ServerConfig, create_app
from tests.server_fixtures import DEFAULT_ARGS, post_json, shared_server, sse_chunks, streamed_text, wait_idle

PROMPT = "Scheduling at token granularity removes head-of-line blocking"
EOS = 2  # the tiny model's "</s>"
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens"}


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, DEFAULT_ARGS)
    yield srv
    wait_idle(srv.url)


def stream(url: str, body: dict) -> list[dict]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=body) as r:
                raw = await r.read()
                assert r.status == 200, raw[:500]
                return sse_chunks(raw)

    return asyncio.run(go())


def rising_to(counts: list[int], n: int) -> bool:
    """Per-chunk completion_tokens: one more each chunk as a rule (a chunk per token), but a busy machine may
    merge two engine steps into one chunk, so only "strictly rising, ending at n" is certain."""
    return all(b > a for a, b in zip(counts, counts[1:])) and counts[-1] == n and counts[0] >= 1


def complete(server, **body) -> dict:
    status, _, out = post_json(server.url + "/v1/completions", body)
    assert status == 200, out
    return out


def chat(server, **body) -> dict:
    status, _, out = post_json(server.url + "/v1/chat/completions", body)
    assert status == 200, out
    return out


def error(server, path: str, **body) -> dict:
    status, _, out = post_json(f"{server.url}/v1/{path}", body)
    assert status == 400, out
    return out["error"]


def prompt_ids(server, prompt) -> list[int]:
    """The token ids the server makes of `prompt` (a scoring-only echo names them)."""
    tokens = complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                      return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


# -- stream_options ---------------------------------------------------------------------------------------------
def test_continuous_usage_stats_on_every_completion_chunk(client, model):
    """guidellm's payload: every chunk carries the usage so far (one chunk per token), then the usage chunk."""
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stop=None,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert prompt_tokens > 5 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert rising_to([c.usage.completion_tokens for c in with_choices], 6) and len(with_choices) > 1
    assert all(c.usage.prompt_tokens == prompt_tokens for c in with_choices)
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in with_choices)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in with_choices) == plain.choices[0].text


def test_continuous_usage_stats_per_prompt_and_choice(server):
    """Several prompts and n: each chunk's usage is its own prompt's tokens and its own choice's count (vLLM)."""
    short, long = [2, 50, 60], [2, 70, 80, 90, 100, 110]
    chunks = stream(server.url + "/v1/completions", {
        "prompt": [short, long], "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 3, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert set(c["usage"]) == USAGE_KEYS
        assert c["usage"]["prompt_tokens"] == (len(short) if choice["index"] < 2 else len(long))
        counts.setdefault(choice["index"], []).append(c["usage"]["completion_tokens"])
    assert sorted(counts) == [0, 1, 2, 3] and all(rising_to(c, 3) for c in counts.values())
    assert chunks[-1] == {**chunks[-1], "choices": [],
                          "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                                    "prompt_tokens_details": {"cached_tokens": 0}}}  # (shorter than a block)


def test_continuous_usage_stats_on_chat_chunks(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (prompt_tokens, 0)
    assert rising_to([c.usage.completion_tokens for c in chunks[1:-1]], 4)
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_stream_options_defaults_follow_vllm(server):
    """include_usage defaults to true once stream_options is sent; continuous_usage_stats needs include_usage."""
    url, base = server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "stream": True}
    chunks = stream(url, dict(base, stream_options={}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert all("usage" not in c for c in chunks[:-1])
    chunks = stream(url, dict(base, stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in stream(url, base))


# -- detokenization -----------------------------------------------------------------------------------------------
def test_skip_special_tokens(server):
    """Forced "</s>" tokens (logit_bias, ignore_eos): skipped from the text by default, kept when asked."""
    body = {"prompt": PROMPT, "max_tokens": 3, "logit_bias": {str(EOS): 100}, "ignore_eos": True}
    assert complete(server, **body)["choices"][0]["text"] == ""
    kept = complete(server, **body, skip_special_tokens=False)
    assert kept["choices"][0]["text"] == "</s></s></s>" and kept["usage"]["completion_tokens"] == 3
    streamed = stream(server.url + "/v1/completions", dict(body, skip_special_tokens=False, stream=True))
    assert streamed_text(streamed) == "</s></s></s>"
    reply = chat(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, skip_special_tokens=False,
                 logit_bias={str(EOS): 100}, ignore_eos=True)
    assert reply["choices"][0]["message"]["content"] == "</s></s>"


def test_spaces_between_special_tokens_over_http(server):
    """OPT's byte-level decoder puts no space between special tokens, so (as on vLLM) both settings give the
    same text here; the setting is validated and reaches the detokenizer (the test below shows its effect)."""
    body = {"prompt": PROMPT, "max_tokens": 3, "logit_bias": {str(EOS): 100}, "ignore_eos": True,
            "skip_special_tokens": False}
    for spaces in (True, False):
        assert complete(server, **body, spaces_between_special_tokens=spaces)["choices"][0]["text"] == "</s>" * 3
    err = error(server, "completions", **body, spaces_between_special_tokens="no")
    assert err["param"] == "spaces_between_special_tokens" and "boolean" in err["message"]


def test_spaces_between_special_tokens_in_the_detokenizer():
    """A decoder that joins tokens with spaces (WordPiece): with spaces_between_special_tokens false, an added
    token right after another comes without its space (vLLM's rule); skipped special tokens make it moot."""
    backend = RustTokenizer(models.WordLevel({"a": 0, "b": 1, "[S]": 2, "[UNK]": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("[S]", special=True)])
    tok = Tokenizer(backend, {"bos": None, "eos": AddedToken("[S]", special=True), "unk": None, "pad": None})
    output = [0, 2, 2, 2, 1, 2]

    def text(**kw) -> str:
        detok = IncrementalDetokenizer(tok, [1], **kw)
        return "".join(detok.step([t]) for t in output) + detok.flush()

    assert text(skip_special_tokens=False) == " a [S] [S] [S] b [S]" == " " + tok.decode(output, False)
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == " a [S][S][S] b [S]"
    assert text(spaces_between_special_tokens=False) == text() == " a b"


def test_include_stop_str_in_output(server):
    """A stop string ends the text (stream and not) instead of being cut off; so does a stop token's text,
    which by default is left out (vLLM's rule for EOS and stop_token_ids)."""
    base = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = complete(server, **base)["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert "\ufffd" not in stop and len(stop) == 3
    end = text.index(stop)
    for include, expected in ((False, text[:end]), (True, text[:end + 3])):
        body = dict(base, stop=[stop], include_stop_str_in_output=include)
        choice = complete(server, **body)["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
        assert streamed_text(stream(server.url + "/v1/completions", dict(body, stream=True))) == expected
    # stop_token_ids: the stop token's own text only with include_stop_str_in_output.
    lp = complete(server, **base, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    as_ids = [int(t.removeprefix("token_id:")) for t in complete(
        server, **base, logprobs=0, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["tokens"]]
    j = next(j for j in range(1, len(lp)) if lp[j].strip().isalnum() and as_ids[j] not in as_ids[:j])
    body = dict(base, stop_token_ids=[as_ids[j]])
    left_out, kept = complete(server, **body), complete(server, **body, include_stop_str_in_output=True)
    for out in (left_out, kept):
        assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["stop_reason"] == as_ids[j]
        assert out["usage"]["completion_tokens"] == j + 1
    assert kept["choices"][0]["text"] == left_out["choices"][0]["text"] + lp[j]


# -- prompts ------------------------------------------------------------------------------------------------------
def test_truncate_prompt_tokens(server):
    """Left truncation: a text prompt keeps its BOS and its last N-1 tokens (vLLM's tokenizer truncation), a
    token-id prompt its last N ids; the output is that of the kept prompt, and usage counts the kept tokens."""
    full = prompt_ids(server, PROMPT)
    assert full[0] == EOS and len(full) > 6
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    cut = complete(server, prompt=PROMPT, truncate_prompt_tokens=4, echo=True, logprobs=0,
                   return_tokens_as_token_ids=True, **base)
    kept = [EOS, *full[-3:]]
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["logprobs"]["tokens"][:4] == [f"token_id:{t}" for t in kept]
    same = complete(server, prompt=kept, echo=True, **base)["choices"][0]["text"]
    assert complete(server, prompt=PROMPT, truncate_prompt_tokens=4, echo=True, **base)["choices"][0]["text"] == same
    ids_cut = complete(server, prompt=full, truncate_prompt_tokens=3, **base)
    assert ids_cut["usage"]["prompt_tokens"] == 3
    assert ids_cut["choices"][0]["text"] == complete(server, prompt=full[-3:], **base)["choices"][0]["text"]
    assert complete(server, prompt=PROMPT, truncate_prompt_tokens=500, **base)["usage"]["prompt_tokens"] == len(full)
    reply = chat(server, messages=[{"role": "user", "content": PROMPT}], truncate_prompt_tokens=5, **base)
    assert reply["usage"]["prompt_tokens"] == 5
    for n, words in ((0, [">= 1"]), (-1, [">= 1"]), (5000, ["5000", "max_model_len 2048"])):
        err = error(server, "completions", prompt=PROMPT, truncate_prompt_tokens=n)
        assert err["param"] == "truncate_prompt_tokens" and all(w in err["message"] for w in words), err


def test_add_special_tokens(server):
    """false: no BOS before the prompt (completions default true; chat too here, see docs/api.md, "Request fields")."""
    with_bos = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    without = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                       add_special_tokens=False)["choices"][0]["logprobs"]
    assert with_bos["tokens"][0] == "</s>" and without["tokens"] == with_bos["tokens"][1:]
    messages = [{"role": "user", "content": "Hi"}]
    n = chat(server, messages=messages, max_tokens=1)["usage"]["prompt_tokens"]
    assert chat(server, messages=messages, max_tokens=1, add_special_tokens=False)["usage"]["prompt_tokens"] == n - 1


# -- logprobs -----------------------------------------------------------------------------------------------------
def test_return_tokens_as_token_ids(client, model):
    def top(**extra):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].logprobs

    text, ids = top(), top(return_tokens_as_token_ids=True)
    assert all(t.startswith("token_id:") for t in ids.tokens) and ids.token_logprobs == text.token_logprobs
    assert all(all(k.startswith("token_id:") for k in d) for d in ids.top_logprobs)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids":
                                                                                      True})
    assert all(e.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in e.top_logprobs)
               for e in reply.choices[0].logprobs.content)


def test_prompt_logprobs(server):
    """vLLM's prompt_logprobs: per prompt token, null first, then {id: {logprob, rank, decoded_token}} for the
    token and the top k; the same numbers as echo's logprobs. Per choice for completions, per response for chat;
    refused with stream."""
    body = complete(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=2, temperature=0)
    choice = body["choices"][0]
    plp, n = choice["prompt_logprobs"], body["usage"]["prompt_tokens"]
    assert len(plp) == n and plp[0] is None and choice["logprobs"] is None
    echo = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)["choices"][0]["logprobs"]
    for pos in range(1, n):
        entries = plp[pos]
        assert 2 <= len(entries) <= 3
        ranked = sorted(entries.values(), key=lambda e: -e["logprob"])
        assert [e["rank"] for e in ranked[:2]] == [1, 2]
        by_token = {e["decoded_token"]: e["logprob"] for e in entries.values()}
        assert by_token[echo["tokens"][pos]] == pytest.approx(echo["token_logprobs"][pos], abs=1e-6)
        assert by_token == pytest.approx(echo["top_logprobs"][pos], abs=1e-6)
    reply = chat(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, prompt_logprobs=0)
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"] and reply["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] is None for e in reply["prompt_logprobs"][1:])
    err = error(server, "completions", prompt=PROMPT, prompt_logprobs=1, stream=True)
    assert err["param"] == "prompt_logprobs" and "stream" in err["message"]


def test_scoring_only_echo_matches_transformers(client, model, tiny_model_dir):
    """lm-eval's loglikelihood request: max_tokens 0 + echo + logprobs gives the prompt, its logprobs (first
    null) equal to transformers' on the same checkpoint, nothing generated, finish_reason "length"."""
    from transformers import OPTForCausalLM

    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(choice.logprobs.tokens), 0)
    ids = [int(t.removeprefix("token_id:")) for t in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.tokens]
    hf = OPTForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and choice.logprobs.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lps[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4), pos
        assert max(choice.logprobs.top_logprobs[pos].values()) == pytest.approx(ref[pos - 1].max().item(), abs=1e-4)
    # The same streamed: one chunk with the prompt; and on token-id prompts, batched, as lm-eval sends them.
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].text for c in chunks if c.choices] == [PROMPT]
    assert chunks[-1].usage.completion_tokens == 0
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(lps[1:], abs=1e-6)
    batch = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=1)
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(ids), 3]
    assert batch.choices[0].logprobs.token_logprobs[0] is None
    assert batch.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lps[1:], abs=1e-6)
    assert batch.usage.completion_tokens == 0


def test_max_tokens_0_without_echo_is_refused(server):
    err = error(server, "completions", prompt=PROMPT, max_tokens=0, logprobs=1)
    assert err["param"] == "max_tokens" and ">= 1" in err["message"]


# -- chat ---------------------------------------------------------------------------------------------------------
def test_message_name_reaches_the_prompt(server):
    """The default template writes "User (alice): Hi": the same prompt as a completion of that text."""
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    named = chat(server, messages=[{"role": "user", "name": "alice", "content": "Hi"}], **base)
    same = complete(server, prompt="User (alice): Hi\nAssistant:", **base)
    assert named["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
    assert named["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    plain = chat(server, messages=[{"role": "user", "content": "Hi"}], **base)
    assert plain["usage"]["prompt_tokens"] < named["usage"]["prompt_tokens"]
    err = error(server, "chat/completions", messages=[{"role": "user", "name": 5, "content": "Hi"}])
    assert err["param"] == "messages[0].name"


def test_add_generation_prompt_continue_final_message_and_echo(server):
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    no_prompt = chat(server, messages=convo, add_generation_prompt=False, **base)
    as_text = complete(server, prompt="User: Hi\nAssistant: Once upon\n", **base)
    assert no_prompt["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    assert no_prompt["choices"][0]["message"] == {"role": "assistant", "content": as_text["choices"][0]["text"]}
    # continue_final_message: the prompt ends right after the last message's content.
    cont = chat(server, messages=convo, add_generation_prompt=False, continue_final_message=True, **base)
    cont_text = complete(server, prompt="User: Hi\nAssistant: Once upon", **base)["choices"][0]["text"]
    assert cont["choices"][0]["message"]["content"] == cont_text
    # echo: the last message's content first when it has the reply's role (streamed too).
    echoed = chat(server, messages=convo, add_generation_prompt=False, continue_final_message=True, echo=True,
                  **base)
    assert echoed["choices"][0]["message"]["content"] == "Once upon" + cont_text
    chunks = stream(server.url + "/v1/chat/completions",
                    dict(base, messages=convo, add_generation_prompt=False, continue_final_message=True, echo=True,
                         stream=True))
    assert chunks[1]["choices"][0]["delta"] == {"content": "Once upon"}
    assert streamed_text(chunks) == "Once upon" + cont_text
    # With the generation prompt the reply is the assistant's, so a user's last message is not echoed.
    plain = chat(server, messages=convo[:1], **base)["choices"][0]["message"]["content"]
    assert chat(server, messages=convo[:1], echo=True, **base)["choices"][0]["message"]["content"] == plain
    err = error(server, "chat/completions", messages=convo, continue_final_message=True)
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]


def test_documents_and_chat_template_kwargs_reach_a_custom_template(tiny_model_dir):
    """Over loopback HTTP to an in-process server whose --chat-template uses both."""
    from engine.engine import Engine

    template = ("{% for d in documents or [] %}[{{ d['title'] }}] {% endfor %}{{ greeting | default('') }}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=128, profile="analytic"))
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def main():
        app = create_app(AsyncEngine(engine), ServerConfig(served_model_names=("tiny",), chat_template=template))
        async with TestClient(TestServer(app)) as c:
            async def post(path, body):
                r = await c.post(path, json=body)
                assert r.status == 200, await r.text()
                return json.loads(await r.text())

            messages = [{"role": "user", "content": "Hi"}]
            rich = await post("/v1/chat/completions", dict(base, messages=messages,
                                                           documents=[{"title": "Doc", "text": "x"}],
                                                           chat_template_kwargs={"greeting": "Hello "}))
            same = await post("/v1/completions", dict(base, prompt="[Doc] Hello Hi"))
            bare = await post("/v1/chat/completions", dict(base, messages=messages))
            r = await c.post("/v1/chat/completions", json=dict(base, messages=messages,
                                                               chat_template_kwargs={"messages": []}))
            return rich, same, bare, r.status, json.loads(await r.text())

    rich, same, bare, status, err = asyncio.run(main())
    assert rich["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
    assert rich["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    assert bare["usage"]["prompt_tokens"] == len(engine.tokenizer.encode("Hi"))
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs"


def test_unimplemented_vllm_fields_are_refused_naming_them(server):
    messages = [{"role": "user", "content": "Hi"}]
    for field, value in (("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]),
                         ("allowed_token_ids", [5, 6]), ("bad_words", ["x"]), ("use_beam_search", True),
                         ("length_penalty", 2.0), ("chat_template", "{{ messages }}"),
                         ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}])):
        err = error(server, "chat/completions", messages=messages, **{field: value})
        assert err["param"] == field and err["code"] == "unsupported_parameter" and "not supported" in err["message"]
    # Their "off" values are accepted, as vLLM's clients send them.
    assert chat(server, messages=messages, max_tokens=1, use_beam_search=False, length_penalty=1.0, bad_words=[],
                guided_json=None)["usage"]["completion_tokens"] == 1
