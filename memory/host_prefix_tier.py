"""HostPrefixTier: the host side of the two-tier prefix cache (KVManager.enable_prefix_caching with host_tier).

The host tier caches blocks too:
- A cached device block that no job holds any more is copied to the host as it is released (one copy per name:
  not if the host has that name already; a backup), so that when an allocation evicts it (least recently
  released first) its KV lives on in the host tier instead of being lost. Nothing waits on that copy: the
  device block stays free to the allocator, and one evicted before its copy lands leaves the copy void (freed,
  unnamed). The host tier frees a cached block only when it needs the room (least recently released first,
  after its free blocks), for an offload or another copy.
- A lookup finds a prefix on either tier. One longer on the host than on the device is a hit too: the job takes
  references on the host blocks and is parked there (residency HOST, host_prefix), its cached length computed;
  its upload shares the blocks the device still caches and copies only the rest, and the job runs once it
  lands. Proactive: a job still waiting to start whose prefix is on the host is parked so at the next tick
  (jobs_to_park), and the planner uploads it by ENST with the preempted jobs' KV; picked before that, it is
  uploaded on demand.
- Offloads and uploads copy only what the other tier's cache lacks: a block whose name the destination caches
  is shared there, not copied (a preempted job's shared blocks are never copied twice); an offloaded job's named
  blocks are named on the host when the copy lands, so they stay cached after it.
A block held by any job is never evicted on either tier (reference counts).

What it owns: the cache's own device -> host copies in flight (backups) and the host blocks they hold
(CACHE_OWNER), and the jobs waiting to start that may find their prefix on the host (the candidates to park).
What it is given: the two caching allocators (their names and lookups; the KV manager owns the jobs' tables on
them), the copy ledger (host blocks as the backend readies them, and the copies themselves), the stats to count
into and the block size. Events flow one way: the KV manager calls it and applies what it returns (the host
blocks of a prefix to take, the jobs to park, a job's table on the other tier); the device allocator tells it of
evictions (on_evict). It never changes a job's table or residency, and calls nothing of the KV manager.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, filterfalse, islice, repeat
from operator import is_, not_

from memory.block_allocator import blocks_needed
from memory.copy_ledger import CopyLedger
from memory.prefix_cache import CachingBlockAllocator
from memory.residency import JobKV, Residency
from memory.transfers import Direction, TransferHandle

CACHE_OWNER = "<prefix-cache>"  # holds the host blocks of the cache's own device -> host copies while they run


@dataclass(eq=False)
class _Backup:
    """One device -> host copy of cached blocks no job holds (the host tier's copy of what the device may evict)."""

    device: list[int]
    host: list[int]  # held by CACHE_OWNER until the copy lands, then named (cached) and released
    hashes: list
    handle: TransferHandle | None = None
    void: set[int] = field(default_factory=set)  # device blocks evicted while their copy ran: the copy is stale


class HostPrefixTier:
    def __init__(self, device: CachingBlockAllocator, host: CachingBlockAllocator, ledger: CopyLedger, stats,
                 block_size: int) -> None:
        self.device, self.host, self._ledger, self._stats = device, host, ledger, stats  # stats: a KVStats
        self.block_size = block_size
        self._backups: dict[_Backup, None] = {}  # the cache's device -> host copies in flight
        self._backup_of: dict[int, _Backup] = {}  # device block -> its copy in flight
        self.backup_host_blocks = 0  # host blocks those copies hold (CACHE_OWNER)
        # Jobs looked up at admission with no KV yet, that may find their prefix on the host (read by others, changed
        # here alone: add_waiting, leave).
        self.waiting: dict[str, JobKV] = {}
        # Waiting jobs that jobs_to_park may park: every one whose first block the host caches is here (put here
        # when it starts waiting with that block on the host, or when the host names the block later), so a tick
        # looks at these few instead of every waiting job (past capacity thousands wait, and the tiers change
        # nearly every tick); left out again once seen without it. A waiting job's names never change (it holds no
        # KV and its context does not grow). Per waiting job (kept lazily after it leaves, pruned in bulk): its
        # place in `waiting`'s order and its first block's name; and by name, the jobs whose first block it names.
        self._candidates: set[str] = set()
        self._heads: dict[str, tuple[int, bytes]] = {}
        self._by_head: dict[bytes, list[str]] = {}
        self._num_waited = 0
        self._recheck = False  # the tiers' contents changed since jobs_to_park last looked
        device.on_evict = self._on_device_evict
        device.track_released = True

    @property
    def num_copies(self) -> int:
        """The cache's own copies in flight."""
        return len(self._backups)

    # -- the cache's own copies (backups) ---------------------------------------------------------------
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
        self._stats.cache_evicted_to_host += to_host
        self._stats.cache_evicted_dropped += len(blocks) - to_host
        self._recheck = True

    def start_backups(self) -> None:
        """Copy to the host the cached device blocks released since the last call that are still unheld and whose
        names the host lacks, in the order they were released (the order the device evicts them), as many as
        the host has room for."""
        dev, host = self.device, self.host
        released = dev.released
        if not released:
            return
        dev.released = []
        self._ledger.grow_host(host)
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
        self.backup_host_blocks += n
        self._stats.cache_blocks_backed_up += n
        backup.handle = self._ledger.copy(Direction.OFFLOAD, list(zip(blocks, backup.host)))
        if backup.handle.done():
            self._finish_backup(backup)

    def poll(self) -> None:
        """Name the host blocks of the backups that have landed, then start the next ones."""
        if self._backups:
            for backup in [b for b in self._backups if b.handle.done()]:
                self._finish_backup(backup)
        self.start_backups()

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
        self.backup_host_blocks -= len(backup.host)
        del self._backups[backup]
        self._recheck = True

    def offload_landed(self, host_table: list[int], device_table: list[int]) -> None:
        """A job's offload landed: its named device blocks are named on the host too (cached there after it
        comes back)."""
        named = [(hb, name) for hb, name in zip(host_table, self.device.names_of(device_table)) if name is not None]
        self.host.register_many([hb for hb, _ in named], [name for _, name in named])
        self._host_named([name for _, name in named])
        self._recheck = True

    # -- a job's copy between the tiers ---------------------------------------------------------------
    def offload_table(self, jid: str, device_table: list[int]) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The job's host table for an offload of device_table, sharing the host cache's copy of each named block
        and allocating the rest; returns it and the (device, host) pairs to copy, or None (nothing changed) when
        the host has no room."""
        return self._mirror(jid, device_table, self.device, self.host)

    def upload_table(self, jid: str, host_table: list[int]) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The job's device table for an upload of host_table, sharing the device cache's copy of each named block
        and allocating the rest; returns it and the (host, device) pairs to copy, or None (nothing changed) when
        the device has no room."""
        return self._mirror(jid, host_table, self.host, self.device)

    def _mirror(self, jid: str, table: list[int], tier, other) -> tuple[list[int], list[tuple[int, int]]] | None:
        found = other.blocks_named(tier.names_of(table))  # per block: its copy cached on `other`, or None
        shared = [b for b in found if b is not None]
        fresh_needed = len(table) - len(shared)
        if fresh_needed + other.num_unheld(shared) > other.num_free:
            return None
        other.share(jid, shared)
        fresh = iter(other.allocate(jid, fresh_needed))
        mirror = [b if b is not None else next(fresh) for b in found]
        self._stats.blocks_not_copied += len(shared)
        return mirror, [(b, m) for b, m, f in zip(table, mirror, found) if f is None]

    def upload_unfit(self, host_table: list[int]) -> bool:
        """Whether the device lacks the room an upload of these host blocks takes (one block per block the device
        does not cache, plus the unheld cached ones, which leave the free count)."""
        dev = self.device
        found = dev.blocks_named(self.host.names_of(host_table))
        shared = [b for b in found if b is not None]
        return len(found) - len(shared) + dev.num_unheld(shared) > dev.num_free

    # -- prefixes found on the host ---------------------------------------------------------------------
    def hosted_prefix(self, hashes: Sequence, max_blocks: int, context_len: int, num_new_tokens: int) -> list[int]:
        """For a job with no KV at its first allocation (its first max_blocks names given): the host blocks of its
        cached prefix if that is longer on the host than on the device, cut short so that the upload and this
        step's work fit the free device room; [] when no such prefix (down to the device's) fits."""
        bs, dev = self.block_size, self.device
        on_device = len(dev.lookup(hashes, max_blocks))
        hosted = self.host.lookup(hashes, max_blocks)
        if len(hosted) <= on_device:
            return []
        # Device blocks the upload takes: one per hosted block the device does not cache (those it does are
        # shared, and the unheld ones among them leave the free count), then this step's work past the prefix.
        shared = [dev.block_of(h) for h in hashes[:len(hosted)]]
        while len(hosted) > on_device:
            k = len(hosted)
            need = blocks_needed(min(context_len, k * bs + num_new_tokens), bs) - sum(
                1 for b in shared[:k] if b is not None and dev.ref_count(b))
            if need <= dev.num_free:
                break
            hosted.pop()
        return hosted if len(hosted) > on_device else []

    def add_waiting(self, jid: str, kv: JobKV, recheck: bool = False) -> None:
        """Put the job among those waiting to start (at the end, as a dict puts a new key; in place if there);
        recheck: look for jobs to park at the next jobs_to_park."""
        waiting, heads = self.waiting, self._heads
        if jid not in waiting:
            if kv.hashes:
                head = kv.hashes[0]
                self._num_waited += 1
                heads[jid] = (self._num_waited, head)
                self._by_head.setdefault(head, []).append(jid)
                if self.host.block_of(head) is not None:
                    self._candidates.add(jid)
            else:
                heads.pop(jid, None)
            if len(heads) > 2 * len(waiting) + 64:  # forget the jobs that left (amortized: O(1) a job)
                heads = self._heads = {j: heads[j] for j in waiting if j in heads} | (
                    {jid: heads[jid]} if jid in heads else {})
                self._by_head = by_name = {}
                for j, (_, head) in heads.items():
                    by_name.setdefault(head, []).append(j)
        waiting[jid] = kv
        if recheck:
            self._recheck = True

    def leave(self, jid: str) -> None:
        """The job waits to start no more (it got KV, or ended)."""
        self.waiting.pop(jid, None)

    def _host_named(self, names: Sequence) -> None:
        """The host tier names these blocks now (some may have been named already): the waiting jobs whose first
        block one of them names become candidates to park (jobs_to_park)."""
        by_name = self._by_head
        if by_name:
            for jids in filter(None, map(by_name.get, names)):
                self._candidates.update(jids)

    def jobs_to_park(self) -> list[tuple[JobKV, list[int]]]:
        """The jobs waiting to start whose cached prefix is longer on the host than on the device, with those host
        blocks, in the order they started waiting (they wait no more): the caller parks them there, so that the
        planner uploads them ahead of need by ENST. Looks only when the tiers changed since it last did, and only
        at the candidates (a job whose first block the host caches)."""
        if not (self._recheck and self.waiting):
            return []
        self._recheck = False
        cands = self._candidates
        if not cands:
            return []
        bs, dev, host, waiting, heads = self.block_size, self.device, self.host, self.waiting, self._heads
        keep: set[str] = set()
        found = []
        for _, jid in sorted((heads[j][0], j) for j in cands if j in waiting and j in heads):
            kv = waiting[jid]
            if kv.residency is not Residency.NONE or kv.device or kv.host or kv.transfer is not None:
                del waiting[jid]
                continue
            max_blocks = (kv.job.context_len - 1) // bs
            if not kv.hashes or host.block_of(kv.hashes[0]) is None:
                continue  # its first block left the host: a candidate again when the host names it
            hosted = host.lookup(kv.hashes, max_blocks)
            if len(hosted) > len(dev.lookup(kv.hashes, max_blocks)):
                del waiting[jid]
                found.append((kv, hosted))
            else:
                keep.add(jid)  # the device caches as much: parked once the device has evicted some of it
        self._candidates = keep
        return found
