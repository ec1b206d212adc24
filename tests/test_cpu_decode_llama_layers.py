"""The compiled Llama-family decode-layers loop (fastserve_kernels/csrc/cpu_decode_llama_layers.cpp) against the
model's Python layer loop (engine/model/llama.py): the same hidden states and the same KV cache, bit for bit, on
checkpoints written to disk and loaded through the real loader: grouped-query attention (2 KV heads under 8 query
heads) with and without q/k/v biases (Llama, Qwen2), a head dim wider than hidden / heads (Mistral's config),
rope scaling (llama3, linear), ragged contexts across block boundaries, with the weights packed for oneDNN
(fastserve_kernels/cpu_packed_linear.py) and without, in float32, float64 and bfloat16; it runs only where it
applies (a decode-only batch); the packed weights give the plain ones' numbers, and the RMSNorm and rotary kernels
both loops run on the CPU give the torch formulas', within float32 rounding (in bfloat16: the rotary's bits, the
RMSNorm's within a bfloat16 step). In bfloat16 the weights are packed in bfloat16, not float32."""

from __future__ import annotations

import logging

import pytest
import torch

import engine.model.llama as llama
from engine.loader import load_model_stage
from engine.model.llama_config import LlamaConfig
from engine.model.registry import load_model_config
from engine.model.rotary import Rotary
from engine.parallel import ParallelLayout, TensorParallelGroup
from fastserve_kernels import cpu_decode_extension, cpu_packed_linear
from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from tests.test_cpu_decode_layers import BS, batch
from tests.test_cpu_decode_layers import run_both as run_both_loops
from tests.test_llama_reference import LLAMA3_SCALING

VARIANTS = {  # 8 query heads over 2 KV heads (llama_config's defaults) unless said
    "llama_gqa_llama3_rope": ("LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "qwen2_gqa_qkv_bias_linear_rope": ("Qwen2ForCausalLM", dict(rope_scaling=dict(rope_type="linear", factor=4.0),
                                                                 tie_word_embeddings=True)),
    "mistral_head_dim_16": ("MistralForCausalLM", dict(head_dim=16)),
    "llama_kv_head_per_query_head": ("LlamaForCausalLM", dict(num_key_value_heads=8)),
}
# Contexts across block boundaries, and past llama3's 32-token pre-training context
SEQS = [(1, 1), (BS - 1, 1), (BS, 1), (3 * BS + 2, 1), (41, 1)]


@pytest.fixture(scope="module")
def layers_op():
    op = cpu_decode_extension.decode_llama_layers_op()
    assert op is not None, f"the CPU decode kernels did not build: {cpu_decode_extension.unavailable_reason()}"
    return op


def load_stage(tmp_path, variant: str, dtype: torch.dtype):
    architecture, overrides = VARIANTS[variant]
    model_dir = write_llama_checkpoint(tmp_path / "model", llama_config(architecture, **overrides), seed=5)
    cfg = load_model_config(model_dir)
    return load_model_stage(model_dir, cfg, TensorParallelGroup(ParallelLayout()), dtype, torch.device("cpu"),
                            "auto", 0), cfg


def run_both(stage, ids, positions, kv, meta, monkeypatch):
    """(hidden, cache) after the stage's forward as it runs, and after the Python loop alone."""
    return run_both_loops(stage, ids, positions, kv, meta, monkeypatch, llama, "cpu_decode_llama_layers_op")


def rope_config(**overrides):
    return LlamaConfig.from_dict(llama_config(**overrides), "LlamaForCausalLM").rope


class Spy:
    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


