"""Per-device rows for the dashboard, /metrics and /health: memory, utilization, temperature and PCIe
throughput of each GPU that nvidia-ml-py (NVML) sees.

Where NVML cannot be loaded or sees no GPU (a CPU machine), there are no rows and `note` says why; nothing
fails. Under tensor/pipeline parallelism an executor can supply its workers' rows instead: anything with
`source`, `note` and `rows()` returning dicts of the same keys (`worker` then carries
{"rank", "tp_rank", "pp_stage"}).
"""

from __future__ import annotations

import logging
from typing import Protocol

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


class NvmlProbe:
    """Every GPU NVML lists (the machine's view, as nvidia-smi's), read at each sample."""

    source = "nvml"

    def __init__(self) -> None:
        self.note: str | None = None
        self._nvml = None
        self._handles: list = []
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
                                       int(mem.total), float(util.gpu), **self._optional(handle)))
            except Exception as e:  # one device failing to answer shows as an error on its row
                rows.append(device_row(i, f"GPU {i}", error=f"{type(e).__name__}: {e}"))
        return rows
