"""The OpenAI wire format: request bodies in, responses and stream chunks out.

What it is: parse_completion() / parse_chat() turn a JSON body of
/v1/completions or /v1/chat/completions into engine prompts and one
SamplingParams (a GenerationRequest), raising engine.errors.ValidationError
(`param` names the field) so the server and the offline API say the same
thing; ResponseBuilder turns the engine's cumulative RequestOutputs into
response bodies and SSE chunk bodies. What it is not: HTTP (server.py).

Rules:
  * Unknown fields are refused (400 naming them); OpenAI parameters this server
    does not implement (best_of > 1, suffix, tools, response_format, ...) are
    refused when set to anything but their "off" value. Nothing is ignored.
    README.md's "Request fields" table lists every field and its status.
  * Chat content is a string or a list of parts; text parts are joined with
    "\\n" (as vLLM does), any other part type is refused. The `developer` role
    (OpenAI's newer name for `system`) reaches the template as `system`.
  * `priority` (vLLM's request class, an integer, lower first) goes to every
    job of the request.
  * Several prompts and n > 1 map to choices at index prompt_index * n + k.
  * Every choice carries `"metrics"`: the engine's RequestMetrics.to_dict() of
    the request that produced it (in a stream: on the chunk that finishes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ValidationError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
MAX_PROMPTS = 256  # prompts in one /v1/completions request
ROLES = ("system", "developer", "user", "assistant")

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "n", "stop", "seed", "ignore_eos", "stop_token_ids",
                    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "min_p")
_COMMON_FIELDS = {"model", "max_tokens", "stream", "stream_options", "user", "priority", *_SAMPLING_FIELDS}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
# OpenAI parameters that are not implemented, with the values that mean "not used" (those are accepted).
UNIMPLEMENTED: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (),
}


@dataclass
class ProtocolContext:
    """What parsing needs from the server: model names, tokenizer, template, context length."""

    served_model_names: list[str]
    tokenizer: object  # engine.tokenizer.Tokenizer
    chat_template: object  # serving.chat_template.ChatTemplate
    max_model_len: int


@dataclass
class GenerationRequest:
    kind: str  # "completion" | "chat"
    model: str  # the served name the response reports
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: the prompt text comes before the output
    user: str | None = None
    priority: int = 0  # vLLM's request class: lower runs first


# -- parsing ------------------------------------------------------------------------------------------
def parse_completion(body: object, ctx: ProtocolContext) -> GenerationRequest:
    body = _check_fields(body, COMPLETION_FIELDS)
    model = _model(body, ctx)
    prompts = _parse_prompts(body.get("prompt"))
    echo = _opt_bool(body, "echo")
    params = _sampling_params(body, max_tokens=body.get("max_tokens"), logprobs=body.get("logprobs"))
    if echo and params.logprobs is not None:
        params.prompt_logprobs = params.logprobs
    return _request("completion", model, body, prompts, params, echo=echo)


def parse_chat(body: object, ctx: ProtocolContext) -> GenerationRequest:
    body = _check_fields(body, CHAT_FIELDS)
    model = _model(body, ctx)
    messages = _parse_messages(body.get("messages"))
    prompt_ids = ctx.tokenizer.encode(ctx.chat_template.render(messages))
    if len(prompt_ids) > ctx.max_model_len:
        raise ValidationError(f"the messages take {len(prompt_ids)} tokens (with the chat template); this "
                              f"model's context is {ctx.max_model_len} tokens", param="messages",
                              code="context_length_exceeded")
    want_logprobs = _opt_bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:
        raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(limit_field)
    if max_tokens is None:  # as vLLM: the rest of the context
        max_tokens = max(1, ctx.max_model_len - len(prompt_ids))
    elif _is_token_id(max_tokens) and len(prompt_ids) + max_tokens > ctx.max_model_len:
        raise ValidationError(f"the messages ({len(prompt_ids)} tokens) + {limit_field} ({max_tokens}) = "
                              f"{len(prompt_ids) + max_tokens} exceeds this model's context of "
                              f"{ctx.max_model_len} tokens", param=limit_field, code="context_length_exceeded")
    params = _sampling_params(body, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None)
    return _request("chat", model, body, [prompt_ids], params)


def _model(body: dict, ctx: ProtocolContext) -> str:
    """The served name asked for (the first one when the body names none)."""
    model = body.get("model")
    if model is None:
        return ctx.served_model_names[0]
    if not isinstance(model, str):
        raise ValidationError(f"model must be a string, got {model!r}", param="model")
    if model not in ctx.served_model_names:
        raise ValidationError(f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, ctx.served_model_names))}", param="model",
                              code="model_not_found")
    return model


def _request(kind: str, model: str, body: dict, prompts: list[Prompt], params: SamplingParams,
             echo: bool = False) -> GenerationRequest:
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ValidationError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ValidationError('stream_options must be {"include_usage": true|false}', param="stream_options")
        include_usage = _opt_bool(options, "include_usage", "stream_options.include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ValidationError(f"user must be a string, got {user!r}", param="user")
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_token_id(priority):
        raise ValidationError(f"priority must be an integer (lower runs first), got {priority!r}"[:200],
                              param="priority")
    return GenerationRequest(kind, model, prompts, params, stream, include_usage, echo, user, priority)


def _check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ValidationError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, off in UNIMPLEMENTED.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value not in off):
            raise ValidationError(f"{name} is not supported by this server; leave it out", param=name,
                                  code="unsupported_parameter")
    unknown = sorted(set(body) - allowed - set(UNIMPLEMENTED))
    if unknown:
        raise ValidationError(f"unknown field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}",
                              param=unknown[0])
    return body


def _opt_bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValidationError(f"{param or name} must be true or false, got {value!r}", param=param or name)
    return value


def _sampling_params(body: dict, max_tokens, logprobs) -> SamplingParams:
    kw = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    if logprobs is not None:
        kw["logprobs"] = logprobs
    return SamplingParams(**kw)  # validates types and ranges, naming the field


def _is_token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_prompts(value: object) -> list[Prompt]:
    shape = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if value is None:
        raise ValidationError(f"prompt is required: {shape}", param="prompt")
    if isinstance(value, str):
        prompts: list[Prompt] = [value]
    elif isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_is_token_id(x) for x in value):
        prompts = [value]
    elif isinstance(value, list) and value and all(
            isinstance(p, list) and all(_is_token_id(x) for x in p) for p in value):
        prompts = list(value)
    elif value == [] or value == "":
        raise ValidationError("prompt must not be empty", param="prompt")
    else:
        raise ValidationError(f"prompt must be {shape}", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ValidationError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValidationError("prompt must not be empty (nor any prompt in the list)", param="prompt")
    return prompts


def _parse_messages(value: object) -> list[dict[str, str]]:
    """The messages as the template sees them: string content, `developer` as `system`."""
    if not isinstance(value, list) or not value:
        raise ValidationError('messages must be a non-empty list of {"role", "content"} objects', param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValidationError(f'{where} must be an object {{"role", "content"}}', param=where)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise ValidationError(f"{where} has unsupported field(s) {', '.join(extra)}; "
                                  "allowed: role, content", param=f"{where}.{extra[0]}")
        if m.get("role") not in ROLES:
            raise ValidationError(f"{where}.role must be one of {', '.join(ROLES)}; got {m.get('role')!r}",
                                  param=f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content_text(m.get("content"), f"{where}.content")})
    return out


def _content_text(content: object, where: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined with "\\n"."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValidationError(f'{where} must be a string or a non-empty list of {{"type": "text", "text"}} parts; '
                              f"got {content!r}"[:200], param=where)
    texts = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValidationError(f'{here} must be an object {{"type": "text", "text": ...}}', param=here)
        if part.get("type") != "text":
            raise ValidationError(f"{here} has type {part.get('type')!r}; this server takes only text parts "
                                  '({"type": "text", "text": ...})', param=f"{here}.type")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise ValidationError(f"{here} has unsupported field(s) {', '.join(extra)}; allowed: type, text",
                                  param=f"{here}.{extra[0]}")
        if not isinstance(part.get("text"), str):
            raise ValidationError(f"{here}.text must be a string, got {part.get('text')!r}"[:200],
                                  param=f"{here}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- responses -----------------------------------------------------------------------------------------
@dataclass
class _Cursor:
    """How much of one choice a stream has sent."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class ResponseBuilder:
    req: GenerationRequest
    response_id: str
    created: int
    tokenizer: object
    _cursors: dict[int, _Cursor] = field(default_factory=dict)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.req.kind == "chat" else "text_completion"

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        obj = self._object + (".chunk" if chunk and self.req.kind == "chat" else "")
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": choices}

    def index(self, prompt_index: int, k: int) -> int:
        return prompt_index * self.req.params.n + k

    def usage(self, outputs: list[RequestOutput | None]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
        completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def response(self, outputs: list[RequestOutput]) -> dict:
        """The non-streaming body, from each prompt's final output."""
        choices = [self._choice(p, out, c, _Cursor(), stream=False)
                   for p, out in enumerate(outputs) for c in out.outputs]
        return dict(self._envelope(choices, chunk=False), usage=self.usage(outputs))

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        if self.req.kind != "chat":
            return []
        n = len(self.req.prompts) * self.req.params.n
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], chunk=True) for i in range(n)]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Stream chunks for what `out` adds to what was sent (one chunk per changed choice)."""
        chunks = []
        for c in out.outputs:
            cur = self._cursors.setdefault(self.index(prompt_index, c.index), _Cursor())
            if cur.finished:
                continue
            has_new = len(c.text) > cur.chars or (c.logprobs is not None and len(c.token_ids) > cur.tokens)
            if has_new or c.finished or (self.req.echo and not cur.started):
                chunks.append(self._envelope([self._choice(prompt_index, out, c, cur, stream=True)], chunk=True))
        return chunks

    def usage_chunk(self, outputs: list[RequestOutput | None]) -> dict:
        return dict(self._envelope([], chunk=True), usage=self.usage(outputs))

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, cur: _Cursor,
                stream: bool) -> dict:
        """One choice holding what `cur` has not sent yet; advances `cur`."""
        text = c.text[cur.chars:]
        ids = c.token_ids[cur.tokens:]
        lps = c.logprobs[cur.tokens:] if c.logprobs is not None else None
        prompt_part = self.req.echo and not cur.started
        if prompt_part:
            text = (out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)) + text
            if lps is not None and out.prompt_logprobs is not None:
                ids, lps = out.prompt_token_ids + ids, out.prompt_logprobs + lps
        cur.chars, cur.tokens, cur.started, cur.finished = len(c.text), len(c.token_ids), True, c.finished
        choice: dict = {"index": self.index(prompt_index, c.index)}
        if self.req.kind == "chat":
            if stream:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = self._chat_logprobs(ids, lps) if lps is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(ids, lps, cur) if lps is not None else None
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        if c.finished:
            choice["metrics"] = out.metrics.to_dict()
        return choice

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a byte-level BPE piece may be part of a UTF-8 character)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece and all(ch in _BYTE_OF_CHAR for ch in piece):
            return [_BYTE_OF_CHAR[ch] for ch in piece]
        return list(self._token(token_id).encode("utf-8"))

    def _completion_logprobs(self, ids: list[int], lps: list, cur: _Cursor) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, lp in zip(ids, lps):
            s = self._token(t)
            tokens.append(s)
            token_lps.append(None if lp is None else _finite(lp.get(t)))
            tops.append(None if lp is None else {self._token(i): _finite(v) for i, v in lp.items()})
            offsets.append(cur.text_offset)
            cur.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list) -> dict:
        top_n = self.req.params.logprobs or 0

        def entry(token_id: int, value: float) -> dict:
            return {"token": self._token(token_id), "logprob": _finite(value), "bytes": self._bytes(token_id)}

        content = []
        for t, lp in zip(ids, lps):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(dict(entry(t, lp[t]), top_logprobs=[entry(i, v) for i, v in best]))
        return {"content": content}


def _finite(value: float | None) -> float | None:
    """JSON has no -inf: a token the model rules out gets -9999.0, as vLLM reports it."""
    return value if value is None or math.isfinite(value) else -9999.0


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE piece uses -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()
