"""Proactive KV-cache management: the rule (paper section 4.2, Fig. 9).

After the scheduler has picked the batch, every tick:
1. Watermark. Keep free device blocks >= growth(batch) + reserved_blocks: the
   blocks the batch's next iteration adds (batch_growth: one for each job whose
   next token starts a new block, one for a job in the middle of a chunked
   prefill), plus the burst slots kept for arriving jobs. (It was len(batch),
   a block for every job, ~16x what a decode batch adds with 16-token blocks:
   at capacity it pushed out idle jobs to keep room nobody used, and each came
   back as an upload; docs/kv-cache.md, "Offload policies".)
   Counting blocks already being offloaded
   as free-to-be, while below it: offload the idle device-resident job with
   the LARGEST estimated_wait (ENST), never one in the batch and never one
   whose upload started this tick (no ping-pong). Host full: stop; a started
   job's KV is never thrown away only to keep a watermark (it would be
   rebuilt; the policy's own evictions still drop when they must).
2. Upload. Host-resident jobs in order of SMALLEST ENST: upload each while
   the device keeps the watermark after taking its blocks, never into free
   blocks promised this tick to a job that waits for room (wait_for_room):
   it would evict the uploaded job again next tick, and so on without end.
3. Swap. If the best host job still did not fit and its ENST is smaller than
   the largest ENST among idle device-resident jobs, offload that job now; the
   upload follows on a later tick, once the copy has freed the room.
Copies are asynchronous; a job being uploaded becomes ready when its copy
completes (KVManager.poll), so compute never reads KV that is still moving. A
job the scheduler picks while it is still on the host is a swap miss, uploaded
on demand (KVManager.allocate); good ENST ranking makes those rare.
"""

from __future__ import annotations

from typing import Protocol

from memory.residency import JobKV


class KVView(Protocol):
    """What the planner reads of the KV state and the two verbs it may use (memory.KVManager implements it; the
    planner knows nothing else of it, so memory/kv_manager.py imports this module and not the other way)."""

    reserved_blocks: int  # device blocks kept free for bursts of new jobs
    block_size: int  # tokens per block

    @property
    def num_free_device_blocks(self) -> int: ...

    @property
    def pending_free_blocks(self) -> int:
        """Device blocks that offloads in flight will free."""
        ...

    @property
    def owed_free_blocks(self) -> int:
        """Free device blocks promised this tick to jobs that wait for room."""
        ...

    def host_resident(self) -> list[JobKV]: ...

    def offload_candidates(self, exclude: set[str]) -> list[JobKV]:
        """Device-resident jobs that may be offloaded: idle, not in `exclude` (job ids), no copy in flight."""
        ...

    def smallest_host_copy(self) -> int: ...

    def start_offload(self, kv: JobKV) -> bool: ...

    def start_upload(self, kv: JobKV, predicted_wait: float | None = None, now: float = 0.0) -> bool: ...


def batch_growth(batch, block_size: int) -> int:
    """Device blocks the batch's next iteration adds: a job that decodes next (its KV now covers its context
    once this step has run) needs a new block when its context fills its blocks, context_len % block_size == 0
    (the token this step samples goes at position context_len); a job in the middle of a chunked prefill is
    counted one block, as before (its next chunk is sized by the room the scheduler finds)."""
    n = 0
    for job in batch:
        ctx = job.prompt_len + job.num_generated  # (job.context_len: once per job of the batch, every tick)
        n += not ctx % block_size or 0 < job.num_scheduled < ctx - job.num_computed
    return n


def plan_transfers(kv: KVView, batch, estimated_wait, now: float) -> None:
    """Cost: O(1) when nothing is on the host and a block a job of the batch is free (most ticks below
    capacity); otherwise one pass over the batch (batch_growth), one look at the device-resident jobs and a
    sort of those it needs, no scan of every job. When not even the smallest host job fits beyond the
    watermark (past capacity, most ticks) the host jobs are not sorted: rule 3 needs only whether one of
    them is due before the top idle job."""
    host = kv.host_resident()
    free_to_be = kv.num_free_device_blocks + kv.pending_free_blocks
    if not host and free_to_be >= len(batch) + kv.reserved_blocks:  # (the growth is at most a block a job)
        return
    watermark = batch_growth(batch, kv.block_size) + kv.reserved_blocks
    if not host and free_to_be >= watermark:
        return
    enst: dict[str, float] = {}

    def wait(e: JobKV) -> float:
        jid = e.job.job_id
        if jid not in enst:
            enst[jid] = estimated_wait(e.job, now)
        return enst[jid]

    idle: list[JobKV] | None = None

    def idle_jobs() -> list[JobKV]:  # device-resident, not in the batch nor in flight, largest ENST first
        return sorted(kv.offload_candidates({j.job_id for j in batch}), key=wait, reverse=True)

    # 1. Watermark (blocks being offloaded count as free-to-be).
    if kv.num_free_device_blocks + kv.pending_free_blocks < watermark:
        idle = idle_jobs()
        while idle and kv.num_free_device_blocks + kv.pending_free_blocks < watermark:
            if not kv.start_offload(idle.pop(0)):
                break  # host full

    free = kv.num_free_device_blocks - kv.owed_free_blocks  # free blocks not promised to a job that waits for room
    if host and free - kv.smallest_host_copy() < watermark:
        # No host job fits (step 1 only offloads, so none left the host): step 2 would stop at the first
        # in ENST order, and rule 3 asks only whether the smallest host ENST is below the top idle job's.
        if idle is None:
            candidates = kv.offload_candidates({j.job_id for j in batch})
            idle = [max(candidates, key=wait)] if candidates else []  # (sorted's first: the first of a tie)
        if idle:
            top = wait(idle[0])
            if any(estimated_wait(e.job, now) < top for e in host):  # (each asked once: no memo needed)
                kv.start_offload(idle[0])
        return

    # 2. Upload, smallest ENST first, keeping the watermark.
    for e in sorted(host, key=wait):
        n = len(e.host)
        if free - n < watermark:
            # 3. Swap: make room for a host job that will run before an idle device job.
            if idle is None:
                idle = idle_jobs()
            if idle and wait(e) < wait(idle[0]):
                kv.start_offload(idle.pop(0))
            break
        kv.start_upload(e, wait(e), now)
        free -= n
