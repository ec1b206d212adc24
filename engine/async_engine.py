"""AsyncEngine: drives the Engine from asyncio for the server.

    aengine = AsyncEngine(Engine(config)); await aengine.start()
    stream = aengine.add_request("r1", "Hello", SamplingParams())   # validates now
    async for out in stream: ...                                     # RequestOutput snapshots
    await aengine.abort("r1")

The loop never blocks the event loop on compute: scheduling and bookkeeping
run on the loop (they are cheap), the forward pass runs in a worker thread
(torch releases the GIL; on CUDA the thread waits for the step's results).
Requests are admitted and aborted on the loop thread while a step runs; the
worker only touches the tensors of the plan it was given, and freed blocks
are reused only by the next schedule, so no lock is needed.

A stream keeps only the newest snapshot (outputs are cumulative), so a slow
reader never holds the engine back and never grows a buffer.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from engine.engine import Engine, Prompt
from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

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
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastserve-step")
        self._task: asyncio.Task | None = None
        self._accepting = True
        self.error: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fastserve-engine-loop")

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish within `timeout` s; abort the rest."""
        self._accepting = False
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
        self._worker.shutdown(wait=True)
        self.engine.executor.shutdown()

    # -- requests ---------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return sum(1 for j in self.engine.scheduler.jobs if j.first_scheduled_time is None)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """Validate and admit; raises ValidationError, QueueFullError or EngineDeadError, changing nothing."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self.error
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        req = self.engine.prepare_request(request_id, prompt, params)
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests)")
        self.engine.admit(req)
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    async def abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream._put(out)

    # -- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                plan = self.engine.schedule_step()
                if plan is None:  # nothing runnable yet (e.g. waiting for memory)
                    await asyncio.sleep(0.001)
                    continue
                try:
                    result = await loop.run_in_executor(self._worker, self.engine.executor.execute, plan.batch)
                except Exception as e:
                    log.exception("forward step failed; failing its batch")
                    outputs = self.engine.fail_step(plan, f"internal error in the forward pass: {type(e).__name__}")
                else:
                    outputs = self.engine.finish_step(plan, result)
                self._dispatch(outputs)
                await asyncio.sleep(0)  # let HTTP handlers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("engine loop died")
            self.error = e
            for stream in self._streams.values():
                stream._fail(EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}"))
            self._streams.clear()
            raise

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
