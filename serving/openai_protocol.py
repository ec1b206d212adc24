"""The OpenAI wire format: request bodies in, responses and stream chunks out.

What it is: parse_completion() / parse_chat() turn a JSON body of
/v1/completions or /v1/chat/completions into engine prompts and one
SamplingParams (a GenerationRequest), raising engine.errors.ValidationError
(`param` names the field) so the server and the offline API say the same
thing; ResponseBuilder turns the engine's cumulative RequestOutputs into
response bodies and SSE chunk bodies. What it is not: HTTP (server.py).

Rules:
  * Unknown fields are refused (400 naming them); OpenAI and vLLM parameters
    this server does not implement (best_of > 1, suffix, tools, response_format,
    guided_*, beam search, ...) are refused, saying why, when set to anything but
    their "off" value. Nothing is ignored. docs/api.md's "Request fields"
    table lists every field and its status.
  * vLLM's extras keep vLLM's meaning and defaults (continuous_usage_stats,
    include_stop_str_in_output, truncate_prompt_tokens, chat echo, ...); where
    this server differs (add_special_tokens defaults to true on chat, unless
    the template is the model's own, which writes its special tokens itself,
    as vLLM assumes; a scoring-only echo counts 0 completion tokens)
    docs/api.md says so.
  * Chat content is a string or a list of parts; text parts are joined with
    "\\n" (as vLLM does), any other part type is refused. The `developer` role
    (OpenAI's newer name for `system`) reaches the template as `system`; a
    message's `name` reaches it too.
  * `priority` (vLLM's request class, an integer, lower first) goes to every
    job of the request.
  * `cache_salt` (vLLM's): a non-empty string that starts the request's KV
    blocks' hash chain, so only requests with the same salt share cached
    prefixes (none: shared with every unsalted request).
  * Several prompts and n > 1 map to choices at index prompt_index * n + k.
  * Every choice carries `"metrics"`: the engine's RequestMetrics.to_dict() of
    the request that produced it (in a stream: on the chunk that finishes it).
  * completions max_tokens 0 + echo (lm-eval's loglikelihood) runs with
    max_tokens 1, as vLLM does, and shows the prompt only: its text and
    logprobs, finish_reason "length", 0 completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ValidationError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, check_cache_salt

Prompt = str | list[int]
MAX_PROMPTS = 256  # prompts in one /v1/completions request
ROLES = ("system", "developer", "user", "assistant")

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "n", "stop", "seed", "ignore_eos", "stop_token_ids",
                    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "min_p", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                    "truncate_prompt_tokens")
_COMMON_FIELDS = {"model", "max_tokens", "stream", "stream_options", "user", "priority", "cache_salt",
                  "add_special_tokens", "prompt_logprobs", "return_tokens_as_token_ids", *_SAMPLING_FIELDS}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "echo",
                                "add_generation_prompt", "continue_final_message", "documents", "chat_template_kwargs"}
MESSAGE_FIELDS = ("role", "content", "name")
# OpenAI and vLLM parameters that are not implemented: the values that mean "not used" (accepted, as is null),
# and why anything else is refused.
UNIMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "only best_of 1 (no candidates beyond n)"),
    "suffix": (("",), "OPT has no fill-in-the-middle"),
    "response_format": (({"type": "text"},), 'only {"type": "text"}: no structured (JSON) output'),
    "tools": (([],), "no tool calling"),
    "tool_choice": (("none",), "no tool calling"),
    "functions": (([],), "no function calling"),
    "function_call": (("none",), "no function calling"),
    "parallel_tool_calls": ((), "no tool calling"),
    "use_beam_search": ((False,), "no beam search"),
    "length_penalty": ((1.0,), "it only applies to beam search, which is not implemented"),
    "guided_json": ((), "no guided (structured) decoding"),
    "guided_regex": ((), "no guided (structured) decoding"),
    "guided_choice": ((), "no guided (structured) decoding"),
    "guided_grammar": ((), "no guided (structured) decoding"),
    "guided_decoding_backend": ((), "no guided (structured) decoding"),
    "guided_whitespace_pattern": ((), "no guided (structured) decoding"),
    "structural_tag": ((), "no guided (structured) decoding"),
    "structured_outputs": ((), "no guided (structured) decoding"),
    "allowed_token_ids": ((), "no allowed-token mask (logit_bias can push tokens up or down)"),
    "bad_words": (([],), "no bad-words filter"),
    "logits_processors": (([],), "no custom logits processors"),
    "chat_template": ((), "no per-request chat template (vLLM refuses it too unless "
                          "--trust-request-chat-template); start the server with --chat-template FILE"),
    "prompt_embeds": ((), "prompts are text or token ids only"),
}


def _is_off(value: object, off: tuple) -> bool:
    """`value` is one of the "not used" values (true is not 1, false is not 0)."""
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)


@dataclass
class ProtocolContext:
    """What parsing needs from the server: model names, tokenizer, template, context length."""

    served_model_names: list[str]
    tokenizer: object  # engine.tokenizer.Tokenizer
    chat_template: object  # serving.chat_template.ChatTemplate
    max_model_len: int
    # add_special_tokens' default on chat: true for a template that leaves BOS to the tokenizer (the default one),
    # false for the model's own (which writes its BOS, as vLLM assumes)
    chat_add_special_tokens: bool = True


@dataclass
class GenerationRequest:
    kind: str  # "completion" | "chat"
    model: str  # the served name the response reports
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage only
    echo: bool = False  # completions: the prompt text comes before the output
    user: str | None = None
    priority: int = 0  # vLLM's request class: lower runs first
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM)
    echo_only: bool = False  # completions max_tokens 0 + echo: the prompt (and its logprobs) only, nothing generated
    role: str = "assistant"  # chat: the reply's role (the last message's with add_generation_prompt false, as vLLM)
    chat_echo: str = ""  # chat echo (vLLM): the last message's content, when it is the reply's role, goes first
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field asked for: returned beside the choices
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefix blocks


# -- parsing ------------------------------------------------------------------------------------------
def parse_completion(body: object, ctx: ProtocolContext) -> GenerationRequest:
    body = _check_fields(body, COMPLETION_FIELDS)
    model = _model(body, ctx)
    prompts = _parse_prompts(body.get("prompt"))
    echo = _opt_bool(body, "echo")
    max_tokens = body.get("max_tokens")
    # lm-eval's loglikelihood: max_tokens 0 + echo scores the prompt and generates nothing (vLLM runs it with
    # max_tokens 1 and shows the prompt only; so do we). Without echo, 0 stays refused (SamplingParams).
    echo_only = echo and _is_token_id(max_tokens) and max_tokens == 0
    params = _sampling_params(body, ctx, max_tokens=1 if echo_only else max_tokens, logprobs=body.get("logprobs"))
    if echo and params.logprobs is not None and params.prompt_logprobs is None:
        params.prompt_logprobs = params.logprobs
    if not _opt_bool(body, "add_special_tokens", default=True):  # no BOS: tokenized here, sent as ids
        prompts = [ctx.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
        if any(not p for p in prompts):
            raise ValidationError("a prompt has no tokens", param="prompt")
    req = _request("completion", model, body, prompts, params, echo=echo)
    req.echo_only = echo_only
    return req


def parse_chat(body: object, ctx: ProtocolContext) -> GenerationRequest:
    body = _check_fields(body, CHAT_FIELDS)
    model = _model(body, ctx)
    raw_messages = body.get("messages")
    messages = _parse_messages(raw_messages)
    add_generation_prompt = _opt_bool(body, "add_generation_prompt", default=True)
    continue_final = _opt_bool(body, "continue_final_message")
    if add_generation_prompt and continue_final:
        raise ValidationError("continue_final_message and add_generation_prompt cannot both be true "
                              "(send add_generation_prompt: false to continue the last message)",
                              param="continue_final_message")
    text = ctx.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final,
                                    documents=_parse_documents(body.get("documents")),
                                    extra=_parse_template_kwargs(body.get("chat_template_kwargs")))
    truncate = _truncation(body, ctx)
    # Our default template leaves OPT's BOS to the tokenizer, so add_special_tokens defaults to true with it
    # (vLLM's default is false: its templates, like a model's own, add their own special tokens).
    prompt_ids = ctx.tokenizer.encode(text, add_special_tokens=_opt_bool(body, "add_special_tokens",
                                                                         default=ctx.chat_add_special_tokens),
                                      truncate_to=truncate)
    if not prompt_ids:
        raise ValidationError("the messages render to an empty prompt", param="messages")
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
    params = _sampling_params(body, ctx, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None)
    req = _request("chat", model, body, [prompt_ids], params)
    # vLLM: without a generation prompt the reply continues the last message, in its role; echo puts the last
    # message's content first when it has the reply's role.
    req.role = "assistant" if add_generation_prompt else raw_messages[-1]["role"]
    if _opt_bool(body, "echo") and raw_messages[-1]["role"] == req.role:
        req.chat_echo = messages[-1]["content"]
    return req


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
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise ValidationError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise ValidationError('stream_options must be {"include_usage": true|false, '
                                  '"continuous_usage_stats": true|false}', param="stream_options")
        # vLLM: include_usage defaults to true once stream_options is sent; continuous_usage_stats (usage on
        # every chunk) counts only with include_usage.
        include_usage = _opt_bool(options, "include_usage", "stream_options.include_usage", default=True)
        continuous = include_usage and _opt_bool(options, "continuous_usage_stats",
                                                 "stream_options.continuous_usage_stats")
    want_prompt_logprobs = body.get("prompt_logprobs") is not None
    if want_prompt_logprobs and stream:
        raise ValidationError("prompt_logprobs are not available with stream: true", param="prompt_logprobs")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ValidationError(f"user must be a string, got {user!r}", param="user")
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_token_id(priority):
        raise ValidationError(f"priority must be an integer (lower runs first), got {priority!r}"[:200],
                              param="priority")
    cache_salt = body.get("cache_salt")
    check_cache_salt(cache_salt)
    return GenerationRequest(kind, model, prompts, params, stream, include_usage, echo, user, priority,
                             continuous_usage=continuous, prompt_logprobs=want_prompt_logprobs,
                             tokens_as_ids=_opt_bool(body, "return_tokens_as_token_ids"), cache_salt=cache_salt)


def _check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ValidationError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, (off, why) in UNIMPLEMENTED.items():
        value = body.get(name)
        if value is not None and not _is_off(value, off):
            raise ValidationError(f"{name} is not supported by this server ({why}); leave it out", param=name,
                                  code="unsupported_parameter")
    unknown = sorted(set(body) - allowed - set(UNIMPLEMENTED))
    if unknown:
        raise ValidationError(f"unknown field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}",
                              param=unknown[0])
    return body


def _opt_bool(body: dict, name: str, param: str | None = None, default: bool = False) -> bool:
    """A boolean field; absent -> `default`, null -> false (as vLLM's optional booleans)."""
    if name not in body:
        return default
    value = body[name]
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValidationError(f"{param or name} must be true or false, got {value!r}"[:200], param=param or name)
    return value


def _truncation(body: dict, ctx: ProtocolContext) -> int | None:
    """truncate_prompt_tokens, checked against the context (vLLM: >= 1 and <= max_model_len)."""
    n = body.get("truncate_prompt_tokens")
    if n is None:
        return None
    if not _is_token_id(n) or n < 1:
        raise ValidationError(f"truncate_prompt_tokens must be an integer >= 1, got {n!r}"[:200],
                              param="truncate_prompt_tokens")
    if n > ctx.max_model_len:
        raise ValidationError(f"truncate_prompt_tokens ({n}) is greater than this model's context (max_model_len "
                              f"{ctx.max_model_len}); pick a smaller value", param="truncate_prompt_tokens")
    return n


def _sampling_params(body: dict, ctx: ProtocolContext, max_tokens, logprobs) -> SamplingParams:
    _truncation(body, ctx)
    kw = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if body.get("prompt_logprobs") is not None:
        kw["prompt_logprobs"] = body["prompt_logprobs"]
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
    """The messages as the template sees them: string content, `developer` as `system`, `name` when given."""
    if not isinstance(value, list) or not value:
        raise ValidationError('messages must be a non-empty list of {"role", "content"} objects', param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValidationError(f'{where} must be an object {{"role", "content"}}', param=where)
        extra = sorted(set(m) - set(MESSAGE_FIELDS))
        if extra:
            raise ValidationError(f"{where} has unsupported field(s) {', '.join(extra)}; "
                                  f"allowed: {', '.join(MESSAGE_FIELDS)}", param=f"{where}.{extra[0]}")
        if m.get("role") not in ROLES:
            raise ValidationError(f"{where}.role must be one of {', '.join(ROLES)}; got {m.get('role')!r}",
                                  param=f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": _content_text(m.get("content"), f"{where}.content")}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ValidationError(f"{where}.name must be a string, got {name!r}"[:200], param=f"{where}.name")
            message["name"] = name
        out.append(message)
    return out


def _parse_documents(value: object) -> list[dict[str, str]] | None:
    """vLLM's `documents` (for RAG templates): a list of {string: string} objects, given to the template."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in value):
        raise ValidationError('documents must be a list of objects of strings (e.g. {"title": ..., "text": ...})',
                              param="documents")
    return value


def _parse_template_kwargs(value: object) -> dict:
    """vLLM's `chat_template_kwargs`: more variables for the template (they may override
    add_generation_prompt, documents, bos_token, eos_token; not messages)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError(f"chat_template_kwargs must be an object, got {value!r}"[:200],
                              param="chat_template_kwargs")
    if "messages" in value:
        raise ValidationError("chat_template_kwargs cannot set messages", param="chat_template_kwargs")
    return value


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

    def _generated(self, c: CompletionOutput) -> int:
        """Tokens the client is told were generated (none for a scoring-only echo)."""
        return 0 if self.req.echo_only else len(c.token_ids)

    def usage(self, outputs: list[RequestOutput | None]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
        completion = sum(self._generated(c) for o in outputs if o is not None for c in o.outputs)
        cached = [o.num_cached_tokens for o in outputs if o is not None and o.num_cached_tokens is not None]
        return _usage(prompt, completion, sum(cached) if cached else None)

    def response(self, outputs: list[RequestOutput]) -> dict:
        """The non-streaming body, from each prompt's final output."""
        choices = [self._choice(p, out, c, _Cursor(), stream=False)
                   for p, out in enumerate(outputs) for c in out.outputs]
        body = self._envelope(choices, chunk=False)
        if self.req.prompt_logprobs and self.req.kind == "chat":  # vLLM: beside the choices for chat
            body["prompt_logprobs"] = self._prompt_logprobs(outputs[0])
        return dict(body, usage=self.usage(outputs))

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the reply's role, as OpenAI does; with chat echo (vLLM), a chunk
        with the last message's content follows. With continuous usage, each carries the prompt's usage."""
        if self.req.kind != "chat":
            return []
        n = len(self.req.prompts) * self.req.params.n
        deltas = [{"role": self.req.role, "content": ""}] + ([{"content": self.req.chat_echo}]
                                                             if self.req.chat_echo else [])
        chunks = []
        for delta in deltas:
            for i in range(n):
                chunk = self._envelope([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                                       chunk=True)
                if self.req.continuous_usage:
                    chunk["usage"] = _usage(len(self.req.prompts[0]), 0)
                chunks.append(chunk)
        return chunks

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Stream chunks for what `out` adds to what was sent (one chunk per changed choice). With
        continuous_usage_stats, every new token gets a chunk (its text may be empty), as vLLM sends one per
        step, and each chunk carries that choice's usage so far."""
        chunks = []
        for c in out.outputs:
            cur = self._cursors.setdefault(self.index(prompt_index, c.index), _Cursor())
            if cur.finished:
                continue
            more_tokens = len(c.token_ids) > cur.tokens and not self.req.echo_only
            has_new = (len(c.text) > cur.chars and not self.req.echo_only) or (
                more_tokens and (c.logprobs is not None or self.req.continuous_usage))
            if has_new or c.finished or (self.req.echo and not cur.started):
                chunk = self._envelope([self._choice(prompt_index, out, c, cur, stream=True)], chunk=True)
                if self.req.continuous_usage:
                    chunk["usage"] = _usage(len(out.prompt_token_ids), self._generated(c))
                chunks.append(chunk)
        return chunks

    def usage_chunk(self, outputs: list[RequestOutput | None]) -> dict:
        return dict(self._envelope([], chunk=True), usage=self.usage(outputs))

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt as echoed: the text of the tokens the model saw (the kept ones under truncation)."""
        if out.prompt is not None and self.req.params.truncate_prompt_tokens is None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids)

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, cur: _Cursor,
                stream: bool) -> dict:
        """One choice holding what `cur` has not sent yet; advances `cur`."""
        if self.req.echo_only:  # the prompt and its logprobs only
            text, ids = "", []
            lps = [] if c.logprobs is not None else None
        else:
            text = c.text[cur.chars:]
            ids = c.token_ids[cur.tokens:]
            lps = c.logprobs[cur.tokens:] if c.logprobs is not None else None
        prompt_part = self.req.echo and not cur.started
        if prompt_part:
            text = self._prompt_text(out) + text
            if lps is not None and out.prompt_logprobs is not None:
                ids, lps = out.prompt_token_ids + ids, out.prompt_logprobs + lps
        cur.chars, cur.tokens, cur.started, cur.finished = len(c.text), len(c.token_ids), True, c.finished
        choice: dict = {"index": self.index(prompt_index, c.index)}
        if self.req.kind == "chat":
            if not stream:
                text = self.req.chat_echo + text
            if stream:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["message"] = {"role": self.req.role, "content": text}
            choice["logprobs"] = self._chat_logprobs(ids, lps) if lps is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(ids, lps, cur) if lps is not None else None
        reason = c.finish_reason
        if self.req.echo_only and reason not in (None, "abort", "error"):
            reason = "length"  # max_tokens 0 reached: the one token the engine drew is not shown
        choice["finish_reason"] = reason
        choice["stop_reason"] = None if self.req.echo_only else c.stop_reason
        if self.req.prompt_logprobs and self.req.kind == "completion" and not stream:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        if c.finished:
            choice["metrics"] = out.metrics.to_dict()
        return choice

    def _prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, null for the first, else {"id": {"logprob", "rank",
        "decoded_token"}} for the token and the top-k alternatives. rank (1 = most likely) is null where it
        is not known here: the prompt token when it is outside the top k."""
        if out.prompt_logprobs is None:
            return None
        k = self.req.params.prompt_logprobs or 0
        result: list = []
        for token, lp in zip(out.prompt_token_ids, out.prompt_logprobs):
            if lp is None:
                result.append(None)
                continue
            ranked = sorted(lp.items(), key=lambda kv: -kv[1])
            outside = len(lp) > k  # the prompt token is not among the top k
            entry = {}
            for r, (i, v) in enumerate(ranked, start=1):
                known = not (outside and i == token)
                entry[str(i)] = {"logprob": _finite(v), "rank": (r if known else None),
                                 "decoded_token": self._token(i)}
            result.append(entry)
        return result

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_name(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:{id}" with return_tokens_as_token_ids (vLLM)."""
        return f"token_id:{token_id}" if self.req.tokens_as_ids else self._token(token_id)

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
            tokens.append(self._token_name(t))
            token_lps.append(None if lp is None else _finite(lp.get(t)))
            tops.append(None if lp is None else {self._token_name(i): _finite(v) for i, v in lp.items()})
            offsets.append(cur.text_offset)
            cur.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list) -> dict:
        top_n = self.req.params.logprobs or 0

        def entry(token_id: int, value: float) -> dict:
            return {"token": self._token_name(token_id), "logprob": _finite(value), "bytes": self._bytes(token_id)}

        content = []
        for t, lp in zip(ids, lps):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(dict(entry(t, lp[t]), top_logprobs=[entry(i, v) for i, v in best]))
        return {"content": content}


def _usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens (prompt tokens read from the prefix cache) only when
    prefix caching is on."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


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