# Where torch's oneDNN runs bfloat16 (AVX-512), by torch's own check: there bfloat16 weights must be packed in it.
BF16_PACKS = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# In bfloat16 too the two loops agree bit for bit: they run the same kernels (RMSNorm, rotary, the attention kernel,
# which sums in float32 in both) and the same matmuls on the same (packed) weights, in the same order.
@pytest.mark.parametrize("dtype, packed", [(torch.float32, True), (torch.float32, False), (torch.float64, False),
                                           (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["float32-packed", "float32-plain", "float64", "bfloat16-packed", "bfloat16-plain"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_layers_equal_the_python_loop_bit_for_bit(layers_op, variant, dtype, packed, tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_packed_linear.ENV_SWITCH, "1" if packed else "0")
    stage, cfg = load_stage(tmp_path, variant, dtype)
    spy = Spy(layers_op)
    monkeypatch.setattr(llama, "cpu_decode_llama_layers_op", lambda kv_cache: spy)
    ids, positions, kv, meta = batch(cfg, SEQS, dtype)
    out, kv_out, out_python, kv_python = run_both(stage, ids, positions, kv, meta, monkeypatch)
    assert spy.calls == 1  # the compiled loop ran (once, for every layer)
    qkv = stage.layers[0].self_attn.qkv_proj
    packs = torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16 or BF16_PACKS)
    assert (qkv.packed is not None) == (packed and packs)
    if qkv.packed is not None:
        assert qkv.packed.is_mkldnn and qkv.packed.dtype == dtype
    assert out.dtype == dtype and kv_out.dtype == dtype
    assert torch.equal(out, out_python)
    assert torch.equal(kv_out, kv_python)  # the step's K/V written to the same rows, nothing else touched


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_packed_weights_give_the_plain_weights_numbers(layers_op, tmp_path, monkeypatch):
    """The same stage and batch with and without packed weights: the hidden states, the cache and the logits
    agree within float32 rounding (another order of sums), not more."""
    results = []
    for packed in ("1", "0"):
        monkeypatch.setenv(cpu_packed_linear.ENV_SWITCH, packed)
        stage, cfg = load_stage(tmp_path / packed, "qwen2_gqa_qkv_bias_linear_rope", torch.float32)
        ids, positions, kv, meta = batch(cfg, SEQS, torch.float32)
        with torch.inference_mode():
            hidden = stage(ids, positions, kv, meta)
            results.append((hidden, kv, stage.compute_logits(hidden, torch.arange(len(SEQS)))))
    for packed, plain in zip(*results):
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-4)
    assert not torch.equal(results[0][2], results[1][2])  # oneDNN did run: its sums are not MKL's


@pytest.mark.skipif(not BF16_PACKS, reason="torch's oneDNN does not run bfloat16 on this CPU")
def test_bfloat16_weights_are_packed_in_bfloat16_and_the_loop_runs_in_it(layers_op, tmp_path, monkeypatch):
    """A bfloat16 stage's matmuls all run on bfloat16 packed weights (a silent fallback to float32 copies, or to
    the plain weights, fails here), the compiled loop gets them with bfloat16 activations and cache, and gives
    bfloat16 hidden states."""
    monkeypatch.setenv(cpu_packed_linear.ENV_SWITCH, "1")
    assert torch.bfloat16 in cpu_packed_linear.dtypes()
    stage, cfg = load_stage(tmp_path, "llama_gqa_llama3_rope", torch.bfloat16)
    calls = []
    monkeypatch.setattr(llama, "cpu_decode_llama_layers_op", lambda kv_cache: lambda *a: calls.append(a) or
                        layers_op(*a))
    ids, positions, kv, meta = batch(cfg, SEQS, torch.bfloat16)
    with torch.inference_mode():
        hidden = stage(ids, positions, kv, meta)
        logits = stage.compute_logits(hidden, torch.arange(len(SEQS)))
    (args,) = calls
    hidden_in, weights, kv_in = args[0], args[1], args[7]
    matmul_weights = [w for i, w in enumerate(weights) if i % 10 in (1, 3, 6, 8)]  # qkv, o, gate_up, down (Slot)
    assert len(matmul_weights) == 4 * cfg.num_hidden_layers
    assert all(w.is_mkldnn and w.dtype == torch.bfloat16 for w in matmul_weights)
    assert stage._packed_head.is_mkldnn and stage._packed_head.dtype == torch.bfloat16
    assert hidden_in.dtype == kv_in.dtype == hidden.dtype == torch.bfloat16
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_rms_norm_and_rotary_kernels_compute_the_torch_formulas(layers_op, dtype):
    """The element-wise kernels the CPU runs in both loops (cpu_decode_extension.llama_kernel) against Hugging
    Face's formulas in torch ops, on strided inputs (slices of a fused matmul's output, as the layers give them):
    equal within float32 rounding. In bfloat16 the rotary rounds each product and sum to bfloat16 as torch's ops
    do (the same bits), and RMSNorm's scale, computed in float32 from a sum in double rather than torch's float32
    mean, may move a value across a rounding boundary: within one bfloat16 step (2^-7 relative at most)."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(6, 3 * 128, generator=g, dtype=dtype) * 3
    x, weight = fused[:, :128], 1 + 0.1 * torch.randn(128, generator=g, dtype=dtype)
    x32 = x.float()
    want = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = cpu_decode_extension.llama_kernel("rms_norm", x)(x, weight, 1e-5)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
        assert (got == want).float().mean() > 0.95
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    heads = fused[:, 128:].view(6, 8, 32)  # 8 heads of 32 dims
    rotary = Rotary(rope_config(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING), 32)
    rotation = rotary(torch.tensor([0, 1, 7, 31, 40, 300]), dtype)
    rotated = torch.cat((-heads[..., 16:], heads[..., :16]), dim=-1)
    want = heads * rotation.cos + rotated * rotation.sin
    got = cpu_decode_extension.llama_kernel("rotary", heads)(heads, rotation.cos, rotation.sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.is_contiguous() and rotation.apply(heads).equal(got)  # Rotation.apply runs the kernel


def test_weights_whose_copies_the_host_cannot_hold_stay_plain(tmp_path, monkeypatch, caplog):
    """fits() reads the host's available memory: nothing fits in none, everything in more than exists; a stage
    whose copies do not fit is not packed, and runs on the plain weights."""
    assert cpu_packed_linear.fits(0)
    with caplog.at_level(logging.WARNING):
        assert not cpu_packed_linear.fits(1 << 60)
    assert "weights not packed for oneDNN" in caplog.text
    monkeypatch.setattr(cpu_packed_linear, "fits", lambda nbytes: False)
    stage, cfg = load_stage(tmp_path, "qwen2_gqa_qkv_bias_linear_rope", torch.float32)
    ids, positions, kv, meta = batch(cfg, SEQS, torch.float32)
    with torch.inference_mode():
        assert stage(ids, positions, kv, meta).shape == (len(SEQS), cfg.hidden_size)
    assert stage.layers[0].self_attn.qkv_proj.packed is None and stage._packed_head is None


def test_a_batch_with_a_prefill_runs_the_python_loop(layers_op, tmp_path, monkeypatch):
    stage, cfg = load_stage(tmp_path, "llama_gqa_llama3_rope", torch.float32)
    spy = Spy(layers_op)
    monkeypatch.setattr(llama, "cpu_decode_llama_layers_op", lambda kv_cache: spy)
    ids, positions, kv, meta = batch(cfg, [(5, 1), (0, 6), (9, 1)], torch.float32)
    with torch.inference_mode():
        stage(ids, positions, kv, meta)
    assert spy.calls == 0


def test_switched_off_the_python_loop_serves(tmp_path, monkeypatch):
    """FASTSERVE_CPU_KERNEL=0 turns off the layers loop with the attention kernel it is built with."""
    monkeypatch.setenv(cpu_decode_extension.ENV_SWITCH, "0")
    assert cpu_decode_extension.decode_llama_layers_op() is None
    stage, cfg = load_stage(tmp_path, "llama_gqa_llama3_rope", torch.float32)
    ids, positions, kv, meta = batch(cfg, [(5, 1), (9, 1)], torch.float32)
    with torch.inference_mode():
        assert stage(ids, positions, kv, meta).shape == (2, cfg.hidden_size)
