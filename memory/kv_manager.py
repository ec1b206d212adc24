"""KVManager: where each job's KV cache lives, in paged blocks.

What it is: the block tables of every job and the admission verbs the
scheduler uses (can_fit / allocate / evict), plus free() for finished jobs.
What it is not: tensors, attention, or the choice of which jobs run.

This step has one tier (the device) and one eviction rule: drop the blocks,
and the job recomputes its KV when it runs again (job.num_computed = 0). The
host tier, offload/upload and the ENST-ranked proactive policy extend this
class in the KV-manager issue.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory.block_allocator import BlockAllocator


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class KVStats:
    num_evictions: int = 0
    num_recomputed_tokens: int = 0


class KVManager:
    def __init__(self, num_device_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.device = BlockAllocator(num_device_blocks, "device")
        self._tables: dict[str, list[int]] = {}
        self.stats = KVStats()

    # -- the scheduler's verbs ------------------------------------------------------------------
    def can_fit(self, job, num_new_tokens: int) -> bool:
        return self._extra_blocks(job, num_new_tokens) <= self.device.num_free

    def allocate(self, job, num_new_tokens: int) -> None:
        extra = self._extra_blocks(job, num_new_tokens)
        if extra > 0:
            self._tables.setdefault(job.job_id, []).extend(self.device.allocate(job.job_id, extra))

    def evict(self, job) -> None:
        """Drop the job's KV: it recomputes prompt + output so far when next run."""
        self._release(job.job_id)
        self.stats.num_evictions += 1
        self.stats.num_recomputed_tokens += job.num_computed
        job.num_computed = 0
        job.ready = True

    # -- the engine's verbs ------------------------------------------------------------------------
    def free(self, job_id: str) -> None:
        """Return every block of a finished or aborted job."""
        self._release(job_id)

    def block_table(self, job_id: str) -> list[int]:
        return self._tables.get(job_id, [])

    def max_tokens_per_job(self) -> int:
        return self.device.num_blocks * self.block_size

    @property
    def device_usage(self) -> float:
        return self.device.num_used / self.device.num_blocks if self.device.num_blocks else 0.0

    def check_invariants(self) -> None:
        self.device.check_invariants()
        owned = sum(len(t) for t in self._tables.values())
        assert owned == self.device.num_used, f"tables hold {owned} blocks, allocator says {self.device.num_used}"

    # -- internals ---------------------------------------------------------------------------------
    def _extra_blocks(self, job, num_new_tokens: int) -> int:
        have = len(self._tables.get(job.job_id, ()))
        need = blocks_needed(job.num_computed + num_new_tokens, self.block_size)
        return max(0, need - have)

    def _release(self, job_id: str) -> None:
        blocks = self._tables.pop(job_id, None)
        if blocks:
            self.device.free(job_id, blocks)
