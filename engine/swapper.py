"""Swapper: moves KV blocks between the device cache and the host cache.

The TransferBackend memory/ plans against (memory/transfers.py). Each call
copies whole blocks, consecutive ones in one copy (contiguous_runs) — with
the block-major layout one block is one contiguous
piece holding every layer's K and V for block_size tokens — and returns a
handle:
- CUDA: the copies are queued on a copy stream of their direction (one for
  device-to-host, one for host-to-device) after the pending work of the
  compute stream, named when the Swapper is made (by default the device's
  default stream, where the engine computes: nothing in it sets another), so
  an offload reads what compute wrote whichever thread asks for the copy
  (not the asking thread's current stream), into pinned host memory
  (engine/host_tier.py: only page-locked host blocks are handed out, and no
  copy crosses one of its chunks' boundaries), non-blocking; the handle is a
  CUDA event.
- CPU: a copy thread per direction runs the copies in order; the handle is its
  future.
Either way memory/ frees the source blocks only once the handle is done, and
a job being uploaded becomes ready only then, so compute never races a copy.

`copy_delay_s` slows every copy (tests of the ordering rules use it).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.device_memory import free_storage
from engine.host_tier import HostTier
from memory.transfers import Direction


class _FutureHandle:
    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()


class _EventHandle:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        self._event.synchronize()


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) runs covering the (source, destination) block pairs: one
    copy per run instead of one per block. Blocks handed out together are mostly consecutive on both tiers,
    so an offload or upload of a whole job is usually a few large copies."""
    runs: list[list[int]] = []
    for s, d in sorted(pairs):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


class Swapper:
    def __init__(self, device_cache: torch.Tensor, host: torch.Tensor | HostTier, copy_delay_s: float = 0.0,
                 compute_stream: torch.cuda.Stream | None = None) -> None:
        """host: the host tier (engine/host_tier.py), or a plain host tensor whose blocks are all usable.
        compute_stream (CUDA): the stream whose work a copy waits for; the device's default stream if None."""
        self.device_cache = device_cache  # [NB, L, 2, H, bs, D]
        self.tier = host if isinstance(host, HostTier) else None
        self.host_cache = host.blocks if isinstance(host, HostTier) else host  # [NH, L, 2, H, bs, D]
        self.copy_delay_s = copy_delay_s
        self.bytes_copied = 0
        self._cuda = device_cache.is_cuda
        # One copy engine per direction, so offloads and uploads overlap each other and compute. No hazard
        # between them: an offload's device blocks are reused, and an upload's host blocks freed, only after
        # their copy completed; each copy reads or writes only blocks its job owns.
        if self._cuda:
            self.compute_stream = compute_stream or torch.cuda.default_stream(device_cache.device)
            self._streams = {d: torch.cuda.Stream(device=device_cache.device) for d in Direction}
        else:
            self._threads = {d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fastserve-{d.value}")
                             for d in Direction}

    @property
    def block_bytes(self) -> int:
        return self.device_cache[0].numel() * self.device_cache.element_size()

    def host_blocks_ready(self) -> int:
        """The TransferBackend verb: leading host blocks usable now (those already page-locked on CUDA)."""
        return self.tier.blocks_ready if self.tier is not None else self.host_cache.shape[0]

    def runs(self, direction: Direction, pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """The copies of these block pairs: contiguous runs, cut at the host tier's chunk boundaries."""
        runs = contiguous_runs(pairs)
        if self.tier is None:
            return runs
        return self.tier.chunk_runs(runs, host_side=1 if direction is Direction.OFFLOAD else 0)

    def copy(self, direction: Direction, pairs: list[tuple[int, int]]):
        """Start copying the (source block, destination block) pairs; returns the handle. Raises ValueError if a
        host block is not ready yet (not page-locked): memory/ must never hand one out."""
        if self.tier is not None and pairs:
            host_side = 1 if direction is Direction.OFFLOAD else 0
            top, ready = max(p[host_side] for p in pairs), self.tier.blocks_ready
            if top >= ready:
                raise ValueError(f"{direction.value} of host block {top}, but only host blocks 0..{ready - 1} are "
                                 f"ready (page-locked); the KV manager handed out a block it was not given")
        src, dst = ((self.device_cache, self.host_cache) if direction is Direction.OFFLOAD
                    else (self.host_cache, self.device_cache))
        self.bytes_copied += len(pairs) * self.block_bytes
        runs = self.runs(direction, pairs)
        if self._cuda:
            stream = self._streams[direction]
            stream.wait_stream(self.compute_stream)  # after the compute queued so far
            with torch.cuda.stream(stream):
                for s, d, n in runs:
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            return _EventHandle(event)
        return _FutureHandle(self._threads[direction].submit(self._copy_blocks, src, dst, runs))

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n])

    def shutdown(self) -> None:
        """Wait for the copies in flight and stop the copy threads (new ones start with the next copy). The host
        tier stays open, its blocks usable: an engine that is shut down may run again (LocalExecutor.shutdown; a
        server's AsyncEngine shutting down, an LLM collected while its engine is kept), and the KV manager still
        counts on every block it was given. close() or release() end the tier."""
        if self._cuda:
            for stream in self._streams.values():
                stream.synchronize()
        else:
            for d, thread in self._threads.items():
                thread.shutdown(wait=True)
                self._threads[d] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fastserve-{d.value}")

    def close(self) -> None:
        """shutdown(), then close the host tier (unlocking its pages on CUDA): no copy may use it afterwards."""
        self.shutdown()
        if self.tier is not None:
            self.tier.close()

    def release(self) -> None:
        """close(), then free the host tier's memory now and drop the copy streams and the device cache (whose
        owner, the ModelRunner, frees it): an engine closing. The swapper cannot copy afterwards."""
        self.close()
        free_storage(self.host_cache)
        self.device_cache = self.host_cache = self.tier = None
        self._streams = self._threads = {}
