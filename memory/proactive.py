"""Proactive KV-cache management: the rule (paper section 4.2, Fig. 9).

After the scheduler has picked the batch, every tick:
1. Watermark. Keep free device blocks >= len(batch) + reserved_blocks (room
   for the batch's next-iteration growth, one block per job at most, plus the
   burst slots kept for arriving jobs). Counting blocks already being offloaded
   as free-to-be, while below it: offload the idle device-resident job with
   the LARGEST estimated_wait (ENST), never one in the batch and never one
   whose upload started this tick (no ping-pong). Host full: stop; a started
   job's KV is never thrown away only to keep a watermark (it would be
   rebuilt; the policy's own evictions still drop when they must).
2. Upload. Host-resident jobs in order of SMALLEST ENST: upload each while
   the device keeps the watermark after taking its blocks.
3. Swap. If the best host job still did not fit and its ENST is smaller than
   the largest ENST among idle device-resident jobs, offload that job now; the
   upload follows on a later tick, once the copy has freed the room.
Copies are asynchronous; a job being uploaded becomes ready when its copy
completes (KVManager.poll), so compute never reads KV that is still moving. A
job the scheduler picks while it is still on the host is a swap miss, uploaded
on demand (KVManager.allocate); good ENST ranking makes those rare.
"""

from __future__ import annotations

from memory.kv_manager import KVManager, Residency


def plan_transfers(kv: KVManager, batch, estimated_wait, now: float) -> None:
    in_batch = {j.job_id for j in batch}
    watermark = len(batch) + kv.reserved_blocks
    entries = list(kv._jobs.values())
    idle = [e for e in entries if e.residency is Residency.DEVICE and e.device
            and e.job.job_id not in in_batch and e.transfer_tick != kv.tick]
    enst = {e.job.job_id: estimated_wait(e.job, now) for e in entries
            if e.residency in (Residency.DEVICE, Residency.HOST)}
    idle.sort(key=lambda e: enst[e.job.job_id], reverse=True)  # largest ENST first

    # 1. Watermark (blocks being offloaded count as free-to-be).
    while idle and kv.device.num_free + kv.pending_free_blocks < watermark:
        if not kv._start_offload(idle.pop(0)):
            break  # host full

    # 2. Upload, smallest ENST first, keeping the watermark.
    host = sorted((e for e in entries if e.residency is Residency.HOST), key=lambda e: enst[e.job.job_id])
    for e in host:
        if kv.device.num_free - len(e.host) < watermark:
            # 3. Swap: make room for a host job that will run before an idle device job.
            if idle and enst[e.job.job_id] < enst[idle[0].job.job_id]:
                kv._start_offload(idle.pop(0))
            break
        kv._start_upload(e, enst[e.job.job_id], now)
