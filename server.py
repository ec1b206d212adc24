"""FastServe's HTTP server: OpenAI-compatible completions and chat on aiohttp + uvloop.

    fastserve serve [MODEL] [--port 8000] ...     (--help documents every flag; MODEL = --model; none: SmolLM2)
    python server.py [MODEL] [--port 8000] ...    (the same)

Routes: POST /v1/completions and /v1/chat/completions (JSON, or SSE with "stream": true); GET
/v1/models, /version, /metrics (Prometheus text, serving/server_metrics.py), /dashboard (a page to watch;
its JSON /dashboard/data is documented in serving/dashboard.py) and /health: 200 while the engine loop is
alive, 503 when it is not or the server is shutting down; /health and the dashboard page (static, no data)
need no API key.
/health's JSON also reports `running`, `waiting` and the free/total KV blocks of both tiers
(`kv_free_blocks`, `kv_total_blocks`, `kv_host_free_blocks`, `kv_host_total_blocks`).

Errors are OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 bad input, 401 no or
wrong API key, 404 unknown model or route, 408 a body not all in within --request-body-timeout s (then
the connection is closed), 413 body over --max-request-bytes, 500 a failure inside one request (others
are unaffected), 503 queue full or shutting down (with Retry-After) or engine dead. A body's JSON may nest
arrays and objects MAX_JSON_DEPTH (64) deep; deeper is a 400. Once a stream has started, an error is a
`data: {"error": ...}` chunk, then `data: [DONE]`.
When the engine dies (a worker process died, the engine loop failed) the requests in flight get that error,
the workers are stopped, and the process exits with status 1 within a few seconds, so that its supervisor
restarts it (vLLM's behaviour; deploy/ has a systemd unit and a Dockerfile).
Beyond OpenAI's format: each choice has "stop_reason" and, once finished, "metrics" (the engine's
RequestMetrics.to_dict(); times on its monotonic clock); /v1/models gives max_model_len and
vocab_size; X-Request-Id is echoed or generated; vLLM's extras (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, repetition_penalty, priority, cache_salt, skip_special_tokens, include_stop_str_in_output,
truncate_prompt_tokens, prompt_logprobs, stream_options.continuous_usage_stats, chat echo, ...) are
served with vLLM's meaning, and those that cannot be honoured are refused naming the field
(docs/api.md's "Request fields" table).

A client that disconnects has its requests aborted (a watcher polls the transports of live
requests; a failed write does the same); a stream whose client stops reading for
--stream-write-timeout s is aborted and its connection dropped. SIGTERM/SIGINT: new requests get
503, in-flight ones get --shutdown-timeout s, the rest end with finish_reason "abort"; exit 0.
One log line per finished request.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from aiohttp import web

from engine.args import OneLineErrorParser, add_engine_args, config_from_args
from engine.async_engine import AsyncEngine, QueueFullError, RequestStream, merge_streams
from engine.config import EngineConfig
from engine.errors import EngineDeadError, ValidationError
from engine.model_names import SERVE_DEFAULT, is_tiny_opt, model_path
from engine.outputs import RequestOutput
from scheduler.policy import ORACLES
from serving.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from serving.dashboard import PUBLIC_PATHS as DASHBOARD_PAGES
from serving.dashboard import add_dashboard
from serving.gpu_probe import CachedRows, DeviceRows, NvmlProbe
from serving.openai_protocol import ProtocolContext, ResponseBuilder, error_body, parse_chat, parse_completion
from serving.routing import add_fallback_route, add_get, add_post
from serving.server_metrics import CONTENT_TYPE, EngineSnapshot, ServerMetrics

log = logging.getLogger("fastserve.server")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = ("tiny-opt",)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS; empty = off
    max_request_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    stream_write_timeout: float = 30.0
    chat_template: str = DEFAULT_CHAT_TEMPLATE  # Jinja source
    disconnect_poll_s: float = 0.1
    request_body_timeout: float = 60.0  # seconds from a request's headers to the end of its body


# Deepest nesting of arrays and objects in a request body (.NET System.Text.Json's default): no real request
# comes near it, and nothing deeper reaches code that recurses.
MAX_JSON_DEPTH = 64


@dataclass(eq=False)
class _Live:
    """A request being generated, watched for its client going away."""

    request: web.Request
    streams: list[RequestStream]
    gone: bool = False


@dataclass
class ServerState:
    protocol: ProtocolContext
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    live: set[_Live] = field(default_factory=set)
    client_ids: dict[str, str] = field(default_factory=dict)  # engine request id -> X-Request-Id


ENGINE = web.AppKey("engine", AsyncEngine)
CONFIG = web.AppKey("config", ServerConfig)
STATE = web.AppKey("state", ServerState)
DEVICES = web.AppKey("devices", DeviceRows)  # GPU rows (nvidia-ml-py, read in a thread): /metrics, /health, dashboard
REQUEST_ID = web.RequestKey("request_id", str)


class ApiError(Exception):
    """An error answer; `close`: the connection is closed once it is sent."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.body, self.close = status, error_body(message, type_, param, code), close
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


