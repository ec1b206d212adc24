"""The host KV tier locked in the background (engine/host_tier.py), on the CPU with a fake page-locker:
blocks become ready chunk by chunk in order, the chunks cover the tensor exactly, a failure stops the tier
at what was locked, close() unlocks everything, and the Swapper never lets a copy cross a chunk nor touch a
block not locked yet."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from engine.host_tier import HostTier
from engine.swapper import Swapper
from memory.transfers import Direction

BLOCK = (2, 2, 1, 4, 3)  # [L, 2, H, bs, D]
BLOCK_BYTES = 2 * 2 * 4 * 1 * 3 * 4  # float32


class FakeLocker:
    """Records register/unregister calls; each register waits until the test releases it."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.gate = threading.Semaphore(0)
        self.fail_at = fail_at

    def register(self, ptr: int, size: int) -> None:
        assert self.gate.acquire(timeout=10), "the test never released this chunk"
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise RuntimeError("locked-memory limit")
        self.registered.append((ptr, size))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.001)


def tier_with(locker: FakeLocker, num_blocks: int = 10, chunk_blocks: int = 4) -> HostTier:
    return HostTier(num_blocks, BLOCK, torch.float32, pin=True, chunk_bytes=chunk_blocks * BLOCK_BYTES,
                    register=locker.register, unregister=locker.unregister)


def test_blocks_become_ready_chunk_by_chunk_and_close_unlocks_them():
    locker = FakeLocker()
    tier = tier_with(locker)  # 10 blocks in chunks of 4, 4, 2
    assert tier.chunk_blocks == 4 and tier.blocks_ready == 0 and tier.pinning
    for ready in (4, 8, 10):
        locker.gate.release()
        wait_for(lambda ready=ready: tier.blocks_ready == ready)
    assert tier.wait_pinned(timeout=10)
    base = tier.blocks.data_ptr()
    assert locker.registered == [(base, 4 * BLOCK_BYTES), (base + 4 * BLOCK_BYTES, 4 * BLOCK_BYTES),
                                 (base + 8 * BLOCK_BYTES, 2 * BLOCK_BYTES)]
    tier.close()
    assert sorted(locker.unregistered) == sorted(p for p, _ in locker.registered) and tier.blocks_ready == 0


def test_a_failed_lock_leaves_the_tier_at_what_was_locked(caplog):
    locker = FakeLocker(fail_at=1)
    tier = tier_with(locker)
    for _ in range(2):
        locker.gate.release()
    assert tier.wait_pinned(timeout=10)
    assert tier.blocks_ready == 4 and "page-locking stopped at block 4 of 10" in caplog.text
    tier.close()
    assert locker.unregistered == [tier.blocks.data_ptr()]


def test_close_while_locking_stops_and_unlocks_the_locked_part():
    locker = FakeLocker()
    tier = tier_with(locker)
    locker.gate.release()
    wait_for(lambda: tier.blocks_ready == 4)
    closer = threading.Thread(target=tier.close)
    closer.start()
    locker.gate.release()  # a chunk being locked when close() came finishes; no further one starts
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert len(locker.registered) in (1, 2)  # (whether the second had begun when close() came)
    assert sorted(locker.unregistered) == sorted(p for p, _ in locker.registered)


def test_on_the_cpu_nothing_is_locked_and_every_block_is_ready():
    tier = HostTier(10, BLOCK, torch.float32, pin=False, register=pytest.fail, unregister=pytest.fail)
    assert tier.blocks_ready == 10 and not tier.pinning
    tier.close()


def test_runs_are_cut_at_chunk_boundaries_on_the_host_side():
    tier = HostTier(12, BLOCK, torch.float32, pin=False, chunk_bytes=4 * BLOCK_BYTES)
    # device 0..5 -> host 2..7 crosses host chunk [0, 4) | [4, 8): cut at host block 4
    assert tier.chunk_runs([(0, 2, 6)], host_side=1) == [(0, 2, 2), (2, 4, 4)]
    # host 3..9 -> device 10..16 (upload: the host is the source)
    assert tier.chunk_runs([(3, 10, 7)], host_side=0) == [(3, 10, 1), (4, 11, 4), (8, 15, 2)]


