"""Tensor-parallel linear layers, and RMSNorm.

ColumnParallelLinear: weight [out / tp, in] — each rank computes a slice of
the output features; no communication. A fused projection whose parts are
split differently (q, k, v under grouped-query attention, where KV heads may
be replicated) gives its local width itself.
RowParallelLinear: weight [out, in / tp] — each rank consumes its slice of the
input features; partial sums are all-reduced, then the bias is added once
(on one rank, in the matmul itself).
Either multiplies by `packed` instead of `weight` where a model set it (a copy of the weight packed for oneDNN
on the CPU, fastserve_kernels/cpu_packed_linear.py; engine/model/llama.py sets it with one rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.parallel import TensorParallelGroup
from fastserve_kernels import cpu_decode_extension, cpu_packed_linear


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup,
                 local_out: int | None = None) -> None:
        super().__init__()
        if local_out is None:
            local_out = tp.layout.shard(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(local_out), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / tp]
        if self.packed is not None:
            return cpu_packed_linear.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        local_in = tp.layout.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # set with one rank only

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.packed is not None:
            return cpu_packed_linear.linear(x, self.packed, self.bias)
        if self.tp.layout.tp_size == 1:  # nothing to reduce: the bias goes into the matmul (one addmm)
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y.add_(self.bias) if self.bias is not None else y


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: x / sqrt(mean(x^2) + eps) in float32, cast back, times the weight. On the CPU
    one compiled kernel computes it, the one the compiled Llama decode loop runs (cpu_decode_extension.llama_kernel;
    within float32 rounding of these torch ops, not their bits)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        if (kernel := cpu_decode_extension.llama_kernel("rms_norm", x)) is not None:
            return kernel(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
