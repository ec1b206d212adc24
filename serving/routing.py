"""Two pieces of routing that aiohttp handles before (and outside) the app's middlewares, made to answer
like every other route:

- `expect_handler`: an `Expect` header. aiohttp's default answers anything but `100-continue` with a plain
  417, and with a 500 when the value is not UTF-8 (it builds the 417's text from the raw value and fails to
  encode it; found by tests/test_fuzz_http.py). Here: 100-continue as aiohttp does, anything else a 417
  with OpenAI's error body. Every route is registered with it (`add_get`, `add_post`).
- `add_fallback_route`: requests that no route matches go to a catch-all route (registered last, with the
  same expect handler) that raises aiohttp's own 404 / 405, which the error middleware turns into OpenAI
  error bodies as before.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import _default_expect_handler  # 100-continue: the interim response

from serving.openai_protocol import error_body

_FALLBACK = web.AppKey("fallback_resource", object)


async def expect_handler(request: web.Request) -> web.Response | None:
    if request.headers.get(hdrs.EXPECT, "").lower() == "100-continue":
        return await _default_expect_handler(request)
    body = error_body("unsupported Expect header: only '100-continue' is", "invalid_request_error", "Expect",
                      "expectation_failed")
    return web.json_response(body, status=417)


def add_get(app: web.Application, path: str, handler) -> None:
    app.router.add_get(path, handler, expect_handler=expect_handler)  # and HEAD, as aiohttp's add_get


def add_post(app: web.Application, path: str, handler) -> None:
    app.router.add_post(path, handler, expect_handler=expect_handler)


async def _unrouted(request: web.Request) -> web.StreamResponse:
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.app[_FALLBACK]:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def add_fallback_route(app: web.Application) -> None:
    """Register after every other route."""
    route = app.router.add_route("*", "/{_unrouted_path:.*}", _unrouted, expect_handler=expect_handler)
    app[_FALLBACK] = route.resource
