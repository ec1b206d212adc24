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
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (a test requirement: its absence is a failure, not a skip)

from engine import LLM
from engine.config import EngineConfig
from kernels import paged_attention as ref
from kernels.attention_backend import AttentionBackendError, attention_function, resolve_attention_backend
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


def compile_for(target_arch: int, dtype: torch.dtype, d: int, bs: int = 16) -> dict[str, int]:
    """Compile every kernel as the host code would launch it (head dim d, block size bs) for an NVIDIA GPU of
    compute capability target_arch, with no GPU: triton's front end, PTX and ptxas. Returns each kernel's
    shared memory in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = sys.modules.get("kernels.triton_attention") or importlib.import_module("kernels.triton_attention")
    if module.INTERPRETED:
        module = importlib.reload(module)
    assert not module.INTERPRETED, "unset TRITON_INTERPRET to compile the kernels"
    ty = {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    dp = module._padded_head_dim(d)
    block_m, block_n = module.prefill_tile(dtype, dp)
    data, long, acc = f"*{ty}", "*i64", "*fp32"
    kernels = [
        (module._write_kv_kernel, dict(k_ptr=data, v_ptr=data, cache_ptr=data, slot_blocks_ptr=long,
                                       slot_offsets_ptr=long), dict(BLOCK_H=16, BLOCK_D=triton.next_power_of_2(d))),
        (module._decode_split_kernel, dict(q_ptr=data, cache_ptr=data, tables_ptr=long, lens_ptr=long, rows_ptr=long,
                                           part_acc_ptr=acc, part_max_ptr=acc, part_sum_ptr=acc, scale="fp32"),
         dict(BS=bs, BLOCK_N=module.decode_tile(), BLOCK_D=dp, TOKENS_PER_SPLIT=module.DEFAULT_TOKENS_PER_SPLIT)),
        (module._decode_reduce_kernel, dict(part_acc_ptr=acc, part_max_ptr=acc, part_sum_ptr=acc, out_ptr=data,
                                            rows_ptr=long), dict(BLOCK_P=4, BLOCK_D=dp)),
        (module._prefill_kernel, dict(q_ptr=data, k_ptr=data, v_ptr=data, out_ptr=data, cache_ptr=data, tables_ptr=long,
                                      q_starts_ptr=long, q_lens_ptr=long, prefix_lens_ptr=long, scale="fp32"),
         dict(BS=bs, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dp)),
    ]
    shared = {}
    for kernel, types, constexprs in kernels:
        names = inspect.signature(kernel.fn).parameters
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", target_arch, 32))
        assert compiled.asm["cubin"], kernel.fn.__name__
        shared[kernel.fn.__name__] = compiled.metadata.shared
    return shared


def test_kernels_compile_for_an_h100_class_gpu_without_one():
    """The compiled path cannot run here; this checks that it builds: float16, head dim 128, sm_90."""
    shared = compile_for(90, torch.float16, 128)
    assert set(shared) == {"_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel"}
    assert max(shared.values()) < 100 * 1024  # fits an A100's and an H100's shared memory per block


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(("dtype", "d"), [(torch.float16, 64), (torch.float16, 80), (torch.float32, 64),
                                          (torch.float32, 128), (torch.bfloat16, 128)])
def test_kernels_compile_for_each_dtype_head_dim_and_arch(arch, dtype, d):
    shared = compile_for(arch, dtype, d)
    assert max(shared.values()) < 160 * 1024


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_compiled_kernels_on_cuda_match_reference(monkeypatch, dtype, d):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    attention_function("triton", cuda)
    module = importlib.reload(sys.modules["kernels.triton_attention"])  # compiled, whatever was loaded before
    assert not module.INTERPRETED
    bs = 16
    seqs = [(0, 1), (0, 200), (15, 1), (16, 1), (17, 1), (1500, 1), (100, 37), (64, 130), (2047, 1)]
    q, k, v, kv, meta, _ = make_batch(seqs, h=4, d=d, bs=bs, dtype=dtype, seed=5)
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