class _ClientGone(Exception):
    """The client disconnected or stopped reading; nothing more can be sent."""


def _too_large(request: web.Request) -> ApiError:
    limit = request.app[CONFIG].max_request_bytes
    return ApiError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


# -- middlewares and signals ------------------------------------------------------------------------------
@web.middleware
async def _errors_middleware(request: web.Request, handler):
    """Request ids, and every failure as an OpenAI error body; one request's failure stays its own."""
    rid = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = rid if 0 < len(rid) <= 128 and rid.isascii() and rid.isprintable() else uuid.uuid4().hex
    if rid and request[REQUEST_ID] != rid:
        return ApiError(400, "X-Request-Id must be 1-128 printable ASCII characters", param="X-Request-Id").response()
    try:
        return await handler(request)
    except ApiError as e:
        if not e.close:
            return e.response()
        resp = e.response()
        resp.force_close()  # "Connection: close"
        await resp.prepare(request)
        await resp.write_eof()
        request.protocol.force_close()  # now: not after aiohttp has read (lingered on) the rest of the body
        return resp
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status == 413:
            return _too_large(request).response()
        return ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                        "invalid_request_error" if e.status < 500 else "server_error").response()
    except Exception as e:
        log.exception("request %s failed", request[REQUEST_ID])
        return ApiError(500, f"internal server error ({type(e).__name__}) in request {request[REQUEST_ID]}",
                        "server_error", code="internal_error").response()


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    """Bearer --api-key on every route but /health and the dashboard's static page, compared in constant time."""
    if request.path != "/health" and request.path not in DASHBOARD_PAGES:
        want = "Bearer " + request.app[CONFIG].api_key
        given = request.headers.get("Authorization", "").encode(errors="surrogateescape")
        if not hmac.compare_digest(given, want.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
    return await handler(request)


def _cors_origin(request: web.Request) -> str | None:
    origin, allowed = request.headers.get("Origin"), request.app[CONFIG].allowed_origins
    return origin if origin and ("*" in allowed or origin in allowed) else None


@web.middleware
async def _cors_middleware(request: web.Request, handler):
    """Answers CORS preflights of allowed origins (before the API key check: browsers send none)."""
    if request.method == "OPTIONS" and _cors_origin(request) and "Access-Control-Request-Method" in request.headers:
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
            "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Request-Id"})
    return await handler(request)


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]
    if request.app[CONFIG].allowed_origins and (origin := _cors_origin(request)):
        response.headers.update({"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                                 "Access-Control-Expose-Headers": "X-Request-Id"})


# -- routes ------------------------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, "cmpl")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, "chatcmpl")


async def models(request: web.Request) -> web.Response:
    engine, created = request.app[ENGINE].engine, request.app[STATE].started
    data = [{"id": name, "object": "model", "created": created, "owned_by": "fastserve",
             "max_model_len": engine.max_model_len, "vocab_size": engine.model_config.vocab_size}
            for name in request.app[CONFIG].served_model_names]
    return web.json_response({"object": "list", "data": data})


async def version(request: web.Request) -> web.Response:
    try:
        return web.json_response({"version": metadata.version("fastserve")})
    except metadata.PackageNotFoundError:
        return web.json_response({"version": "unknown"})


def _snapshot(app: web.Application) -> EngineSnapshot:
    aengine = app[ENGINE]
    engine = aengine.engine
    kv = engine.kv
    return EngineSnapshot(aengine.num_running(), aengine.num_waiting(), kv.num_swapped(), kv.device.num_free,
                          kv.device.num_blocks, kv.host.num_free, kv.host.num_blocks, engine.scheduler_stats(),
                          kv.stats, engine.executor.kv_block_bytes, app[DEVICES].rows(),
                          (kv.device.num_queries, kv.device.num_hits, kv.device.num_cached, kv.device.num_evictable)
                          if kv.prefix_caching else (0, 0, 0, 0))


async def health(request: web.Request) -> web.Response:
    aengine, state = request.app[ENGINE], request.app[STATE]
    ok = aengine.is_alive and not state.draining
    s = _snapshot(request.app)
    body = {"status": "ok" if ok else ("shutting_down" if state.draining else "engine_dead")}
    if aengine.error is not None:
        body["error"] = f"{aengine.error}"  # e.g. which worker rank died
    if s.devices:
        body["gpus"] = s.devices
    return web.json_response(
        {**body, "running": s.num_running,
         "waiting": s.num_waiting, "kv_free_blocks": s.kv_free, "kv_total_blocks": s.kv_total,
         "kv_host_free_blocks": s.host_free, "kv_host_total_blocks": s.host_total}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[STATE].metrics.render(_snapshot(request.app))
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE})


# -- generation --------------------------------------------------------------------------------------------
async def _read_json(request: web.Request) -> object:
    if (request.content_length or 0) > request.app[CONFIG].max_request_bytes:
        raise _too_large(request)
    if request.content_type != "application/json":
        raise ApiError(400, f"Content-Type must be application/json, got {request.content_type or 'none'}",
                       code="invalid_content_type")
    timeout = request.app[CONFIG].request_body_timeout
    try:
        async with asyncio.timeout(timeout):
            data = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
        raise _too_large(request) from None
    except TimeoutError:
        request.app[STATE].metrics.body_timeouts.inc()
        log.info("request %s: the body did not arrive within %g s; closing the connection", request[REQUEST_ID],
                 timeout)
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s of the request's headers "
                       "(--request-body-timeout)", code="request_timeout", close=True) from None
    try:
        body = json.loads(data)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not valid UTF-8 JSON", code="invalid_json") from None
    except RecursionError:  # nested far deeper than MAX_JSON_DEPTH: the parser ran out of stack
        raise _too_deep() from None
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and _nesting_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _too_deep() -> ApiError:
    return ApiError(400, f"the body's JSON nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                    code="json_too_deep")


def _nesting_exceeds(value: object, limit: int) -> bool:
    """Whether `value` nests lists and dicts more than `limit` deep (`[]` is 1 deep); iterative, level by level."""
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (list, dict))]
        if not level:
            return False
    return True


