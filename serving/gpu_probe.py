"""Per-device rows for the dashboard, /metrics and /health: memory, utilization, temperature and PCIe
throughput of each GPU that nvidia-ml-py (NVML) sees.

Where NVML cannot be loaded or sees no GPU (a CPU machine), there are no rows and `note` says why; nothing
fails. Rows are the whole machine's GPUs; the executor's workers (`Executor.worker_devices()`: one per rank
on a GPU, with its UUID and PCI address) label the rows of the GPUs they run on: `worker` is then
{"rank", "tp_rank", "pp_stage", "cuda_device"} (under TP/PP each rank has its own GPU), else null. Matching
goes by UUID, else PCI address, never by index (CUDA and NVML number devices differently), and only for
workers on this host (NVML sees this machine alone). Anything with `source`, `note` and `rows()` returning
dicts of the same keys can stand in for NvmlProbe.

Reading NVML is slow: its PCIe-throughput query samples a 20 ms window, and NvmlProbe.rows() makes two per GPU
(160 ms on 4 GPUs, 320 ms on 8). So the server never calls a probe on its event loop: CachedRows reads it in a
thread of its own every second and /health, /metrics and the dashboard read the last rows it kept.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
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


class CachedRows:
    """A DeviceRows whose rows() returns at once: the rows `probe` gave at its last sample, taken every
    `interval_s` in a daemon thread (so a slow probe delays only the next sample, never the event loop). Before
    the first sample, and when the probe has a note (no GPU), there are no rows. Start and stop it with the app
    (`app.cleanup_ctx.append(rows.cleanup_ctx)`: the first sample is taken, in the thread, before serving)."""

    def __init__(self, probe: DeviceRows, interval_s: float = 1.0) -> None:
        self.probe, self.interval_s = probe, interval_s
        self._rows: list[dict] = []
        self.sampled_at: float | None = None  # time.monotonic() of the last sample
        self.num_samples = 0
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def source(self) -> str:
        return self.probe.source

    @property
    def note(self) -> str | None:
        return self.probe.note

    def rows(self) -> list[dict]:
        return self._rows

    def sample(self) -> None:
        """Read the probe once and keep its rows (the thread's work; callable directly off the loop)."""
        rows = self.probe.rows()
        self._rows, self.sampled_at = rows, time.monotonic()
        self.num_samples += 1

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # one failed sample keeps the last rows; the next one tries again
                log.exception("GPU telemetry sample failed")
            self._ready.set()
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> None:
        """Start sampling (nothing to sample when the probe has a note: no GPU)."""
        if self.note is not None or self._thread is not None:
            self._ready.set()
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fastserve-gpu-telemetry", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the first sample has been taken (within timeout s)."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    async def cleanup_ctx(self, app) -> AsyncIterator[None]:
        """aiohttp cleanup context: sample from start-up (the first sample awaited off the loop, at most 10 s)
        until shutdown."""
        self.start()
        await asyncio.to_thread(self.wait_ready, 10.0)
        yield
        await asyncio.to_thread(self.stop, 10.0)
