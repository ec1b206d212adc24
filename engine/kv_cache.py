"""The KV cache tensors of one stage, and how many blocks fit.

Layout (kernels/paged_attention.py): [num_blocks, layers, 2, block_size,
local_heads, head_dim], block-major. memory/ hands out the block ids.
"""

from __future__ import annotations

import torch

from engine.model.config import OPTConfig
from engine.parallel import ParallelLayout

DEFAULT_CPU_KV_BYTES = 1 << 30  # CPU "device" tier when no override is given: 1 GiB


def kv_block_shape(cfg: OPTConfig, layout: ParallelLayout, block_size: int) -> tuple[int, ...]:
    """Shape of one block: [layers, 2, block_size, local_heads, head_dim]."""
    layers = len(layout.stage_layers(cfg.num_hidden_layers))
    heads = layout.shard(cfg.num_attention_heads, "num_attention_heads")
    return (layers, 2, block_size, heads, cfg.head_dim)


def kv_block_bytes(cfg: OPTConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for d in kv_block_shape(cfg, layout, block_size):
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def num_device_blocks(
    cfg: OPTConfig,
    layout: ParallelLayout,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    override: int | None,
    gpu_memory_utilization: float,
) -> int:
    """Blocks of the device tier: the override, else what the memory budget holds.

    On CUDA the budget is gpu_memory_utilization of the device's memory minus
    what is in use after the model was loaded and a forward pass ran (the
    caller runs it first, as vLLM does); on CPU it is DEFAULT_CPU_KV_BYTES.
    """
    if override is not None:
        return override
    per_block = kv_block_bytes(cfg, layout, block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * gpu_memory_utilization) - used
    else:
        budget = DEFAULT_CPU_KV_BYTES
    return max(0, budget // per_block)


def allocate_kv_cache(
    num_blocks: int, cfg: OPTConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype, device
) -> torch.Tensor:
    return torch.zeros((num_blocks, *kv_block_shape(cfg, layout, block_size)), dtype=dtype, device=device)
