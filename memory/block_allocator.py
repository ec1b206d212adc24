"""BlockAllocator: the free list and ownership of one tier of KV blocks.

What it is: bookkeeping of block ids (ints) on one tier (device or host) —
which are free and which job owns each. What it is not: storage; the engine
owns the tensors the ids index into.

Invariant: every block is free or owned by exactly one job.
"""

from __future__ import annotations

from collections import deque


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, tier: str = "device") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.tier = tier
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{self.tier} tier: asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._owner[b] = owner
        return blocks

    def free(self, owner: str, blocks: list[int]) -> None:
        for b in blocks:
            if self._owner.get(b) != owner:
                raise AssertionError(f"{self.tier} block {b} is owned by {self._owner.get(b)!r}, not {owner!r}")
            del self._owner[b]
            self._free.append(b)

    def grow(self, num_blocks: int) -> None:
        """Add the ids from the current count up to num_blocks, free (a tier whose storage arrives over time,
        engine/host_tier.py); no-op when it already has that many."""
        if num_blocks > self.num_blocks:
            self._free.extend(range(self.num_blocks, num_blocks))
            self.num_blocks = num_blocks

    def owner_of(self, block: int) -> str | None:
        return self._owner.get(block)

    def holders(self) -> dict[int, frozenset[str]]:
        """Every held block and who holds it (the KV manager's accounting check)."""
        return {b: frozenset((o,)) for b, o in self._owner.items()}

    def check_invariants(self) -> None:
        """Every block free or owned once; used by tests and debug assertions."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.tier}: a block is on the free list twice"
        assert not (free & self._owner.keys()), f"{self.tier}: a block is both free and owned"
        assert len(free) + len(self._owner) == self.num_blocks, f"{self.tier}: blocks lost"
