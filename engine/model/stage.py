"""DecoderStage: what every architecture's pipeline stage shares, and the
contract between a stage and the loader (WeightTarget).

A stage is one pipeline stage of a decoder-only model on one tensor-parallel
rank: the layers `layout.stage_layers(n)`, the embeddings on the first stage,
the head on the last. The runner calls forward(inputs, positions, kv_cache,
meta) and compute_logits(hidden, rows); the loader asks checkpoint_target(name)
where each checkpoint tensor goes and fused_parts(param) which rows of a fused
parameter each of its checkpoint tensors fills. What it is not: an
architecture (engine/model/opt.py, engine/model/llama.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from engine.device_memory import free_storage
from engine.parallel import TensorParallelGroup
from fastserve_kernels.attention_backend import AttentionFn
from fastserve_kernels.paged_attention import paged_attention

UNEXPECTED = "unexpected"  # checkpoint_target's answer for a name no stage of the model knows
NOT_A_LAYER = "not a layer"  # local_layer's answer for a name outside layers.N.*
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes on this rank."""

    param: str  # the stage's parameter
    split_dim: int | None = None  # the tensor's dim this rank reads one piece of; None: all of it
    piece: tuple[int, int] = (0, 1)  # (index, count): this rank's piece of `count` equal pieces along split_dim
    part: str | None = None  # the part of a fused parameter the tensor fills (its rows: fused_parts)


class DecoderStage(nn.Module):
    def __init__(self, cfg, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.layout = layout = tp.layout
        self.cfg = cfg
        self.layer_range = layout.stage_layers(cfg.num_hidden_layers)
        self.is_first = layout.is_first_stage
        self.is_last = layout.is_last_stage
        self.attention: AttentionFn = paged_attention  # every layer's (use_attention)
        # Fused parameters by module name (e.g. "qkv_proj"): part -> (first row, rows) in the local parameter
        self.fused: dict[str, dict[str, tuple[int, int]]] = {}

    @property
    def num_layers(self) -> int:
        return len(self.layer_range)

    def release_weights(self) -> int:
        """Free every parameter's memory now, whoever still holds the module (engine/device_memory.py); returns
        the bytes freed. The stage cannot run afterwards."""
        return sum(free_storage(t) for t in (*self.parameters(), *self.buffers()))

    def use_attention(self, attention: AttentionFn) -> None:
        """Run every layer's attention with `attention` (fastserve_kernels/attention_backend.py)."""
        self.attention = attention
        for layer in self.layers:
            layer.self_attn.attention = attention

    def fused_parts(self, param: str) -> dict[str, tuple[int, int]]:
        """The parts of a fused parameter (e.g. layers.0.self_attn.qkv_proj.weight: q, k, v) and their rows;
        {} for a parameter filled by one checkpoint tensor."""
        return self.fused.get(param.rsplit(".", 2)[-2], {})

    def local_layer(self, name: str) -> tuple[str, str] | str | None:
        """For a per-layer checkpoint name (prefix stripped, "layers.N.rest"): (this stage's "layers.n." prefix,
        rest); None for another stage's layer; UNEXPECTED for a layer the model does not have; NOT_A_LAYER for a
        name that is not a layer's tensor."""
        m = _LAYER.fullmatch(name)
        if m is None:
            return NOT_A_LAYER
        layer, rest = int(m.group(1)), m.group(2)
        if layer not in self.layer_range:
            return None if 0 <= layer < self.cfg.num_hidden_layers else UNEXPECTED
        return f"layers.{layer - self.layer_range.start}.", rest

    def checkpoint_target(self, name: str) -> WeightTarget | str | None:
        """Where checkpoint tensor `name` goes on this stage: a WeightTarget, None (another stage's, or a tied
        copy), or UNEXPECTED."""
        raise NotImplementedError

    def compute_logits(self, h: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Logits of the selected rows: [T, E] x [S] -> [S, V] (float32). Last stage only."""
        raise NotImplementedError
