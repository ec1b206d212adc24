"""What the device check's host-tier and swap items need, on the CPU: the host tier starts on a page and locks
whole pages a chunk (engine/host_tier.py), the round trip and close() of tests/test_cuda.py's host-tier test run
here with a fake page-locker, and the Swapper's copies wait on the compute stream it was given, whichever stream
is current in the asking thread (engine/swapper.py; fake streams stand in for CUDA's)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.host_tier import PAGE_BYTES, HostTier, page_aligned_empty
from engine.swapper import Swapper
from memory.transfers import Direction

BLOCK = (2, 2, 4, 16, 8)  # [L, 2, H, bs, D]: 8 KiB in float32


class Locker:
    """A page-locker that locks nothing: records what is locked now, and every range it was asked to lock."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []

    def register(self, ptr: int, size: int) -> None:
        self.calls.append((ptr, size))
        self.locked[ptr] = size

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]


def round_trip_then_close(device: torch.Tensor, tier: HostTier, locked) -> None:
    """Copies through the tier across its chunk boundaries come back equal; shutdown() keeps the tier locked
    (an engine shut down may run again), close() unlocks it. locked(): whether the tier's pages are locked."""
    assert tier.wait_pinned(timeout=60) and tier.blocks_ready == tier.num_blocks
    assert locked()
    swapper = Swapper(device, tier)
    pairs = [(d, 6 + d) for d in range(device.shape[0])]  # host 6..21: crosses chunks at 8 and 16
    swapper.copy(Direction.OFFLOAD, pairs).wait()
    back = device.clone()
    device.zero_()
    swapper.copy(Direction.UPLOAD, [(h, d) for d, h in pairs]).wait()
    if device.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(device, back)
    swapper.shutdown()
    assert locked() and tier.blocks_ready == tier.num_blocks
    swapper.close()
    assert not locked() and tier.blocks_ready == 0


def test_the_round_trip_and_close_of_the_cuda_test_with_a_fake_locker():
    device = torch.randn(16, *BLOCK)
    block_bytes = device[0].numel() * 4
    locker = Locker()
    tier = HostTier(40, BLOCK, torch.float32, pin=True, chunk_bytes=8 * block_bytes, register=locker.register,
                    unregister=locker.unregister, page_bytes=PAGE_BYTES)  # 5 chunks
    round_trip_then_close(device, tier, lambda: bool(locker.locked))
    assert len(locker.calls) == 5


@pytest.mark.parametrize("shape", [(3, *BLOCK), (1000, 7, 3), (0, *BLOCK), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_host_tier_starts_on_a_page(shape, dtype):
    """torch.empty's large buffers start 64 bytes past a page; the tier's start on one, pinned or not."""
    t = page_aligned_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % PAGE_BYTES == 0
    tier = HostTier(shape[0], shape[1:], dtype, pin=False)
    assert tier.blocks.shape == shape and tier.blocks.data_ptr() % PAGE_BYTES == 0


@pytest.mark.parametrize("block", [BLOCK, (2, 2, 1, 4, 3), (1, 2, 3, 5, 7)], ids=["8KiB", "192B", "840B"])
def test_each_chunk_locks_whole_pages_none_twice(block):
    """Chunk sizes are whole pages however many bytes a block holds, so every lock starts on a page and no page
    is locked by two chunks (a second cudaHostRegister of a page fails); together they cover the tier."""
    locker = Locker()
    block_bytes = torch.empty(block).numel() * 4
    tier = HostTier(1200, block, torch.float32, pin=True, chunk_bytes=3 * PAGE_BYTES + 100, register=locker.register,
                    unregister=locker.unregister, page_bytes=PAGE_BYTES)
    assert tier.wait_pinned(timeout=10) and tier.blocks_ready == 1200
    assert len(locker.calls) > 1
    start = tier.blocks.data_ptr()
    for ptr, size in locker.calls:
        assert ptr == start and ptr % PAGE_BYTES == 0
        start = ptr + size
    assert start == tier.blocks.data_ptr() + 1200 * block_bytes
    assert all(size % PAGE_BYTES == 0 for _, size in locker.calls[:-1])
    tier.close()


class FakeStream:
    """Stands in for a torch.cuda.Stream: records the streams it was told to wait for."""

    def __init__(self, name: str = "copy", device=None) -> None:
        self.name, self.waited_for = name, []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other)

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def record(self, stream: FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class OnTheDevice(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so that the Swapper takes its CUDA path (with fake streams)."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_copies_wait_on_the_named_compute_stream_not_the_asking_threads(monkeypatch):
    default = FakeStream("default")

    def current_stream(device=None):
        raise AssertionError("a copy must not depend on the asking thread's current stream")

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    device = torch.Tensor._make_subclass(OnTheDevice, torch.randn(4, *BLOCK))
    host = torch.zeros(4, *BLOCK)
    swapper = Swapper(device, host)
    assert swapper.compute_stream is default  # where the engine computes: the default stream
    swapper.copy(Direction.OFFLOAD, [(0, 1), (1, 2)]).wait()
    assert torch.equal(host[1:3], device[0:2].as_subclass(torch.Tensor))
    compute = FakeStream("compute")
    named = Swapper(device, host, compute_stream=compute)
    named.copy(Direction.UPLOAD, [(1, 3)]).wait()
    copy_streams = {d: s.waited_for for d, s in named._streams.items()}
    assert copy_streams == {Direction.OFFLOAD: [], Direction.UPLOAD: [compute]}
    assert swapper._streams[Direction.OFFLOAD].waited_for == [default]
