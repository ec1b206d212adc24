"""Tensor-parallel linear layers.

ColumnParallelLinear: weight [out / tp, in] — each rank computes a slice of
the output features; no communication.
RowParallelLinear: weight [out, in / tp] — each rank consumes its slice of the
input features; partial sums are all-reduced, then the bias is added once
(on one rank, in the matmul itself).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.parallel import TensorParallelGroup


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        local_out = tp.layout.shard(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(local_out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / tp]
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        local_in = tp.layout.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.tp.layout.tp_size == 1:  # nothing to reduce: the bias goes into the matmul (one addmm)
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y.add_(self.bias) if self.bias is not None else y
