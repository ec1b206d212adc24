"""free_storage: give a tensor's memory back now, however many references to it remain.

Closing an engine (LLM.close, LocalExecutor.close) must return its device
memory before the next engine in the same process sizes its KV cache. Dropping
references is not enough: a captured CUDA graph, a stream, an output object or
a test's traceback may still hold the KV cache or the weights, and then the
memory stays allocated until garbage collection, if ever. Resizing the storage
to nothing frees it at once, for every view and alias of it; the tensor keeps
its shape over an empty storage (nothing may use it afterwards: the closed
executor refuses new steps).
"""

from __future__ import annotations

import torch


def free_storage(t: torch.Tensor | None) -> int:
    """Free the memory under `t` (a no-op for None and meta tensors); returns the bytes freed, 0 where the storage
    is not torch's to resize (memory torch did not allocate, e.g. a memory-mapped file: only dropped then)."""
    if t is None or t.device.type == "meta":
        return 0
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    try:
        storage.resize_(0)
    except RuntimeError:
        return 0
    return nbytes


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (cudaMemGetInfo, after the device finished its work); None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
