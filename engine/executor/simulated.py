"""SimulatedExecutor: runs no model; advances a VirtualClock by each
iteration's profiled cost, so the real engine loop, scheduler and KV manager
run at any scale on a laptop (scripts/simulate.py).

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
from dataclasses import dataclass

from engine.batch import BatchResult, ModelBatch, SequenceResult
from engine.clock import VirtualClock
from engine.executor.base import Executor
from memory.transfers import Direction
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


class SimulatedExecutor(Executor):
    def __init__(
        self,
        cost: ProfiledCostModel,
        clock: VirtualClock,
        num_device_blocks: int,
        block_size: int,
        kv_block_bytes: int,
        transfer: TransferModel | None = None,
    ) -> None:
        self.cost, self.clock = cost, clock
        self.num_device_blocks, self.block_size = num_device_blocks, block_size
        self.kv_block_bytes = kv_block_bytes
        self.transfer = transfer or TransferModel()
        self.swapper: SimulatedSwapper | None = None
        self.busy_s = 0.0

    def attach_host_tier(self, num_host_blocks: int, copy_delay_s: float = 0.0) -> SimulatedSwapper:
        self.swapper = SimulatedSwapper(self.clock, self.kv_block_bytes, self.transfer)
        return self.swapper

    def execute(self, batch: ModelBatch) -> BatchResult:
        prefill = [len(s.token_ids) for s in batch.seqs if s.start_pos == 0]
        decode = [s.start_pos + len(s.token_ids) for s in batch.seqs if s.start_pos > 0]
        seconds = self.cost.batch_cost(prefill, decode)
        self.clock.advance(seconds)
        self.busy_s += seconds
        return BatchResult([SequenceResult(SIMULATED_TOKEN) for _ in batch.seqs], seconds)