def test_swapper_copies_through_a_chunked_tier_move_the_same_bytes():
    device = torch.randn(12, *BLOCK)  # [NB, L, 2, H, bs, D]
    tier = HostTier(12, BLOCK, torch.float32, pin=False, chunk_bytes=4 * BLOCK_BYTES)
    swapper = Swapper(device, tier)
    try:
        pairs = [(d, d + 1) for d in range(9)]  # host 1..9: three chunks
        assert swapper.runs(Direction.OFFLOAD, pairs) == [(0, 1, 3), (3, 4, 4), (7, 8, 2)]
        handle = swapper.copy(Direction.OFFLOAD, pairs)
        wait_for(handle.done)
        assert torch.equal(tier.blocks[1:10], device[0:9])
        assert swapper.host_blocks_ready() == 12
    finally:
        swapper.close()


def test_a_swapper_copies_again_after_shutdown_and_only_close_ends_its_tier():
    """shutdown() (an engine's, which may run again) waits for the copies and stops the threads but keeps the
    tier's blocks: the KV manager was given them. close() unlocks the tier; collecting a tier unlocks it too."""
    locker = FakeLocker()
    device = torch.randn(8, *BLOCK)
    swapper = Swapper(device, tier_with(locker))  # 10 host blocks in chunks of 4
    for _ in range(3):
        locker.gate.release()
    wait_for(lambda: swapper.host_blocks_ready() == 10)
    wait_for(swapper.copy(Direction.OFFLOAD, [(0, 1)]).done)
    swapper.shutdown()
    assert swapper.host_blocks_ready() == 10 and locker.unregistered == []
    handle = swapper.copy(Direction.OFFLOAD, [(1, 9), (2, 2)])  # a new copy thread
    wait_for(handle.done)
    assert torch.equal(swapper.host_cache[[1, 9, 2]], device[[0, 1, 2]])
    swapper.close()
    assert swapper.host_blocks_ready() == 0 and len(locker.unregistered) == 3
    with pytest.raises(ValueError, match="only host blocks 0..-1 are ready"):
        swapper.copy(Direction.OFFLOAD, [(0, 0)])

    other = FakeLocker()
    held = [tier_with(other)]
    for _ in range(3):
        other.gate.release()
    wait_for(lambda: held[0].blocks_ready == 10)
    held[0]._thread.join()  # the locking thread holds the tier until it ends
    held.clear()  # the last reference
    gc.collect()
    assert sorted(other.unregistered) == sorted(p for p, _ in other.registered)


def test_swapper_refuses_a_copy_through_a_host_block_not_yet_locked():
    """memory/ must never hand out such a block; a worker that gets one fails loudly instead of copying through
    pageable memory (on CUDA that copy would silently stop being asynchronous)."""
    locker = FakeLocker()
    device = torch.randn(8, *BLOCK)  # [NB, L, 2, H, bs, D]
    swapper = Swapper(device, tier_with(locker))  # 10 host blocks in chunks of 4
    try:
        locker.gate.release()
        wait_for(lambda: swapper.host_blocks_ready() == 4)
        with pytest.raises(ValueError, match="offload of host block 4, but only host blocks 0..3 are ready"):
            swapper.copy(Direction.OFFLOAD, [(0, 3), (1, 4)])
        with pytest.raises(ValueError, match="upload of host block 5"):
            swapper.copy(Direction.UPLOAD, [(5, 0)])
        handle = swapper.copy(Direction.OFFLOAD, [(0, 2), (1, 3)])  # within the locked chunk
        wait_for(handle.done)
        assert torch.equal(swapper.host_cache[2:4], device[0:2])
    finally:
        for _ in range(2):
            locker.gate.release()  # let the locking end, so close() does not wait on the gate
        swapper.close()