async def _generate(request: web.Request, parse, prefix: str) -> web.StreamResponse:
    aengine, state = request.app[ENGINE], request.app[STATE]
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable_error", code="shutting_down",
                       retry_after=5)
    body = await _read_json(request)
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        req = parse(body, state.protocol)
        streams = aengine.add_requests([(f"{response_id}-{i}", p, req.params) for i, p in enumerate(req.prompts)],
                                       priority=req.priority, cache_salt=req.cache_salt)
    except ValidationError as e:
        raise ApiError(404 if e.code == "model_not_found" else 400, e.message, param=e.param, code=e.code) from None
    except QueueFullError as e:
        raise ApiError(503, f"{e}; retry later", "service_unavailable_error", code="queue_full",
                       retry_after=1) from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), "service_unavailable_error", code="engine_unavailable") from None
    state.client_ids.update((s.request_id, request[REQUEST_ID]) for s in streams)
    builder = ResponseBuilder(req, response_id, int(time.time()), state.protocol.tokenizer)
    live = _Live(request, streams)
    state.live.add(live)
    try:
        return await (_stream(request, builder, live) if req.stream else _collect(builder, live))
    finally:
        state.live.discard(live)
        for s in streams:
            await s.abort()  # no-op once finished
            state.client_ids.pop(s.request_id, None)


def _failure(outputs: list[RequestOutput | None]) -> str | None:
    """The error message of the first failed sequence, if any."""
    return next((c.error or "generation failed" for o in outputs if o for c in o.outputs
                 if c.finish_reason == "error"), None)


