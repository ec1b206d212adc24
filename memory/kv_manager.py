"""KVManager: where each job's KV cache lives — device blocks, host blocks, or nowhere (dropped) — and the verbs
that move it.

What it is: block tables on two tiers, each job's residency, the admission verbs the scheduler uses (can_fit /
allocate / evict), the engine's verbs (free, block_table, poll, plan) and telemetry. What it is not: tensors (the
engine's Swapper copies bytes through the TransferBackend it injects) or the choice of which jobs run (scheduler/).

Its parts, each owning its own state; events flow one way (the manager calls the others and applies what they
return; neither calls the manager, nor touches another's state):
- KVManager (here): residency and admission. The jobs' entries (JobKV), their tables on both tiers and the
  allocators, the index of who is where (ResidencyIndex), overload admission, the naming of full blocks (prefix
  caching), eviction, and applying landed copies (_land).
- CopyLedger (memory/copy_ledger.py): the jobs' copies in flight and the jobs that wait on them. It starts the
  copies, counts what they hold and free, keeps the room promised to waiting jobs and their swap waits, and its
  poll returns the copies that landed.
- HostPrefixTier (memory/host_prefix_tier.py): the host side of the two-tier prefix cache, when enabled. Its own
  copies of released cached blocks, and the jobs waiting to start that may find their prefix on the host; it
  answers with the host blocks of a prefix, the jobs to park and a job's table on the other tier.

kv-policy (paper section 4.2; the rules live in memory/kv_policy.py and memory/proactive.py):
- recompute: evicting drops the KV; the job rebuilds it (prefill over prompt + output so far) when next scheduled.
- reactive: evicting offloads to host only when a job the scheduler picked needs the room; that job waits until
  the copy has freed it. A job on the host stays schedulable and is uploaded when the scheduler picks it; it runs
  once the upload lands (swap wait: memory/copy_ledger.py).
- proactive: plan() keeps free device blocks above a watermark by offloading the idle jobs with the largest ENST
  ahead of need, and uploads host jobs with the smallest ENST when there is room, both overlapped with compute. A
  job whose prefetch is in flight is not ready. A job still on the host when the scheduler picks it is a swap
  miss: its upload starts then and it runs when the copy lands; misses and their wait are counted.
When the host tier is full, an eviction falls back to a drop (recompute).

Overload admission (may_start): past capacity a preemptive policy keeps starting new jobs ahead of old ones, so
the set of started jobs, each holding KV, grows without bound; once it outgrows the host, evictions become drops
and every promotion rebuilds a whole context. So a job with no KV anywhere (new, or dropped) starts only while the
KV of every started job plus its own stays within `max_started_blocks` (device and host together; None = no
limit, the paper's behaviour); beyond it, it waits where it is in the policy's order. The engine's default with a
host tier is both tiers less an eighth of both (room for the started jobs to grow as they decode), so
admission binds only where drops would begin; `--kv-overcommit N` sets N device caches instead (engine/engine.py,
_make_kv_manager).

Nothing here ever waits on a copy: the engine's event loop must not block. evict() starts an offload and the
device blocks free when it completes (poll); allocate() of a job on the host starts its upload and leaves
job.ready False; the policy sees "not ready" / "no room yet" and the job simply waits. A copy whose handle reports
done() at once (no backend, the simulator's zero-byte case) completes on the spot, so nothing waits a tick for
nothing.

Invariants (check_invariants): every block on each tier is free or owned by exactly one job; device blocks of an
offload are reused only after its copy completes; host blocks are freed only after their upload completes.
"""

from __future__ import annotations

import time
from collections.abc import Container

from memory import prefix_cache
from memory.block_allocator import BlockAllocator, blocks_needed
from memory.copy_ledger import CopyLedger
from memory.host_prefix_tier import CACHE_OWNER, HostPrefixTier
from memory.kv_policy import KVPolicy
from memory.prefix_cache import CachingBlockAllocator, PrefixSource
from memory.proactive import plan_transfers
from memory.residency import GREW_BY_NOTHING, Allocation, JobKV, KVStats, Residency, ResidencyIndex
from memory.transfers import Direction, TransferBackend

