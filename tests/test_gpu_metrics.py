"""GPU telemetry from nvidia-ml-py in /metrics and /health: per-GPU gauges from a stand-in NVML module (no GPU
here), and simply none when NVML is missing or sees no GPU."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server import ServerConfig, create_app


def fake_nvml(count: int):
    consts = dict(NVML_TEMPERATURE_GPU=0, NVML_PCIE_UTIL_TX_BYTES=0, NVML_PCIE_UTIL_RX_BYTES=1)

    def pcie(handle, counter):
        if handle == 1:
            raise RuntimeError("Not Supported")
        return 2048 if counter == 0 else 1024  # KB/s

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: count, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) << 30, total=141 << 30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50 + h),
        nvmlDeviceGetTemperature=lambda h, sensor: 40 + h, nvmlDeviceGetPcieThroughput=pcie, **consts)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engine.engine import Engine

    return Engine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=64, kv_policy="recompute",
                               profile="analytic"))


def scrape(engine) -> tuple[dict, dict]:
    async def run():
        app = create_app(AsyncEngine(engine), ServerConfig(served_model_names=("tiny",)))
        async with TestClient(TestServer(app)) as client:
            metrics = await (await client.get("/metrics")).text()
            health = await (await client.get("/health")).json()
        return metrics, health

    text, health = asyncio.run(run())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("fastserve:gpu_")}
    return samples, health


def test_gpu_gauges_per_device(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(2))
    samples, health = scrape(engine)
    gpu0 = (("gpu", "0"), ("name", "NVIDIA H200"))
    gpu1 = (("gpu", "1"), ("name", "NVIDIA H200"))
    assert samples[("fastserve:gpu_memory_used_bytes", gpu1)] == 2 << 30
    assert samples[("fastserve:gpu_memory_total_bytes", gpu0)] == 141 << 30
    assert samples[("fastserve:gpu_utilization_percent", gpu1)] == 51
    assert samples[("fastserve:gpu_temperature_celsius", gpu0)] == 40
    assert samples[("fastserve:gpu_pcie_tx_bytes_per_second", gpu0)] == 2048 * 1024
    assert samples[("fastserve:gpu_pcie_rx_bytes_per_second", gpu0)] == 1024 * 1024
    assert ("fastserve:gpu_pcie_tx_bytes_per_second", gpu1) not in samples  # the device does not say
    assert [g["temperature_c"] for g in health["gpus"]] == [40, 41]


@pytest.mark.parametrize("nvml", [None, fake_nvml(0)], ids=["no-library", "no-gpu"])
def test_no_gpu_means_no_gpu_series_and_nothing_fails(engine, monkeypatch, nvml):
    if nvml is None:
        def missing():
            raise OSError("NVML Shared Library Not Found")

        nvml = types.SimpleNamespace(nvmlInit=missing)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    samples, health = scrape(engine)
    assert samples == {} and "gpus" not in health and health["status"] == "ok"
