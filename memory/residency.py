"""Where one job's KV lives (Residency), the KV manager's record of it (JobKV), its index of who is where
(ResidencyIndex), its counters (KVStats) and what its allocate() did (Allocation): the types that
memory/kv_manager.py keeps and its parts (memory/copy_ledger.py, memory/host_prefix_tier.py) and
memory/proactive.py read, in a module of their own so that none imports another's internals."""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from memory.transfers import TransferHandle


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
    order: int = 0  # when the KV manager made the entry (its offload candidates come in this order)
    transfer: TransferHandle | None = None
    transfer_tick: int = -1  # tick the last transfer started (no ping-pong within a tick)
    transfer_started: float = 0.0
    predicted_wait: float | None = None  # ENST when an upload started, for ENST accuracy
    upload_time: float | None = None
    freed: bool = False  # finished or aborted while a copy was in flight
    cancel_upload: bool = False  # evicted while uploading: the device blocks free when the copy lands
    offload_tick: int | None = None  # tick of the last offload, until the job is wanted back (thrash count)
    pending_blocks: int = 0  # device blocks that free when the transfer in flight completes
    # Prefix caching (memory/prefix_cache.py): the names of the job's full blocks computed so far, how many of
    # `device`'s leading blocks are registered (or found taken), and the table that count is for.
    hashes: list = field(default_factory=list)
    num_registered: int = 0
    registered_table: list | None = None
    cached_tokens: int | None = None  # tokens its first lookup found cached (None: never looked up)
    # Computed tokens from which allocate's fast path calls the naming (KVManager._register_full): at most where
    # a prompt block fills past num_registered, 0 when `device` may be a new table, never (inf) with caching off
    # or once the prompt's full blocks are named (generated blocks are named when the job leaves the device).
    name_at: float = float("inf")
    # Two tiers (memory/kv_manager.py): the job has not run yet and its `host` blocks are a cached prefix found on
    # the host tier (references on the host cache's blocks), parked there for an upload ahead of need.
    host_prefix: bool = False


class ResidencyIndex:
    """The entries on each tier, kept as they move, so that the planner and the policy's walk find them without a
    scan of every job: those that became device-resident (pruned lazily by offload_candidates), and those whose KV
    is on the host alone (`on_host`, by job, in the order they got there; a job not started whose cached prefix
    waits there is in `prefix_parked` instead), with how many of them hold each number of host blocks. The KV
    manager owns it and tells it every move; it changes no entry."""

    def __init__(self) -> None:
        self.device_resident: dict[JobKV, None] = {}
        self.on_host: dict[object, JobKV] = {}
        self.prefix_parked: dict[object, JobKV] = {}
        self._sizes: Counter[int] = Counter()
        self._floor: int | None = None  # min(_sizes), None = to be recomputed

    def park(self, kv: JobKV) -> None:
        """The entry's KV is now on the host alone."""
        (self.prefix_parked if kv.host_prefix else self.on_host)[kv.job] = kv
        n = len(kv.host)
        self._sizes[n] += 1
        if self._floor is not None and n < self._floor:
            self._floor = n

    def unpark(self, kv: JobKV) -> None:
        """The entry's KV leaves the host-alone state (call before its block lists change)."""
        if self.on_host.pop(kv.job, None) is None and (
                not self.prefix_parked or self.prefix_parked.pop(kv.job, None) is None):
            return
        n, sizes = len(kv.host), self._sizes
        sizes[n] -= 1
        if not sizes[n]:
            del sizes[n]
            if n == self._floor:
                self._floor = None

    def smallest_host_copy(self) -> int:
        """Blocks of the smallest KV on the host alone (0 if none)."""
        floor = self._floor
        if floor is None:
            if not self._sizes:
                return 0
            floor = self._floor = min(self._sizes)
        return floor

    def host_resident(self) -> list[JobKV]:
        """Entries on the host alone in the order they got there, then the parked prefixes."""
        if self.prefix_parked:
            return list(self.on_host.values()) + list(self.prefix_parked.values())
        return list(self.on_host.values())

    def offload_candidates(self, jobs: dict[str, JobKV], exclude: set[str], tick: int) -> list[JobKV]:
        """Entries of `jobs` (the live ones) on the device alone with no copy this tick, not in flight in a pipeline
        stage and not in `exclude`, in the order they were made."""
        resident = self.device_resident
        found, gone = [], []
        for e in resident:
            if e.residency is not Residency.DEVICE or jobs.get(e.job.job_id) is not e:
                gone.append(e)  # left the device, or freed: forgotten until it comes back
            elif (e.device and not e.job.in_flight and not e.job.kv_busy and e.job.job_id not in exclude
                  and e.transfer_tick != tick):
                found.append(e)
        for e in gone:
            del resident[e]
        found.sort(key=lambda e: e.order)  # the order of the entries, as a scan of them would give
        return found

    def check_invariants(self, jobs: dict[str, JobKV]) -> None:
        missing = [kv.job.job_id for kv in jobs.values()
                   if kv.residency is Residency.DEVICE and kv not in self.device_resident]
        assert not missing, f"device-resident entries the planner's index lacks: {missing}"
        parked = list(self.on_host.values()) + list(self.prefix_parked.values())
        assert set(parked) == {kv for kv in jobs.values() if kv.residency is Residency.HOST}, \
            "host-resident set is stale"
        assert all(kv.host_prefix for kv in self.prefix_parked.values()) and not any(
            kv.host_prefix for kv in self.on_host.values()), "a parked prefix in the wrong set"
        assert all(kv.job is job for job, kv in self.on_host.items()), "host-resident index keyed wrong"
        assert self._sizes == Counter(len(kv.host) for kv in parked), "host sizes are stale"
        assert self._floor is None or self._floor == min(self._sizes), "host floor is stale"


