"""The load generator's HTTP side: one streaming completion request, timed, against any OpenAI-compatible server.

What this is: `send_request()` POSTs one /v1/completions body with "stream": true and reads the SSE reply
through `StreamState`, which records what benchmark_serving records (time to the first text chunk, the gaps
between text chunks, end-to-end latency, generated token count from `usage` or else the number of text
chunks, and usage's prompt_tokens and prompt_tokens_details.cached_tokens when sent) and, when the server gives
them, FastServe's per-request metrics (queued_s, executing_s,
swap_wait_s, preemptions: the finishing choice's or `usage`'s "metrics" object; absent on vLLM).
`server_info()` asks /v1/models for the model name and, if told, max_model_len and vocab_size.
What this is not: metric arithmetic (metrics.py) or pacing (loadgen.py).

SSE rules: only `data:` lines matter; `data: [DONE]` ends the stream; a `data: {"error": ...}` chunk fails the
request with its message; a stream that ends without [DONE] has failed; a chunk that is not JSON fails it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

DONE = object()  # parse_sse_line's value for `data: [DONE]`
BREAKDOWN_KEYS = ("queued_s", "executing_s", "swap_wait_s", "preemptions")


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int  # max_tokens asked for
    start_s: float = 0.0  # when it was sent, seconds after the run started
    success: bool = False
    output_tokens: int = 0  # generated tokens: usage.completion_tokens, else text chunks
    ttft: float = 0.0  # seconds from send to the first text chunk
    itl: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    latency: float = 0.0  # seconds from send to the last text chunk
    error: str = ""
    server_metrics: dict | None = None  # FastServe's per-request metrics, None on other servers
    generated_text: str = ""
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the server sends usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix cache hits), if sent


def parse_sse_line(line: str) -> object:
    """The JSON value of a `data:` line, DONE for `data: [DONE]`, None for anything else (comments, blanks,
    event:/id: fields). Raises ValueError for a data line that is not JSON."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return DONE
    try:
        return json.loads(payload)
    except json.JSONDecodeError as e:
        raise ValueError(f"stream chunk is not JSON ({e.msg}): {payload[:200]!r}") from None


class StreamState:
    """Folds the events of one stream into a RequestResult; `feed` returns True once the stream is over."""

    def __init__(self, result: RequestResult, sent_at: float):
        self.result, self.sent_at = result, sent_at
        self.last_chunk_at: float | None = None
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.done = False

    def feed_line(self, line: str, now: float) -> bool:
        try:
            event = parse_sse_line(line)
        except ValueError as e:
            return self.fail(str(e))
        if event is None:
            return False
        if event is DONE:
            self.done = True
            return True
        return self.feed(event, now)

    def feed(self, chunk: object, now: float) -> bool:
        if not isinstance(chunk, dict):
            return self.fail(f"stream chunk is not a JSON object: {str(chunk)[:200]}")
        if "error" in chunk:
            err = chunk["error"]
            return self.fail(str(err.get("message", err) if isinstance(err, dict) else err))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.result.prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.result.cached_tokens = details["cached_tokens"]
            self._take_metrics(usage.get("metrics"))
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
            if text:
                if self.last_chunk_at is None:
                    self.result.ttft = now - self.sent_at
                else:
                    self.result.itl.append(now - self.last_chunk_at)
                self.last_chunk_at = now
                self.chunks += 1
                self.result.generated_text += text
            self._take_metrics(choice.get("metrics"))
        return False

    def _take_metrics(self, metrics: object) -> None:
        if isinstance(metrics, dict):
            self.result.server_metrics = {k: metrics[k] for k in BREAKDOWN_KEYS
                                          if isinstance(metrics.get(k), (int, float))}

    def fail(self, message: str) -> bool:
        self.result.error = message
        return True

    def finish(self, now: float) -> RequestResult:
        """The result once the stream has ended (at `now`), however it ended."""
        r = self.result
        if not r.error and not self.done:
            r.error = "the stream ended without data: [DONE]"
        r.success = not r.error
        if r.success:
            r.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
            end = self.last_chunk_at if self.last_chunk_at is not None else now
            r.latency = end - self.sent_at
            if self.last_chunk_at is None:  # no text at all: the first output is seen at the end
                r.ttft = r.latency
        return r


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    body = (await resp.text(errors="replace"))[:1000]
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.strip() or resp.reason
    return f"HTTP {resp.status}: {message}"


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, result: RequestResult,
                       timeout_s: float) -> RequestResult:
    """POST `payload` (a streaming completions body) and time its reply; never raises for a failed request."""
    sent_at = time.perf_counter()
    state = StreamState(result, sent_at)
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                state.fail(await _error_message(resp))
            else:
                async for raw in resp.content:
                    if state.feed_line(raw.decode("utf-8", errors="replace"), time.perf_counter()):
                        break
    except asyncio.TimeoutError:
        state.fail(f"timed out after {timeout_s:g} s")
    except aiohttp.ClientError as e:
        state.fail(f"{type(e).__name__}: {e}")
    return state.finish(time.perf_counter())


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None = None
    vocab_size: int | None = None


async def server_info(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 30.0) -> ServerInfo:
    """The first model /v1/models lists, with what it says about its limits."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {url} failed: {await _error_message(resp)}")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise RuntimeError(f"cannot ask {url} which model it serves ({type(e).__name__}: {e}); "
                           "is the server up? or pass --model") from None
    try:
        first = body["data"][0]
        model = first["id"]
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET {url} returned no models: {str(body)[:200]}; pass --model") from None
    as_int = lambda v: v if isinstance(v, int) and v > 0 else None
    return ServerInfo(str(model), as_int(first.get("max_model_len")), as_int(first.get("vocab_size")))