async def _collect(builder: ResponseBuilder, live: _Live) -> web.Response:
    final: list[RequestOutput | None] = [None] * len(live.streams)
    try:
        async for i, out in merge_streams(live.streams):
            final[i] = out
    except EngineDeadError as e:
        raise ApiError(500, str(e), "server_error", code="engine_dead") from None
    if live.gone or None in final:
        return web.Response(status=499, text="client closed the connection")  # nobody reads it
    if (message := _failure(final)) is not None:
        raise ApiError(500, message, "server_error", code="generation_failed")
    return web.json_response(builder.response(final))


async def _stream(request: web.Request, builder: ResponseBuilder, live: _Live) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    timeout = request.app[CONFIG].stream_write_timeout

    async def send(data: bytes) -> None:
        try:
            await asyncio.wait_for(resp.write(data), timeout)
        except (ConnectionError, asyncio.TimeoutError) as e:
            if request.transport is not None:
                request.transport.abort()  # drop a client that stopped reading
            raise _ClientGone(type(e).__name__) from None

    async def send_json(obj: dict) -> None:
        await send(b"data: " + json.dumps(obj).encode() + b"\n\n")

    latest: list[RequestOutput | None] = [None] * len(live.streams)
    try:
        try:
            for chunk in builder.first_chunks():
                await send_json(chunk)
            async for i, out in merge_streams(live.streams):
                latest[i] = out
                for chunk in builder.chunks(i, out):
                    await send_json(chunk)
                if (message := _failure([out])) is not None:
                    await send_json(error_body(message, "server_error", code="generation_failed"))
                    break
            else:
                if builder.req.include_usage:
                    await send_json(builder.usage_chunk(latest))
        except EngineDeadError as e:
            await send_json(error_body(str(e), "server_error", code="engine_dead"))
        except _ClientGone:
            raise
        except Exception as e:
            log.exception("stream %s failed", builder.response_id)
            await send_json(error_body(f"internal server error ({type(e).__name__})", "server_error",
                                       code="internal_error"))
        await send(b"data: [DONE]\n\n")
    except _ClientGone as e:
        live.gone = True
        log.info("client of %s is gone (%s); its requests are aborted", builder.response_id, e)
    return resp


# -- lifecycle -----------------------------------------------------------------------------------------------
def _finish_listener(state: ServerState):
    def on_finished(out: RequestOutput) -> None:
        state.metrics.observe_finished(out)
        m, client = out.metrics, state.client_ids.get(out.request_id)
        log.info("request %s%s finished: reason=%s prompt_tokens=%d output_tokens=%d ttft=%s e2e=%s",
                 out.request_id, f" (X-Request-Id {client})" if client else "",
                 ",".join(sorted({c.finish_reason or "abort" for c in out.outputs})), len(out.prompt_token_ids),
                 sum(len(c.token_ids) for c in out.outputs), "-" if m.ttft_s is None else f"{m.ttft_s:.3f}s",
                 "-" if m.e2e_s is None else f"{m.e2e_s:.3f}s")
    return on_finished


async def _watch_disconnects(app: web.Application) -> None:
    state = app[STATE]
    while True:
        await asyncio.sleep(app[CONFIG].disconnect_poll_s)
        for live in list(state.live):
            transport = live.request.transport
            if not live.gone and (transport is None or transport.is_closing()):
                live.gone = True
                log.info("client went away; aborting %s", ", ".join(s.request_id for s in live.streams))
                for s in live.streams:
                    await s.abort()


async def _engine_ctx(app: web.Application):
    await app[ENGINE].start()
    watcher = asyncio.create_task(_watch_disconnects(app), name="fastserve-disconnect-watcher")
    yield
    watcher.cancel()
    await app[ENGINE].shutdown(0)  # a no-op after drain()


async def drain(app: web.Application) -> None:
    """Stop admitting (503), give in-flight requests --shutdown-timeout s, then abort the rest."""
    app[STATE].draining = True
    await app[ENGINE].shutdown(app[CONFIG].shutdown_timeout)


