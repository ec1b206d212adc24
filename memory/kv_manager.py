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
- reactive: evicting offloads to host only when a job the scheduler picked
  needs the room; that job waits until the copy has freed it. A job on the
  host stays schedulable and is uploaded when the scheduler picks it; it runs
  once the upload lands (swap wait).
- proactive: plan() keeps free device blocks above a watermark by offloading
  the idle jobs with the largest ENST ahead of need, and uploads host jobs
  with the smallest ENST when there is room, both overlapped with compute. A
  job whose prefetch is in flight is not ready. A job still on the host when
  the scheduler picks it is a swap miss: its upload starts then and it runs
  when the copy lands; misses and their wait are counted.
When the host tier is full, an eviction falls back to a drop (recompute).

Overload admission (may_start): past capacity a preemptive policy keeps
starting new jobs ahead of old ones, so the set of started jobs, each holding
KV, grows without bound; once it outgrows the host, evictions become drops and
every promotion rebuilds a whole context. So a job with no KV anywhere (new,
or dropped) starts only while the KV of every started job plus its own stays
within `max_started_blocks` (device and host together; None = no limit, the
paper's behaviour); beyond it, it waits where it is in the policy's order.
The engine's default with a host tier is both tiers less an eighth of the
device (room for the started jobs to grow as they decode), so admission binds
only where drops would begin; `--kv-overcommit N` sets N device caches
instead (engine/engine.py, _make_kv_manager).

Nothing here ever waits on a copy: the engine's event loop must not block.
evict() starts an offload and the device blocks free when it completes (poll);
allocate() of a job on the host starts its upload and leaves job.ready False;
the policy sees "not ready" / "no room yet" and the job simply waits. A copy
whose handle reports done() at once (no backend, the simulator's zero-byte
case) completes on the spot, so nothing waits a tick for nothing.

Swap wait (per job, reported per request as swap_wait_s): the sum, over the
ticks at which the policy picked the job but could not run it because of a
copy (its KV on the host or moving, or the device room it needs still being
freed by an offload), of the engine-clock time until the next tick: the time
it would have been running. Ticks at which it was simply not picked are
queueing, not swap wait.

Invariants (check_invariants): every block on each tier is free or owned by
exactly one job; device blocks of an offload are reused only after its copy
completes; host blocks are freed only after their upload completes.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from itertools import compress, filterfalse, islice, repeat
from operator import is_, not_
from typing import Protocol

from memory.block_allocator import BlockAllocator
from memory.kv_policy import KVPolicy
from memory.prefix_cache import CachingBlockAllocator, extend_chain
from memory.proactive import plan_transfers
from memory.residency import JobKV, Residency
from memory.transfers import CompletedTransfer, Direction, NoCopyBackend, TransferBackend, TransferHandle

THRASH_TICKS = 4  # an offload undone within this many ticks counts as thrash
CACHE_OWNER = "<prefix-cache>"  # holds the host blocks of the cache's own device -> host copies while they run


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _next_name_at(kv: JobKV, block_size: int) -> float:
    """Where allocate's fast path next names the job's blocks (JobKV.name_at): when the block after those named
    fills, while that block lies within the prompt. Blocks of generated tokens are named only when the job
    leaves the device (evict, free): no other request can hit them before, since a request shares blocks only at
    its first allocation, and its prompt cannot hold an answer still being generated. Naming them as they fill
    would hash a block every few decode steps of every job for nothing (issue 28's per-tick cost)."""
    end = (kv.num_registered + 1) * block_size
    return end if end <= kv.job.prompt_len else float("inf")


@dataclass
class KVStats:
    num_drops: int = 0  # evictions that dropped KV (recompute)
    num_recomputed_tokens: int = 0
    num_offloads: int = 0
    num_uploads: int = 0
    blocks_offloaded: int = 0
    blocks_uploaded: int = 0
    swap_wait_s: float = 0.0  # job-seconds picked but waiting on a copy (the module docstring's swap wait)
    host_full_fallbacks: int = 0  # evictions that wanted the host but found it full
    num_thrash: int = 0  # offloads whose job was wanted back (upload, or picked) within THRASH_TICKS ticks
    num_swap_misses: int = 0  # jobs scheduled while their KV was still on the host (uploaded on demand)
    # ENST accuracy: for each upload, predicted vs actual wait until the job next ran (engine clock).
    enst_samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=1000))  # the latest
    enst_count: int = 0
    enst_abs_error_s: float = 0.0  # sum of |predicted - actual|
    # Prefix caching's host tier (the section "Two tiers for cached blocks" of enable_prefix_caching):
    cache_blocks_backed_up: int = 0  # cached device blocks copied to the host as they were released
    cache_evicted_to_host: int = 0  # cached device blocks evicted (handed out) with a copy on the host
    cache_evicted_dropped: int = 0  # ... with none (host full, or its copy still in flight)
    host_hit_tokens: int = 0  # prompt tokens of hits found on the host tier (uploaded, not computed)
    num_prefix_uploads: int = 0  # uploads of a job's cached prefix found on the host (not KV it computed)
    num_prefix_uploads_on_demand: int = 0  # of those, started when the scheduler picked the job (not ahead)
    num_prefix_prefetches: int = 0  # jobs parked with a host prefix while they waited to start (proactive)
    num_prefix_releases: int = 0  # of those, uploaded but given back to the cache when nothing could run
    blocks_not_copied: int = 0  # blocks of an offload or upload whose copy the other tier's cache already held


@dataclass(eq=False)
class _Backup:
    """One device -> host copy of cached blocks no job holds (the host tier's copy of what the device may evict)."""

    device: list[int]
    host: list[int]  # held by CACHE_OWNER until the copy lands, then named (cached) and released
    hashes: list
    handle: TransferHandle | None = None
    void: set[int] = field(default_factory=set)  # device blocks evicted while their copy ran: the copy is stale


