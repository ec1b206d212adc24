"""ParallelLayout and TensorParallelGroup: which shard of the model this
process computes, and how its tensor-parallel peers combine results.

Tensor parallelism splits attention heads and FFN columns across `tp_size`
ranks (column-parallel in, row-parallel out, one all-reduce after each); KV
heads are split too, or, when a model has fewer KV heads than ranks, each is
replicated on the ranks whose query heads read it (kv_heads);
pipeline parallelism gives each of `pp_size` stages a contiguous layer range,
the embeddings to the first stage and the head to the last. With
tp = pp = 1 every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={self.tp_size} pp={self.pp_size}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank out of range: tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> range:
        """The contiguous layer range of this pipeline stage (earlier stages get the remainder)."""
        if num_layers < self.pp_size:
            raise ValueError(f"{num_layers} layers cannot be split over {self.pp_size} pipeline stages")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    def shard(self, size: int, what: str) -> int:
        """The per-rank size of a dimension split over tensor-parallel ranks."""
        if size % self.tp_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {self.tp_size}")
        return size // self.tp_size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count): the KV heads this rank holds. num_kv_heads / tp_size each when tp_size divides them;
        with fewer KV heads than ranks, one each, KV head i on the tp_size / num_kv_heads ranks that hold its
        query heads (vLLM's replication), so a rank's query heads always read KV heads it holds."""
        if num_kv_heads >= self.tp_size:
            count = self.shard(num_kv_heads, "num_key_value_heads")
            return self.tp_rank * count, count
        if self.tp_size % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) neither divides nor is divisible by "
                             f"tensor_parallel_size {self.tp_size}")
        return self.tp_rank * num_kv_heads // self.tp_size, 1


class TensorParallelGroup:
    """All-reduce over the tensor-parallel ranks; identity when there is one."""

    def __init__(self, layout: ParallelLayout, process_group=None) -> None:
        self.layout = layout
        self.process_group = process_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.tp_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.process_group)
        return x
