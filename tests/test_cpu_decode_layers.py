"""The compiled decode-layers loop (fastserve_kernels/csrc/cpu_decode_layers.cpp) against the model's Python layer loop
(engine/model/opt.py): the same hidden states and the same KV cache, bit for bit, on checkpoints written to
disk and loaded through the real loader, for every OPT layer variant (pre- and post-layer-norm, no biases,
layer norms without affine weights) and ragged contexts across block boundaries; and it runs only where it
applies (a decode-only batch), the Python loop elsewhere."""

from __future__ import annotations

import pytest
import torch

import engine.model.opt as opt
from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.parallel import ParallelLayout, TensorParallelGroup
from fastserve_kernels import cpu_decode_extension
from fastserve_kernels.paged_attention import AttentionMetadata
from modelmaker.opt_checkpoint import opt_config, write_opt_checkpoint

BS = 4
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=128)
VARIANTS = {
    "pre_ln": {},
    "post_ln_with_projections": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
    "no_biases": dict(enable_bias=False),
    "layer_norms_without_affine": dict(layer_norm_elementwise_affine=False),
}


@pytest.fixture(scope="module")
def layers_op():
    op = cpu_decode_extension.decode_layers_op()
    assert op is not None, f"the CPU decode kernels did not build: {cpu_decode_extension.unavailable_reason()}"
    return op


def load_stage(tmp_path, overrides: dict, dtype: torch.dtype):
    cfg_dict = opt_config(**SMALL, **overrides)
    model_dir = write_opt_checkpoint(tmp_path / "model", cfg_dict, seed=5)
    cfg = OPTConfig.from_dict(cfg_dict)
    return load_model_stage(model_dir, cfg, TensorParallelGroup(ParallelLayout()), dtype, torch.device("cpu"),
                            "auto", 0), cfg


def batch(cfg, seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """A cache of random K/V over shuffled blocks, and the flat inputs of a batch of (cached, new) pairs."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-(cached + new) // BS) for cached, new in seqs]
    perm = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in blocks]
    layout = ParallelLayout()
    kv = allocate_kv_cache(sum(blocks) + 3, cfg, layout, BS, dtype, torch.device("cpu"))
    kv.copy_(torch.randn(kv.shape, generator=g, dtype=dtype))
    meta = AttentionMetadata.for_sequences(seqs, tables, BS)
    tokens = sum(new for _, new in seqs)
    ids = torch.randint(4, cfg.vocab_size, (tokens,), generator=g)
    positions = torch.cat([torch.arange(cached, cached + new) for cached, new in seqs])
    return ids, positions, kv, meta


def run_both(stage, ids, positions, kv, meta, monkeypatch, model=opt, op_getter: str = "cpu_decode_layers_op"):
    """(hidden, cache) after the stage's forward as it runs, and after the Python loop alone (the model module's
    getter of the compiled loop answering None)."""
    kv_python = kv.clone()
    with torch.inference_mode():
        out = stage(ids, positions, kv, meta)
        with monkeypatch.context() as m:
            m.setattr(model, op_getter, lambda kv_cache: None)
            out_python = stage(ids, positions, kv_python, meta)
    return out, kv, out_python, kv_python


class Spy:
    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_layers_equal_the_python_loop_bit_for_bit(layers_op, variant, dtype, tmp_path, monkeypatch):
    stage, cfg = load_stage(tmp_path, VARIANTS[variant], dtype)
    spy = Spy(layers_op)
    monkeypatch.setattr(opt, "cpu_decode_layers_op", lambda kv_cache: spy)
    seqs = [(1, 1), (BS - 1, 1), (BS, 1), (3 * BS + 2, 1), (7, 1)]  # contexts across block boundaries
    ids, positions, kv, meta = batch(cfg, seqs, dtype)
    out, kv_out, out_python, kv_python = run_both(stage, ids, positions, kv, meta, monkeypatch)
    assert spy.calls == 1  # the compiled loop ran (once, for every layer)
    assert torch.equal(out, out_python)
    assert torch.equal(kv_out, kv_python)  # the step's K/V written to the same rows, nothing else touched


def test_a_batch_with_a_prefill_runs_the_python_loop(layers_op, tmp_path, monkeypatch):
    stage, cfg = load_stage(tmp_path, {}, torch.float32)
    spy = Spy(layers_op)
    monkeypatch.setattr(opt, "cpu_decode_layers_op", lambda kv_cache: spy)
    ids, positions, kv, meta = batch(cfg, [(5, 1), (0, 6), (9, 1)], torch.float32)
    with torch.inference_mode():
        stage(ids, positions, kv, meta)
    assert spy.calls == 0


def test_switched_off_the_python_loop_serves(tmp_path, monkeypatch):
    """FASTSERVE_CPU_KERNEL=0 turns off the layers loop with the attention kernel it is built with."""
    monkeypatch.setenv(cpu_decode_extension.ENV_SWITCH, "0")
    assert cpu_decode_extension.decode_layers_op() is None
    stage, cfg = load_stage(tmp_path, {}, torch.float32)
    ids, positions, kv, meta = batch(cfg, [(5, 1), (9, 1)], torch.float32)
    with torch.inference_mode():
        assert stage(ids, positions, kv, meta).shape == (2, SMALL["hidden_size"])