class PrefixSource(Protocol):
    """What prefix caching asks the engine of a job (engine/prefix_source.py implements it)."""

    def token_ids(self, job, start: int, end: int) -> Sequence[int]:
        """The job's tokens at positions [start, end) (prompt, then output)."""
        ...

    def cache_salt(self, job) -> str | None:
        """The salt that starts its blocks' hash chain (None: no salt, shared with every unsalted job)."""
        ...

    def may_reuse(self, job) -> bool:
        """Whether it may skip computing a cached prefix (False: e.g. it wants prompt logprobs)."""
        ...


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
        max_started_blocks: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_started_blocks is not None and max_started_blocks < 1:
            raise ValueError(f"max_started_blocks must be >= 1 or None, got {max_started_blocks}")
        self.max_started_blocks = max_started_blocks
        self.block_size = block_size
        self.policy = KVPolicy(policy)
        self.reserved_blocks = reserved_blocks
        self.device = BlockAllocator(num_device_blocks, "device")
        self.transfers = transfers or NoCopyBackend()
        self.num_host_blocks = num_host_blocks  # the host tier's size once all of it is there
        self.host = BlockAllocator(0, "host")  # grows as the backend readies host blocks (_grow_host)
        self._grow_host()
        self._now = now  # the engine's clock: swap waits are measured on it (virtual in the simulator)
        self._jobs: dict[str, JobKV] = {}
        self._made = 0  # entries made so far (JobKV.order)
        # Entries that became device-resident (Residency.DEVICE), pruned lazily when offload_candidates meets one
        # that has left that state or was freed: the planner's candidates without a scan of every job.
        self._device_resident: dict[JobKV, None] = {}
        self._orphans: list[JobKV] = []  # freed while a copy was in flight
        self._inflight: dict[JobKV, None] = {}  # entries with a transfer in flight (orphans included)
        # Entries whose KV is on the host alone (Residency.HOST), by job, in the order they got there; and how
        # many of them hold each number of host blocks (the smallest is parked_unfit()'s floor).
        self._on_host: dict[object, JobKV] = {}
        self._host_sizes: Counter[int] = Counter()
        self._host_floor: int | None = None  # min(_host_sizes), None = to be recomputed
        self._copied = 0  # blocks held on both tiers by the copies in flight (started_blocks counts them once)
        self._pending_free = 0  # device blocks that free when the copies in flight complete
        self._claimed = 0  # of those, promised this tick to jobs that wait for room (wait_for_room)
        self._short: dict[str, int] = {}  # jobs that asked wait_for_room this tick and did not get it: the room asked
        self._promised = 0  # device blocks promised this tick to jobs that wait for room (free and freeing)
        self._blocked: dict[str, None] = {}  # job ids picked this tick but kept by a copy
        self._blocked_at = 0.0  # when the first of them was (the tick's time)
        self._waits: dict[str, float] = {}  # job id -> swap wait accrued since it last ran
        self.tick = 0
        self.stats = KVStats()
        self._prefix: PrefixSource | None = None  # prefix caching's token source (enable_prefix_caching)
        self._host_cache = False  # the host tier caches blocks too (enable_prefix_caching's host_tier)
        self._backups: dict[_Backup, None] = {}  # the cache's device -> host copies in flight
        self._backup_of: dict[int, _Backup] = {}  # device block -> its copy in flight
        self._backup_host_blocks = 0  # host blocks those copies hold (CACHE_OWNER)
        self._waiting: dict[str, JobKV] = {}  # looked up at admission, no KV yet: may find its prefix on the host
        # Waiting jobs that _park_waiting may park: every one whose first block the host caches is here (put here
        # when it starts waiting with that block on the host, or when the host names the block later), so a tick
        # looks at these few instead of every waiting job (past capacity thousands wait, and the tiers change
        # nearly every tick); left out again once seen without it. A waiting job's names never change (it holds no
        # KV and its context does not grow). Per waiting job (kept lazily after it leaves, pruned in bulk): its
        # place in _waiting's order and its first block's name; and by name, the jobs whose first block it names.
        self._waiting_candidates: set[str] = set()
        self._waiting_heads: dict[str, tuple[int, bytes]] = {}
        self._heads_waiting: dict[bytes, list[str]] = {}
        self._num_waited = 0
        self._recheck_waiting = False  # the tiers' contents changed since _park_waiting last looked
        self._prefix_parked: dict[object, JobKV] = {}  # jobs not started whose cached prefix waits on the host
        # Entries whose last allocation stopped short of their context (a chunk of a prefill, chunked prefill) and
        # that still hold KV: admission counts the blocks the rest of their prefill will take (started_blocks).
        self._prefilling: dict[JobKV, None] = {}

    # -- the scheduler's verbs ------------------------------------------------------------------
    def can_fit(self, job, num_new_tokens: int) -> bool:
        # _extra_device_blocks(job, n) <= free, inlined (the scheduler asks this of every job it walks).
        kv = self._jobs.get(job.job_id)
        need = -(-(job.num_computed + num_new_tokens) // self.block_size)
        if kv is None:
            return need <= self.device.num_free
        if kv.residency is Residency.HOST:  # the upload takes every host block (a chunked job may hold more)
            return max(need, len(kv.host)) <= self.device.num_free
        return need - len(kv.device) <= self.device.num_free

    def may_start(self, job, num_new_tokens: int) -> bool:
        """Overload admission: whether a job may start its (re)computation now. A job holding KV (device or
        host) may always go on; one with none starts only while every started job's KV plus its own stays
        within max_started_blocks, counted on both tiers."""
        limit = self.max_started_blocks
        if limit is None:
            return True
        kv = self._jobs.get(job.job_id)
        if kv is not None and (kv.device or kv.host):
            return True
        return self.started_blocks() + blocks_needed(job.num_computed + num_new_tokens, self.block_size) <= limit

    def started_blocks(self) -> int:
        """KV blocks held by jobs on either tier, a block being copied counted once, plus the blocks a partly
        prefilled job (chunked prefill) still has to take for the rest of its context: a prompt that prefills in
        chunks is counted whole from its first chunk, as one that prefills in one iteration is (without it,
        admission let in a long prompt per chunk's room, and past capacity both tiers overflowed into drops:
        docs/benchmarks.md, "Chunked prefill, session 14")."""
        held = self.device.num_used + self.host.num_used - self._copied - self._backup_host_blocks
        if self._prefilling:
            bs = self.block_size
            for kv in self._prefilling:
                held += max(0, -(-kv.job.context_len // bs) - max(len(kv.device), len(kv.host)))
        return held

    def parked_unfit(self) -> Container:
        """Jobs the policy's walk may pass over now without asking: their KV is on the host alone, and
        can_fit and may_evict_for are both False for each (proactive: a host job waits for free room; and
        the device's free blocks are fewer than the smallest host copy, while a job coming back needs at
        least its copy's blocks). Empty when that does not hold. Costs O(1). The answer stays true while
        the free device blocks do not grow and no job leaves the host: through allocate() of a job not in
        it, not through evict()."""
        if self.policy is not KVPolicy.PROACTIVE or not self._on_host:
            return ()
        return self._on_host if self.smallest_host_copy() > self.device.num_free else ()

    def room_for(self, num_tokens: int) -> bool:
        """Whether a job with no KV needing num_tokens could get its blocks this tick without an eviction
        (the room can_fit and wait_for_room would find: free, or freeing and not promised)."""
        return blocks_needed(num_tokens, self.block_size) <= self.device.num_free + self._pending_free - self._claimed

    def parked(self) -> Container:
        """Jobs whose KV is on the host alone (they hold no device blocks)."""
        return self._on_host

    def smallest_host_copy(self) -> int:
        """Blocks of the smallest KV on the host alone (0 if none): no such job comes back to the device
        with fewer free blocks than this."""
        floor = self._host_floor
        if floor is None:
            if not self._host_sizes:
                return 0
            floor = self._host_floor = min(self._host_sizes)
        return floor

    def allocate(self, job, num_new_tokens: int) -> bool:
        """Reserve the room. A job whose KV is on the host (a swap miss) starts its upload here and is
        not ready until it lands (job.ready False): the policy leaves it out of this tick's batch. True when
        started_blocks() did not shrink (a job on the device with no copy in flight: its blocks only grow, and a
        partly prefilled job leaves _prefilling only once its blocks cover its context), so a may_start refusal
        stays valid (KVAdmission.allocate); False otherwise (an upload's copy counts its blocks once)."""
        kv = self._jobs.get(job.job_id)
        if kv is not None and kv.residency is Residency.DEVICE and kv.transfer is None:
            # A job on the device with no copy in flight (every job of the batch but new ones, every tick): what
            # the general path below does for it, without the checks that cannot apply.
            if self._waiting:
                self._waiting.pop(job.job_id, None)
            if self._short:
                self._short.pop(job.job_id, None)
            if job.kv_pinned:  # (it runs now)
                job.kv_pinned = False
            computed = job.num_computed
            if computed >= kv.name_at:  # (else no block has filled since it last ran: nothing to name)
                self._register_full(kv)
            end = computed + num_new_tokens
            extra = -(-end // self.block_size) - len(kv.device)
            if extra > 0:
                kv.device.extend(self.device.allocate(job.job_id, extra))
            if end < job.prompt_len + job.num_generated:  # a chunk: more of its context to come
                self._prefilling[kv] = None
            elif self._prefilling:
                self._prefilling.pop(kv, None)
            return True
        if kv is None:
            kv = self._entry(job)
        if self._short:
            self._short.pop(job.job_id, None)  # (it got its room after all: evictions freed it this tick)
        if self._waiting:
            self._waiting.pop(job.job_id, None)
        end = job.num_computed + num_new_tokens  # the position this step's work ends at
        if self._host_cache and kv.residency is Residency.NONE and kv.transfer is None:
            self._take_host_prefix(kv, job, num_new_tokens)  # a longer prefix on the host: parks the job there
            if kv.residency is Residency.HOST:  # (num_new_tokens counted from 0: the prefix is not work now)
                end = min(job.num_computed + num_new_tokens, job.context_len)
        if kv.residency is Residency.HOST:
            if kv.host_prefix:
                self.stats.num_prefix_uploads_on_demand += 1  # (its prefix, not KV it computed: not a swap miss)
            else:
                self.stats.num_swap_misses += 1
            if not self.start_upload(kv, now=self._now()):
                raise RuntimeError("allocate() without can_fit(): no device room to upload the job's KV")
            if self.policy is not KVPolicy.PROACTIVE:
                # Reactive: uploaded for this pick, it is no eviction candidate until it runs. Without it, when
                # the policy's order changed between ticks (starvation promotion), each tick evicted the job
                # that had just come back for the next one it picked, and no step ran (tests/test_simulation.py).
                job.kv_pinned = True
            if not job.ready:
                self._block(job.job_id)
        if self._prefix is not None and kv.transfer is None:
            if kv.residency is Residency.NONE:  # (new, or dropped: num_computed is 0)
                end = self._attach_prefix(kv, job, num_new_tokens)
            else:
                self._register_full(kv)
        # _extra_device_blocks, inlined (once per job in the batch, every tick); the KV is not on the host now.
        extra = -(-end // self.block_size) - len(kv.device)
        if extra > 0:
            kv.device.extend(self.device.allocate(job.job_id, extra))
        if kv.residency is Residency.NONE:
            kv.residency = Residency.DEVICE
            self._device_resident[kv] = None
        if end < job.context_len:  # a chunk: more of its context to come (counted by started_blocks)
            self._prefilling[kv] = None
        elif self._prefilling:
            self._prefilling.pop(kv, None)
        return False

    @property
    def victims_by_priority(self) -> bool:
        """Recompute drops what it evicts: the policy takes the lowest-priority job first (vLLM's rule)."""
        return self.policy is KVPolicy.RECOMPUTE

    def may_evict_for(self, job) -> bool:
        """Proactive: a job whose KV is on the host runs when there is free room (or after its prefetch),
        never by pushing resident jobs out; that would trade one swap for two and, under the churn of
        starvation promotion, thrash. Reactive and recompute: yes (their definition)."""
        if self.policy is not KVPolicy.PROACTIVE:
            return True
        kv = self._jobs.get(job.job_id)
        # (A job not started whose host copy is a cached prefix is a new job: it may make room as one does.)
        return kv is None or kv.host_prefix or kv.residency not in (Residency.HOST, Residency.OFFLOADING)

    def evict(self, job) -> None:
        """Give the job's device blocks back: drop them now (recompute, or host full), or start an offload
        whose blocks free when the copy completes (poll). Never waits. An upload in flight cannot be
        recalled: its device blocks free when it lands, and the job stays on the host."""
        if job.kv_busy:
            raise RuntimeError(f"evict({job.job_id}): a launched step still writes its KV (async scheduling)")
        kv = self._jobs.get(job.job_id)
        job.kv_pinned = False
        if kv is None or not kv.device or kv.residency is Residency.OFFLOADING or kv.cancel_upload:
            return
        if kv.residency is Residency.UPLOADING:
            kv.cancel_upload = True
            self._hold_pending(kv, len(kv.device))
            return
        if self._prefix is not None:
            self._register_full(kv)  # its full blocks stay in the cache for its return
            if self.device.ref_count(kv.device[0]) > 1:  # shares its prefix with another job: release, never copy
                self._drop(kv)
                return
        if self.policy is KVPolicy.RECOMPUTE or not self.start_offload(kv):
            self._drop(kv)
        if self._host_cache:
            self._start_backups()

    def wait_for_room(self, job, num_new_tokens: int) -> bool:
        """If room_coming(): promise that room to the job for this tick, start its swap-wait clock and
        return True (the job waits for the copy); else False (more must be evicted, or it cannot run)."""
        extra = self._extra_device_blocks(job, num_new_tokens)
        free = self.device.num_free
        if extra > free + self._pending_free - self._claimed:
            self._short[job.job_id] = extra  # (the planner keeps clear of the room there is: owed_free_blocks)
            return False
        self._claimed += max(0, extra - free)
        self._promised += extra
        if self._short:
            self._short.pop(job.job_id, None)  # (promised now: counted once)
        self._block(job.job_id)
        return True

    def note_blocked(self, job) -> None:
        """The policy would run this job now but it is not ready: if that is because its KV is on the host
        or moving, its swap-wait clock starts (not ready for other reasons, e.g. in flight in a pipeline
        stage, is not swap wait)."""
        kv = self._jobs.get(job.job_id)
        if kv is not None and kv.residency in (Residency.HOST, Residency.OFFLOADING, Residency.UPLOADING):
            self._block(job.job_id)
            self._wanted_back(kv)

    def _wanted_back(self, kv: JobKV) -> None:
        if kv.offload_tick is not None:
            self.stats.num_thrash += self.tick - kv.offload_tick <= THRASH_TICKS
            kv.offload_tick = None

    def _block(self, job_id: str) -> None:
        if not self._blocked:
            self._blocked_at = self._now()
        self._blocked[job_id] = None

    def _accrue_waits(self) -> None:
        """The jobs kept by a copy at the last tick waited from then until now (the next tick)."""
        if not self._blocked:
            return
        dt = max(0.0, self._now() - self._blocked_at)
        waits = self._waits
        for jid in self._blocked:  # free() forgets a job that ends
            waits[jid] = waits.get(jid, 0.0) + dt
        self.stats.swap_wait_s += dt * len(self._blocked)
        self._blocked = {}

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
        self._blocked.pop(job_id, None)
        self._waits.pop(job_id, None)
        if self._waiting:
            self._waiting.pop(job_id, None)
        if kv is None:
            return
        self._prefilling.pop(kv, None)
        if kv.transfer is not None and not kv.transfer.done():  # (not on the host alone: its copy is in flight)
            kv.freed = True
            self._hold_pending(kv, len(kv.device))  # every device block of an orphan frees when it lands
            self._orphans.append(kv)
            return
        if kv.transfer is not None:
            self._complete(kv)
        if self._prefix is not None and kv.residency is Residency.DEVICE:
            self._register_full(kv)  # its blocks go back to the cache, named, for the next hit
        self._unpark(kv)
        self._release_all(kv)
        if self._host_cache:
            self._start_backups()

    def host_resident(self) -> list[JobKV]:
        """Entries whose KV is on the host alone, in the order they got there (memory/proactive.py), then the
        jobs not started whose cached prefix waits on the host (two tiers: the planner uploads both by ENST)."""
        if self._prefix_parked:
            return list(self._on_host.values()) + list(self._prefix_parked.values())
        return list(self._on_host.values())

    def offload_candidates(self, exclude: set[str]) -> list[JobKV]:
        """Entries whose KV is on the device alone with no copy this tick, not in flight in a pipeline
        stage and not in `exclude` (the batch): what the proactive planner may offload."""
        resident, jobs, tick = self._device_resident, self._jobs, self.tick
        found, gone = [], []
        for e in resident:
            if e.residency is not Residency.DEVICE or jobs.get(e.job.job_id) is not e:
                gone.append(e)  # left the device, or freed: forgotten until it comes back
            elif (e.device and not e.job.in_flight and not e.job.kv_busy and e.job.job_id not in exclude
                  and e.transfer_tick != tick):
                found.append(e)
        for e in gone:
            del resident[e]
        found.sort(key=lambda e: e.order)  # the order of self._jobs, as a scan of it would give
        if self._prefix is not None:  # a job sharing its prefix is never offloaded (its blocks are in use)
            found = [e for e in found if self.device.ref_count(e.device[0]) == 1]
        return found

    def pending_transfers(self) -> int:
        """Copies in flight, the cache's own included (the engine loop keeps polling while there are any)."""
        return len(self._inflight) + len(self._backups)

    def poll(self) -> None:
        """At the start of a tick: accrue the last tick's swap waits, and complete finished copies (free
        the source tier's blocks, mark uploaded jobs ready). Costs one look per copy in flight and per
        job kept by a copy, not per job."""
        self._accrue_waits()
        if self._host_cache:
            if self._backups:
                for backup in [b for b in self._backups if b.handle.done()]:
                    self._finish_backup(backup)
            self._start_backups()
        if not self._inflight:
            return
        for kv in [kv for kv in self._inflight if kv.transfer.done()]:
            if kv.freed:
                self._end_copy(kv)
                kv.transfer = None
                self._release_pending(kv)
                self._release_all(kv)
                self._orphans.remove(kv)
            else:
                self._complete(kv)

    def plan(self, batch, estimated_wait, now: float) -> None:
        """After the scheduler picked `batch`: start proactive offloads/uploads (proactive only)."""
        self.tick += 1
        if self.policy is KVPolicy.PROACTIVE:
            if self._recheck_waiting and self._waiting:
                self._park_waiting()  # waiting jobs whose prefix is on the host: the planner uploads them by ENST
            plan_transfers(self, batch, estimated_wait, now)  # (it keeps clear of this tick's promised room)
            if not batch and self._host_cache:
                self._release_unstarted()
        self._claimed = self._promised = 0  # promises of room last for the tick that made them
        if self._short:
            self._short.clear()

    @property
    def owed_free_blocks(self) -> int:
        """Free device blocks promised this tick to jobs that wait for room, beyond what the copies in flight
        will free: the proactive planner must not upload into them (its upload would take the room, the
        waiting job would evict again, and so on without end). A job that asked for more room than there is
        free or freeing (it evicts more next tick) is owed what it asked for too: with a full host tier its
        victims are dropped and free their room at once, and uploads into it would start the same circle."""
        return max(0, self._promised + sum(self._short.values()) - self._pending_free)

    def note_scheduled(self, job, now: float) -> float:
        """The job runs at `now`: returns the swap wait it just ended (0.0 if none), and for a job that
        was uploaded, records predicted (ENST) vs actual wait for the ENST-accuracy telemetry."""
        waited = self._waits.pop(job.job_id, 0.0)
        kv = self._jobs.get(job.job_id)
        if kv is not None:
            kv.host_prefix = False  # it has run: its KV is its own now
        if kv is not None and kv.predicted_wait is not None:
            actual = now - kv.upload_time
            self.stats.enst_samples.append((kv.predicted_wait, actual))
            self.stats.enst_count += 1
            self.stats.enst_abs_error_s += abs(kv.predicted_wait - actual)
            kv.predicted_wait = None
        return waited

    # -- prefix caching (memory/prefix_cache.py; issue 28) -----------------------------------------
    def enable_prefix_caching(self, source: PrefixSource, host_tier: bool = True) -> None:
        """Make the device tier a prefix cache (before any job): a job with no KV starts from its longest
        cached prefix (allocate), its full blocks are named as they fill and stay cached after it ends, and an
        allocation evicts unreferenced cached blocks, least recently released first. Evicting a job whose
        prefix another job holds releases its references and drops the rest (never copies or frees a block
        in use); its named blocks stay cached, so it recomputes only what was evicted meanwhile.

        Two tiers for cached blocks (host_tier, when there is a host tier): the host tier is a cache too.
        - A cached device block that no job holds any more is copied to the host as it is released (one copy
          per name: not if the host has that name already), so that when an allocation evicts it (least
          recently released first) its KV lives on in the host tier instead of being lost. Nothing waits on
          that copy: the device block stays free to the allocator, and one evicted before its copy lands
          leaves the copy void (freed, unnamed). The host tier frees a cached block only when it needs the
          room (least recently released first, after its free blocks), for an offload or another copy.
        - A lookup finds a prefix on either tier. One longer on the host than on the device is a hit too:
          the job takes references on the host blocks and is parked there (residency HOST, host_prefix), its
          cached length computed; its upload (start_upload) shares the blocks the device still caches and
          copies only the rest, and the job runs once it lands. Proactive: a job still waiting to start whose
          prefix is on the host is parked so at the next tick (_park_waiting), and the planner uploads it by
          ENST with the preempted jobs' KV (host_resident); picked before that, it is uploaded on demand.
        - Offloads and uploads copy only what the other tier's cache lacks: a block whose name the destination
          caches is shared there, not copied (a preempted job's shared blocks are never copied twice); an
          offloaded job's named blocks are named on the host when the copy lands, so they stay cached after it.
        A block held by any job is never evicted on either tier (reference counts)."""
        if self._jobs:
            raise RuntimeError("enable_prefix_caching() after jobs were allocated")
        self.device = CachingBlockAllocator(self.device.num_blocks, "device")
        self._prefix = source
        if host_tier and self.num_host_blocks and self.policy is not KVPolicy.RECOMPUTE:
            self.host = CachingBlockAllocator(self.host.num_blocks, "host")
            self._host_cache = True
            self.device.on_evict = self._on_device_evict
            self.device.track_released = True

    @property
    def host_caching(self) -> bool:
        """Whether the host tier caches prefix blocks too (enable_prefix_caching's host_tier)."""
        return self._host_cache

    @property
    def prefix_caching(self) -> bool:
        return self._prefix is not None

    def cached_tokens(self, job_id: str) -> int | None:
        """Tokens the job's first lookup found cached (None: not looked up; caching off, or not started)."""
        kv = self._jobs.get(job_id)
        return kv.cached_tokens if kv is not None else None

    def expected_hit(self, job) -> int:
        """Tokens of a job with no KV yet that its first allocation would find cached now (whole blocks, never
        its last token; 0 if it may not reuse a prefix). Takes no reference and counts no query: the engine asks
        at admission, for the entry rule (Job.num_cached_prompt_tokens). The job's names are kept for its first
        allocation, whose hit may be shorter (blocks evicted meanwhile, or too little room)."""
        if self._prefix is None or not self._prefix.may_reuse(job):
            return 0
        kv = self._entry(job)
        max_blocks = (job.context_len - 1) // self.block_size
        self._extend_hashes(kv, job, max_blocks)
        found = len(self.device.lookup(kv.hashes, max_blocks))
        if self._host_cache and kv.residency is Residency.NONE and not kv.host:
            found = max(found, len(self.host.lookup(kv.hashes, max_blocks)))
            self._add_waiting(job.job_id, kv)
            self._recheck_waiting = True
        return found * self.block_size

    def clear_prefix_cache(self) -> int:
        """Forget every cached block no job holds, on both tiers (vLLM's reset_prefix_cache); returns how many."""
        if self._prefix is None:
            return 0
        n = self.device.evict_all()
        return n + self.host.evict_all() if self._host_cache else n

    # -- two tiers for cached blocks (enable_prefix_caching) ------------------------------------------
    def _on_device_evict(self, blocks: list[int], names: list) -> None:
        """The device cache handed out (or forgot) blocks no job held, named `names`."""
        backup_of = self._backup_of
        if not backup_of:
            to_host = self.host.num_named(names)
        else:
            to_host, on_host = 0, self.host.names
            for b, name in zip(blocks, names):
                backup = backup_of.pop(b, None)
                if backup is not None:
                    backup.void.add(b)  # its copy read a block being reused: never name it
                elif name in on_host:
                    to_host += 1
        self.stats.cache_evicted_to_host += to_host
        self.stats.cache_evicted_dropped += len(blocks) - to_host
        self._recheck_waiting = True

    def _start_backups(self) -> None:
        """Copy to the host the cached device blocks released since the last call that are still unheld and whose
        names the host lacks, in the order they were released (the order the device evicts them), as many as
        the host has room for."""
        dev, host = self.device, self.host
        released = dev.released
        if not released:
            return
        dev.released = []
        self._grow_host()
        backup_of = self._backup_of
        unheld = dev.evictable_names(filterfalse(backup_of.__contains__, released) if backup_of else released)
        lacking = list(map(not_, map(host.names.__contains__, unheld.values())))  # (the host lacks its name)
        blocks = list(compress(unheld, lacking))
        n = min(len(blocks), host.num_free)
        if not n:
            return
        del blocks[n:]
        names = list(islice(compress(unheld.values(), lacking), n))
        backup = _Backup(blocks, host.allocate(CACHE_OWNER, n), names)
        backup_of.update(zip(blocks, repeat(backup)))
        self._backups[backup] = None
        self._backup_host_blocks += n
        self.stats.cache_blocks_backed_up += n
        backup.handle = self.transfers.copy(Direction.OFFLOAD, list(zip(blocks, backup.host)))
        if backup.handle.done():
            self._finish_backup(backup)

    def _finish_backup(self, backup: _Backup) -> None:
        """A cache copy landed: name its host blocks (those not void, whose name no other host block took
        meanwhile) and release them to the host cache."""
        host, backup_of, void, device = self.host, self._backup_of, backup.void, backup.device
        # Forget its device blocks that still map to it (a void one was forgotten when evicted, and may map to a
        # later copy since).
        deque(map(backup_of.__delitem__, compress(device, map(is_, map(backup_of.get, device), repeat(backup)))), 0)
        if void:
            keep = list(map(not_, map(void.__contains__, device)))
            host.register_fresh(list(compress(backup.host, keep)), list(compress(backup.hashes, keep)))
        else:
            host.register_fresh(backup.host, backup.hashes)
        self._host_named(backup.hashes)
        host.free(CACHE_OWNER, backup.host)
        self._backup_host_blocks -= len(backup.host)
        del self._backups[backup]
        self._recheck_waiting = True

    def _take_host_prefix(self, kv: JobKV, job, num_new_tokens: int) -> None:
        """A job with no KV at its first allocation: if its cached prefix is longer on the host than on the device,
        park it on the host with that prefix (allocate then uploads it), as long as the upload and this step's
        work fit the free device room (else the prefix is cut short, down to the device's)."""
        if not self._prefix.may_reuse(job):
            return
        bs, ctx, dev = self.block_size, job.context_len, self.device
        max_blocks = (ctx - 1) // bs
        self._extend_hashes(kv, job, max_blocks)
        on_device = len(dev.lookup(kv.hashes, max_blocks))
        hosted = self.host.lookup(kv.hashes, max_blocks)
        if len(hosted) <= on_device:
            return
        # Device blocks the upload takes: one per hosted block the device does not cache (those it does are
        # shared, and the unheld ones among them leave the free count), then this step's work past the prefix.
        shared = [dev.block_of(h) for h in kv.hashes[:len(hosted)]]
        while len(hosted) > on_device:
            k = len(hosted)
            need = blocks_needed(min(ctx, k * bs + num_new_tokens), bs) - sum(
                1 for b in shared[:k] if b is not None and dev.ref_count(b))
            if need <= dev.num_free:
                break
            hosted.pop()
        if len(hosted) > on_device:
            self._park_prefix(kv, job, hosted)

    def _park_prefix(self, kv: JobKV, job, hosted: list[int]) -> None:
        """Take the job's references on its cached prefix on the host and park it there, that prefix computed."""
        h = len(hosted) * self.block_size
        self.host.share(job.job_id, hosted)
        kv.host = list(hosted)
        kv.host_prefix = True
        kv.residency = Residency.HOST
        job.num_computed = h
        self.device.count_query(job.context_len, h)
        if kv.cached_tokens is None:
            kv.cached_tokens = h
        self.stats.host_hit_tokens += h
        self._waiting.pop(job.job_id, None)
        self._park(kv)

    def _add_waiting(self, jid: str, kv: JobKV) -> None:
        """Put the job among those waiting to start (at the end, as a dict puts a new key; in place if there)."""
        waiting, heads = self._waiting, self._waiting_heads
        if jid not in waiting:
            if kv.hashes:
                head = kv.hashes[0]
                self._num_waited += 1
                heads[jid] = (self._num_waited, head)
                self._heads_waiting.setdefault(head, []).append(jid)
                if self.host.block_of(head) is not None:
                    self._waiting_candidates.add(jid)
            else:
                heads.pop(jid, None)
            if len(heads) > 2 * len(waiting) + 64:  # forget the jobs that left (amortized: O(1) a job)
                heads = self._waiting_heads = {j: heads[j] for j in waiting if j in heads} | (
                    {jid: heads[jid]} if jid in heads else {})
                self._heads_waiting = by_name = {}
                for j, (_, head) in heads.items():
                    by_name.setdefault(head, []).append(j)
        waiting[jid] = kv

    def _host_named(self, names: Sequence) -> None:
        """The host tier names these blocks now (some may have been named already): the waiting jobs whose first
        block one of them names become candidates to park (_park_waiting)."""
        by_name = self._heads_waiting
        if by_name:
            for jids in filter(None, map(by_name.get, names)):
                self._waiting_candidates.update(jids)

    def _park_waiting(self) -> None:
        """Proactive: park the jobs waiting to start whose cached prefix is longer on the host than on the device,
        so that the planner uploads them ahead of need by ENST (host_resident). Only a job whose first block the
        host caches can be parked: the candidates (_waiting_candidates), in _waiting's order."""
        self._recheck_waiting = False
        cands = self._waiting_candidates
        if not cands:
            return
        bs, dev, host, waiting, heads = self.block_size, self.device, self.host, self._waiting, self._waiting_heads
        keep: set[str] = set()
        for _, jid in sorted((heads[j][0], j) for j in cands if j in waiting and j in heads):
            kv = waiting[jid]
            if kv.residency is not Residency.NONE or kv.device or kv.host or kv.transfer is not None:
                del waiting[jid]
                continue
            job = kv.job
            max_blocks = (job.context_len - 1) // bs
            if not kv.hashes or host.block_of(kv.hashes[0]) is None:
                continue  # its first block left the host: a candidate again when the host names it
            hosted = host.lookup(kv.hashes, max_blocks)
            if len(hosted) > len(dev.lookup(kv.hashes, max_blocks)):
                self._park_prefix(kv, job, hosted)
                self.stats.num_prefix_prefetches += 1
            else:
                keep.add(jid)  # the device caches as much: parked once the device has evicted some of it
        self._waiting_candidates = keep

    def _release_unstarted(self) -> None:
        """Nothing could run this tick: the jobs not started that hold device blocks only because their cached
        prefix was uploaded ahead of need give them back to the cache (named, so their next allocation finds them
        again, on the device or the host). The scheduler evicts started jobs alone, so room held by these would
        otherwise stay held while the jobs the scheduler walks first wait for it (a livelock the soak found).
        Not parked again before the next tick: the scheduler has the room first."""
        for jid, kv in list(self._jobs.items()):
            job = kv.job
            if (not kv.host_prefix or kv.residency is not Residency.DEVICE or kv.transfer is not None
                    or job.in_flight or job.kv_busy or job.first_scheduled_time is not None):
                continue
            self._register_full(kv)
            self.device.free(jid, kv.device)
            kv.device, kv.residency, kv.host_prefix = [], Residency.NONE, False
            kv.registered_table, kv.num_registered = None, 0
            job.num_computed = 0
            self._prefilling.pop(kv, None)  # (a first chunk was allocated: it holds no KV now)
            self._add_waiting(jid, kv)
            self.stats.num_prefix_releases += 1
        self._start_backups()

    def audit(self) -> dict[str, dict[str, int]]:
        """The accounting check (no leaks): every block of each tier is free, cached (named, held by no one), held
        by jobs (live ones: an ended job holds nothing), or held by the cache's own copies in flight, and the
        counts add up to the tier. Returns those counts per tier; raises AssertionError on any mismatch."""
        self.check_invariants()
        live = set(self._jobs) | {kv.job.job_id for kv in self._orphans}
        out = {}
        for alloc in (self.device, self.host):
            holders = alloc.holders()
            jobs = copies = 0
            for b, owners in holders.items():
                stray = set(owners) - live - {CACHE_OWNER}
                assert not stray, f"{alloc.tier} block {b} is held by {sorted(stray)!r}, which are not live jobs"
                if owners - {CACHE_OWNER}:
                    jobs += 1
                else:
                    copies += 1
            cached = alloc.num_evictable if isinstance(alloc, CachingBlockAllocator) else 0
            free = alloc.num_free - cached
            assert free + cached + jobs + copies == alloc.num_blocks, f"{alloc.tier}: blocks unaccounted for"
            out[alloc.tier] = {"free": free, "cached": cached, "jobs": jobs, "copies": copies,
                               "refs": alloc.num_refs if isinstance(alloc, CachingBlockAllocator) else jobs}
        return out

    def _attach_prefix(self, kv: JobKV, job, n: int) -> int:
        """A job with no KV: take references on its longest cached prefix (whole blocks, never its last
        token) that leaves room for the rest of this step's work (the hit's unreferenced blocks leave the free
        count); job.num_computed becomes the cached length. Returns where this step's work ends."""
        bs, ctx, dev = self.block_size, job.context_len, self.device
        src = self._prefix
        kv.name_at = 0  # (its table is new: the next allocate names what has filled, unless a hit sets it below)
        if not src.may_reuse(job):
            if kv.cached_tokens is None:
                kv.cached_tokens = 0
            return job.num_computed + n
        max_blocks = (ctx - 1) // bs
        self._extend_hashes(kv, job, max_blocks)
        hit = dev.lookup(kv.hashes, max_blocks)
        unheld = sum(1 for b in hit if not dev.ref_count(b))
        while hit and -(-min(ctx, len(hit) * bs + n) // bs) - len(hit) + unheld > dev.num_free:
            unheld -= not dev.ref_count(hit.pop())
        h = len(hit) * bs
        dev.count_query(ctx, h)
        if kv.cached_tokens is None:
            kv.cached_tokens = h
        if not hit:
            return job.num_computed + n
        dev.share(job.job_id, hit)
        kv.device.extend(hit)
        kv.registered_table, kv.num_registered = kv.device, len(hit)
        kv.name_at = _next_name_at(kv, bs)
        job.num_computed = h
        return min(ctx, h + n)

    def _extend_hashes(self, kv: JobKV, job, num_blocks: int) -> None:
        """Name the job's first num_blocks blocks (those not named yet; a job's tokens never change)."""
        hashes, bs = kv.hashes, self.block_size
        start = len(hashes)
        if num_blocks <= start:
            return
        tokens = self._prefix.token_ids(job, start * bs, num_blocks * bs)
        extend_chain(hashes, tokens, bs, self._prefix.cache_salt(job) if not hashes else None)

    def _register_full(self, kv: JobKV) -> None:
        """Name the job's device blocks that are full of computed KV and not named yet (a block whose name is
        taken stays its private copy)."""
        device, bs = kv.device, self.block_size
        if kv.registered_table is not device:  # a new table (dropped, offloaded, uploaded): start over
            kv.registered_table, kv.num_registered = device, 0
        start, full = kv.num_registered, min(kv.job.num_computed // bs, len(device))
        if full > start:
            hashes = kv.hashes
            if len(hashes) < full:
                self._extend_hashes(kv, kv.job, full)
            if full == start + 1:  # (one block filled since: a decoding job's, the usual case)
                self.device.register(device[start], hashes[start])
            else:
                self.device.register_many(device[start:full], hashes[start:full])
            kv.num_registered = full
        kv.name_at = _next_name_at(kv, bs)

    # -- capacity ---------------------------------------------------------------------------------
    def num_swapped(self) -> int:
        return sum(1 for kv in self._jobs.values() if kv.residency in (Residency.HOST, Residency.OFFLOADING))

    @property
    def num_free_device_blocks(self) -> int:
        return self.device.num_free

    @property
    def pending_free_blocks(self) -> int:
        """Device blocks that free when the copies in flight complete."""
        return self._pending_free

    def check_invariants(self) -> None:
        self.device.check_invariants()
        self.host.check_invariants()
        entries = list(self._jobs.values()) + self._orphans
        missing = [kv.job.job_id for kv in self._jobs.values()
                   if kv.residency is Residency.DEVICE and kv not in self._device_resident]
        assert not missing, f"device-resident entries the planner's index lacks: {missing}"
        stale = [kv.job.job_id for kv in self._prefilling if self._jobs.get(kv.job.job_id) is not kv
                 or not (kv.device or kv.host)]
        assert not stale, f"partly prefilled entries freed or holding no KV: {stale}"
        if self._prefix is not None:  # allocate's fast path names blocks no later than _register_full would
            late = [kv.job.job_id for kv in self._jobs.values() if kv.residency is Residency.DEVICE and kv.name_at > (
                0 if kv.registered_table is not kv.device else _next_name_at(kv, self.block_size))]
            assert not late, f"entries whose filled blocks allocate would not name: {late}"
        dev = sum(len(kv.device) for kv in entries)
        host = sum(len(kv.host) for kv in entries) + self._backup_host_blocks
        # (With prefix caching, blocks are shared: the tables add up to the references held.)
        used = self.device.num_refs if self._prefix is not None else self.device.num_used
        assert dev == used, f"tables hold {dev} device blocks, allocator says {self.device.num_used}"
        host_used = self.host.num_refs if self._host_cache else self.host.num_used
        assert host == host_used, f"tables hold {host} host blocks, allocator says {host_used}"
        pending = sum(kv.pending_blocks for kv in entries)
        assert pending == self._pending_free, f"entries hold {pending} pending blocks, the counter {self._pending_free}"
        assert set(self._inflight) == {kv for kv in entries if kv.transfer is not None}, "in-flight set is stale"
        parked = list(self._on_host.values()) + list(self._prefix_parked.values())
        assert set(parked) == {kv for kv in self._jobs.values() if kv.residency is Residency.HOST}, \
            "host-resident set is stale"
        assert all(kv.host_prefix for kv in self._prefix_parked.values()) and not any(
            kv.host_prefix for kv in self._on_host.values()), "a parked prefix in the wrong set"
        assert all(kv.job is job for job, kv in self._on_host.items()), "host-resident index keyed wrong"
        assert self._host_sizes == Counter(len(kv.host) for kv in parked), "host sizes are stale"
        assert self._host_floor is None or self._host_floor == min(self._host_sizes), "host floor is stale"
        copied = sum(min(len(kv.device), len(kv.host)) for kv in self._inflight)
        assert copied == self._copied, f"copies in flight hold {copied} blocks twice, the counter {self._copied}"

    # -- moves (start_offload and start_upload are the proactive planner's verbs) -----------------
    def _entry(self, job) -> JobKV:
        kv = self._jobs.get(job.job_id)
        if kv is None:
            self._made += 1
            kv = self._jobs[job.job_id] = JobKV(job, order=self._made)
            if self._prefix is not None:
                kv.name_at = 0
        return kv

    def _extra_device_blocks(self, job, num_new_tokens: int) -> int:
        kv = self._jobs.get(job.job_id)
        need = blocks_needed(job.num_computed + num_new_tokens, self.block_size)
        if kv is not None and kv.residency is Residency.HOST:
            # A job on the host holds no device blocks: bringing it back needs room for every block it has there,
            # which may be more than its computed tokens need (chunked prefill: blocks allocated for a chunk that
            # did not run, when the job's upload started instead) and the new tokens'.
            return max(need, len(kv.host))
        return max(0, need - (len(kv.device) if kv is not None else 0))

    def _grow_host(self) -> None:
        """Take in the host blocks the backend has readied since last asked (engine/host_tier.py): only
        those are ever handed out."""
        if self.host.num_blocks < self.num_host_blocks:
            self.host.grow(min(self.num_host_blocks, self.transfers.host_blocks_ready()))

    def start_offload(self, kv: JobKV) -> bool:
        """Begin device -> host; False (nothing started) when the host tier has no room."""
        n = len(kv.device)
        self._grow_host()
        if self._prefix is not None:
            self._register_full(kv)  # (its generated blocks too: named when it leaves the device)
        if self._host_cache:
            pairs = self._host_copies(kv)
            if pairs is None:
                self.stats.host_full_fallbacks += 1
                return False
        else:
            if n > self.host.num_free:
                self.stats.host_full_fallbacks += 1
                return False
            kv.host = self.host.allocate(kv.job.job_id, n)
            pairs = list(zip(kv.device, kv.host))
        kv.offload_tick = self.tick
        kv.residency = Residency.OFFLOADING
        kv.transfer_tick = self.tick
        kv.job.ready = False
        self.stats.num_offloads += 1
        self.stats.blocks_offloaded += len(pairs)
        self._hold_pending(kv, n)
        self._begin(kv, self.transfers.copy(Direction.OFFLOAD, pairs) if pairs else CompletedTransfer())
        return True

    def _host_copies(self, kv: JobKV) -> list[tuple[int, int]] | None:
        """Two tiers: the job's host table for an offload, sharing the host cache's copy of each named block it
        has and allocating the rest; returns the (device, host) pairs to copy, or None (nothing changed) when
        the host has no room."""
        made = self._mirror_table(kv.job.job_id, kv.device, self.device, self.host)
        if made is None:
            return None
        kv.host, pairs = made
        return pairs

    def _device_copies(self, kv: JobKV) -> list[tuple[int, int]] | None:
        """Two tiers: the job's device table for an upload, sharing the device cache's copy of each named host
        block and allocating the rest; returns the (host, device) pairs to copy, or None (nothing changed) when
        the device has no room."""
        made = self._mirror_table(kv.job.job_id, kv.host, self.host, self.device)
        if made is None:
            return None
        kv.device, pairs = made
        return pairs

    def _mirror_table(self, jid: str, table: list[int], tier, other) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The job's table on `other` for a copy of `table` (on `tier`): each block whose name `other` caches is
        shared (not copied), the rest allocated. Returns (the new table, the (source, destination) pairs to copy),
        or None, with nothing changed, when `other` has no room."""
        found = other.blocks_named(tier.names_of(table))  # per block: its copy cached on `other`, or None
        shared = [b for b in found if b is not None]
        fresh_needed = len(table) - len(shared)
        if fresh_needed + other.num_unheld(shared) > other.num_free:
            return None
        other.share(jid, shared)
        fresh = iter(other.allocate(jid, fresh_needed))
        mirror = [b if b is not None else next(fresh) for b in found]
        self.stats.blocks_not_copied += len(shared)
        return mirror, [(b, m) for b, m, f in zip(table, mirror, found) if f is None]

    def start_upload(self, kv: JobKV, predicted_wait: float | None = None, now: float = 0.0) -> bool:
        n = len(kv.host)
        if self._host_cache:
            if self._upload_unfit(kv):
                return False
            self._unpark(kv)
            pairs = self._device_copies(kv)
            if pairs is None:  # (cannot happen: _upload_unfit checked the same room)
                self._park(kv)
                return False
        else:
            if n > self.device.num_free:
                return False
            self._unpark(kv)
            kv.device = self.device.allocate(kv.job.job_id, n)
            pairs = list(zip(kv.host, kv.device))
        self._wanted_back(kv)
        kv.residency = Residency.UPLOADING
        kv.transfer_tick = self.tick
        kv.predicted_wait, kv.upload_time = predicted_wait, now
        kv.job.ready = False
        self.stats.num_uploads += 1
        self.stats.num_prefix_uploads += kv.host_prefix
        self.stats.blocks_uploaded += len(pairs)
        self._begin(kv, self.transfers.copy(Direction.UPLOAD, pairs) if pairs else CompletedTransfer())
        return True

    def _upload_unfit(self, kv: JobKV) -> bool:
        """Two tiers: whether the device lacks the room an upload of this job's host blocks takes (one block per
        block the device does not cache, plus the unheld cached ones, which leave the free count)."""
        dev = self.device
        found = dev.blocks_named(self.host.names_of(kv.host))
        shared = [b for b in found if b is not None]
        return len(found) - len(shared) + dev.num_unheld(shared) > dev.num_free

    def _begin(self, kv: JobKV, handle: TransferHandle) -> None:
        kv.transfer = handle
        self._inflight[kv] = None
        self._copied += min(len(kv.device), len(kv.host))
        if handle.done():  # nothing to wait for (no backend): complete now, not a tick later
            self._complete(kv)

    def _hold_pending(self, kv: JobKV, n: int) -> None:
        self._pending_free += n - kv.pending_blocks
        kv.pending_blocks = n

    def _release_pending(self, kv: JobKV) -> None:
        self._pending_free -= kv.pending_blocks
        kv.pending_blocks = 0

    def _complete(self, kv: JobKV) -> None:
        jid = kv.job.job_id
        self._end_copy(kv)
        self._release_pending(kv)
        if kv.residency is Residency.OFFLOADING:
            if self._host_cache:  # its named blocks are named on the host too: cached there after it comes back
                named = [(hb, name) for hb, name in zip(kv.host, self.device.names_of(kv.device)) if name is not None]
                self.host.register_many([hb for hb, _ in named], [name for _, name in named])
                self._host_named([name for _, name in named])
                self._recheck_waiting = True
            self.device.free(jid, kv.device)
            kv.device = []
            kv.residency = Residency.HOST
            self._park(kv)
            kv.job.ready = True  # schedulable: uploaded on demand if picked before a prefetch brings it back
        elif kv.residency is Residency.UPLOADING and kv.cancel_upload:  # evicted while it came up
            self.device.free(jid, kv.device)
            kv.device = []
            kv.residency = Residency.HOST
            self._park(kv)
            kv.cancel_upload = False
            kv.predicted_wait = None
            kv.job.ready = True
        elif kv.residency is Residency.UPLOADING:
            self.host.free(jid, kv.host)
            kv.host = []
            kv.residency = Residency.DEVICE
            if self._prefix is not None:
                kv.name_at = 0  # a new device table: named at its next allocate
            self._device_resident[kv] = None
            kv.job.ready = True
        kv.transfer = None

    def _drop(self, kv: JobKV) -> None:
        assert kv.transfer is None, "a job with a copy in flight cannot be dropped"
        jid = kv.job.job_id
        self._unpark(kv)
        self._prefilling.pop(kv, None)  # (it holds no KV now: admission counts it whole if it starts again)
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

    def _end_copy(self, kv: JobKV) -> None:
        """The entry's copy is over (before its block lists change)."""
        if self._inflight.pop(kv, 0) is None:
            self._copied -= min(len(kv.device), len(kv.host))

    def _park(self, kv: JobKV) -> None:
        """The entry's KV is now on the host alone."""
        (self._prefix_parked if kv.host_prefix else self._on_host)[kv.job] = kv
        n = len(kv.host)
        self._host_sizes[n] += 1
        if self._host_floor is not None and n < self._host_floor:
            self._host_floor = n

    def _unpark(self, kv: JobKV) -> None:
        """The entry's KV leaves the host-alone state (call before its block lists change)."""
        if self._on_host.pop(kv.job, None) is None and (
                not self._prefix_parked or self._prefix_parked.pop(kv.job, None) is None):
            return
        n, sizes = len(kv.host), self._host_sizes
        sizes[n] -= 1
        if not sizes[n]:
            del sizes[n]
            if n == self._host_floor:
                self._host_floor = None