def create_app(async_engine: AsyncEngine, server_config: ServerConfig) -> web.Application:
    cfg, tok = server_config, async_engine.engine.tokenizer
    middlewares = ([_cors_middleware] if cfg.allowed_origins else []) + [_errors_middleware]
    app = web.Application(middlewares=middlewares + ([_auth_middleware] if cfg.api_key else []),
                          client_max_size=cfg.max_request_bytes)
    special = {f"{name}_token": tok.decode([i], skip_special_tokens=False) if i is not None else ""
               for name, i in (("bos", tok.bos_token_id), ("eos", tok.eos_token_id))}
    own = cfg.chat_template == DEFAULT_CHAT_TEMPLATE and tok.chat_template  # no --chat-template: the model's own
    protocol = ProtocolContext(list(cfg.served_model_names), tok, ChatTemplate(own or cfg.chat_template, **special),
                               async_engine.engine.max_model_len, chat_add_special_tokens=not own)
    app[ENGINE], app[CONFIG] = async_engine, cfg
    app[STATE] = state = ServerState(protocol, ServerMetrics(cfg.served_model_names[0]))
    async_engine.finish_listeners.append(_finish_listener(state))
    add_post(app, "/v1/completions", completions)
    add_post(app, "/v1/chat/completions", chat_completions)
    for path, handler in (("/v1/models", models), ("/version", version), ("/health", health), ("/metrics", metrics)):
        add_get(app, path, handler)
    app.cleanup_ctx.append(_engine_ctx)
    app[DEVICES] = devices = CachedRows(NvmlProbe(async_engine.engine.executor.worker_devices()))
    app.cleanup_ctx.append(devices.cleanup_ctx)  # NVML is read in a thread, never on the event loop
    add_dashboard(app, async_engine, cfg.served_model_names[0], devices)
    add_fallback_route(app)  # last: unknown paths and methods get 404 / 405 bodies
    app.on_shutdown.append(drain)
    app.on_response_prepare.append(_on_prepare)
    return app