THRASH_TICKS = 4  # an offload undone within this many ticks counts as thrash


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
        self._ledger = CopyLedger(transfers, num_host_blocks, now)
        self.host = BlockAllocator(0, "host")  # grows as the backend readies host blocks (CopyLedger.grow_host)
        self._ledger.grow_host(self.host)
        self._now = now  # the engine's clock (virtual in the simulator)
        self._jobs: dict[str, JobKV] = {}
        self._made = 0  # entries made so far (JobKV.order)
        self._where = ResidencyIndex()  # the entries on the device, and on the host alone
        self.tick = 0
        self.stats = KVStats()
        self._prefix: PrefixSource | None = None  # prefix caching's token source (enable_prefix_caching)
        self._tier: HostPrefixTier | None = None  # the host tier caches blocks too (enable_prefix_caching)
        # Entries whose last allocation stopped short of their context (a chunk of a prefill, chunked prefill) and
        # that still hold KV: admission counts the blocks the rest of their prefill will take (started_blocks).
        self._prefilling: dict[JobKV, None] = {}

    @property
    def transfers(self) -> TransferBackend:
        """The engine's backend that moves the bytes of every copy."""
        return self._ledger.backend

    @property
    def num_host_blocks(self) -> int:
        """The host tier's size once all of it is there."""
        return self._ledger.num_host_blocks

    # -- the scheduler's verbs ------------------------------------------------------------------
    def can_fit(self, job, num_new_tokens: int) -> bool:
        # (the scheduler asks this of every job it walks: inlined, as allocate's fast path)
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
        docs/benchmarks.md, "Chunked prefill")."""
        held = self.device.num_used + self.host.num_used - self._ledger.copied
        if self._tier is not None:
            held -= self._tier.backup_host_blocks
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
        on_host = self._where.on_host
        if self.policy is not KVPolicy.PROACTIVE or not on_host:
            return ()
        return on_host if self._where.smallest_host_copy() > self.device.num_free else ()

    def room_for(self, num_tokens: int) -> bool:
        """Whether a job with no KV needing num_tokens could get its blocks this tick without an eviction
        (the room can_fit and wait_for_room would find: free, or freeing and not promised)."""
        return blocks_needed(num_tokens, self.block_size) <= self.device.num_free + self._ledger.unpromised

    def parked(self) -> Container:
        """Jobs whose KV is on the host alone (they hold no device blocks)."""
        return self._where.on_host

    def smallest_host_copy(self) -> int:
        """Blocks of the smallest KV on the host alone (0 if none): no such job comes back to the device
        with fewer free blocks than this."""
        return self._where.smallest_host_copy()

    def allocate(self, job, num_new_tokens: int) -> Allocation | None:
        """Reserve the device room for the job's next num_new_tokens; None, changing nothing, when can_fit(job,
        num_new_tokens) is False (the caller makes room, or passes the job over). A job whose KV is on the host
        (a swap miss) starts its upload here and is not ready until it lands (job.ready False): the policy leaves
        it out of this tick's batch. The Allocation says which of these happened."""
        kv = self._jobs.get(job.job_id)
        if kv is None or kv.residency is not Residency.DEVICE or kv.transfer is not None:
            return self._allocate_anew(kv, job, num_new_tokens)
        # A job on the device with no copy in flight (every job of the batch but new ones, every tick): what
        # _allocate_anew does for it, without the checks that cannot apply.
        computed = job.num_computed
        end = computed + num_new_tokens
        extra = -(-end // self.block_size) - len(kv.device)
        if extra > self.device.num_free:
            return None
        jid = job.job_id
        tier = self._tier
        if tier is not None and tier.waiting:
            tier.leave(jid)
        if self._ledger.short:
            self._ledger.got_room(jid)
        if job.kv_pinned:  # (it runs now)
            job.kv_pinned = False
        if computed >= kv.name_at:  # (else no block has filled since it last ran: nothing to name)
            self._register_full(kv)
        grant = GREW_BY_NOTHING
        if extra > 0:
            new = self.device.allocate(jid, extra)
            kv.device.extend(new)
            grant = Allocation(new, True, False)
        if end < job.prompt_len + job.num_generated:  # a chunk: more of its context to come
            self._prefilling[kv] = None
        elif self._prefilling:
            self._prefilling.pop(kv, None)
        return grant

    def _allocate_anew(self, kv: JobKV | None, job, num_new_tokens: int) -> Allocation | None:
        """allocate() of a job whose KV is not on the device alone: it has none (new, or dropped; it may find a
        cached prefix), or its KV is on the host (its upload starts)."""
        if not self.can_fit(job, num_new_tokens):
            return None
        if kv is None:
            kv = self._entry(job)
        before = len(kv.device)
        if self._ledger.short:
            self._ledger.got_room(job.job_id)  # (evictions freed its room this tick after all)
        tier = self._tier
        if tier is not None and tier.waiting:
            tier.leave(job.job_id)
        end = job.num_computed + num_new_tokens  # the position this step's work ends at
        if tier is not None and kv.residency is Residency.NONE and kv.transfer is None:
            self._take_host_prefix(kv, job, num_new_tokens)  # a longer prefix on the host: parks the job there
            if kv.residency is Residency.HOST:  # (num_new_tokens counted from 0: the prefix is not work now)
                end = min(job.num_computed + num_new_tokens, job.context_len)
        upload = kv.residency is Residency.HOST
        if upload:
            if kv.host_prefix:
                self.stats.num_prefix_uploads_on_demand += 1  # (its prefix, not KV it computed: not a swap miss)
            else:
                self.stats.num_swap_misses += 1
            if not self.start_upload(kv, now=self._now()):
                raise RuntimeError("allocate(): can_fit said yes, but no device room to upload the job's KV")
            if self.policy is not KVPolicy.PROACTIVE:
                # Reactive: uploaded for this pick, it is no eviction candidate until it runs. Without it, when
                # the policy's order changed between ticks (starvation promotion), each tick evicted the job
                # that had just come back for the next one it picked, and no step ran (tests/test_simulation.py).
                job.kv_pinned = True
            if not job.ready:
                self._ledger.keep(job.job_id)
        if self._prefix is not None and kv.transfer is None:
            if kv.residency is Residency.NONE:  # (new, or dropped: num_computed is 0)
                end = prefix_cache.attach_prefix(kv, job, self.device, self._prefix, num_new_tokens, self.block_size)
            else:
                self._register_full(kv)
        # (the KV is not on the host now)
        extra = -(-end // self.block_size) - len(kv.device)
        if extra > 0:
            kv.device.extend(self.device.allocate(job.job_id, extra))
        if kv.residency is Residency.NONE:
            kv.residency = Residency.DEVICE
            self._where.device_resident[kv] = None
        if end < job.context_len:  # a chunk: more of its context to come (counted by started_blocks)
            self._prefilling[kv] = None
        elif self._prefilling:
            self._prefilling.pop(kv, None)
        return Allocation(kv.device[before:], False, upload)

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
            self._ledger.hold(kv, len(kv.device))
            return
        if self._prefix is not None:
            self._register_full(kv)  # its full blocks stay in the cache for its return
            if self.device.ref_count(kv.device[0]) > 1:  # shares its prefix with another job: release, never copy
                self._drop(kv)
                return
        if self.policy is KVPolicy.RECOMPUTE or not self.start_offload(kv):
            self._drop(kv)
        if self._tier is not None:
            self._tier.start_backups()

    def wait_for_room(self, job, num_new_tokens: int) -> bool:
        """If the room the job lacks is free or being freed by copies in flight (and not promised yet): promise it
        to the job for this tick, start its swap-wait clock and return True (the job waits for the copy); else
        False (more must be evicted, or it cannot run)."""
        kv = self._jobs.get(job.job_id)
        need = blocks_needed(job.num_computed + num_new_tokens, self.block_size)
        if kv is not None and kv.residency is Residency.HOST:
            # A job on the host holds no device blocks: bringing it back needs room for every block it has there,
            # which may be more than its computed tokens need (chunked prefill: blocks allocated for a chunk that
            # did not run, when the job's upload started instead) and the new tokens'.
            extra = max(need, len(kv.host))
        else:
            extra = max(0, need - (len(kv.device) if kv is not None else 0))
        return self._ledger.promise(job.job_id, extra, self.device.num_free)

    def note_blocked(self, job) -> None:
        """The policy would run this job now but it is not ready: if that is because its KV is on the host
        or moving, its swap-wait clock starts (not ready for other reasons, e.g. in flight in a pipeline
        stage, is not swap wait)."""
        kv = self._jobs.get(job.job_id)
        if kv is not None and kv.residency in (Residency.HOST, Residency.OFFLOADING, Residency.UPLOADING):
            self._ledger.keep(job.job_id)
            self._wanted_back(kv)

    def _wanted_back(self, kv: JobKV) -> None:
        if kv.offload_tick is not None:
            self.stats.num_thrash += self.tick - kv.offload_tick <= THRASH_TICKS
            kv.offload_tick = None

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
        self._ledger.forget(job_id)
        tier = self._tier
        if tier is not None and tier.waiting:
            tier.leave(job_id)
        if kv is None:
            return
        self._prefilling.pop(kv, None)
        if kv.transfer is not None and not kv.transfer.done():  # (not on the host alone: its copy is in flight)
            self._ledger.orphan(kv)  # every device block of an orphan frees when it lands
            return
        if kv.transfer is not None:
            self._complete(kv)
        if self._prefix is not None and kv.residency is Residency.DEVICE:
            self._register_full(kv)  # its blocks go back to the cache, named, for the next hit
        self._where.unpark(kv)
        self._release_all(kv)
        if tier is not None:
            tier.start_backups()

    def host_resident(self) -> list[JobKV]:
        """Entries whose KV is on the host alone, in the order they got there (memory/proactive.py), then the
        jobs not started whose cached prefix waits on the host (two tiers: the planner uploads both by ENST)."""
        return self._where.host_resident()

    def offload_candidates(self, exclude: set[str]) -> list[JobKV]:
        """Entries whose KV is on the device alone with no copy this tick, not in flight in a pipeline
        stage and not in `exclude` (the batch): what the proactive planner may offload."""
        found = self._where.offload_candidates(self._jobs, exclude, self.tick)
        if self._prefix is not None:  # a job sharing its prefix is never offloaded (its blocks are in use)
            found = [e for e in found if self.device.ref_count(e.device[0]) == 1]
        return found

    def pending_transfers(self) -> int:
        """Copies in flight, the cache's own included (the engine loop keeps polling while there are any)."""
        return self._ledger.num_in_flight + (self._tier.num_copies if self._tier is not None else 0)

    def poll(self) -> None:
        """At the start of a tick: accrue the last tick's swap waits, and complete finished copies (free
        the source tier's blocks, mark uploaded jobs ready). Costs one look per copy in flight and per
        job kept by a copy, not per job."""
        if waited := self._ledger.accrue_waits():
            self.stats.swap_wait_s += waited
        if self._tier is not None:
            self._tier.poll()
        for kv in self._ledger.poll():
            if kv.freed:
                self._release_all(kv)
            else:
                self._land(kv)

    def plan(self, batch, estimated_wait, now: float) -> None:
        """After the scheduler picked `batch`: start proactive offloads/uploads (proactive only)."""
        self.tick += 1
        tier = self._tier
        if self.policy is KVPolicy.PROACTIVE:
            if tier is not None:  # waiting jobs whose prefix is on the host: the planner uploads them by ENST
                for kv, hosted in tier.jobs_to_park():
                    self._park_prefix(kv, kv.job, hosted)
                    self.stats.num_prefix_prefetches += 1
            plan_transfers(self, batch, estimated_wait, now)  # (it keeps clear of this tick's promised room)
            if not batch and tier is not None:
                self._release_unstarted()
        self._ledger.end_tick()

    @property
    def owed_free_blocks(self) -> int:
        """Free device blocks promised this tick to jobs that wait for room (CopyLedger.owed): the proactive planner
        must not upload into them."""
        return self._ledger.owed

    def note_scheduled(self, job, now: float) -> float:
        """The job runs at `now`: returns the swap wait it just ended (0.0 if none), and for a job that
        was uploaded, records predicted (ENST) vs actual wait for the ENST-accuracy telemetry."""
        waited = self._ledger.end_wait(job.job_id)
        kv = self._jobs.get(job.job_id)
        if kv is not None:
            kv.host_prefix = False  # it has run: its KV is its own now
        if kv is not None and kv.predicted_wait is not None:  # (uploaded: how good was the ENST it was ranked by)
            actual = now - kv.upload_time
            self.stats.enst_samples.append((kv.predicted_wait, actual))
            self.stats.enst_count += 1
            self.stats.enst_abs_error_s += abs(kv.predicted_wait - actual)
            kv.predicted_wait = None
        return waited

    # -- prefix caching (memory/prefix_cache.py) ---------------------------------------------------
    def enable_prefix_caching(self, source: PrefixSource, host_tier: bool = True) -> None:
        """Make the device tier a prefix cache (before any job): a job with no KV starts from its longest
        cached prefix (allocate), its full blocks are named as they fill and stay cached after it ends, and an
        allocation evicts unreferenced cached blocks, least recently released first. Evicting a job whose
        prefix another job holds releases its references and drops the rest (never copies or frees a block
        in use); its named blocks stay cached, so it recomputes only what was evicted meanwhile.

        host_tier (when there is a host tier and the KV policy swaps): the host tier caches blocks too, the two
        tiers as one cache (memory/host_prefix_tier.py says how)."""
        if self._jobs:
            raise RuntimeError("enable_prefix_caching() after jobs were allocated")
        self.device = CachingBlockAllocator(self.device.num_blocks, "device")
        self._prefix = source
        if host_tier and self.num_host_blocks and self.policy is not KVPolicy.RECOMPUTE:
            self.host = CachingBlockAllocator(self.host.num_blocks, "host")
            self._tier = HostPrefixTier(self.device, self.host, self._ledger, self.stats, self.block_size)

    @property
    def host_caching(self) -> bool:
        """Whether the host tier caches prefix blocks too (enable_prefix_caching's host_tier)."""
        return self._tier is not None

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
        prefix_cache.extend_names(kv, job, self._prefix, max_blocks, self.block_size)
        found = len(self.device.lookup(kv.hashes, max_blocks))
        if self._tier is not None and kv.residency is Residency.NONE and not kv.host:
            found = max(found, len(self.host.lookup(kv.hashes, max_blocks)))
            self._tier.add_waiting(job.job_id, kv, recheck=True)
        return found * self.block_size

    def clear_prefix_cache(self) -> int:
        """Forget every cached block no job holds, on both tiers (vLLM's reset_prefix_cache); returns how many."""
        if self._prefix is None:
            return 0
        n = self.device.evict_all()
        return n + self.host.evict_all() if self._tier is not None else n

    def _take_host_prefix(self, kv: JobKV, job, num_new_tokens: int) -> None:
        """A job with no KV at its first allocation: if its cached prefix is longer on the host than on the device,
        park it on the host with that prefix (allocate then uploads it), as long as the upload and this step's
        work fit the free device room (else the prefix is cut short, down to the device's)."""
        if not self._prefix.may_reuse(job):
            return
        max_blocks = (job.context_len - 1) // self.block_size
        prefix_cache.extend_names(kv, job, self._prefix, max_blocks, self.block_size)
        hosted = self._tier.hosted_prefix(kv.hashes, max_blocks, job.context_len, num_new_tokens)
        if hosted:
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
        self._where.park(kv)

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
            self._tier.add_waiting(jid, kv)
            self.stats.num_prefix_releases += 1
        self._tier.start_backups()

    def audit(self) -> dict[str, dict[str, int]]:
        """The accounting check (no leaks): every block of each tier is free, cached (named, held by no one), held
        by jobs (live ones: an ended job holds nothing), or held by the cache's own copies in flight, and the
        counts add up to the tier. Returns those counts per tier; raises AssertionError on any mismatch."""
        self.check_invariants()
        live = set(self._jobs) | {kv.job.job_id for kv in self._ledger.orphans}
        return {alloc.tier: prefix_cache.account(alloc, live, CACHE_OWNER) for alloc in (self.device, self.host)}

    def _register_full(self, kv: JobKV) -> None:
        """Name the job's device blocks that are full of computed KV and not named yet."""
        prefix_cache.register_full(kv, self.device, self._prefix, self.block_size)

    # -- capacity ---------------------------------------------------------------------------------
    def num_swapped(self) -> int:
        return sum(1 for kv in self._jobs.values() if kv.residency in (Residency.HOST, Residency.OFFLOADING))

    @property
    def num_free_device_blocks(self) -> int:
        return self.device.num_free

    @property
    def pending_free_blocks(self) -> int:
        """Device blocks that free when the copies in flight complete."""
        return self._ledger.pending_free

    def check_invariants(self) -> None:
        self.device.check_invariants()
        self.host.check_invariants()
        entries = list(self._jobs.values()) + list(self._ledger.orphans)
        stale = [kv.job.job_id for kv in self._prefilling if self._jobs.get(kv.job.job_id) is not kv
                 or not (kv.device or kv.host)]
        assert not stale, f"partly prefilled entries freed or holding no KV: {stale}"
        if self._prefix is not None:  # allocate's fast path names blocks no later than _register_full would
            late = [kv.job.job_id for kv in self._jobs.values() if kv.residency is Residency.DEVICE and kv.name_at > (
                0 if kv.registered_table is not kv.device else prefix_cache.next_name_at(kv, self.block_size))]
            assert not late, f"entries whose filled blocks allocate would not name: {late}"
        dev = sum(len(kv.device) for kv in entries)
        host = sum(len(kv.host) for kv in entries) + (self._tier.backup_host_blocks if self._tier else 0)
        # (With prefix caching, blocks are shared: the tables add up to the references held.)
        used = self.device.num_refs if self._prefix is not None else self.device.num_used
        assert dev == used, f"tables hold {dev} device blocks, allocator says {self.device.num_used}"
        host_used = self.host.num_refs if self._tier is not None else self.host.num_used
        assert host == host_used, f"tables hold {host} host blocks, allocator says {host_used}"
        self._ledger.check_invariants(entries)
        self._where.check_invariants(self._jobs)

    # -- moves (start_offload and start_upload are the proactive planner's verbs) -----------------
    def _entry(self, job) -> JobKV:
        kv = self._jobs.get(job.job_id)
        if kv is None:
            self._made += 1
            kv = self._jobs[job.job_id] = JobKV(job, order=self._made)
            if self._prefix is not None:
                kv.name_at = 0
        return kv

    def start_offload(self, kv: JobKV) -> bool:
        """Begin device -> host; False (nothing started) when the host tier has no room."""
        n = len(kv.device)
        self._ledger.grow_host(self.host)
        if self._prefix is not None:
            self._register_full(kv)  # (its generated blocks too: named when it leaves the device)
        if self._tier is not None:  # (the host cache's copies of its named blocks are shared, not copied)
            made = self._tier.offload_table(kv.job.job_id, kv.device)
            if made is None:
                self.stats.host_full_fallbacks += 1
                return False
            kv.host, pairs = made
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
        self._ledger.hold(kv, n)
        if self._ledger.start(kv, Direction.OFFLOAD, pairs):
            self._complete(kv)
        return True

    def start_upload(self, kv: JobKV, predicted_wait: float | None = None, now: float = 0.0) -> bool:
        n = len(kv.host)
        tier = self._tier
        if tier is not None:  # (the device cache's copies of its named blocks are shared, not copied)
            if tier.upload_unfit(kv.host):
                return False
            self._where.unpark(kv)
            made = tier.upload_table(kv.job.job_id, kv.host)
            if made is None:  # (cannot happen: upload_unfit checked the same room)
                self._where.park(kv)
                return False
            kv.device, pairs = made
        else:
            if n > self.device.num_free:
                return False
            self._where.unpark(kv)
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
        if self._ledger.start(kv, Direction.UPLOAD, pairs):
            self._complete(kv)
        return True

    def _complete(self, kv: JobKV) -> None:
        """The entry's copy has landed (before any poll saw it): settle it in the ledger and apply it."""
        self._ledger.settle(kv)
        self._land(kv)

    def _land(self, kv: JobKV) -> None:
        """Apply a landed copy (the ledger has settled it): free the source tier's blocks, and park the job on
        the host or make it device-resident."""
        jid = kv.job.job_id
        offload = kv.residency is Residency.OFFLOADING
        if offload or kv.cancel_upload:  # an offload, or an upload recalled by an eviction while it came up
            if offload and self._tier is not None:  # its named blocks are named on the host too: cached there
                self._tier.offload_landed(kv.host, kv.device)
            self.device.free(jid, kv.device)
            kv.device = []
            kv.residency = Residency.HOST
            self._where.park(kv)
            if not offload:
                kv.cancel_upload, kv.predicted_wait = False, None
            kv.job.ready = True  # schedulable: uploaded on demand if picked before a prefetch brings it back
        elif kv.residency is Residency.UPLOADING:
            self.host.free(jid, kv.host)
            kv.host = []
            kv.residency = Residency.DEVICE
            if self._prefix is not None:
                kv.name_at = 0  # a new device table: named at its next allocate
            self._where.device_resident[kv] = None
            kv.job.ready = True

    def _drop(self, kv: JobKV) -> None:
        assert kv.transfer is None, "a job with a copy in flight cannot be dropped"
        jid = kv.job.job_id
        self._where.unpark(kv)
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
