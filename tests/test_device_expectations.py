"""scripts/device_expectations.py: the figures docs/benchmarks.md lists for the device check come from the model
shapes, counted the way bench_gpu counts the bytes a decode step reads."""

from __future__ import annotations

import torch

from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup
from scripts import bench_gpu
from scripts import device_expectations as dx


def test_weight_and_kv_bytes_are_counted_as_bench_gpu_counts_them(tiny_model_dir):
    cfg = OPTConfig.from_model_dir(tiny_model_dir)
    model = load_model_stage(tiny_model_dir, cfg, TensorParallelGroup(ParallelLayout()), torch.float32, "cpu")
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, block_size=16)
    assert dx.weight_bytes(cfg, torch.float32) == bench_gpu.weight_bytes_read(runner)
    assert 32 * 512 * dx.kv_bytes_per_token(cfg, torch.float32) == bench_gpu.kv_bytes_read(runner, 32, 512)


def test_opt_13b_floor_on_an_h200():
    cfg = dx.model_config("opt-13b")
    v, e, f, layers = 50272, 5120, 20480, 40
    per_layer = 4 * (e * e + e) + (e * f + f) + (f * e + e) + 2 * 2 * e  # attention, FFN, two layer norms
    assert dx.weight_bytes(cfg, torch.float16) == 2 * (v * e + layers * per_layer + 2 * e)  # 25.69 GB, no positions
    assert dx.kv_bytes_per_token(cfg, torch.float16) == 40 * 2 * 5120 * 2
    row = next(r for r in dx.rows([512], [32], torch.float16) if r["model"] == "opt-13b")
    assert abs(row["floor_ms_H200"] - (25.686e9 + 32 * 512 * 819_200) / 4.8e12 * 1e3) < 0.01  # 8.15 ms