# -- command line ----------------------------------------------------------------------------------------------
def build_parser(prog: str = "server.py") -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=prog, description="FastServe: an OpenAI-compatible server for OPT, Llama, Qwen2 and "
                                                  "Mistral models (Hugging Face directories or GGUF files).")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help=f"the model, the same as --model (`fastserve serve MODEL`, as `vllm serve MODEL`) (default: "
                        f"{SERVE_DEFAULT}; tiny-opt: the built-in tiny random-weight model)")

    def flag(name: str, doc: str, **kw) -> None:  # every help line says its default
        p.add_argument(name, help=doc if "default" in doc else doc + " (default: %(default)s)", **kw)

    add_engine_args(p)
    srv = ServerConfig()
    flag("--host", "address to listen on", default="127.0.0.1")
    flag("--port", "port to listen on (0: any free port)", type=int, default=8000)
    flag("--served-model-name", "model name(s) clients use; responses report the first "
         f"(default: the model as given, or {SERVE_DEFAULT})", nargs="+")
    flag("--api-key", "require 'Authorization: Bearer KEY' on every route but /health and the /dashboard page "
         "(default: $FASTSERVE_API_KEY, else none)", default=os.environ.get("FASTSERVE_API_KEY"))
    flag("--allowed-origins", "CORS: comma-separated origins, or '*' (default: CORS off)", default="")
    flag("--chat-template", "Jinja chat template file (default: the model's own, from tokenizer_config.json, "
         "chat_template.jinja or GGUF metadata; else serving/chat_template.py's)")
    flag("--shutdown-timeout", "seconds in-flight requests get after SIGTERM before they are aborted",
         type=float, default=srv.shutdown_timeout)
    flag("--max-request-bytes", "largest request body; larger ones get 413", type=int,
         default=srv.max_request_bytes)
    flag("--stream-write-timeout", "seconds a stream waits on a client that stops reading before "
         "aborting it", type=float, default=srv.stream_write_timeout)
    flag("--request-body-timeout", "seconds a request body may take to arrive in all, from the end of its "
         "headers (a total, not nginx's gap between two reads, which a client sending a byte a second never "
         "reaches); later: 408 and the connection is closed", type=float, default=srv.request_body_timeout)
    flag("--log-level", "log level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from the flags; a bad value raises ValueError."""
    if args.model_tag is not None:  # the positional MODEL: --model's value, unless both are given and differ
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ; give the model once")
        args.model = args.model_tag
    if args.model is None:  # no model given: a real small one (SmolLM2-135M-Instruct; engine/model_names.py)
        args.model = SERVE_DEFAULT
    if not is_tiny_opt(args.model):  # a named model that is not installed: one line saying how to get it
        try:
            model_path(args.model)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_request_bytes < 1 or args.shutdown_timeout < 0 or args.stream_write_timeout <= 0:
        raise ValueError("--max-request-bytes must be >= 1, --shutdown-timeout >= 0, --stream-write-timeout > 0")
    if not 0 < args.request_body_timeout < float("inf"):
        raise ValueError(f"--request-body-timeout must be a number of seconds > 0, got {args.request_body_timeout}")
    template = DEFAULT_CHAT_TEMPLATE
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read --chat-template {args.chat_template}: {e.strerror}") from None
    ChatTemplate(template)  # raises ValueError if it does not parse
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    if args.scheduling_policy in {p.value for p in ORACLES}:
        raise ValueError(f"--scheduling-policy {args.scheduling_policy} is the simulator's oracle (it reads true "
                         "output lengths); a server cannot run it")
    return (config_from_args(args),
            ServerConfig(tuple(args.served_model_name or [args.model]), args.api_key or None,
                         origins, args.max_request_bytes, args.shutdown_timeout, args.stream_write_timeout, template,
                         request_body_timeout=args.request_body_timeout))


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (before the model loads) so that a port in use is said at once;
    OSError with a one-line message otherwise."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        hint = "; pick another with --port (0: any free port)" if e.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


async def serve(app: web.Application, sock: socket.socket, access_log: bool = False) -> int:
    """Serve on the bound `sock` until SIGTERM/SIGINT, then drain and return 0; or until the engine dies (a
    worker process died, the engine loop failed), then return 1 at once, as vLLM does, so that a supervisor
    (systemd, Kubernetes) restarts the server: every request in flight has had its error by then, and every
    worker has been stopped and reaped."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0,
                           access_log=logging.getLogger("aiohttp.access") if access_log else None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    cfg = app[CONFIG]
    auth = ' -H "Authorization: Bearer $FASTSERVE_API_KEY"' if cfg.api_key else ""
    engine_cfg = app[ENGINE].engine.config
    print(f"FastServe: serving {cfg.served_model_names[0]} on http://{host}:{port} (scheduling "
          f"{engine_cfg.scheduling_policy}, kv {engine_cfg.kv_policy}) ; try: curl "
          f"http://{host}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
          """-d '{"prompt": "Hello", "max_tokens": 16}'""", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(app[ENGINE].wait_failed())
    await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
    if not stopped.done():  # the engine died; every request has ended with its error (AsyncEngine._run)
        stopped.cancel()
        error = failed.result()
        log.error("exiting with status 1: the engine is dead (%s: %s); a supervisor should restart the server",
                  type(error).__name__, error)
        app[STATE].draining = True
        await runner.cleanup()  # the handlers write the errors they hold; the workers are stopped and reaped
        log.info("stopped")
        return 1
    failed.cancel()
    log.info("shutting down: no new requests; in-flight ones get %.1f s", cfg.shutdown_timeout)
    await drain(app)  # the listener stays open meanwhile, answering 503
    await runner.cleanup()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None, prog: str = "server.py") -> int:
    """`python server.py ...` and `fastserve serve ...` (prog: how errors name the command)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_cfg, server_cfg = _configs(args)
        sock = listen(args.host, args.port)
    except (ValueError, OSError) as e:  # bad flag values, unreadable template file, address in use
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    try:
        from engine.engine import Engine  # torch and the model: only once the flags and the port are good

        if is_tiny_opt(engine_cfg.model):  # the built-in tiny model, built on first use (the engine only loads)
            from modelmaker.tiny_model import ensure_tiny_model

            ensure_tiny_model()
        engine = Engine(engine_cfg)
    except (ValueError, OSError, RuntimeError) as e:  # bad or unreadable model files, workers that failed to start
        sock.close()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    app = create_app(AsyncEngine(engine, engine_cfg.max_queued_requests), server_cfg)
    coro = serve(app, sock, access_log=args.log_level == "debug")
    try:
        import uvloop
    except ImportError:  # no uvloop on this platform: asyncio's own loop serves the same
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