@dataclass
class KVStats:
    num_drops: int = 0  # evictions that dropped KV (recompute)
    num_recomputed_tokens: int = 0
    num_offloads: int = 0
    num_uploads: int = 0
    blocks_offloaded: int = 0
    blocks_uploaded: int = 0
    swap_wait_s: float = 0.0  # job-seconds picked but waiting on a copy (memory/kv_manager.py's swap wait)
    host_full_fallbacks: int = 0  # evictions that wanted the host but found it full
    num_thrash: int = 0  # offloads whose job was wanted back (upload, or picked) within kv_manager.THRASH_TICKS ticks
    num_swap_misses: int = 0  # jobs scheduled while their KV was still on the host (uploaded on demand)
    # ENST accuracy: for each upload, predicted vs actual wait until the job next ran (engine clock).
    enst_samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=1000))  # the latest
    enst_count: int = 0
    enst_abs_error_s: float = 0.0  # sum of |predicted - actual|
    # Prefix caching's host tier (memory/host_prefix_tier.py):
    cache_blocks_backed_up: int = 0  # cached device blocks copied to the host as they were released
    cache_evicted_to_host: int = 0  # cached device blocks evicted (handed out) with a copy on the host
    cache_evicted_dropped: int = 0  # ... with none (host full, or its copy still in flight)
    host_hit_tokens: int = 0  # prompt tokens of hits found on the host tier (uploaded, not computed)
    num_prefix_uploads: int = 0  # uploads of a job's cached prefix found on the host (not KV it computed)
    num_prefix_uploads_on_demand: int = 0  # of those, started when the scheduler picked the job (not ahead)
    num_prefix_prefetches: int = 0  # jobs parked with a host prefix while they waited to start (proactive)
    num_prefix_releases: int = 0  # of those, uploaded but given back to the cache when nothing could run
    blocks_not_copied: int = 0  # blocks of an offload or upload whose copy the other tier's cache already held


class Allocation(NamedTuple):
    """What allocate() did, when it could (None when it could not: no device room, nothing changed)."""

    new_blocks: Sequence[int]  # device blocks this call put in the job's table (a cached prefix and an upload's too)
    # The job's KV was on the device with no copy in flight and only grew: the KV that admission counts
    # (started_blocks) did not shrink, so a may_start refusal stays valid past this call.
    in_place: bool
    # Its KV (or its cached prefix) was on the host: its upload started and it runs once the copy lands
    # (job.ready False until then; at once when nothing had to be copied).
    upload: bool


GREW_BY_NOTHING = Allocation((), True, False)  # (the usual answer for a decoding job: no block filled)
