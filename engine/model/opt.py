"""OPTStage: one pipeline stage of OPT, on one tensor-parallel rank, computing
flattened batches over a paged KV cache.

Computes what Hugging Face's OPTForCausalLM computes (checked in
tests/test_model_reference.py): learned positions with OPT's offset of 2,
pre-LN blocks (do_layer_norm_before=True) or post-LN blocks (opt-350m),
project_in / project_out when word_embed_proj_dim != hidden_size, ReLU FFN,
the final layer norm when the config has one, lm_head tied to the embeddings.

A stage owns layers `layout.stage_layers(n)`; the first stage embeds tokens,
the last computes logits. On the CPU a decode-only batch runs the layers in one
compiled call with the same ops (fastserve_kernels/csrc/cpu_decode_layers.cpp), the
Python loop everywhere else. Parameter names follow Hugging Face's, without the
`model.decoder.` prefix, with q/k/v fused into `qkv_proj` (checkpoint_target
maps checkpoint names onto them; both `model.decoder.*` and `decoder.*` load).
Embeddings and lm_head are replicated across tensor-parallel ranks; attention
heads and FFN columns are split.

Legend: T tokens in the flattened batch, S sequences, E hidden size,
P word_embed_proj_dim, V vocab size, H local heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.model.config import POSITION_OFFSET, OPTConfig
from engine.model.layers import ColumnParallelLinear, RowParallelLinear
from engine.model.stage import NOT_A_LAYER, UNEXPECTED, DecoderStage, WeightTarget
from engine.parallel import TensorParallelGroup
from fastserve_kernels.paged_attention import AttentionMetadata, cpu_decode_layers_op, paged_attention

_PREFIXES = ("model.decoder.", "decoder.")
# Tensor-parallel split of each per-layer tensor: the dim split across ranks, or None (replicated).
_SPLIT_DIM = {
    "self_attn.out_proj.weight": 1,
    "fc1.weight": 0,
    "fc1.bias": 0,
    "fc2.weight": 1,
}
_FIRST_STAGE = {"embed_positions.weight", "project_in.weight"}
_LAST_STAGE = {"final_layer_norm.weight", "final_layer_norm.bias", "project_out.weight"}


class OPTAttention(nn.Module):
    def __init__(self, cfg: OPTConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.num_heads = tp.layout.shard(cfg.num_attention_heads, "num_attention_heads")
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        e = cfg.hidden_size
        # One matmul for q, k, v: rows [q | k | v], each this rank's heads.
        self.qkv_proj = ColumnParallelLinear(e, 3 * e, cfg.enable_bias, tp)
        self.out_proj = RowParallelLinear(e, e, cfg.enable_bias, tp)
        self.attention = paged_attention  # or the Triton kernels' (OPTStage.use_attention)

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, E] -> [T, E]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        out = self.attention(q, k, v, kv_cache, layer, meta, self.scale)  # [T, H, D]
        return self.out_proj(out.reshape(t, self.num_heads * self.head_dim))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: OPTConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.pre_ln = cfg.do_layer_norm_before
        affine = cfg.layer_norm_elementwise_affine
        self.self_attn = OPTAttention(cfg, tp)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_dim, cfg.enable_bias, tp)
        self.fc2 = RowParallelLinear(cfg.ffn_dim, cfg.hidden_size, cfg.enable_bias, tp)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)

    def forward(self, h: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        # [T, E] -> [T, E]
        # The sums write into the fresh output of out_proj / fc2, and ReLU into fc1's (no new tensors).
        residual = h
        if self.pre_ln:
            h = self.self_attn_layer_norm(h)
        h = self.self_attn(h, kv_cache, layer, meta).add_(residual)
        if not self.pre_ln:
            h = self.self_attn_layer_norm(h)
        residual = h
        if self.pre_ln:
            h = self.final_layer_norm(h)
        h = self.fc2(F.relu(self.fc1(h), inplace=True)).add_(residual)
        if not self.pre_ln:
            h = self.final_layer_norm(h)
        return h


class OPTStage(DecoderStage):
    def __init__(self, cfg: OPTConfig, tp: TensorParallelGroup) -> None:
        super().__init__(cfg, tp)
        e, p = cfg.hidden_size, cfg.word_embed_proj_dim
        if self.is_first or self.is_last:  # the last stage needs it for the tied lm_head
            self.embed_tokens = nn.Embedding(cfg.vocab_size, p)
            self.embed_tokens.weight.requires_grad_(False)
        if self.is_first:
            self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, e)
            self.embed_positions.weight.requires_grad_(False)
            self.project_in = nn.Linear(p, e, bias=False) if cfg.has_projections else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp) for _ in self.layer_range)
        local = tp.layout.shard(cfg.num_attention_heads, "num_attention_heads") * cfg.head_dim  # rows of q, k, v
        self.fused = {"qkv_proj": {"q": (0, local), "k": (local, local), "v": (2 * local, local)}}
        self._layer_weights: list[torch.Tensor | None] | None = None  # decode_layers' list, made on first use
        if self.is_last:
            affine = cfg.layer_norm_elementwise_affine
            self.final_layer_norm = (
                nn.LayerNorm(e, elementwise_affine=affine) if cfg.has_final_layer_norm else None
            )
            self.project_out = nn.Linear(e, p, bias=False) if cfg.has_projections else None
        self.requires_grad_(False)

    def release_weights(self) -> int:
        self._layer_weights = None
        return super().release_weights()

    def checkpoint_target(self, name: str) -> WeightTarget | str | None:
        if name == "lm_head.weight":
            return None  # tied to embed_tokens (OPT always ties); the tied copy is loaded from there
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return UNEXPECTED
        name = name[len(prefix):]
        where = self.local_layer(name)
        if isinstance(where, tuple):
            local, rest = where
            proj = rest.split(".")
            if len(proj) == 3 and proj[0] == "self_attn" and proj[1] in ("q_proj", "k_proj", "v_proj"):
                return WeightTarget(local + f"self_attn.qkv_proj.{proj[2]}", 0, self._tp_piece, proj[1][0])
            split = _SPLIT_DIM.get(rest)
            return WeightTarget(local + rest, split, self._tp_piece if split is not None else (0, 1))
        if where != NOT_A_LAYER:  # another stage's layer, or one the model does not have
            return where
        if name == "embed_tokens.weight":
            return WeightTarget(name) if (self.is_first or self.is_last) else None
        if name in _FIRST_STAGE:
            return WeightTarget(name) if self.is_first else None
        if name in _LAST_STAGE:
            return WeightTarget(name) if self.is_last else None
        return UNEXPECTED

    @property
    def _tp_piece(self) -> tuple[int, int]:
        return self.layout.tp_rank, self.layout.tp_size

    def forward(
        self,
        inputs: torch.Tensor,  # first stage: token ids [T] long; later stages: hidden [T, E]
        positions: torch.Tensor,  # [T] long, 0-based position of each token in its sequence
        kv_cache: torch.Tensor,  # [NB, L, 2, H, bs, D], L = this stage's layers
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        if self.is_first:
            h = self.embed_tokens(inputs)  # [T, P]
            if self.project_in is not None:
                h = self.project_in(h)  # [T, E]
            h = h + self.embed_positions(positions + POSITION_OFFSET)
        else:
            h = inputs
        if (out := self._decode_layers_in_one_call(h, kv_cache, meta)) is not None:
            return out
        for i, layer in enumerate(self.layers):
            h = layer(h, kv_cache, i, meta)
        return h

    def _decode_layers_in_one_call(self, h: torch.Tensor, kv_cache: torch.Tensor,
                                   meta: AttentionMetadata) -> torch.Tensor | None:
        """Every layer of a decode-only batch on the CPU in one compiled call
        (fastserve_kernels/csrc/cpu_decode_layers.cpp: the ops of OPTDecoderLayer.forward in the same order, the
        same output bit for bit), or None where it does not apply and the Python loop runs: tensor parallel, the
        Triton backend, a batch with a prefill, a cache the compiled decode kernel does not serve (another device or
        dtype), or the kernels not built."""
        if (self.layout.tp_size != 1 or self.attention is not paged_attention or not len(self.layers)
                or h.shape[0] == 0 or meta.decode_token_index.numel() != h.shape[0]):
            return None
        op = cpu_decode_layers_op(kv_cache)
        if op is None:
            return None
        if self._layer_weights is None:  # the parameters are filled in place by the loader: the same tensors
            self._layer_weights = [t for layer in self.layers for t in (
                layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias, layer.self_attn.qkv_proj.weight,
                layer.self_attn.qkv_proj.bias, layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias,
                layer.final_layer_norm.weight, layer.final_layer_norm.bias, layer.fc1.weight, layer.fc1.bias,
                layer.fc2.weight, layer.fc2.bias)]
        first = self.layers[0]
        return op(h, self._layer_weights, first.self_attn.num_heads, first.self_attn_layer_norm.eps,
                  self.cfg.do_layer_norm_before, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                  meta.slot_blocks, meta.slot_offsets, first.self_attn.scale)

    def compute_logits(self, h: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Logits of the selected rows: [T, E] x [S] -> [S, V] (float32)."""
        h = h[indices]
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)  # [S, P]
        return F.linear(h, self.embed_tokens.weight).float()
