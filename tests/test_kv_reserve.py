"""The KV budget keeps out what is allocated after sizing: the decode graphs' pool, NCCL's
point-to-point buffers, the sampler's and prompt logprobs' logits and the torch backend's decode gather
(engine/kv_cache.kv_reserve). The warm-up forward that measures the peak allocates none of them, so without the
reserve --gpu-memory-utilization 0.95 could run out of memory once serving. Here: each term against its formula
written out for OPT-13b and a Llama-3-8B shape (whose gated MLP holds 3F a token, measured on the real module),
which terms apply where, and the real blocks_that_fit on a faked CUDA device (a fake
device allocator: free memory is what the storages made on this thread leave) subtracting exactly the reserve,
and logging it, as LLM(...) starts."""

from __future__ import annotations

import logging

import pytest
import torch

import engine.executor.local as local_executor
import engine.kv_cache as kv_cache
from engine import LLM
from engine.decode_inputs import graph_buckets
from engine.kv_cache import KVReserve, kv_reserve, mlp_activation_width
from engine.model.config import OPTConfig
from engine.model.llama import GatedMLP
from engine.model.llama_config import LlamaConfig
from engine.parallel import ParallelLayout, TensorParallelGroup
from modelmaker.llama_checkpoint import llama_config
from tests.test_engine_close import FakeDeviceMemory

OPT_13B = OPTConfig(vocab_size=50272, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480,
                    max_position_embeddings=2048, word_embed_proj_dim=5120)
MiB = 2**20


def reserve_13b(backend: str, graphs: bool, layout: ParallelLayout | None = None) -> KVReserve:
    return kv_reserve(OPT_13B, layout or ParallelLayout(), torch.float16, block_size=16, max_num_seqs=256,
                      max_model_len=2048, max_num_batched_tokens=8192, attention_backend=backend,
                      graph_buckets=graph_buckets(256, 2048, 16, backend) if graphs else None)


def test_reserve_for_opt_13b_is_the_formula():
    r = reserve_13b("torch", graphs=True)
    # logits: 50,272 x 4 bytes x (4 x 256 sampler rows + 3 x 2,048 prompt rows)
    assert r.logits == 50272 * 4 * (4 * 256 + 3 * 2048)  # 1,374.6 MiB
    # the torch gather: 1.25 x K and V [256, 40 heads, 2,048, 128] fp16, + scores [256, 40, 2,048] fp32
    assert r.decode_gather == int(1.25 * 2 * 256 * 2048 * 5120 * 2) + 256 * 40 * 2048 * 4
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # x 8 widths
    outputs = sum(sizes) * 8 * 5120 * 2
    inputs = 256 * (5 + 128) * 8
    layer = 256 * (4 * 5120 + 4 * 5120 + 2 * 20480) * 2
    attention = 2 * 256 * 2048 * 5120 * 2 + 256 * 40 * 2048 * 4
    assert r.graph_pool == outputs + inputs + layer + attention
    assert r.nccl_p2p == 0  # one stage
    assert r.total == r.graph_pool + r.logits + r.decode_gather
    assert round(r.total / MiB) == 24655  # 24.1 GiB: the torch backend's gathers dominate (docs/benchmarks.md)

    t = reserve_13b("triton", graphs=True)
    assert t.decode_gather == 0 and t.logits == r.logits
    # Triton: 35 batch sizes at the widest table; partial sums [256 x 40 x 4 splits, 128 + 2] fp32
    assert t.graph_pool == (sum(graph_buckets(256, 2048, 16, "triton")[0]) * 5120 * 2 + inputs + layer
                            + 256 * 40 * 4 * 130 * 4)
    assert round(t.total / MiB) == 1477  # 1.4 GiB, most of it the logits
    assert reserve_13b("triton", graphs=False).graph_pool == 0


def test_pipeline_stages_reserve_nccl_buffers_and_only_the_last_the_logits(monkeypatch):
    monkeypatch.delenv("NCCL_BUFFSIZE", raising=False)
    first, middle, last = (reserve_13b("triton", False, ParallelLayout(pp_size=3, pp_rank=r)) for r in range(3))
    send = 8192 * 5120 * 2  # the hidden states on their way to the next stage
    assert first.nccl_p2p == 1 * 2 * 8 * (4 * MiB) + send and first.logits == 0
    assert middle.nccl_p2p == 2 * 2 * 8 * (4 * MiB) + send and middle.logits == 0
    assert last.nccl_p2p == 1 * 2 * 8 * (4 * MiB) and last.logits > 0
    monkeypatch.setenv("NCCL_BUFFSIZE", str(1 << 20))
    assert reserve_13b("triton", False, ParallelLayout(pp_size=2, pp_rank=1)).nccl_p2p == 2 * 8 * MiB
    # tensor parallel: this rank's heads and FFN columns
    tp = reserve_13b("torch", False, ParallelLayout(tp_size=2))
    assert tp.decode_gather == int(1.25 * 2 * 256 * 2048 * 2560 * 2) + 256 * 20 * 2048 * 4


# Meta-Llama-3-8B's shape: grouped-query attention (32 query heads over 8 KV heads), a gated MLP 3.5x the width
LLAMA_3_8B = LlamaConfig.from_dict(llama_config(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                                max_position_embeddings=8192), "LlamaForCausalLM")


