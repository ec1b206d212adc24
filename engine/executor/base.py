"""Executor: the one interface the engine runs batches through.

Three implementations, each complete: LocalExecutor (world size 1, in this
process), MultiprocExecutor (one worker process per GPU, tensor + pipeline
parallel, engine/executor/multiproc.py) and SimulatedExecutor (a virtual clock
advanced by profiled costs). The engine, the server and the simulator use only
what is declared here.

    future = executor.submit(batch)     # non-blocking; up to max_in_flight at once
    result = future.result()            # BatchResult, in submission order
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.batch import BatchResult, ModelBatch
from engine.executor.device_identity import WorkerDevice
from memory.transfers import TransferBackend


class ExecutorDeadError(RuntimeError):
    """A worker of the executor died (killed, out of memory, an exception): no further step can run."""


class Executor(ABC):
    num_device_blocks: int  # KV blocks of the device tier (the same block ids on every rank)
    block_size: int  # tokens per KV block
    kv_block_bytes: int  # bytes of one block on one device (the largest rank's slice): swap space is per device
    device: torch.device  # where the model runs ("meta" in the simulator: no model runs)
    dtype: torch.dtype
    simulated: bool = False  # True: costs come from a profile on a virtual clock, no model runs
    max_in_flight: int = 1  # batches that may run at once (pipeline stages)
    # Fills a step's placeholders (SequenceWork.fill_last) from the tokens of the step submitted before it, so the
    # engine may queue a step before the one ahead of it has finished (EngineConfig.async_scheduling)
    supports_async_scheduling: bool = False

    @abstractmethod
    def submit(self, batch: ModelBatch) -> Future[BatchResult]:
        """Start one step; results come back in submission order. Raises ExecutorDeadError when dead."""

    def execute(self, batch: ModelBatch) -> BatchResult:
        """Run one step and wait for it."""
        return self.submit(batch).result()

    @abstractmethod
    def attach_host_tier(self, num_host_blocks: int) -> TransferBackend:
        """Allocate the host tier (pinned on CUDA) and return the backend that copies blocks to and from it."""

    def release(self, job_ids: list[str]) -> None:  # noqa: B027 - executors without per-job state keep nothing
        """Forget per-job state of jobs that finished or were aborted."""

    def worker_devices(self) -> list[WorkerDevice]:
        """The GPU of each rank that runs on one, by rank (the dashboard labels NVML's rows with them); [] on CPU
        and in the simulator."""
        return []

    @property
    def error(self) -> str | None:
        """Why the executor can no longer run steps (a dead worker), or None while it can."""
        return None

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:  # noqa: B027 - cannot fail alone
        """Call listener(message), from any thread, when the executor dies (in-process executors never do
        apart from the engine)."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to release in process
        """Stop the workers (worker processes exit, and their device memory with them). Idempotent."""

    def close(self) -> None:
        """For good: shutdown(), and every device tensor released now (LLM.close). Idempotent. Executors whose
        shutdown() already ends their workers (and so their memory) need nothing more."""
        self.shutdown()
