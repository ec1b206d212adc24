"""scripts/benchmarks/gpu.py on CPU, with the tiny model: the prefill is timed with every attention backend
the decode rows use (it used to run after the script switched back to torch, so the Triton prefill that serving
uses was never timed), and the swaps' memcpy baseline copies the way the swapper does (one host buffer allocated
and pinned at once, device blocks block-major contiguous), not across the host tier's separately pinned chunks."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup
from fastserve_kernels.paged_attention import paged_attention
from scripts.benchmarks import gpu as bench_gpu


@pytest.fixture
def runner(tiny_model_dir):
    cfg = OPTConfig.from_model_dir(tiny_model_dir)
    model = load_model_stage(tiny_model_dir, cfg, TensorParallelGroup(ParallelLayout()), torch.float32, "cpu")
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, block_size=4)
    runner.allocate_kv_cache(64)
    return runner


def test_prefill_is_timed_with_every_attention_backend(runner, monkeypatch):
    """A stand-in "triton" backend (the torch function, counted): the prefill rows cover both backends, the
    stand-in really ran during its row, and the model is back on torch afterwards."""
    calls = {"triton": 0}

    def triton_stand_in(*args, **kwargs):
        calls["triton"] += 1
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(bench_gpu, "attention_backends",
                        lambda device: ({"torch": paged_attention, "triton": triton_stand_in}, None))
    rows = bench_gpu.bench_prefill(runner, seqs=2, tokens=16, repeat=1)
    assert [r["backend"] for r in rows] == ["torch", "triton"]
    assert all(r["step_ms"] > 0 and r["gemm_ms"] > 0 and r["tflop"] > 0 for r in rows)
    assert calls["triton"] >= 2 * runner.model.num_layers  # warm-up + timed run, every layer
    assert runner.model.attention is paged_attention


class _Copies(TorchDispatchMode):
    """(destination, source) of every copy_."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def test_the_memcpy_baseline_is_one_contiguous_copy_to_one_host_buffer(runner):
    """Each baseline copy moves device blocks 0..n-1 (one contiguous range of the cache) to or from one host
    buffer of its own, never the host tier; the swap benchmark divides by these times."""
    n = 8
    swapper = runner.attach_host_tier(n)
    tier = swapper.host_cache.untyped_storage().data_ptr()
    cache = runner.kv_cache
    with _Copies() as spy:
        times = bench_gpu.memcpy_times(cache, n, repeat=1)
    assert set(times) == {"memcpy_d2h", "memcpy_h2d"} and all(t > 0 for t in times.values())
    block = cache[0].numel()
    hosts = set()
    for dst, src in spy.copies:
        device_side, host_side = (src, dst) if dst.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr() \
            else (dst, src)
        assert device_side.data_ptr() == cache.data_ptr() and device_side.is_contiguous()
        assert device_side.numel() == host_side.numel() == n * block
        assert host_side.is_contiguous() and host_side.untyped_storage().data_ptr() != tier
        hosts.add(host_side.untyped_storage().data_ptr())
    assert len(spy.copies) >= 4 and len(hosts) == 1  # warm-ups and timed runs, both ways, one buffer
    swapper.shutdown()


def test_the_swap_benchmark_compares_against_that_baseline(runner, monkeypatch):
    baseline = {"memcpy_d2h": 1.0, "memcpy_h2d": 2.0}  # seconds: far slower than any real copy here
    monkeypatch.setattr(bench_gpu, "memcpy_times", lambda cache, n, repeat: dict(baseline))
    r = bench_gpu.bench_swap(runner, jobs=2, blocks_per_job=4, repeat=1)
    assert r["gb_per_s"]["memcpy_d2h"] == pytest.approx(r["bytes"] / 1.0 / 1e9)
    assert r["offload_contiguous_vs_memcpy"] > 1 and r["upload_fragmented_vs_memcpy"] > 1


def test_each_backends_decode_rows_run_with_that_backends_graph_buckets(runner, monkeypatch):
    """The graph buckets depend on the backend (engine/decode_inputs.graph_buckets): while a backend's rows are
    timed, the runner's backend is that one (torch rows used to replay through Triton's widest-table buckets),
    and afterwards the runner is back on the backend it started with."""
    seen = []
    real = runner.use_decode_graphs

    def spy(*args, **kwargs):
        seen.append((runner.attention_backend, runner.model.attention))
        return real(*args, **kwargs)

    def triton_stand_in(*args, **kwargs):
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(runner, "use_decode_graphs", spy)
    monkeypatch.setattr(bench_gpu, "attention_backends",
                        lambda device: ({"torch": paged_attention, "triton": triton_stand_in}, None))
    first = runner.attention_backend
    rows, _ = bench_gpu.bench_decode(runner, [1, 2], context=20, max_model_len=64, bandwidth=1e9, repeat=1)
    assert [name for name, _ in seen] == ["torch", "torch", "triton", "triton"]
    assert [fn for _, fn in seen] == [paged_attention, paged_attention, triton_stand_in, triton_stand_in]
    assert runner.attention_backend == first and runner.model.attention is paged_attention
    # 20 tokens in blocks of 4: 5 blocks a row eagerly, the next bucket width (8) through the padded buffers
    assert {(r["mode"], r["table_width"]) for r in rows} == {("eager", 5), ("padded", 8)}


@pytest.mark.parametrize("memory_gb", [80, 141], ids=["H100", "H200"])
def test_the_default_cuda_batches_fit_both_cards(memory_gb):
    """Every default CUDA batch's OPT-13B KV at the default context, the weights and the reserve fit an H100's
    and an H200's memory, so no default row is dropped (batch 256, 107 GB of KV, fit neither)."""
    from scripts import device_expectations as dx

    cfg = dx.model_config(bench_gpu.CUDA_SHAPE)
    weights, per_token = dx.weight_bytes(cfg, torch.float16), dx.kv_bytes_per_token(cfg, torch.float16)
    for batch in bench_gpu.CUDA_BATCHES:
        assert weights + batch * bench_gpu.CONTEXT * per_token + bench_gpu.KV_RESERVE_BYTES <= memory_gb * 1e9, batch
