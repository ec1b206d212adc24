"""Automatic prefix caching: full KV blocks named by a hash chain, shared by reference count.

What it is: a tier's block bookkeeping when prefix caching is on (the device's; and the host's with the host
tier caching too, memory/kv_manager.py's enable_prefix_caching). A block that a job filled
completely (block_size tokens whose KV is computed) is registered under a hash of its token ids and of the
hash of the block before it (the first block's parent is an optional cache_salt), so the name of block i
says everything about positions [0, (i + 1) * block_size): two sequences whose first k blocks hash alike
have identical KV there (causal attention), and a new job may use those blocks instead of computing them.

Each block is in exactly one of three states:
- free: holds nothing anyone may look up (the free list);
- referenced: held by one or more jobs (its owners); a registered one may be shared by any number of them;
- evictable: registered, held by no job, kept for a later hit; evicted (unregistered and handed out again)
  least recently released first when the free list runs out.
Free and evictable blocks are both "free" to the rest of memory/ (num_free): an evictable block is handed
out as soon as an allocation needs it, so the cache never costs admission any room.

A chain's blocks are released last-block-first (a job's blocks in reverse), so eviction takes the tails of
cached prefixes before their heads: a head without its tail still serves the next hit, a tail without its
head never does.

And the names of one job's blocks (register_full, attach_prefix: what the KV manager asks of the cache for a job,
kept in the job's JobKV). What it is not: storage (the engine owns the tensors), the copies between tiers
(memory/copy_ledger.py, memory/host_prefix_tier.py), or the choice of which job runs. The token ids come from
the engine (the KV manager passes on the PrefixSource it is given).

Hashes are SHA-256 digests (vLLM's default since v0.10): Python's hash() of ints is predictable, so a
tenant could craft a collision and read another's KV. A lookup never reuses a prompt's last token: a
request must compute at least one token to sample from (lookup's max_tokens).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress, filterfalse, islice, repeat
from operator import not_
from typing import Protocol

from memory.block_allocator import BlockAllocator, OutOfBlocks
from memory.residency import JobKV

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """The name of a full block: its tokens and the name of the block before it (the chain's first block:
    the salt instead, when one is given, so tenants with different salts never match each other)."""
    h = hashlib.sha256()
    if parent is not None:
        h.update(parent)
    elif salt:
        h.update(b"salt:" + salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                 known: list[BlockHash] | None = None) -> list[BlockHash]:
    """The names of every full block of token_ids, extending `known` (the names of its first blocks, already
    computed) in place when it is given."""
    out = known if known is not None else []
    start = len(out)
    extend_chain(out, token_ids[start * block_size:], block_size, salt)
    return out


def extend_chain(chain: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str | None = None) -> None:
    """Append to `chain` the names of the full blocks of token_ids, the tokens that follow the chain's last block
    (the salt starts an empty chain). The same names as hash_block block by block (the slow reference; the tests
    hold the two to each other), with the tokens packed once for all the blocks: by struct, whose bytes are
    array("q")'s (native int64) at half its cost (array converts each item through PyArg_Parse)."""
    if chain and len(token_ids) == block_size:  # one block after others (a decoding job's block just filled)
        chain.append(hashlib.sha256(chain[-1] + _int64s(block_size).pack(*token_ids)).digest())
        return
    n = len(token_ids) // block_size
    if n <= 0:
        return
    if len(token_ids) != n * block_size:
        token_ids = token_ids[:n * block_size]
    data = _int64s(n * block_size).pack(*token_ids)  # int64, as hash_block packs them
    width, end = block_size * 8, n * block_size * 8
    sha256, off = hashlib.sha256, 0
    if chain:
        parent = chain[-1]
    else:  # the chain's first block: the salt in place of a parent
        parent = sha256((b"salt:" + salt.encode() if salt else b"") + data[:width]).digest()
        chain.append(parent)
        off = width
    while off < end:  # (one buffer per digest: faster than a hash object fed twice)
        parent = sha256(parent + data[off:off + width]).digest()
        chain.append(parent)
        off += width


_PACKERS: dict[int, struct.Struct] = {}


