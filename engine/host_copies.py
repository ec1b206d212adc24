"""HostCopyCounter: counts the torch calls that can move host data to the device while it is active: tensors
built from Python or numpy data (torch.tensor, as_tensor, from_numpy), copies (Tensor.copy_, slice assignment,
Tensor.to / .cuda). For tests and benchmarks of a step's input preparation (ModelRunner.prepare): an eager
decode step builds about eight tensors from Python lists (each a synchronous host-to-device copy on CUDA from
pageable memory); the staged decode inputs (engine/decode_inputs.py) make one non-blocking copy on CUDA and
none on CPU, where the buffers are host memory already. Writes through a numpy view of a host buffer are not
torch calls and are not counted: they stay on the host.

    with HostCopyCounter() as counter:
        runner.prepare(batch)
    counter.count, counter.calls    # e.g. 1, {"copy_": 1}

Worker processes count their steps' prepare when FASTSERVE_TEST_COUNT_HOST_COPIES names a file (tests only):
one line a step, "rank tokens sequences count".
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

COUNT_ENV = "FASTSERVE_TEST_COUNT_HOST_COPIES"
_NAMES = {"tensor", "as_tensor", "from_numpy", "copy_", "__setitem__", "to", "cuda"}


class HostCopyCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _NAMES and not (name == "to" and _same_device(args, kwargs)):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _same_device(args, kwargs) -> bool:
    """Tensor.to(dtype) or to the tensor's own device: no copy between host and device."""
    src, rest = args[0], list(args[1:]) + list((kwargs or {}).values())
    devices = [torch.device(a) for a in rest if isinstance(a, str | torch.device)]
    devices += [a.device for a in rest if isinstance(a, torch.Tensor)]
    return all(d.type == src.device.type for d in devices)


def count_file() -> str | None:
    """Where a worker writes its per-step counts (tests), or None."""
    return os.environ.get(COUNT_ENV) or None
