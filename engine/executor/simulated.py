"""SimulatedExecutor: runs no model; advances a VirtualClock by each
iteration's profiled cost, so the real engine loop, scheduler and KV manager
run at any scale on a laptop (`fastserve simulate`).

Parallelism: the profile gives the cost of one iteration on the setup's GPUs
(tensor parallelism is inside that number: scripts/tools/make_sim_profiles.py
scales compute and bandwidth by the GPU count). With pipeline parallelism the
setup's GPUs form `pp` stages of tp GPUs each; a stage holds 1/pp of the
layers on 1/pp of the GPUs, so it takes the profiled time, and a batch passes
through all stages (latency pp x cost). Up to `max_in_flight` batches (pp by
default; 1 = no pipelining) occupy different stages at once, so at full load
throughput is up to pp times that of one batch at a time.

Costs come from a job profile (scheduler/cost_model.py); KV transfers take
bytes / bandwidth on one copy engine per direction, overlapped with compute:
a copy starts when its engine is free and completes at a virtual time; waiting
on it is the engine's business: a job whose copy has not completed is not
ready, and when nothing can run the simulator jumps the clock to the next
completion (next_completion). Every job samples
the same ordinary token, so outputs run to max_tokens (use ignore_eos).
"""

from __future__ import annotations

import heapq
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.batch import BatchResult, ModelBatch, SequenceResult
from engine.clock import VirtualClock
from engine.executor.base import Executor
from memory.transfers import NO_LIMIT, Direction
from scheduler.cost_model import ProfiledCostModel

SIMULATED_TOKEN = 4  # any id that is not BOS/EOS/PAD


@dataclass
class TransferModel:
    host_to_device_bytes_per_s: float = 25e9  # PCIe 4.0 x16, achievable
    device_to_host_bytes_per_s: float = 25e9


class _VirtualCopy:
    def __init__(self, clock: VirtualClock, end: float) -> None:
        self._clock, self.end = clock, end

    def done(self) -> bool:
        return self._clock.now() >= self.end


class SimulatedSwapper:
    """The TransferBackend of the simulator: one copy engine per direction."""

    def __init__(self, clock: VirtualClock, block_bytes: int, transfer: TransferModel) -> None:
        self.clock, self.block_bytes, self.transfer = clock, block_bytes, transfer
        self._busy_until = {Direction.OFFLOAD: 0.0, Direction.UPLOAD: 0.0}
        self._ends: list[float] = []  # heap: completion times of the copies issued
        self.bytes_copied = 0

    def next_completion(self) -> float | None:
        """The earliest virtual time a copy still in flight completes (None: none in flight)."""
        now = self.clock.now()
        while self._ends and self._ends[0] <= now:
            heapq.heappop(self._ends)
        return self._ends[0] if self._ends else None

    def copy(self, direction: Direction, pairs: list[tuple[int, int]]) -> _VirtualCopy:
        nbytes = len(pairs) * self.block_bytes
        bw = (self.transfer.device_to_host_bytes_per_s if direction is Direction.OFFLOAD
              else self.transfer.host_to_device_bytes_per_s)
        start = max(self.clock.now(), self._busy_until[direction])
        end = start + nbytes / bw
        self._busy_until[direction] = end
        heapq.heappush(self._ends, end)
        self.bytes_copied += nbytes
        return _VirtualCopy(self.clock, end)

    def in_flight(self, direction: Direction) -> bool:
        """Whether a copy in this direction has not completed yet (one engine per direction: copies queue)."""
        return self.clock.now() < self._busy_until[direction]

    def host_blocks_ready(self) -> int:
        return NO_LIMIT  # a virtual host tier is all there at once


class _VirtualStep(Future):
    """A step's future on the virtual clock: its result is there at once, but reading it advances the clock
    to the time the step's last stage finishes (as waiting for a real step would)."""

    def __init__(self, clock: VirtualClock, end: float, result: BatchResult) -> None:
        super().__init__()
        self._clock, self.end = clock, end
        self.set_result(result)

    def result(self, timeout: float | None = None) -> BatchResult:
        if self._clock.now() < self.end:
            self._clock.advance(self.end - self._clock.now())
        return super().result(timeout)


class SimulatedExecutor(Executor):
    simulated = True

    def __init__(
        self,
        cost: ProfiledCostModel,
        clock: VirtualClock,
        num_device_blocks: int,
        block_size: int,
        kv_block_bytes: int,
        transfer: TransferModel | None = None,
        dtype: torch.dtype = torch.float16,
        pipeline_parallel_size: int = 1,
        max_in_flight: int | None = None,
    ) -> None:
        self.device, self.dtype = torch.device("meta"), dtype  # no device: costs come from the profile
        self.cost, self.clock = cost, clock
        self.num_device_blocks, self.block_size = num_device_blocks, block_size
        self.kv_block_bytes = kv_block_bytes
        self.transfer = transfer or TransferModel()
        self.swapper: SimulatedSwapper | None = None
        self.busy_s = 0.0  # seconds the first stage computed (= the whole pipe's work / pp)
        # Copy stalls (note_idle): virtual seconds no step ran while requests waited and a KV copy was in flight
        # (the steps waited for it), and of those, the seconds an upload was among the copies in flight.
        self.copy_wait_s = 0.0
        self.upload_wait_s = 0.0
        self.pp = pipeline_parallel_size
        self.max_in_flight = max_in_flight or pipeline_parallel_size
        self._stage_free = [0.0] * pipeline_parallel_size  # virtual time each stage finishes its queued work

    def attach_host_tier(self, num_host_blocks: int) -> SimulatedSwapper:
        self.swapper = SimulatedSwapper(self.clock, self.kv_block_bytes, self.transfer)
        return self.swapper

    def submit(self, batch: ModelBatch) -> Future[BatchResult]:
        """Book the batch on each stage in turn; reading the result advances the clock to its end."""
        prefill = [len(s.token_ids) for s in batch.seqs if s.start_pos == 0]
        decode = [s.start_pos + 1 for s in batch.seqs if s.start_pos > 0 and len(s.token_ids) == 1]
        chunks = [(s.start_pos, len(s.token_ids)) for s in batch.seqs if s.start_pos > 0 and len(s.token_ids) > 1]
        seconds = self.cost.batch_cost(prefill, decode, chunks)  # one stage's time
        t = self.clock.now()
        for stage in range(self.pp):
            t = max(t, self._stage_free[stage]) + seconds
            self._stage_free[stage] = t
        self.busy_s += seconds
        # Every sequence samples the same token: one result shared by all (the engine only reads results).
        result = BatchResult([SequenceResult(SIMULATED_TOKEN)] * len(batch.seqs), seconds * self.pp)
        return _VirtualStep(self.clock, t, result)

    def note_idle(self, seconds: float, work_pending: bool) -> None:
        """The simulator let `seconds` pass with no step running: with requests pending and a copy in flight,
        that is a copy stall (a job the policy wants is on the host or moving, or its room is still being freed),
        and an upload stall when an upload is among the copies."""
        if not work_pending or self.swapper is None or self.swapper.next_completion() is None:
            return
        self.copy_wait_s += seconds
        if self.swapper.in_flight(Direction.UPLOAD):
            self.upload_wait_s += seconds

    def next_copy_completion(self) -> float | None:
        """The virtual time at which the next pending copy completes, or None."""
        return self.swapper.next_completion() if self.swapper is not None else None

