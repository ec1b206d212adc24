"""Per-device rows for the dashboard, /metrics and /health: memory, utilization, temperature and PCIe
throughput of each GPU that nvidia-ml-py (NVML) sees.

Where NVML cannot be loaded or sees no GPU (a CPU machine), there are no rows and `note` says why; nothing
fails. Rows are the whole machine's GPUs; the executor's workers (`Executor.worker_devices()`: one per rank
on a GPU, with its UUID and PCI address) label the rows of the GPUs they run on: `worker` is then
{"rank", "tp_rank", "pp_stage", "cuda_device"} (under TP/PP each rank has its own GPU), else null. Matching
goes by UUID, else PCI address, never by index (CUDA and NVML number devices differently), and only for
workers on this host (NVML sees this machine alone). Anything with `source`, `note` and `rows()` returning
dicts of the same keys can stand in for NvmlProbe.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Protocol

from engine.executor.device_identity import WorkerDevice, normalize_uuid, pci_key_of_bus_id

log = logging.getLogger("fastserve.dashboard")


class DeviceRows(Protocol):
    source: str  # who measured the rows ("nvml", or an executor's name)
    note: str | None  # why there are no rows, if there are none

    def rows(self) -> list[dict]: ...


def device_row(index: int, name: str, memory_used: int | None = None, memory_total: int | None = None,
               utilization_pct: float | None = None, worker: dict | None = None, error: str | None = None,
               temperature_c: float | None = None, pcie_tx_bytes_per_s: float | None = None,
               pcie_rx_bytes_per_s: float | None = None) -> dict:
    return {"id": index, "name": name, "worker": worker, "memory_used_bytes": memory_used,
            "memory_total_bytes": memory_total, "utilization_pct": utilization_pct, "error": error,
            "temperature_c": temperature_c, "pcie_tx_bytes_per_s": pcie_tx_bytes_per_s,
            "pcie_rx_bytes_per_s": pcie_rx_bytes_per_s}


def _identity(nvml, handle) -> tuple[str | None, str | None]:
    """(normalized UUID, PCI key) of one NVML device; None for what it does not say."""
    uuid = pci = None
    try:
        uuid = normalize_uuid(nvml.nvmlDeviceGetUUID(handle))
    except Exception:
        pass
    try:
        pci = pci_key_of_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except Exception:
        pass
    return uuid, pci


def worker_labels(identities: Sequence[tuple[str | None, str | None]], workers: Sequence[WorkerDevice],
                  host: str) -> list[dict | None]:
    """For each NVML device (its (UUID, PCI key)), the `worker` label of the rank on this host that runs on it,
    else None. A rank is matched by UUID, else by PCI address (unique per physical GPU on a host; it also finds
    the GPU of a rank on a MIG instance, whose UUID is the instance's)."""
    labels: list[dict | None] = []
    local = [w for w in workers if w.host == host]
    for uuid, pci in identities:
        match = next((w for w in local if uuid is not None and w.uuid == uuid), None)
        if match is None:
            match = next((w for w in local if pci is not None and w.pci_bus_id == pci), None)
        labels.append(match.label() if match is not None else None)
    return labels


class NvmlProbe:
    """Every GPU NVML lists (the machine's view, as nvidia-smi's), read at each sample; the rows of GPUs that
    the executor's workers run on carry their rank (`workers`: Executor.worker_devices())."""

    source = "nvml"

    def __init__(self, workers: Sequence[WorkerDevice] = ()) -> None:
        self.note: str | None = None
        self._nvml = None
        self._handles: list = []
        self._labels: list[dict | None] = []
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception as e:  # no driver, no library, no permission: a CPU machine
            self.note = f"no GPU visible to nvidia-ml-py ({type(e).__name__}: {e})"
            return
        if not self._handles:
            self.note = "nvidia-ml-py sees no GPU"
        identities = [_identity(self._nvml, h) for h in self._handles]
        self._labels = worker_labels(identities, workers, socket.gethostname())
        unmatched = len(workers) - sum(label is not None for label in self._labels)
        if unmatched and self._handles:
            log.info("%d of %d worker GPUs not matched to an NVML device (other hosts, or no UUID/PCI id)",
                     unmatched, len(workers))

    def _optional(self, handle) -> dict:
        """Temperature and PCIe throughput: readings some devices or drivers do not give (then None)."""
        nvml, out = self._nvml, {}
        for key, read in (
            ("temperature_c", lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))),
            ("pcie_tx_bytes_per_s",  # NVML reports KB/s
             lambda: 1024.0 * nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES)),
            ("pcie_rx_bytes_per_s",
             lambda: 1024.0 * nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES)),
        ):
            try:
                out[key] = read()
            except Exception:  # not supported here: the reading is missing, nothing fails
                out[key] = None
        return out

    def rows(self) -> list[dict]:
        nvml, rows = self._nvml, []
        for i, handle in enumerate(self._handles):
            try:
                name = nvml.nvmlDeviceGetName(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                rows.append(device_row(i, name.decode() if isinstance(name, bytes) else name, int(mem.used),
                                       int(mem.total), float(util.gpu), self._labels[i], **self._optional(handle)))
            except Exception as e:  # one device failing to answer shows as an error on its row
                rows.append(device_row(i, f"GPU {i}", worker=self._labels[i], error=f"{type(e).__name__}: {e}"))
        return rows
