"""Automatic prefix caching (issue 28): full KV blocks named by a hash chain, shared by reference count.

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

What it is not: storage (the engine owns the tensors), the copies between tiers (memory/kv_manager.py), or the
choice of which job runs. The token ids come
from the engine (memory/kv_manager.py asks for them through the provider it is given).

Hashes are SHA-256 digests (vLLM's default since v0.10): Python's hash() of ints is predictable, so a
tenant could craft a collision and read another's KV. A lookup never reuses a prompt's last token: a
request must compute at least one token to sample from (lookup's max_tokens).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from memory.block_allocator import BlockAllocator, OutOfBlocks

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
    parent = out[-1] if out else None
    for i in range(len(out), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        out.append(parent)
    return out


class CachingBlockAllocator(BlockAllocator):
    """BlockAllocator's interface (allocate, free, num_free, num_used, check_invariants) over blocks that
    several owners may hold, plus the cache's verbs: lookup, share, register.

    Counting: num_free = free list + evictable; num_used = blocks held by at least one owner; num_refs =
    references held (a block held by three jobs counts three times: what memory/'s block tables add up to)."""

    def __init__(self, num_blocks: int, tier: str = "device") -> None:
        super().__init__(num_blocks, tier)
        self._owners: dict[int, set[str]] = {}  # referenced blocks -> their owners (the base class's _owner unused)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; least recent first
        self._hash_of: dict[int, BlockHash] = {}  # registered block -> its name
        self._block_of: dict[BlockHash, int] = {}  # name -> the one block registered under it
        self._num_refs = 0
        # Called with (block, name) as an allocation or evict_all takes a cached block out of the cache (the
        # KV manager's hook: a host copy of it in flight is then void; memory/kv_manager.py, two tiers).
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # Blocks that became evictable since the KV manager last drained this list (its host-tier backups).
        self.released: list[int] = []
        self.track_released = False
        # Telemetry (vLLM's prefix_cache_queries / _hits count tokens: what lookups asked for, what they found).
        self.num_queries = 0
        self.num_hits = 0
        self.num_evictions = 0

    # -- counts -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

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
        return len(owners) if owners else 0

    def owners(self, block: int) -> frozenset[str]:
        return frozenset(self._owners.get(block, ()))

    def owner_of(self, block: int) -> str | None:
        owners = self._owners.get(block)
        return next(iter(owners)) if owners else None

    def holders(self) -> dict[int, frozenset[str]]:
        return {b: frozenset(o) for b, o in self._owners.items()}

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def hash_of(self, block: int) -> BlockHash | None:
        """The block's name (None: not cached)."""
        return self._hash_of.get(block)

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The block cached under this name (None: none)."""
        return self._block_of.get(block_hash)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evictable_order(self) -> list[int]:
        """Evictable blocks, the next to be evicted first."""
        return list(self._evictable)

    # -- BlockAllocator's verbs ---------------------------------------------------------------------------
    def allocate(self, owner: str, n: int) -> list[int]:
        """n blocks for `owner` alone: free ones first, then evictable ones, least recently released first
        (each leaves the cache)."""
        if n > self.num_free:
            raise OutOfBlocks(f"{self.tier} tier: asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self._hash_of.pop(b)
                del self._block_of[h]
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(b, h)
            self._owners[b] = {owner}
            blocks.append(b)
        self._num_refs += n
        return blocks

    def free(self, owner: str, blocks: list[int]) -> None:
        """Release owner's reference on each block, last block first (the module docstring: tails are evicted
        before heads). A block no one holds goes to the evictable end of the cache if registered, else to the
        free list. Raises if owner does not hold one (nothing is changed then)."""
        for b in blocks:
            if owner not in self._owners.get(b, ()):
                raise AssertionError(f"{self.tier} block {b} is held by {sorted(self._owners.get(b, ()))!r}, "
                                     f"not {owner!r}")
        for b in reversed(blocks):
            owners = self._owners[b]
            owners.discard(owner)
            self._num_refs -= 1
            if not owners:
                del self._owners[b]
                if b in self._hash_of:
                    self._evictable[b] = None
                    if self.track_released:
                        self.released.append(b)
                else:
                    self._free.append(b)

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
        for b in blocks:
            if b not in self._hash_of:
                raise AssertionError(f"{self.tier} block {b} is not cached: only cached blocks are shared")
            owners = self._owners.get(b)
            if owners is None:
                self._evictable.pop(b)
                self._owners[b] = {owner}
            elif owner in owners:
                raise AssertionError(f"{self.tier} block {b} is already held by {owner!r}")
            else:
                owners.add(owner)
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

    def count_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.num_queries += queried_tokens
        self.num_hits += hit_tokens

    def evict_all(self) -> int:
        """Empty the cache of unreferenced blocks (they go to the free list); returns how many. Referenced
        blocks keep their names (their owners still read them)."""
        n = len(self._evictable)
        for b in self._evictable:
            h = self._hash_of.pop(b)
            del self._block_of[h]
            self._free.append(b)
            if self.on_evict is not None:
                self.on_evict(b, h)
        self._evictable.clear()
        return n

    def check_invariants(self) -> None:
        free = set(self._free)
        evictable = set(self._evictable)
        held = set(self._owners)
        assert len(free) == len(self._free), f"{self.tier}: a block is on the free list twice"
        assert not (free & evictable) and not (free & held) and not (evictable & held), \
            f"{self.tier}: a block is in two states"
        assert len(free) + len(evictable) + len(held) == self.num_blocks, f"{self.tier}: blocks lost"
        assert all(self._owners.values()), f"{self.tier}: a held block with no owner"
        assert self._num_refs == sum(len(o) for o in self._owners.values()), f"{self.tier}: reference count drift"
        assert evictable <= self._hash_of.keys(), f"{self.tier}: an evictable block has no name"
        assert not (free & self._hash_of.keys()), f"{self.tier}: a free block keeps a name"
        assert len(self._block_of) == len(self._hash_of) and all(
            self._block_of[h] == b for b, h in self._hash_of.items()), f"{self.tier}: name maps disagree"
