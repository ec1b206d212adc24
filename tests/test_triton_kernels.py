"""The Triton kernels and --attention-backend.

On CPU the kernels are checked against the reference under Triton's
interpreter, in a fresh pytest process (tests/triton_interpreter_cases.py):
triton picks interpreter or compiler for its own library when it is first
imported, once per process, so the interpreter cases cannot share this
process with whatever imported triton first. Here: that run, how the backend
is resolved (auto, torch, triton, the errors), and the compiled kernels on
CUDA against the reference (skipped without a GPU). triton is a test
requirement: a missing triton fails these tests, it does not skip them."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (a test requirement: its absence is a failure, not a skip)

from engine import LLM
from engine.config import EngineConfig
from fastserve_kernels import paged_attention as ref
from fastserve_kernels.attention_backend import AttentionBackendError, attention_function, resolve_attention_backend
from scripts import triton_registers
from tests.paged_batches import make_batch

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def test_triton_kernels_match_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton_interpreter_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert run.returncode == 0, f"tests/triton_interpreter_cases.py failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_start_up_runs_no_warm_up_forward_off_cuda(monkeypatch, tiny_model_dir):
    """KV sizing measures peak memory with a forward of max_num_batched_tokens (8,192) tokens only where memory
    is measured (CUDA); on CPU the budget is fixed, so start-up runs no forward at all (the interpreted Triton
    prefill kernel would take hours over 8,192 tokens; tests/triton_interpreter_cases.py starts LLM(...) so)."""
    from engine.kv_cache import DEFAULT_CPU_KV_BYTES
    from engine.model_runner import ModelRunner

    forwards = []
    real_forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, *a, **kw: forwards.append(a) or real_forward(self, *a,
                                                                                                             **kw))
    with LLM(model=str(tiny_model_dir), device="cpu", profile="analytic") as llm:
        executor = llm.engine.executor
        assert forwards == []
        assert executor.runner.measure_peak_memory(8192, 2048) == 0 and forwards == []
        assert executor.num_device_blocks == DEFAULT_CPU_KV_BYTES // executor.kv_block_bytes


def test_auto_backend_is_torch_on_cpu_and_triton_needs_the_interpreter(monkeypatch, tiny_model_dir):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_attention_backend("torch", CPU) == "torch"
    with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", CPU)
    with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
        LLM(model=str(tiny_model_dir), device="cpu", attention_backend="triton", profile="analytic")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", CPU) == "triton"  # resolving imports nothing
    assert resolve_attention_backend("auto", CPU) == "torch"  # the interpreter is for tests, never chosen by auto
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton"):
        EngineConfig(attention_backend="flash")


def test_triton_asked_for_but_not_installed_is_one_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else
                        real_find_spec(name, *a))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(AttentionBackendError, match="triton package is not installed"):
        resolve_attention_backend("triton", CPU)
    assert resolve_attention_backend("auto", torch.device("cuda")) == "torch"  # auto falls back


# Per-thread register limits of each kernel compiled for sm_90 as the host code launches it (measured with
# the pinned triton 3.7.1 / ptxas 12.8, block size 16, scripts/triton_registers.py: write_kv 25-100, decode split 50-72
# (48-80 on 64-token tiles, --block-size 128; the same under --heads 32,8), reduce 22-28, prefill 94-158), and no
# spills. Before the kernels read the cache one
# base pointer a KV block, the decode kernel took 64-143 registers (232-255 without the launch's alignment
# hints) and prefill spilled.
REGISTER_LIMITS = {"_write_kv_kernel": 128, "_decode_split_kernel": 96, "_decode_reduce_kernel": 64,
                   "_prefill_kernel": 192}
SHARED_LIMIT = 160 * 1024  # fits an A100's shared memory per block (163 KiB) and an H100's (227 KiB)


def test_kernels_compile_for_an_h100_class_gpu_without_one_within_register_limits():
    """float16, head dim 128 (OPT-13b), block size 16, sm_90: each kernel as paged_attention launches it
    (scripts/triton_registers.py records the launches on meta tensors and compiles them with Triton's own
    specialization), its registers and spills read from ptxas -v."""
    builds = triton_registers.compile_kernels(90, torch.float16, 128, bs=16)
    assert set(builds) == set(REGISTER_LIMITS)
    for name, build in builds.items():
        assert build.spill_stores == 0 and build.spill_loads == 0, build
        assert build.registers <= REGISTER_LIMITS[name], build
        assert build.shared < SHARED_LIMIT, build
    assert builds["_prefill_kernel"].num_warps == 8
    # Without the alignment hints (no vectorized loads) the decode kernel still holds one base pointer a tile,
    # not a 64-bit pointer an element: 92 registers (255 before), no spills.
    unaligned = triton_registers.compile_kernels(90, torch.float16, 128, bs=16, aligned=False)
    assert unaligned["_decode_split_kernel"].registers <= 128 and unaligned["_decode_split_kernel"].spill_stores == 0


@pytest.mark.parametrize(("heads", "dtype", "d", "bs"), [((32, 8), torch.float16, 128, 16),  # Llama 3 8B: G = 4
                                                        ((9, 3), torch.bfloat16, 64, 16),  # SmolLM2-135M: G = 3
                                                        ((32, 8), torch.float16, 128, 128),  # 64-token tiles
                                                        ((64, 1), torch.float16, 128, 16)])  # G = 64: 4 programs
def test_kernels_compile_for_grouped_query_attention_within_register_limits(heads, dtype, d, bs):
    """Fewer KV heads than query heads, sm_90: the decode kernel's program takes a KV head's query heads as the
    rows of its tl.dot (16, padded past G), within the same limits and without spills."""
    builds = triton_registers.compile_kernels(90, dtype, d, bs=bs, heads=heads)
    assert set(builds) == set(REGISTER_LIMITS)
    for name, build in builds.items():
        assert build.spill_stores == 0 and build.spill_loads == 0, build
        assert build.registers <= REGISTER_LIMITS[name], build
        assert build.shared < SHARED_LIMIT, build


def test_launches_are_recorded_as_the_host_code_makes_them():
    """The register check compiles what paged_attention really launches: every kernel, with the tiles and warps
    of decode_config / prefill_config and the cache tile of the block size."""
    module = triton_registers.attention_module()
    launches = triton_registers.launches(module, torch.float16, 128, bs=32)
    by_name = {kernel.fn.__name__: kwargs for kernel, _grid, _args, kwargs in launches}
    assert set(by_name) == set(REGISTER_LIMITS)
    assert by_name["_decode_split_kernel"]["BLOCK_N"] == 32 and by_name["_decode_split_kernel"]["num_warps"] == 4
    assert (by_name["_prefill_kernel"]["BLOCK_M"], by_name["_prefill_kernel"]["BLOCK_N"],
            by_name["_prefill_kernel"]["PREFIX_N"], by_name["_prefill_kernel"]["num_warps"]) == (64, 64, 32, 8)
    assert module.decode_config(128, 128) == (64, 8) and module.decode_config(4, 128) == (16, 4)
    # The decode split grid: one program a KV head and split, the group's query heads its rows (16, or
    # ceil(G / 16) programs a KV head past 16), whatever the query heads.
    for (h, h_kv), programs in {(40, 40): 40, (32, 8): 8, (9, 3): 3, (64, 1): 4}.items():
        recorded = triton_registers.launches(module, torch.float16, 128, bs=16, heads=(h, h_kv))
        (_, grid, _, kwargs), = [x for x in recorded if x[0].fn.__name__ == "_decode_split_kernel"]
        assert grid[1] == programs and (kwargs["G"], kwargs["BLOCK_G"]) == (h // h_kv, 16), (h, h_kv)
        assert module.decode_kv_bytes([100, 7], h, h_kv, 128, torch.float16) == programs * 107 * 2 * 128 * 2
    with pytest.raises(ValueError, match="multiple of the decode tile"):
        q = torch.empty(1, 2, 16, device="meta")
        module.decode_attention(q, torch.empty(4, 1, 2, 2, 16, 16, device="meta"), 0, torch.zeros(1, dtype=torch.long),
                                torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0.25, q, 40)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(("dtype", "d"), [(torch.float16, 64), (torch.float16, 80), (torch.float32, 64),
                                          (torch.float32, 128), (torch.bfloat16, 128)])
@pytest.mark.parametrize("bs", [4, 16, 128])
def test_kernels_compile_without_spills_for_each_dtype_head_dim_block_size_and_arch(arch, dtype, d, bs):
    builds = triton_registers.compile_kernels(arch, dtype, d, bs=bs)
    for name, build in builds.items():
        if dtype == torch.float32 and bs < 16 and name == "_prefill_kernel" and arch == 90:
            continue  # a base a token under blocks of 4 in float32 spills on sm_90 (tests only; serving uses 16)
        assert build.spill_stores == 0 and build.spill_loads == 0, build
        assert build.shared < SHARED_LIMIT, build
        if arch == 90:
            assert build.registers <= REGISTER_LIMITS[name], build


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_compiled_kernels_on_cuda_match_reference(monkeypatch, dtype, d):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    attention_function("triton", cuda)
    module = importlib.reload(sys.modules["fastserve_kernels.triton_attention"])  # compiled, whatever was loaded before
    assert not module.INTERPRETED
    bs = 16
    seqs = [(0, 1), (0, 200), (15, 1), (16, 1), (17, 1), (1500, 1), (100, 37), (64, 130), (2047, 1)]
    # 6 query heads over 2 KV heads: a decode program's 16 rows hold 3 query heads (the engine's OPT tests on
    # CUDA, tests/test_decode_graphs.py, run them with as many KV heads as query heads).
    q, k, v, kv, meta, _ = make_batch(seqs, h=6, d=d, bs=bs, dtype=dtype, seed=5, h_kv=2)
    q, k, v, kv = (x.to(cuda) for x in (q, k, v, kv))
    meta = meta.to(cuda)
    # The reference in float32 on float32 copies (its float16 SDPA on CUDA is itself approximate).
    ref_kv = kv.float()
    expected = ref.paged_attention(q.float(), k.float(), v.float(), ref_kv, 1, meta, d**-0.5)
    out = module.paged_attention(q, k, v, kv, 1, meta, d**-0.5)
    assert torch.equal(kv.float(), ref_kv)  # the same values written to the same slots
    cuda_tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.float(), expected, **cuda_tol)
    for tokens_per_split in (64, 256):  # the 2048-token context in 32 and 8 splits
        out2 = torch.full_like(q, float("nan"))
        module.decode_attention(q, kv, 1, meta.decode_token_index, meta.decode_block_tables,
                                meta.decode_context_lens, d**-0.5, out2, tokens_per_split)
        rows = meta.decode_token_index
        torch.testing.assert_close(out2[rows].float(), expected[rows], **cuda_tol)


def test_decode_kv_traffic_script_prints_the_bytes_read_a_group_and_a_query_head():
    """scripts/decode_kv_traffic.py, run as a user runs it: the K/V one layer's decode reads per shape, with one
    program a KV head against one a query head (G times as much; ceil(G / 16) programs a KV head past 16)."""
    run = subprocess.run([sys.executable, "-m", "scripts.decode_kv_traffic", "--batch", "2", "--context", "100"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = {line.split(" | ")[0].strip("| "): line for line in run.stdout.splitlines() if line.startswith("| ")}
    llama = 8 * 2 * 100 * 2 * 128 * 2  # 8 KV heads x 2 rows x 100 tokens x K and V x 128 x float16
    assert lines["llama-3-8b"] == f"| llama-3-8b | 32 | 8 | {llama / 1e6:.1f} | {4 * llama / 1e6:.1f} | 4.00x |"
    assert lines["opt-13b"].endswith("| 1.00x |") and lines["smollm2-135m"].endswith("| 3.00x |")
    assert lines["falcon-7b"].endswith(f"| {71 / 5:.2f}x |")  # 71 query heads over 5 programs of 16 rows
    bad = subprocess.run([sys.executable, "-m", "scripts.decode_kv_traffic", "--context", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("--batch and --context must be at least 1")
