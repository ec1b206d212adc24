"""The KV cache tensors of one stage, and how many blocks fit.

Layout (fastserve_kernels/paged_attention.py): [num_blocks, layers, 2, local_kv_heads,
block_size, head_dim], block-major, head-major inside a block. The heads are the model's KV heads
(num_key_value_heads: fewer than the query heads under grouped-query attention), those this rank holds
(ParallelLayout.kv_heads), so a block's bytes, and the number of blocks a budget holds, follow from them.
memory/ hands out the block ids.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.model.registry import ModelConfig
from engine.parallel import ParallelLayout

log = logging.getLogger("fastserve.kv_cache")

DEFAULT_CPU_KV_BYTES = 1 << 30  # CPU "device" tier when no override is given: 1 GiB


def kv_block_shape(cfg: ModelConfig, layout: ParallelLayout, block_size: int) -> tuple[int, ...]:
    """Shape of one block: [layers, 2, local_kv_heads, block_size, head_dim]."""
    layers = len(layout.stage_layers(cfg.num_hidden_layers))
    _, kv_heads = layout.kv_heads(cfg.num_key_value_heads)
    return (layers, 2, kv_heads, block_size, cfg.head_dim)


def kv_block_bytes(cfg: ModelConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for d in kv_block_shape(cfg, layout, block_size):
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


# What is allocated after the KV cache is sized, and so is reserved from its budget (kv_reserve).
NCCL_DEFAULT_BUFFSIZE = 4 << 20  # NCCL_BUFFSIZE's default: one channel's buffer, one direction
NCCL_P2P_CHANNELS = 8  # channels NCCL may open to one peer for send/recv (an upper estimate; NCCL picks 1-32)
SAMPLER_LOGIT_COPIES = 4  # [S, V] float32 in the sampler: the logits, the penalties/bias output, probs, log_softmax
PROMPT_LOGIT_COPIES = 3  # [R, V] for prompt logprobs: the lm head's output, its float32 copy, log_softmax
GATHER_GROWTH = 1.25  # fastserve_kernels.paged_attention.Workspace grows its buffers by at least this factor
# fastserve_kernels/triton_attention.py DEFAULT_TOKENS_PER_SPLIT (not imported: no triton here)
DECODE_SPLIT_TOKENS = 512


@dataclass(frozen=True)
class KVReserve:
    """Device bytes, on one rank, that are allocated only after the KV cache has taken its budget. The warm-up
    forward (ModelRunner.measure_peak_memory: a prefill of max_num_batched_tokens) allocates none of them."""

    graph_pool: int = 0  # the decode graphs' private pool, their outputs and persistent inputs
    nccl_p2p: int = 0  # NCCL's send/recv buffers to the neighbouring pipeline stages, the hidden states in flight
    logits: int = 0  # the sampler's and prompt logprobs' [rows, vocab] logits (last stage)
    decode_gather: int = 0  # the torch backend's gathered K/V of an eager step's decode rows, and their scores

    @property
    def total(self) -> int:
        return self.graph_pool + self.nccl_p2p + self.logits + self.decode_gather

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / 2**20:.1f} MiB" for name in
                          ("graph_pool", "nccl_p2p", "logits", "decode_gather"))
        return f"{self.total / 2**20:.1f} MiB ({parts})"


# [tokens, intermediate_size / tp] tensors one layer's MLP holds at once, by the config's mlp_kind: OPT's fc1 output
# (ReLU in place), counted twice as an upper estimate; a gated MLP's fused gate|up output (two) and silu(gate) (one),
# which up is multiplied into in place (engine/model/llama.py GatedMLP).
MLP_ACTIVATIONS = {"plain": 2, "gated": 3}


def mlp_activation_width(cfg: ModelConfig, tp_size: int = 1) -> int:
    """Elements per token of one layer's MLP activations on one rank (kv_reserve's mF)."""
    return MLP_ACTIVATIONS[cfg.mlp_kind] * (cfg.intermediate_size // tp_size)


def kv_reserve(cfg: ModelConfig, layout: ParallelLayout, dtype: torch.dtype, *, block_size: int, max_num_seqs: int,
               max_model_len: int, max_num_batched_tokens: int, attention_backend: str,
               graph_buckets: tuple[list[int], list[int]] | None) -> KVReserve:
    """What one rank allocates after KV sizing, from the shapes alone (every term is an upper estimate).

    elt: bytes of dtype; S = max_num_seqs; C = the longest context in whole blocks (ceil(max_model_len / bs) x
    bs); E hidden size, H query heads on this rank (SDPA expands grouped KV heads to them), D head dim, A = H x D,
    F = intermediate_size / tp, m = MLP_ACTIVATIONS of the config's mlp_kind (2 for OPT's fc1/fc2, 3 for a gated
    MLP's gate, up and silu(gate)), V vocabulary.
    - graph_pool (graph_buckets: the captured (batch sizes, widths), None without graphs), B the largest batch,
      Cg its widest context: every graph's output [b, E] (sum over buckets), the persistent inputs (B x (5 + MB)
      int64, and [B, E] on a later stage), one layer's activations B x (4E + 4A + mF) x elt (the pool is reused
      from layer to layer), and the attention's scratch: torch 2 x B x Cg x A x elt (K and V gathered, no
      workspace under capture) + B x H x Cg x 4 (scores); Triton B x H x P x (Dp + 2) x 4, P = ceil(Cg / 512).
    - nccl_p2p (pp > 1): per neighbouring stage 2 directions x NCCL_P2P_CHANNELS x NCCL_BUFFSIZE, and on every
      stage but the last the hidden states being sent, max_num_batched_tokens x E x elt.
    - logits (last stage): V x 4 x (SAMPLER_LOGIT_COPIES x S + PROMPT_LOGIT_COPIES x R), R = min(max_num_batched_
      tokens, max_model_len) (one sequence's prompt rows in a step).
    - decode_gather (torch backend): GATHER_GROWTH x 2 x S x C x A x elt (the workspace's K and V) + S x H x C x 4.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    e, v = cfg.hidden_size, cfg.vocab_size
    h = layout.shard(cfg.num_attention_heads, "num_attention_heads")
    d = cfg.head_dim
    a, mlp = h * d, mlp_activation_width(cfg, layout.tp_size)
    max_blocks = -(-max_model_len // block_size)
    c, s = max_blocks * block_size, max_num_seqs
    graph_pool = 0
    if graph_buckets is not None:
        sizes, widths = graph_buckets
        b, cg = max(sizes), max(widths) * block_size
        outputs = sum(sizes) * len(widths) * e * elt
        inputs = b * (5 + max_blocks) * 8 + (0 if layout.is_first_stage else b * e * elt)
        layer = b * (4 * e + 4 * a + mlp) * elt
        if attention_backend == "triton":
            dp = max(16, 1 << (d - 1).bit_length())
            attention = b * h * (-(-cg // DECODE_SPLIT_TOKENS)) * (dp + 2) * 4
        else:
            attention = 2 * b * cg * a * elt + b * h * cg * 4
        graph_pool = outputs + inputs + layer + attention
    nccl_p2p = 0
    if layout.pp_size > 1:
        peers = int(not layout.is_first_stage) + int(not layout.is_last_stage)
        buffsize = int(os.environ.get("NCCL_BUFFSIZE", NCCL_DEFAULT_BUFFSIZE))
        nccl_p2p = peers * 2 * NCCL_P2P_CHANNELS * buffsize
        if not layout.is_last_stage:
            nccl_p2p += max_num_batched_tokens * e * elt
    logits = 0
    if layout.is_last_stage:
        rows = SAMPLER_LOGIT_COPIES * s + PROMPT_LOGIT_COPIES * min(max_num_batched_tokens, max_model_len)
        logits = v * 4 * rows
    decode_gather = 0
    if attention_backend == "torch":
        decode_gather = int(GATHER_GROWTH * 2 * s * c * a * elt) + s * h * c * 4
    return KVReserve(graph_pool, nccl_p2p, logits, decode_gather)


def blocks_that_fit(per_block_bytes: int, device: torch.device, gpu_memory_utilization: float,
                   peak_bytes: int = 0, reserve: KVReserve | None = None) -> int:
    """Phase two of KV sizing: how many blocks of this rank's size fit in its memory budget.

    On CUDA the budget is gpu_memory_utilization of the device's memory minus what the process needs at its
    peak: the weights and the activations of the warm-up forward of the largest batch (`peak_bytes`, measured
    by ModelRunner.measure_peak_memory), memory outside torch's allocator (CUDA context, NCCL), and `reserve`:
    what is allocated after sizing (kv_reserve). The budget and its parts are logged. On CPU it is
    DEFAULT_CPU_KV_BYTES (no reserve: host memory is not what runs out). The controller takes the minimum over
    ranks, so every rank holds the same block ids.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
        reserved = reserve.total if reserve is not None else 0
        budget = int(total * gpu_memory_utilization) - peak_bytes - outside_torch - reserved
        gib = 2**30
        log.info("KV budget on %s: %.2f GiB = %.2f of %.2f GiB - peak %.2f GiB - outside torch %.2f GiB - "
                 "reserved for after sizing %s -> %d blocks of %d bytes", device, budget / gib,
                 gpu_memory_utilization, total / gib, peak_bytes / gib, outside_torch / gib,
                 reserve.describe() if reserve is not None else "0", max(0, budget // per_block_bytes),
                 per_block_bytes)
        if budget <= 0:
            log.warning("no KV cache fits on %s: lower max_num_seqs / max_model_len, raise "
                        "gpu_memory_utilization or use more devices", device)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    return max(0, budget // per_block_bytes)


def allocate_kv_cache(
    num_blocks: int, cfg: ModelConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype, device
) -> torch.Tensor:
    return torch.zeros((num_blocks, *kv_block_shape(cfg, layout, block_size)), dtype=dtype, device=device)
