"""CopyLedger: the copies of jobs' KV between the tiers while they are in flight.

What it is: the one place that starts a job's offload (device -> host) or upload (host -> device) on the
engine's TransferBackend, knows which copies still run, and reports those that have landed. It counts what they
hold meanwhile: the device blocks that free when they land (pending_free: an offload's, an upload recalled by an
eviction, an ended job's) and the blocks held on both tiers at once (copied: admission counts them once). It also
hands out the host blocks the backend has readied (grow_host) and starts the copies that others track themselves
(copy: the prefix cache's backups, memory/host_prefix_tier.py).

And the jobs that wait on those copies: the room the copies are freeing that is promised this tick to jobs
that wait for it (promise), and each job's swap wait (reported per request as swap_wait_s): the sum, over the
ticks at which the policy picked the job but could not run it because of a copy (its KV on the host or
moving, or the device room it needs still being freed by an offload), of the engine-clock time until the
next tick: the time it would have been running. Ticks at which it was simply not picked are queueing, not
swap wait.

What it is not: the owner of block tables or residency. memory/kv_manager.py picks the blocks and applies a
landed copy (frees the source tier, parks or readies the job); the ledger only keeps the handle (JobKV.transfer,
JobKV.pending_blocks and JobKV.freed are its fields of the shared record).

Events flow one way: the KV manager calls start / hold / orphan / settle, and poll returns the copies that have
landed, settled here, in the order they started, for the manager to apply. The ledger calls no one. Nothing here
waits on a copy: a handle is only asked done().
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from memory.block_allocator import BlockAllocator
from memory.residency import JobKV
from memory.transfers import CompletedTransfer, Direction, NoCopyBackend, TransferBackend, TransferHandle


class CopyLedger:
    def __init__(self, backend: TransferBackend | None, num_host_blocks: int, now=time.perf_counter) -> None:
        self.backend = backend or NoCopyBackend()
        self._now = now  # the engine's clock: swap waits are measured on it (virtual in the simulator)
        self.num_host_blocks = num_host_blocks  # the host tier's size once all of it is there
        self._inflight: dict[JobKV, None] = {}  # entries with a copy in flight (orphans included), in start order
        self._orphans: list[JobKV] = []  # ended (freed) while their copy was in flight
        self.copied = 0  # blocks held on both tiers by the copies in flight
        self.pending_free = 0  # device blocks that free when the copies in flight land
        self._claimed = 0  # device blocks freeing, promised this tick to jobs that wait for room
        self._promised = 0  # device blocks promised this tick to jobs that wait for room (free and freeing)
        # Jobs that asked for room this tick and did not get it: the room each asked (read by others, changed here).
        self.short: dict[str, int] = {}
        self._kept: dict[str, None] = {}  # job ids picked this tick but kept by a copy
        self._kept_at = 0.0  # when the first of them was (the tick's time)
        self._waits: dict[str, float] = {}  # job id -> swap wait accrued since it last ran

    def grow_host(self, host: BlockAllocator) -> None:
        """Take in the host blocks the backend has readied since last asked (engine/host_tier.py): only those are
        ever handed out."""
        if host.num_blocks < self.num_host_blocks:
            host.grow(min(self.num_host_blocks, self.backend.host_blocks_ready()))

    def copy(self, direction: Direction, pairs: list[tuple[int, int]]) -> TransferHandle:
        """Start a copy that the caller tracks itself (not a job's: the prefix cache's own)."""
        return self.backend.copy(direction, pairs)

    # -- a job's copy ------------------------------------------------------------------------------
    def start(self, kv: JobKV, direction: Direction, pairs: list[tuple[int, int]]) -> bool:
        """Start copying the entry's blocks (pairs of source, destination; none: nothing to copy). Returns whether
        the copy has landed already (no backend, nothing to copy): then the caller settles and applies it now,
        not a tick later."""
        handle = self.backend.copy(direction, pairs) if pairs else CompletedTransfer()
        kv.transfer = handle
        self._inflight[kv] = None
        self.copied += min(len(kv.device), len(kv.host))
        return handle.done()

    def hold(self, kv: JobKV, n: int) -> None:
        """n of the entry's device blocks free when its copy lands."""
        self.pending_free += n - kv.pending_blocks
        kv.pending_blocks = n

    def orphan(self, kv: JobKV) -> None:
        """The entry's job ended while its copy runs: every device block it holds frees when the copy lands
        (poll returns it with kv.freed set; its blocks are the caller's to free)."""
        kv.freed = True
        self.hold(kv, len(kv.device))
        self._orphans.append(kv)

    def settle(self, kv: JobKV) -> None:
        """The entry's copy is over (call before its block lists change): forget it and what it held."""
        if self._inflight.pop(kv, 0) is None:
            self.copied -= min(len(kv.device), len(kv.host))
        self.pending_free -= kv.pending_blocks
        kv.pending_blocks = 0
        kv.transfer = None

    def poll(self) -> list[JobKV]:
        """The entries whose copies have landed since the last poll, in the order they started, each settled (an
        orphan among them, kv.freed, is forgotten too). Costs one look per copy in flight."""
        if not self._inflight:
            return []
        landed = [kv for kv in self._inflight if kv.transfer.done()]
        for kv in landed:
            self.settle(kv)
            if kv.freed:
                self._orphans.remove(kv)
        return landed

    # -- room promised to jobs that wait for it ---------------------------------------------------------
    def promise(self, job_id: str, extra: int, free: int) -> bool:
        """A job lacks `extra` device blocks with `free` free: if the room free and freeing (not promised yet)
        covers it, promise it to the job for this tick and keep the job (it waits for the copies: True); else
        note what it asked (owed) and return False."""
        if extra > free + self.pending_free - self._claimed:
            self.short[job_id] = extra  # (the planner keeps clear of the room there is: owed)
            return False
        self._claimed += max(0, extra - free)
        self._promised += extra
        if self.short:
            self.short.pop(job_id, None)  # (promised now: counted once)
        self.keep(job_id)
        return True

    @property
    def unpromised(self) -> int:
        """Device blocks the copies in flight are freeing that no job was promised this tick."""
        return self.pending_free - self._claimed

    @property
    def owed(self) -> int:
        """Free device blocks promised this tick to jobs that wait for room, beyond what the copies in flight will
        free: the proactive planner must not upload into them (its upload would take the room, the waiting job
        would evict again, and so on without end). A job that asked for more room than there is free or freeing
        (it evicts more next tick) is owed what it asked for too: with a full host tier its victims are dropped
        and free their room at once, and uploads into it would start the same circle."""
        return max(0, self._promised + sum(self.short.values()) - self.pending_free)

    def got_room(self, job_id: str) -> None:
        """The job got its room this tick after all: it is owed nothing."""
        self.short.pop(job_id, None)

    def end_tick(self) -> None:
        """Promises of room last for the tick that made them."""
        self._claimed = self._promised = 0
        if self.short:
            self.short.clear()

    # -- swap waits ----------------------------------------------------------------------------------
    def keep(self, job_id: str) -> None:
        """The policy picked the job this tick but a copy keeps it (its KV moving, or the room it needs being
        freed): it waits from now until the next tick."""
        if not self._kept:
            self._kept_at = self._now()
        self._kept[job_id] = None

    def accrue_waits(self) -> float:
        """At the next tick: the jobs kept at the last one waited from then until now. Returns the job-seconds
        added (0.0: none was kept)."""
        if not self._kept:
            return 0.0
        dt = max(0.0, self._now() - self._kept_at)
        waits = self._waits
        for jid in self._kept:  # (forget() drops a job that ends)
            waits[jid] = waits.get(jid, 0.0) + dt
        added = dt * len(self._kept)
        self._kept = {}
        return added

    def end_wait(self, job_id: str) -> float:
        """The job runs: the swap wait it accrued since it last ran (0.0 if none), forgotten."""
        return self._waits.pop(job_id, 0.0)

    def forget(self, job_id: str) -> None:
        """The job ended: no swap wait of it is counted any more."""
        self._kept.pop(job_id, None)
        self._waits.pop(job_id, None)

    # -- what it holds -----------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def orphans(self) -> tuple[JobKV, ...]:
        """Entries of ended jobs whose copies still run (their blocks stay held until they land)."""
        return tuple(self._orphans)

    def check_invariants(self, entries: Iterable[JobKV]) -> None:
        """`entries`: every live entry and the orphans."""
        entries = list(entries)
        pending = sum(kv.pending_blocks for kv in entries)
        assert pending == self.pending_free, f"entries hold {pending} pending blocks, the counter {self.pending_free}"
        assert set(self._inflight) == {kv for kv in entries if kv.transfer is not None}, "in-flight set is stale"
        copied = sum(min(len(kv.device), len(kv.host)) for kv in self._inflight)
        assert copied == self.copied, f"copies in flight hold {copied} blocks twice, the counter {self.copied}"
