"""The transfer verbs memory/ asks of the engine, as protocols.

memory/ decides which blocks move where; the engine's Swapper (engine/swapper.py)
moves the bytes (a copy stream on CUDA, a copy thread on CPU) and hands back a
handle. memory/ only asks a handle whether it is done: nothing in memory/
waits on a copy (the engine's event loop must never block on one), so a
handle becomes done whenever its backend notices (a CUDA event, a copy
thread's future, a worker's reply read while the engine steps or polls).
"""

from __future__ import annotations

import enum
import sys
from typing import Protocol

NO_LIMIT = sys.maxsize  # host_blocks_ready() of a backend whose host tier is all there


class Direction(str, enum.Enum):
    OFFLOAD = "offload"  # device -> host
    UPLOAD = "upload"  # host -> device


class TransferHandle(Protocol):
    def done(self) -> bool: ...


class TransferBackend(Protocol):
    def copy(self, direction: Direction, pairs: list[tuple[int, int]]) -> TransferHandle:
        """Start copying blocks: pairs of (source block, destination block)."""
        ...

    def host_blocks_ready(self) -> int:
        """How many leading host blocks (ids 0..n-1) may be used now: the host tier's storage can arrive
        after start-up (pinned in the background on CUDA, engine/host_tier.py); NO_LIMIT when all of it is
        there. memory/ never hands out a host block at or past this count."""
        ...


class CompletedTransfer:
    """A transfer that needed no copy (used when no backend is attached)."""

    def done(self) -> bool:
        return True


class NoCopyBackend:
    """Moves no bytes: for the simulator and for tests of the bookkeeping alone."""

    def copy(self, direction: Direction, pairs: list[tuple[int, int]]) -> TransferHandle:
        return CompletedTransfer()

    def host_blocks_ready(self) -> int:
        return NO_LIMIT
