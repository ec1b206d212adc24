"""AsyncEngine: drives the Engine from asyncio for the server.

    aengine = AsyncEngine(Engine(config)); await aengine.start()
    stream = aengine.add_request("r1", "Hello", SamplingParams())   # validates now
    async for out in stream: ...                                     # RequestOutput snapshots
    await aengine.abort("r1")

The loop never blocks the event loop on compute: scheduling and bookkeeping
run on the loop (they are cheap); the executor runs each step elsewhere (its
own thread in process, worker processes under tensor/pipeline parallelism)
and the loop awaits its future. With pipeline parallelism up to pp steps are
in flight at once (Engine.launch_steps). Requests are admitted and aborted on
the loop thread while steps run; an executor only touches the tensors of the
plans it was given, and freed blocks are reused only by later steps, which
every device runs in order, so no lock is needed. An executor that dies (a
worker process killed) ends every request with an error and the loop stops;
wait_failed() returns then (the server exits, so that a supervisor restarts it).

A stream keeps only the newest snapshot (outputs are cumulative), so a slow
reader never holds the engine back and never grows a buffer.

For the server: add_requests() admits a group (the prompts of one HTTP
request) all or nothing; merge_streams() reads a group as one iterator;
finish listeners see every finished request once (finished, aborted or
failed), whether or not anyone still reads its stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from engine.errors import EngineDeadError, ValidationError
from engine.executor.base import ExecutorDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the server parses its flags before torch is imported
    from engine.engine import Engine, Prompt

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests; retry later."""


class RequestStream:
    """Async iterator over one request's outputs; the newest snapshot wins."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False

    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        if self._latest is None:
            self.finished = True
            raise self._error or EngineDeadError("the engine stopped")
        out, self._latest = self._latest, None
        self.finished = out.finished
        if self._error is not None:  # the engine died after this snapshot: the next read raises
            self._event.set()
        return out

    async def abort(self) -> None:
        if not self.finished:
            self.finished = True
            await self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_requests: int | None = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._closed = False
        self.error: BaseException | None = None
        self._failed = asyncio.Event()  # set when the loop dies (not when it is shut down)
        # Called with each finished request's last output (finished, aborted or failed), on the loop.
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name="fastserve-engine-loop")
            # A worker that dies while the loop is idle must still end every request within a second.
            self.engine.executor.add_failure_listener(lambda _message: self._wake_from_thread(loop))

    def _wake_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the loop from the executor's thread; nothing to do once the event loop has closed (a worker that
        dies during or after shutdown: nobody waits any more)."""
        try:
            loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:  # "Event loop is closed"
            pass

    async def wait_failed(self) -> BaseException | None:
        """Return, with the error, once the engine loop has died (a dead worker, a bug); never while it runs or
        after a shutdown."""
        await self._failed.wait()
        return self.error

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish within `timeout` s; abort the rest.
        Idempotent: a second call returns at once."""
        self._accepting = False
        if self._closed:
            return
        self._closed = True
        deadline = asyncio.get_running_loop().time() + timeout
        while self._streams and asyncio.get_running_loop().time() < deadline and self.is_alive:
            await asyncio.sleep(0.01)
        for rid in list(self._streams):
            await self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.engine.shutdown()

    # -- requests ---------------------------------------------------------------------------
    def num_waiting(self) -> int:
        """Requests none of whose sequences has been scheduled yet (what --max-queued-requests bounds)."""
        return sum(1 for r in self.engine.requests.values() if r.metrics.first_scheduled_time is None)

    def num_running(self) -> int:
        """Requests that have been scheduled at least once and are not finished."""
        return len(self.engine.requests) - self.num_waiting()

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Validate and admit; raises ValidationError, QueueFullError or EngineDeadError, changing nothing."""
        return self.add_requests([(request_id, prompt, params)], priority, cache_salt)[0]

    def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams | None]],
                     priority: int = 0, cache_salt: str | None = None) -> list[RequestStream]:
        """Admit a group all or nothing: every request is validated before any is admitted, and the
        group is one admission decision (admitted while fewer than --max-queued-requests wait).
        `priority` (vLLM's request class, lower first) and `cache_salt` apply to every request of the group."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self.error
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        ids = [rid for rid, _, _ in items]
        if len(set(ids)) != len(ids):
            raise ValidationError("request ids within a group must be distinct", param="request_id")
        reqs = [self.engine.prepare_request(rid, prompt, params, priority=priority, cache_salt=cache_salt)
                for rid, prompt, params in items]
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests)")
        streams = []
        for req in reqs:
            self.engine.admit(req)
            stream = RequestStream(req.request_id, self)
            self._streams[req.request_id] = stream
            streams.append(stream)
        self._wakeup.set()
        return streams

    async def abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream._put(out)
        if out is not None:
            self._notify_finished(out)

    # -- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if engine.executor.error is not None:
                    raise ExecutorDeadError(engine.executor.error)
                if not engine.has_unfinished() and not engine.in_flight:
                    if engine.kv.pending_transfers():  # copies of aborted jobs: their blocks free when done
                        engine.kv.poll()
                        await asyncio.sleep(0.001)
                        continue
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                engine.launch_steps()  # up to pp steps in flight; the executor runs them off this thread
                if not engine.in_flight:  # nothing runnable yet (e.g. waiting for memory or a copy)
                    await asyncio.sleep(0.001)
                    continue
                try:
                    await asyncio.wrap_future(engine.in_flight[0][1])
                except ExecutorDeadError:
                    raise
                except Exception:
                    pass  # complete_step fails the batch and logs it
                self._dispatch(engine.complete_step())
                await asyncio.sleep(0)  # let HTTP handlers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if isinstance(e, ExecutorDeadError):  # said in one line where it was found (engine/executor/)
                log.error("engine loop stopped: %s", e)
            else:
                log.exception("engine loop died")
            self.error = e
            self._failed.set()
            message = f"the engine loop died: {type(e).__name__}: {e}"
            for stream in self._streams.values():
                stream._fail(EngineDeadError(message))
            self._streams.clear()
            self._fail_all(message)
            raise

    def _fail_all(self, message: str) -> None:
        """After the loop died: end every request with an error, returning its KV blocks (best effort)."""
        for request_id in list(self.engine.requests):
            try:
                out = self.engine.fail(request_id, message)
            except Exception:
                log.exception("could not release request %s after the engine loop died", request_id)
                continue
            if out is not None:
                self._notify_finished(out)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
        for out in outputs:
            if out.finished:
                self._notify_finished(out)

    def _notify_finished(self, out: RequestOutput) -> None:
        for listener in self.finish_listeners:
            try:
                listener(out)
            except Exception:  # a listener (metrics, logs) must never take the engine loop down
                log.exception("finish listener failed for request %s", out.request_id)


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as (stream index, output), in the order they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for fut in pending:
            fut.cancel()