class PeakMemory(FakeDeviceMemory):
    """FakeDeviceMemory that keeps the most bytes live after any op, leaving out the storages of `before` (tensors
    made earlier, which an op's views, such as a weight's transpose, would otherwise show as new)."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in before}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for key in self.before:
            self._storages.pop(key, None)
        self.peak = max(self.peak, self.live)
        return out


def test_the_layer_term_follows_the_mlp_kind():
    """OPT's MLP holds 2F a token, the Llama family's gated one 3F (gate and up, then silu(gate)), read from the
    model config; the graph pool's layer term of a Llama-3-8B-shaped model is 4E + 4A + 3F."""
    assert (OPT_13B.mlp_kind, LLAMA_3_8B.mlp_kind) == ("plain", "gated")
    assert mlp_activation_width(OPT_13B) == 2 * 20480 and mlp_activation_width(OPT_13B, 2) == 20480
    assert mlp_activation_width(LLAMA_3_8B) == 3 * 14336
    buckets = graph_buckets(256, 8192, 16, "triton")
    r = kv_reserve(LLAMA_3_8B, ParallelLayout(), torch.float16, block_size=16, max_num_seqs=256, max_model_len=8192,
                   max_num_batched_tokens=8192, attention_backend="triton", graph_buckets=buckets)
    layer = 256 * (4 * 4096 + 4 * 4096 + 3 * 14336) * 2
    outputs, inputs = sum(buckets[0]) * len(buckets[1]) * 4096 * 2, 256 * (5 + 512) * 8
    attention = 256 * 32 * (-(-8192 // 512)) * 130 * 4  # partial sums [B, H, splits, 128 + 2] fp32
    assert r.graph_pool == outputs + inputs + layer + attention


@pytest.mark.parametrize("tokens", [1, 64])
def test_a_gated_mlp_holds_what_the_estimate_says_and_more_than_the_old_2f(tokens):
    """The real GatedMLP forward, its tensors counted as they are made: at its peak it holds 3F + E elements a
    token (gate|up, silu(gate) multiplied by up in place, and down's output [T, E], one of the layer term's E
    terms): the estimate's 3F is its F-wide part exactly; the old 2F, OPT's, fell short by F a token."""
    cfg = LlamaConfig.from_dict(llama_config(hidden_size=64, intermediate_size=224), "LlamaForCausalLM")  # F 3.5E
    mlp = GatedMLP(cfg, TensorParallelGroup(ParallelLayout()))
    for param in mlp.parameters():
        torch.nn.init.normal_(param)
    x = torch.randn(tokens, cfg.hidden_size)
    with PeakMemory([x, *mlp.parameters()]) as memory, torch.no_grad():
        out = mlp(x)
    assert out.shape == x.shape
    per_token = memory.peak // (tokens * x.element_size())
    e, f = cfg.hidden_size, cfg.intermediate_size
    assert per_token == 3 * f + e
    assert per_token - e == mlp_activation_width(cfg) > 2 * f


DEVICE_BYTES = 512 << 20  # the fake device


@pytest.mark.parametrize("reserve_on", [True, False])
def test_llm_start_up_subtracts_the_reserve_on_a_faked_cuda_device(tiny_model_dir, monkeypatch, caplog, reserve_on):
    """LLM(...) sizes its KV cache with the real blocks_that_fit on a faked CUDA device: 0.9 of 512 MiB less the
    peak (the weights here; the warm-up forward runs only on real CUDA) less the reserve, in blocks; the log line
    names the reserve and its parts. Without the reserve (reserve_on False: the executor's reserve replaced by
    none) the same start-up gets exactly reserve / block bytes more blocks."""
    fake = FakeDeviceMemory()
    real_blocks_that_fit = kv_cache.blocks_that_fit
    seen = {}

    def on_faked_cuda(per_block_bytes, device, utilization, peak_bytes=0, reserve=None):
        seen.update(block=per_block_bytes, reserve=reserve, live=fake.live)
        return real_blocks_that_fit(per_block_bytes, torch.device("cuda"), utilization, fake.live,
                                    reserve if reserve_on else None)

    monkeypatch.setattr(local_executor, "blocks_that_fit", on_faked_cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (DEVICE_BYTES - fake.live, DEVICE_BYTES))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: fake.live)  # nothing outside torch
    caplog.set_level(logging.INFO, logger="fastserve.kv_cache")
    with fake:
        llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, profile="analytic", max_num_seqs=32,
                  max_model_len=256, max_num_batched_tokens=512)
    try:
        executor = llm.engine.executor
        reserve = executor.kv_reserve
        assert seen["reserve"] is reserve
        # tiny model: vocab 4,096, hidden 256, 4 heads x 64, torch backend on CPU, no graphs off CUDA
        assert reserve.logits == 4096 * 4 * (4 * 32 + 3 * 256)
        assert reserve.decode_gather == int(1.25 * 2 * 32 * 256 * 256 * 4) + 32 * 4 * 256 * 4
        assert reserve.graph_pool == 0 and reserve.nccl_p2p == 0
        subtracted = reserve.total if reserve_on else 0
        expected = (int(DEVICE_BYTES * 0.9) - seen["live"] - subtracted) // seen["block"]
        assert executor.num_device_blocks == expected > 0
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV budget"))
        assert f"-> {expected} blocks" in line
        if reserve_on:
            assert reserve.describe() in line and "logits 14.0 MiB" in line and "decode_gather" in line
    finally:
        llm.close()
