"""Which GPU a worker rank runs on, in terms that NVML (the dashboard's view of the machine) can match.

What this is: `WorkerDevice`, one rank's GPU as the rank itself saw it after choosing its CUDA device (its
torch index, name, UUID and PCI bus id, and the host it runs on), read by `describe_cuda_device`; and the
normal forms (`normalize_uuid`, `pci_key`) under which torch's and NVML's spellings of the same GPU compare
equal. CUDA indices are not NVML indices (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER renumber devices),
so matching goes by UUID, else by PCI address (serving/gpu_probe.py). On CPU a rank has no WorkerDevice.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class WorkerDevice:
    rank: int  # the worker's global rank (pp_stage * tp_size + tp_rank)
    tp_rank: int
    pp_stage: int
    host: str  # socket.gethostname() of the worker's machine
    cuda_device: int  # torch's device index inside the worker's process
    name: str
    uuid: str | None  # normalize_uuid form; None when torch does not say
    pci_bus_id: str | None  # pci_key form ("0000:19:00"); None when torch does not say

    def label(self) -> dict:
        """The dashboard's `worker` field of the row of this GPU."""
        return {k: v for k, v in asdict(self).items() if k in ("rank", "tp_rank", "pp_stage", "cuda_device")}


def normalize_uuid(uuid: object) -> str | None:
    """A GPU UUID without NVML's "GPU-" prefix, lower case (torch writes none, NVML writes "GPU-...")."""
    if uuid is None:
        return None
    text = (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).strip().lower()
    text = text.removeprefix("gpu-")
    return text or None


def pci_key(domain: int, bus: int, device: int) -> str:
    """A PCI address as "dddd:bb:dd" (hex, lower case; the function is always 0 for a GPU)."""
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def pci_key_of_bus_id(bus_id: object) -> str | None:
    """pci_key of NVML's busId ("00000000:19:00.0", bytes or str); None when it does not parse."""
    try:
        text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
        domain, bus, rest = text.strip().split(":")
        return pci_key(int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))
    except (ValueError, AttributeError):
        return None


def describe_cuda_device(rank: int, tp_rank: int, pp_stage: int, device: torch.device) -> WorkerDevice | None:
    """The WorkerDevice of a rank running on `device`; None for a CPU device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = normalize_uuid(getattr(props, "uuid", None))  # torch >= 2.1
    pci = None
    if all(hasattr(props, f) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")):  # torch >= 2.5
        pci = pci_key(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    return WorkerDevice(rank, tp_rank, pp_stage, socket.gethostname(), index, props.name, uuid, pci)
