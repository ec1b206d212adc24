"""HostTier: the host copy of the KV cache (the swap space), and on CUDA its
page-locking, done in the background so that a large swap space does not
delay start-up.

What it is: the host tensor [NH, L, 2, H, bs, D] the Swapper copies blocks to
and from, and how many of its leading blocks may be used yet. What it is not:
the copies (engine/swapper.py) or the choice of blocks (memory/).

Why in the background: pinned memory is locked when it is allocated. Pinning
all of it up front (torch.empty(pin_memory=True), i.e. cudaHostAlloc) maps
and locks every page before it returns, which for a 100+ GiB swap space
holds start-up for tens of seconds. Instead the tier is allocated pageable
(torch.empty: virtual memory, pages untouched) and a thread page-locks it
chunk by chunk, in block order, with cudaHostRegister; `blocks_ready` counts
the leading blocks whose chunks are locked. The tensor starts on a page
boundary and chunks hold whole pages (a page-locker works in pages: two
chunks sharing a page would lock it twice, and the second lock fails). The KV manager hands out only
those (memory/kv_manager.py grows its host allocator up to it), so every
copy touches pinned memory and stays asynchronous; serving starts at once,
with a host tier that grows to its full size as the thread goes (how fast
has not been measured on a GPU yet). A copy is
never let across a chunk boundary (`chunk_runs`), since each chunk is its
own registration. On the CPU nothing is pinned and every block is ready at
once, as before.

If locking fails (the OS's locked-memory limit, out of memory), the tier
stays at what was locked and a warning says so.

Under the multi-process executor each worker locks its own tier and reports
its `blocks_ready` to the controller (engine/executor/worker.py), which hands
out only the blocks every rank has locked. `SlowLockForTests` stands in for
cudaHostRegister so that this is tested on the CPU with real worker processes.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30  # page-locked per cudaHostRegister call
PAGE_BYTES = mmap.PAGESIZE  # the unit memory is locked in


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose first byte starts a page (torch.empty's large buffers start 64 bytes
    past one: malloc's header)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def _cuda_register(ptr: int, size: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1))  # 1 = cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with cudaError {err}")


def _unlock_all(registered: list[int], unregister: Callable[[int], None]) -> None:
    """Unlock every locked chunk (latest first), emptying `registered`."""
    while registered:
        unregister(registered.pop())


def _cuda_unregister(ptr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with cudaError {err}")


TEST_LOCK_ENV = "FASTSERVE_TEST_SLOW_HOST_LOCK"


@dataclass(frozen=True)
class SlowLockForTests:
    """For tests only: a page-locker that locks nothing and takes `seconds_per_chunk` per chunk of
    `chunk_blocks` blocks, so that a tier on the CPU grows the way a pinned one does on CUDA.

    Worker processes read it from the environment variable FASTSERVE_TEST_SLOW_HOST_LOCK,
    "CHUNK_BLOCKS:SECONDS_RANK0,SECONDS_RANK1,..." (one duration per rank; the last one serves the ranks past
    the list), e.g. "8:0.02,0.1". Never set it outside tests."""

    chunk_blocks: int
    seconds_per_chunk: float

    @classmethod
    def from_env(cls, rank: int) -> SlowLockForTests | None:
        spec = os.environ.get(TEST_LOCK_ENV)
        if not spec:
            return None
        chunk, _, seconds = spec.partition(":")
        per_rank = [float(x) for x in seconds.split(",")]
        return cls(int(chunk), per_rank[min(rank, len(per_rank) - 1)])

    def register(self, ptr: int, size: int) -> None:
        time.sleep(self.seconds_per_chunk)

    def unregister(self, ptr: int) -> None:
        pass


class HostTier:
    def __init__(
        self,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin: bool,
        chunk_bytes: int = CHUNK_BYTES,
        register: Callable[[int, int], None] | None = None,  # (pointer, bytes): page-lock; CUDA's by default
        unregister: Callable[[int], None] | None = None,  # (pointer): undo it
        page_bytes: int | None = None,  # chunks hold whole multiples: PAGE_BYTES pinned by CUDA's locker, else 1
    ) -> None:
        # Uninitialised: a host block is always written by an offload before an upload reads it.
        self.blocks = page_aligned_empty((num_blocks, *block_shape), dtype)  # [NH, L, 2, H, bs, D]
        self.num_blocks = num_blocks
        block_bytes = max(1, self.blocks[0].numel() * self.blocks.element_size()) if num_blocks else 1
        # Whole pages a chunk: its block count a multiple of the blocks that fill whole pages exactly.
        page = page_bytes or (PAGE_BYTES if pin and register is None else 1)
        period = page // math.gcd(block_bytes, page)
        self.chunk_blocks = max(period, chunk_bytes // block_bytes // period * period)
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._registered: list[int] = []  # pointers of the locked chunks, in order
        self._ready = 0 if pin else num_blocks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Unlock whatever is locked when the tier is collected without close() (an engine dropped without
        # LLM.close: its swapper keeps the tier open across shutdown, for the engine may run again).
        self._unlock_at_collection = weakref.finalize(self, _unlock_all, self._registered, self._unregister)
        if pin and num_blocks:
            device = torch.cuda.current_device() if register is None else None
            self._thread = threading.Thread(target=self._pin_all, args=(device,), name="fastserve-pin-host",
                                            daemon=True)
            self._thread.start()

    @property
    def blocks_ready(self) -> int:
        """Leading blocks that may be used now: all on the CPU; on CUDA, those whose chunk is locked."""
        return self._ready

    @property
    def pinning(self) -> bool:
        """Whether the background locking is still going."""
        return self._thread is not None and self._thread.is_alive()

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until the background locking has ended (tests, benchmarks); True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.pinning

    def chunk_runs(self, runs: list[tuple[int, int, int]], host_side: int) -> list[tuple[int, int, int]]:
        """(source start, destination start, length) runs cut where their host side (0: source,
        1: destination) crosses a chunk boundary."""
        out = []
        for run in runs:
            s, d, n = run
            while n:
                host = (s, d)[host_side]
                take = min(n, self.chunk_blocks - host % self.chunk_blocks)
                out.append((s, d, take))
                s, d, n = s + take, d + take, n - take
        return out

    def _pin_all(self, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)  # the runtime's context of the device the tier serves
        for start in range(0, self.num_blocks, self.chunk_blocks):
            if self._stop.is_set():
                return
            end = min(self.num_blocks, start + self.chunk_blocks)
            chunk = self.blocks[start:end]
            try:
                self._register(chunk.data_ptr(), chunk.numel() * chunk.element_size())
            except Exception as e:  # noqa: BLE001 - reported; the tier stays usable at its locked size
                logger.warning("host KV tier: page-locking stopped at block %d of %d (%s); the swap space in use "
                               "is %d blocks", start, self.num_blocks, e, start)
                return
            self._registered.append(chunk.data_ptr())
            self._ready = end  # one int store: readers see the old or the new count

    def close(self) -> None:
        """Stop the locking and unlock what was locked (after every copy that uses the tier has ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._unlock_at_collection()  # unlock now (the finalizer runs once: nothing is left for collection)
        self._ready = 0