def _int64s(n: int) -> struct.Struct:
    """The packer of n native int64s (struct's own cache of formats holds 100; this one every length met)."""
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct(f"={n}q")
    return packer


def _as_set(owners: object) -> frozenset:
    """A block's entry in CachingBlockAllocator._owners as the set of its owners (None: no owner)."""
    if owners is None:
        return frozenset()
    return frozenset(owners) if type(owners) is set else frozenset((owners,))


def _consume(iterator: Iterator) -> None:
    """Run an iterator to its end (itertools' recipe: the loop runs in C, not in the interpreter)."""
    deque(iterator, maxlen=0)


class CachingBlockAllocator(BlockAllocator):
    """BlockAllocator's interface (allocate, free, num_free, num_used, check_invariants) over blocks that
    several owners may hold, plus the cache's verbs: lookup, share, register.

    Counting: num_free = free list + evictable; num_used = blocks held by at least one owner; num_refs =
    references held (a block held by three jobs counts three times: what memory/'s block tables add up to).

    A held block's entry in _owners is its owner itself while it has one (nearly every block: allocate makes no
    object per block, and free compares owners as the base class does), a set of its owners while it has several
    (shared prefixes: share makes the set, free turns it back into the last owner)."""

    # Free list + evictable blocks: a plain attribute that every verb keeps current (not the base class's
    # property: the scheduler reads it for every job it walks, every tick). Read-only outside this class.
    num_free: int = 0

    def __init__(self, num_blocks: int, tier: str = "device") -> None:
        super().__init__(num_blocks, tier)
        self._owners: dict[int, object] = {}  # referenced block -> its owner, or a set of its owners when several
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; least recent first
        self._hash_of: dict[int, BlockHash] = {}  # registered block -> its name
        self._block_of: dict[BlockHash, int] = {}  # name -> the one block registered under it
        self.names = self._block_of.keys()  # the names cached here (a live view, read-only: `in` costs no call)
        self._num_refs = 0
        self.num_free = num_blocks
        # Called with (blocks, their names) after an allocation or evict_all took cached blocks out of the cache
        # (the KV manager's hook: a host copy of one in flight is then void; memory/kv_manager.py, two tiers).
        self.on_evict: Callable[[list[int], list[BlockHash]], None] | None = None
        # Blocks that became evictable since the KV manager last drained this list (its host-tier backups).
        self.released: list[int] = []
        self.track_released = False
        # Telemetry (vLLM's prefix_cache_queries / _hits count tokens: what lookups asked for, what they found).
        self.num_queries = 0
        self.num_hits = 0
        self.num_evictions = 0

    # -- counts -------------------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._owners)

    @property
    def num_refs(self) -> int:
        return self._num_refs

    @property
    def num_cached(self) -> int:
        """Registered blocks, referenced or not."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        owners = self._owners.get(block)
        if owners is None:
            return 0
        return len(owners) if type(owners) is set else 1

    def owners(self, block: int) -> frozenset[str]:
        return _as_set(self._owners.get(block))

    def owner_of(self, block: int) -> str | None:
        owners = self._owners.get(block)
        return next(iter(owners)) if type(owners) is set else owners

    def holders(self) -> dict[int, frozenset[str]]:
        return {b: _as_set(o) for b, o in self._owners.items()}

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def hash_of(self, block: int) -> BlockHash | None:
        """The block's name (None: not cached)."""
        return self._hash_of.get(block)

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The block cached under this name (None: none)."""
        return self._block_of.get(block_hash)

    # (The bulk verbs below map a dict's methods over their arguments: no interpreted loop per block.)
    def names_of(self, blocks: Iterable[int]) -> list[BlockHash | None]:
        """hash_of of each block, in order."""
        return list(map(self._hash_of.get, blocks))

    def blocks_named(self, names: Iterable[BlockHash | None]) -> list[int | None]:
        """block_of of each name, in order (None for a name that is None)."""
        return list(map(self._block_of.get, names))

    def num_named(self, names: Iterable[BlockHash]) -> int:
        """How many of these names this tier caches (a block under each)."""
        return sum(map(self._block_of.__contains__, names))

    def evictable_names(self, blocks: Iterable[int]) -> dict[int, BlockHash]:
        """The evictable blocks among these, each once in the order first met, and their names."""
        found = list(dict.fromkeys(filter(self._evictable.__contains__, blocks)))
        return dict(zip(found, map(self._hash_of.__getitem__, found)))

    def num_unheld(self, blocks: Sequence[int]) -> int:
        """How many of these blocks no job holds (ref_count 0)."""
        return len(blocks) - sum(map(self._owners.__contains__, blocks))

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evictable_order(self) -> list[int]:
        """Evictable blocks, the next to be evicted first."""
        return list(self._evictable)

    # -- BlockAllocator's verbs ---------------------------------------------------------------------------
    def allocate(self, owner: str, n: int) -> list[int]:
        """n blocks for `owner` alone: free ones first, then evictable ones, least recently released first
        (each leaves the cache)."""
        free = self._free
        if n == 1:  # (a decoding job's next block: the usual call)
            if free:
                block = free.popleft()
            elif self.num_free:
                block = self._evict_one()
            else:
                raise OutOfBlocks(f"{self.tier} tier: asked for 1 block, 0 free")
            self._owners[block] = owner
            self._num_refs += 1
            self.num_free -= 1
            return [block]
        if n > self.num_free:
            raise OutOfBlocks(f"{self.tier} tier: asked for {n} blocks, {self.num_free} free")
        if n >= len(free):
            blocks = list(free)
            free.clear()
            if n > len(blocks):
                blocks += self._evict(n - len(blocks))
        else:
            blocks = [free.popleft() for _ in range(n)]
        self._owners.update(zip(blocks, repeat(owner)))
        self._num_refs += n
        self.num_free -= n
        return blocks

    def _evict(self, n: int) -> list[int]:
        """Take the n least recently released evictable blocks out of the cache (for an allocation)."""
        evictable = self._evictable
        blocks = list(islice(evictable, n))  # (the least recent first)
        _consume(map(evictable.__delitem__, blocks))
        self.num_evictions += n
        self._forget(blocks)
        return blocks

    def _evict_one(self) -> int:
        """_evict(1)'s block, without the lists of the general path."""
        block = self._evictable.popitem(last=False)[0]
        self.num_evictions += 1
        self._forget([block])
        return block

    def _forget(self, blocks: list[int]) -> None:
        """Drop the names of these blocks, just taken off the evictable list, and tell the on_evict hook."""
        names = list(map(self._hash_of.pop, blocks))
        _consume(map(self._block_of.__delitem__, names))
        if self.on_evict is not None and blocks:
            self.on_evict(blocks, names)

    def free(self, owner: str, blocks: list[int]) -> None:
        """Release owner's reference on each block, last block first (the module docstring: tails are evicted
        before heads). A block no one holds goes to the evictable end of the cache if registered, else to the
        free list. Raises if owner does not hold one (nothing is changed then)."""
        owners_of = self._owners
        if list(map(owners_of.get, blocks)).count(owner) == len(blocks):  # owner alone holds each (the usual)
            _consume(map(owners_of.__delitem__, blocks))
            unheld = blocks[::-1]
        else:
            get = owners_of.get
            for b in blocks:
                if owner not in _as_set(get(b)):
                    raise AssertionError(f"{self.tier} block {b} is held by {sorted(_as_set(get(b)))!r}, not {owner!r}")
            unheld = []
            for b in reversed(blocks):
                owners = owners_of[b]
                if type(owners) is not set:  # (its one owner: `owner`)
                    del owners_of[b]
                    unheld.append(b)
                    continue
                owners.discard(owner)
                if len(owners) == 1:
                    owners_of[b] = next(iter(owners))
        # The blocks no one holds now, last first: named ones to the evictable end, the rest to the free list.
        named = list(filter(self._hash_of.__contains__, unheld))
        if len(named) < len(unheld):
            self._free.extend(filterfalse(self._hash_of.__contains__, unheld))
        if named:
            self._evictable.update(zip(named, repeat(None)))
            if self.track_released:
                self.released += named
        self._num_refs -= len(blocks)
        self.num_free += len(unheld)

    # -- the cache's verbs --------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash], max_blocks: int | None = None) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (at most max_blocks); takes no reference."""
        found = []
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        block_of = self._block_of
        for i in range(limit):
            b = block_of.get(hashes[i])
            if b is None:
                break
            found.append(b)
        return found

    def share(self, owner: str, blocks: list[int]) -> None:
        """Take owner's reference on cached blocks (a hit): an evictable one leaves the eviction order."""
        owners_of = self._owners
        for b in blocks:
            if b not in self._hash_of:
                raise AssertionError(f"{self.tier} block {b} is not cached: only cached blocks are shared")
            owners = owners_of.get(b)
            if owners is None:
                self._evictable.pop(b)
                owners_of[b] = owner
                self.num_free -= 1
            elif owner in _as_set(owners):
                raise AssertionError(f"{self.tier} block {b} is already held by {owner!r}")
            elif type(owners) is set:
                owners.add(owner)
            else:
                owners_of[b] = {owners, owner}
        self._num_refs += len(blocks)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Name a full, referenced block; False (nothing changed) when the name is taken by another block
        (this one stays a private copy, freed to the free list) or the block already has a name."""
        if block not in self._owners:
            raise AssertionError(f"{self.tier} block {block} is not held: only a job's own blocks are registered")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def register_many(self, blocks: Sequence[int], names: Sequence[BlockHash]) -> None:
        """register() each block under its name, in order (False answers ignored); the blocks are distinct, and so
        are the names (one job's table, or one copy's)."""
        owners, hash_of, block_of = self._owners, self._hash_of, self._block_of
        for b in filterfalse(owners.__contains__, blocks):
            raise AssertionError(f"{self.tier} block {b} is not held: only a job's own blocks are registered")
        if any(map(block_of.__contains__, names)) or any(map(hash_of.__contains__, blocks)):
            for b, h in zip(blocks, names):
                if h not in block_of and b not in hash_of:
                    block_of[h] = b
                    hash_of[b] = h
        else:  # (none named, no name taken: all at once)
            block_of.update(zip(names, blocks))
            hash_of.update(zip(blocks, names))

    def register_fresh(self, blocks: list[int], names: list[BlockHash]) -> None:
        """register_many for blocks allocated and never named since (a copy's destination), under distinct names:
        only a name that another block took meanwhile is skipped (that block stays unnamed)."""
        block_of = self._block_of
        if any(map(block_of.__contains__, names)):
            keep = list(map(not_, map(block_of.__contains__, names)))
            blocks, names = list(compress(blocks, keep)), list(compress(names, keep))
        block_of.update(zip(names, blocks))
        self._hash_of.update(zip(blocks, names))

    def count_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.num_queries += queried_tokens
        self.num_hits += hit_tokens

    def evict_all(self) -> int:
        """Empty the cache of unreferenced blocks (they go to the free list); returns how many. Referenced
        blocks keep their names (their owners still read them)."""
        blocks = list(self._evictable)
        self._evictable.clear()  # (num_free unchanged: evictable blocks are free ones)
        self._forget(blocks)
        self._free.extend(blocks)
        return len(blocks)

    def grow(self, num_blocks: int) -> None:
        before = self.num_blocks
        super().grow(num_blocks)
        self.num_free += self.num_blocks - before

    def check_invariants(self) -> None:
        free = set(self._free)
        evictable = set(self._evictable)
        held = set(self._owners)
        assert len(free) == len(self._free), f"{self.tier}: a block is on the free list twice"
        assert not (free & evictable) and not (free & held) and not (evictable & held), \
            f"{self.tier}: a block is in two states"
        assert len(free) + len(evictable) + len(held) == self.num_blocks, f"{self.tier}: blocks lost"
        assert self.num_free == len(free) + len(evictable), f"{self.tier}: free count drift"
        assert all(o is not None and (type(o) is not set or len(o) > 1) for o in self._owners.values()), \
            f"{self.tier}: a held block with no owner, or a set of one"
        assert self._num_refs == sum(map(self.ref_count, self._owners)), f"{self.tier}: reference count drift"
        assert evictable <= self._hash_of.keys(), f"{self.tier}: an evictable block has no name"
        assert not (free & self._hash_of.keys()), f"{self.tier}: a free block keeps a name"
        assert len(self._block_of) == len(self._hash_of) and all(
            self._block_of[h] == b for b, h in self._hash_of.items()), f"{self.tier}: name maps disagree"


def account(alloc: BlockAllocator, live: set[str], copy_owner: str) -> dict[str, int]:
    """The accounting check of one tier (no leaks): every block is free, cached (named, held by no one), held by
    jobs (live ones), or held by copy_owner alone (the cache's own copies in flight), and the counts add up to the
    tier. Returns those counts; raises AssertionError on any mismatch."""
    jobs = copies = 0
    for b, owners in alloc.holders().items():
        stray = set(owners) - live - {copy_owner}
        assert not stray, f"{alloc.tier} block {b} is held by {sorted(stray)!r}, which are not live jobs"
        if owners - {copy_owner}:
            jobs += 1
        else:
            copies += 1
    caching = isinstance(alloc, CachingBlockAllocator)
    cached = alloc.num_evictable if caching else 0
    free = alloc.num_free - cached
    assert free + cached + jobs + copies == alloc.num_blocks, f"{alloc.tier}: blocks unaccounted for"
    return {"free": free, "cached": cached, "jobs": jobs, "copies": copies, "refs": alloc.num_refs if caching else jobs}


# -- a job's blocks' names (what the KV manager asks of the cache for one job) ---------------------------------
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


def next_name_at(kv: JobKV, block_size: int) -> float:
    """Where allocate's fast path next names the job's blocks (JobKV.name_at): when the block after those named
    fills, while that block lies within the prompt. Blocks of generated tokens are named only when the job
    leaves the device (evict, free): no other request can hit them before, since a request shares blocks only at
    its first allocation, and its prompt cannot hold an answer still being generated. Naming them as they fill
    would hash a block every few decode steps of every job for nothing (a per-tick cost)."""
    end = (kv.num_registered + 1) * block_size
    return end if end <= kv.job.prompt_len else float("inf")


def extend_names(kv: JobKV, job, source: PrefixSource, num_blocks: int, block_size: int) -> None:
    """Name the job's first num_blocks blocks (kv.hashes: those not named yet; a job's tokens never change)."""
    hashes = kv.hashes
    start = len(hashes)
    if num_blocks <= start:
        return
    tokens = source.token_ids(job, start * block_size, num_blocks * block_size)
    extend_chain(hashes, tokens, block_size, source.cache_salt(job) if not hashes else None)


def register_full(kv: JobKV, device: CachingBlockAllocator, source: PrefixSource, block_size: int) -> None:
    """Name the job's device blocks that are full of computed KV and not named yet (a block whose name is taken
    stays its private copy)."""
    table, bs = kv.device, block_size
    if kv.registered_table is not table:  # a new table (dropped, offloaded, uploaded): start over
        kv.registered_table, kv.num_registered = table, 0
    start, full = kv.num_registered, min(kv.job.num_computed // bs, len(table))
    if full > start:
        hashes = kv.hashes
        if len(hashes) < full:
            extend_names(kv, kv.job, source, full, bs)
        if full == start + 1:  # (one block filled since: a decoding job's, the usual case)
            device.register(table[start], hashes[start])
        else:
            device.register_many(table[start:full], hashes[start:full])
        kv.num_registered = full
    kv.name_at = next_name_at(kv, bs)


def attach_prefix(kv: JobKV, job, device: CachingBlockAllocator, source: PrefixSource, n: int,
                  block_size: int) -> int:
    """A job with no KV: take references on its longest cached prefix (whole blocks, never its last token) that
    leaves room for the rest of this step's work, n tokens (the hit's unreferenced blocks leave the free count);
    job.num_computed becomes the cached length. Returns where this step's work ends."""
    bs, ctx, dev = block_size, job.context_len, device
    kv.name_at = 0  # (its table is new: the next allocate names what has filled, unless a hit sets it below)
    if not source.may_reuse(job):
        if kv.cached_tokens is None:
            kv.cached_tokens = 0
        return job.num_computed + n
    max_blocks = (ctx - 1) // bs
    extend_names(kv, job, source, max_blocks, bs)
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
    kv.name_at = next_name_at(kv, bs)
    job.num_computed = h
    return min(ctx, h + n)
