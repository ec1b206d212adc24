"""KVManager: where each job's KV cache lives — device blocks, host blocks,
or nowhere (dropped) — and the verbs that move it.

What it is: block tables on two tiers, each job's residency, the admission
verbs the scheduler uses (can_fit / allocate / evict), the engine's verbs
(free, block_table, poll, plan) and telemetry. What it is not: tensors (the
engine's Swapper copies bytes through the TransferBackend it injects) or the
choice of which jobs run (scheduler/).

kv-policy (paper section 4.2; the rules live in memory/kv_policy.py and
memory/proactive.py):
- recompute: evicting drops the KV; the job rebuilds it (prefill over prompt +
  output so far) when next scheduled.
- reactive: evicting offloads to host, and the step waits for the copy; a job
  on the host stays schedulable and is uploaded when the scheduler picks it,
  the step waiting again (swap wait).
- proactive: plan() keeps free device blocks above a watermark by offloading
  the idle jobs with the largest ENST ahead of need, and uploads host jobs
  with the smallest ENST when there is room, both overlapped with compute. A
  job whose prefetch is in flight is not ready. A job still on the host when
  the scheduler picks it is a swap miss: it is uploaded on demand and the step
  waits for that copy (as the compute stream waits on an upload's event), so
  a high-priority job is never stuck behind lower-priority ones that hold the
  device; misses and their wait are counted.
When the host tier is full, an eviction falls back to a drop (recompute).

Invariants (check_invariants): every block on each tier is free or owned by
exactly one job; device blocks of an offload are reused only after its copy
completes; host blocks are freed only after their upload completes.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from memory.block_allocator import BlockAllocator
from memory.kv_policy import KVPolicy
from memory.transfers import Direction, NoCopyBackend, TransferBackend, TransferHandle


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Residency(str, enum.Enum):
    NONE = "none"  # no KV anywhere (new, or dropped: recompute)
    DEVICE = "device"
    HOST = "host"
    OFFLOADING = "offloading"  # device -> host copy in flight; both tiers held
    UPLOADING = "uploading"  # host -> device copy in flight; both tiers held


@dataclass(eq=False)
class JobKV:
    job: object  # scheduler.Job (read: job_id, num_computed; written: ready, num_computed on drop)
    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    residency: Residency = Residency.NONE
    transfer: TransferHandle | None = None
    transfer_tick: int = -1  # tick the last transfer started (no ping-pong within a tick)
    transfer_started: float = 0.0
    predicted_wait: float | None = None  # ENST when an upload started, for ENST accuracy
    upload_time: float | None = None
    freed: bool = False  # finished or aborted while a copy was in flight


@dataclass
class KVStats:
    num_drops: int = 0  # evictions that dropped KV (recompute)
    num_recomputed_tokens: int = 0
    num_offloads: int = 0
    num_uploads: int = 0
    blocks_offloaded: int = 0
    blocks_uploaded: int = 0
    swap_wait_s: float = 0.0  # seconds steps spent blocked on copies (reactive paths)
    host_full_fallbacks: int = 0  # evictions that wanted the host but found it full
    num_swap_misses: int = 0  # jobs scheduled while their KV was still on the host (uploaded on demand)
    # ENST accuracy: for each upload, predicted vs actual wait until the job next ran (engine clock).
    enst_samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=1000))  # the latest
    enst_count: int = 0
    enst_abs_error_s: float = 0.0  # sum of |predicted - actual|


class KVManager:
    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        policy: KVPolicy | str = KVPolicy.RECOMPUTE,
        reserved_blocks: int = 0,
        transfers: TransferBackend | None = None,
        now=time.perf_counter,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.policy = KVPolicy(policy)
        self.reserved_blocks = reserved_blocks
        self.device = BlockAllocator(num_device_blocks, "device")
        self.host = BlockAllocator(num_host_blocks, "host")
        self.transfers = transfers or NoCopyBackend()
        self._now = now  # the engine's clock: swap waits are measured on it (virtual in the simulator)
        self._jobs: dict[str, JobKV] = {}
        self._orphans: list[JobKV] = []  # freed while a copy was in flight
        self.tick = 0
        self.stats = KVStats()
        self._step_wait = 0.0  # copy waits since the last take_swap_wait(): the step being formed waits

    # -- the scheduler's verbs ------------------------------------------------------------------
    def can_fit(self, job, num_new_tokens: int) -> bool:
        return self._extra_device_blocks(job, num_new_tokens) <= self.device.num_free

    def allocate(self, job, num_new_tokens: int) -> None:
        kv = self._entry(job)
        if kv.residency in (Residency.HOST, Residency.UPLOADING):
            self.stats.num_swap_misses += kv.residency is Residency.HOST
            self._upload_now(kv)  # the scheduler picked a job whose KV is on the host: the step waits
        extra = self._extra_device_blocks(job, num_new_tokens)
        if extra > 0:
            kv.device.extend(self.device.allocate(job.job_id, extra))
        if kv.residency is Residency.NONE:
            kv.residency = Residency.DEVICE

    def may_evict_for(self, job) -> bool:
        """Proactive: a job whose KV is on the host runs when there is free room (or after its prefetch),
        never by pushing resident jobs out; that would trade one swap for two and, under the churn of
        starvation promotion, thrash. Reactive and recompute: yes (their definition)."""
        if self.policy is not KVPolicy.PROACTIVE:
            return True
        kv = self._jobs.get(job.job_id)
        return kv is None or kv.residency not in (Residency.HOST, Residency.OFFLOADING)

    def evict(self, job) -> None:
        """Free the job's device blocks now: offload (waiting for the copy) or drop."""
        kv = self._jobs.get(job.job_id)
        if kv is None or not kv.device:
            return
        if kv.residency is Residency.OFFLOADING:
            self._wait(kv)
            return
        if kv.residency is Residency.UPLOADING:
            self._wait(kv)
        if self.policy is not KVPolicy.RECOMPUTE and self._start_offload(kv):
            self._wait(kv)
        else:
            self._drop(kv)

    # -- the engine's verbs ----------------------------------------------------------------------
    def block_table(self, job_id: str) -> list[int]:
        kv = self._jobs.get(job_id)
        return kv.device if kv is not None else []

    def residency(self, job_id: str) -> Residency:
        kv = self._jobs.get(job_id)
        return kv.residency if kv is not None else Residency.NONE

    def free(self, job_id: str) -> None:
        """Return every block of a finished or aborted job (after any copy in flight)."""
        kv = self._jobs.pop(job_id, None)
        if kv is None:
            return
        if kv.transfer is not None and not kv.transfer.done():
            kv.freed = True
            self._orphans.append(kv)
            return
        self._release_all(kv)

    def take_swap_wait(self) -> float:
        """Seconds spent waiting on copies since the last call. Every wait happens while a step is being
        scheduled, and the whole step waits, so the engine charges it to each request in that step."""
        waited, self._step_wait = self._step_wait, 0.0
        return waited

    def poll(self) -> None:
        """Complete finished copies: free the source tier's blocks, mark uploaded jobs ready."""
        for kv in list(self._jobs.values()):
            if kv.transfer is not None and kv.transfer.done():
                self._complete(kv)
        still = []
        for kv in self._orphans:
            if kv.transfer.done():
                kv.transfer = None
                self._release_all(kv)
            else:
                still.append(kv)
        self._orphans = still

    def plan(self, batch, estimated_wait, now: float) -> None:
        """After the scheduler picked `batch`: start proactive offloads/uploads (proactive only)."""
        from memory.proactive import plan_transfers

        self.tick += 1
        if self.policy is KVPolicy.PROACTIVE:
            plan_transfers(self, batch, estimated_wait, now)

    def note_scheduled(self, job, now: float) -> None:
        """ENST accuracy: when an uploaded job next runs, record predicted vs actual wait."""
        kv = self._jobs.get(job.job_id)
        if kv is not None and kv.predicted_wait is not None:
            actual = now - kv.upload_time
            self.stats.enst_samples.append((kv.predicted_wait, actual))
            self.stats.enst_count += 1
            self.stats.enst_abs_error_s += abs(kv.predicted_wait - actual)
            kv.predicted_wait = None

    # -- capacity ---------------------------------------------------------------------------------
    def num_swapped(self) -> int:
        return sum(1 for kv in self._jobs.values() if kv.residency in (Residency.HOST, Residency.OFFLOADING))

    def check_invariants(self) -> None:
        self.device.check_invariants()
        self.host.check_invariants()
        entries = list(self._jobs.values()) + self._orphans
        dev = sum(len(kv.device) for kv in entries)
        host = sum(len(kv.host) for kv in entries)
        assert dev == self.device.num_used, f"tables hold {dev} device blocks, allocator says {self.device.num_used}"
        assert host == self.host.num_used, f"tables hold {host} host blocks, allocator says {self.host.num_used}"

    # -- moves (also used by memory/proactive.py) -------------------------------------------------
    def _entry(self, job) -> JobKV:
        kv = self._jobs.get(job.job_id)
        if kv is None:
            kv = self._jobs[job.job_id] = JobKV(job)
        return kv

    def _extra_device_blocks(self, job, num_new_tokens: int) -> int:
        kv = self._jobs.get(job.job_id)
        # A job on the host holds no device blocks: bringing it back needs room for the whole context.
        have = len(kv.device) if kv is not None and kv.residency is not Residency.HOST else 0
        return max(0, blocks_needed(job.num_computed + num_new_tokens, self.block_size) - have)

    def _start_offload(self, kv: JobKV) -> bool:
        """Begin device -> host; False (nothing started) when the host tier has no room."""
        n = len(kv.device)
        if n > self.host.num_free:
            self.stats.host_full_fallbacks += 1
            return False
        kv.host = self.host.allocate(kv.job.job_id, n)
        kv.transfer = self.transfers.copy(Direction.OFFLOAD, list(zip(kv.device, kv.host)))
        kv.residency = Residency.OFFLOADING
        kv.transfer_tick = self.tick
        kv.job.ready = False
        self.stats.num_offloads += 1
        self.stats.blocks_offloaded += n
        return True

    def _start_upload(self, kv: JobKV, predicted_wait: float | None = None, now: float = 0.0) -> bool:
        n = len(kv.host)
        if n > self.device.num_free:
            return False
        kv.device = self.device.allocate(kv.job.job_id, n)
        kv.transfer = self.transfers.copy(Direction.UPLOAD, list(zip(kv.host, kv.device)))
        kv.residency = Residency.UPLOADING
        kv.transfer_tick = self.tick
        kv.predicted_wait, kv.upload_time = predicted_wait, now
        kv.job.ready = False
        self.stats.num_uploads += 1
        self.stats.blocks_uploaded += n
        return True

    def _upload_now(self, kv: JobKV) -> None:
        if kv.residency is Residency.HOST:
            if not self._start_upload(kv):
                raise RuntimeError("allocate() without can_fit(): no device room to upload the job's KV")
        self._wait(kv)

    def _wait(self, kv: JobKV) -> None:
        start = self._now()
        kv.transfer.wait()
        waited = self._now() - start
        self.stats.swap_wait_s += waited
        self._step_wait += waited
        self._complete(kv)

    def _complete(self, kv: JobKV) -> None:
        jid = kv.job.job_id
        if kv.residency is Residency.OFFLOADING:
            self.device.free(jid, kv.device)
            kv.device = []
            kv.residency = Residency.HOST
            kv.job.ready = True  # schedulable: uploaded on demand if picked before a prefetch brings it back
        elif kv.residency is Residency.UPLOADING:
            self.host.free(jid, kv.host)
            kv.host = []
            kv.residency = Residency.DEVICE
            kv.job.ready = True
        kv.transfer = None

    def _drop(self, kv: JobKV) -> None:
        jid = kv.job.job_id
        self.device.free(jid, kv.device)
        kv.device = []
        if kv.host:
            self.host.free(jid, kv.host)
            kv.host = []
        kv.residency = Residency.NONE
        self.stats.num_drops += 1
        self.stats.num_recomputed_tokens += kv.job.num_computed
        kv.job.num_computed = 0
        kv.job.ready = True

    def _release_all(self, kv: JobKV) -> None:
        jid = kv.job.job_id
        if kv.device:
            self.device.free(jid, kv.device)
        if kv.host:
            self.host.free(jid, kv.host)
        kv.device, kv.host = [], []
