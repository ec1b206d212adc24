"""The KV cache tensors of one stage, and how many blocks fit.

Layout (kernels/paged_attention.py): [num_blocks, layers, 2, local_heads,
block_size, head_dim], block-major, head-major inside a block. memory/ hands out the block ids.
"""

from __future__ import annotations

import torch

from engine.model.config import OPTConfig
from engine.parallel import ParallelLayout

DEFAULT_CPU_KV_BYTES = 1 << 30  # CPU "device" tier when no override is given: 1 GiB


def kv_block_shape(cfg: OPTConfig, layout: ParallelLayout, block_size: int) -> tuple[int, ...]:
    """Shape of one block: [layers, 2, local_heads, block_size, head_dim]."""
    layers = len(layout.stage_layers(cfg.num_hidden_layers))
    heads = layout.shard(cfg.num_attention_heads, "num_attention_heads")
    return (layers, 2, heads, block_size, cfg.head_dim)


def kv_block_bytes(cfg: OPTConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for d in kv_block_shape(cfg, layout, block_size):
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def blocks_that_fit(per_block_bytes: int, device: torch.device, gpu_memory_utilization: float,
                   peak_bytes: int = 0) -> int:
    """Phase two of KV sizing: how many blocks of this rank's size fit in its memory budget.

    On CUDA the budget is gpu_memory_utilization of the device's memory minus what the process needs at its
    peak: the weights and the activations of the warm-up forward of the largest batch (`peak_bytes`, measured
    by ModelRunner.measure_peak_memory), plus memory outside torch's allocator (CUDA context, NCCL). On CPU it
    is DEFAULT_CPU_KV_BYTES. The controller takes the minimum over ranks, so every rank holds the same block ids.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(device)
        budget = int(total * gpu_memory_utilization) - peak_bytes - max(0, outside_torch)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    return max(0, budget // per_block_bytes)


def allocate_kv_cache(
    num_blocks: int, cfg: OPTConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype, device
) -> torch.Tensor:
    return torch.zeros((num_blocks, *kv_block_shape(cfg, layout, block_size)), dtype=dtype, device=device)
