"""LlamaStage: one pipeline stage of a Llama-family model (LlamaForCausalLM,
Qwen2ForCausalLM, MistralForCausalLM) on one tensor-parallel rank, computing
flattened batches over a paged KV cache.

Computes what Hugging Face's classes compute (checked in
tests/test_llama_reference.py): pre-norm blocks with RMSNorm, rotary position
embeddings on q and k (rope_theta, and rope_scaling's linear or llama3
stretch: engine/model/rotary.py), grouped-query attention (num_key_value_heads
KV heads under num_attention_heads query heads; the paged cache holds the KV
heads only), a SwiGLU MLP (down(silu(gate(x)) * up(x))), biases where the
architecture has them (Qwen2's q/k/v), lm_head tied to the embeddings or not.

On the CPU a decode-only batch runs the layers in one compiled call with the
same ops (fastserve_kernels/csrc/cpu_decode_llama_layers.cpp), the Python loop
everywhere else; both compute RMSNorm and the rotary embedding with that file's
kernels, and in float32 (and in bfloat16 where torch's oneDNN runs it on the
CPU) with one rank every matmul, the head's included, multiplies by a copy of
its weight packed for oneDNN (fastserve_kernels/cpu_packed_linear.py). The
compiled loop runs in the model's dtype, bfloat16 included, its attention
summing in float32.

Tensor parallelism: query heads and MLP columns are split across ranks; KV
heads too when there are at least as many as ranks, else each rank holds the
one KV head its query heads read (ParallelLayout.kv_heads, vLLM's
replication). Embeddings and lm_head are replicated. Parameter names follow
Hugging Face's without the `model.` prefix, with q/k/v fused into `qkv_proj`
and gate/up into `gate_up_proj` (checkpoint_target maps checkpoint names).

Legend: T tokens in the flattened batch, S sequences, E hidden size, V vocab
size, H local query heads, Hkv local KV heads, D head dim, F local MLP width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from engine.model.llama_config import LlamaConfig
from engine.model.rotary import Rotary, Rotation
from engine.model.stage import NOT_A_LAYER, UNEXPECTED, DecoderStage, WeightTarget
from engine.parallel import TensorParallelGroup
from fastserve_kernels import cpu_packed_linear
from fastserve_kernels.paged_attention import AttentionMetadata, cpu_decode_llama_layers_op, paged_attention

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_GATE_UP = {"gate_proj": "gate", "up_proj": "up"}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        layout, d = tp.layout, cfg.head_dim
        self.num_heads = layout.shard(cfg.num_attention_heads, "num_attention_heads")
        first_kv, self.num_kv_heads = layout.kv_heads(cfg.num_key_value_heads)
        # This rank's KV heads as a piece of the checkpoint's k_proj / v_proj rows (loader)
        self.kv_piece = (first_kv // self.num_kv_heads, cfg.num_key_value_heads // self.num_kv_heads)
        self.head_dim, self.scale = d, d**-0.5
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]  # rows of q, k, v
        # One matmul for q, k, v: rows [q | k | v] of this rank's heads.
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                             * d, cfg.qkv_bias, tp, local_out=sum(self.sizes))
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.o_bias, tp)
        self.attention = paged_attention  # or the Triton kernels' (DecoderStage.use_attention)

    def forward(self, x: torch.Tensor, rotation: Rotation, kv_cache: torch.Tensor, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, E] -> [T, E]
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # [T, H * D], [T, Hkv * D] x 2
        q = rotation.apply(q.view(t, self.num_heads, d))  # [T, H, D]
        k = rotation.apply(k.view(t, self.num_kv_heads, d))  # [T, Hkv, D]
        out = self.attention(q, k, v.view(t, self.num_kv_heads, d), kv_cache, layer, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * d))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul: rows [gate | up] of this rank's columns."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.width = tp.layout.shard(cfg.intermediate_size, "intermediate_size")  # F
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, tp,
                                                 local_out=2 * self.width)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)  # [T, F] each
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg, tp)

    def forward(self, h: torch.Tensor, rotation: Rotation, kv_cache: torch.Tensor, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, E] -> [T, E]
        # The sums write into the fresh outputs of o_proj and down_proj.
        h = self.self_attn(self.input_layernorm(h), rotation, kv_cache, layer, meta).add_(h)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class LlamaStage(DecoderStage):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallelGroup) -> None:
        super().__init__(cfg, tp)
        e, v = cfg.hidden_size, cfg.vocab_size
        # The last stage reads the embeddings when lm_head is tied to them.
        if self.is_first or (self.is_last and cfg.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(v, e)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp) for _ in self.layer_range)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        first = self.layers[0]  # every stage has a layer (ParallelLayout.stage_layers)
        q, kv, _ = first.self_attn.sizes
        self.kv_piece = first.self_attn.kv_piece
        width = first.mlp.width
        self.fused = {"qkv_proj": {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)},
                      "gate_up_proj": {"gate": (0, width), "up": (width, width)}}
        if self.is_last:
            self.norm = RMSNorm(e, cfg.rms_norm_eps)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(e, v, bias=False)
        self._packed = False  # whether _pack_weights ran (on first use: the loader fills the weights first)
        self._packed_head: torch.Tensor | None = None
        self._layer_weights: list[torch.Tensor | None] | None = None  # decode_llama_layers' list, made on first use
        self.requires_grad_(False)

    def release_weights(self) -> int:
        self._layer_weights = self._packed_head = None
        for layer in self.layers:
            for linear in _linears(layer):
                linear.packed = None
        return super().release_weights()

    def _pack_weights(self) -> None:
        """With one rank, each matmul's weight packed for oneDNN where it applies (float32, or bfloat16 where
        oneDNN runs it, on the CPU: fastserve_kernels/cpu_packed_linear.py), once: the Python loop, the compiled
        decode loop and the head then all multiply by the packed copies, and so agree bit for bit. Not when the
        copies would take more than half the memory the host has available (cpu_packed_linear.fits): the plain
        weights serve then."""
        self._packed = True
        linears = [linear for layer in self.layers for linear in _linears(layer)] if self.layout.tp_size == 1 else []
        head = self._head() if self.is_last and linears else None
        weights = [linear.weight for linear in linears] + ([head] if head is not None else [])
        if not weights or not cpu_packed_linear.applies(weights[0]):
            return
        if not cpu_packed_linear.fits(sum(w.numel() * w.element_size() for w in weights)):
            return
        for linear in linears:
            linear.packed = cpu_packed_linear.pack(linear.weight)
        if head is not None:
            self._packed_head = cpu_packed_linear.pack(head)

    def _head(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def checkpoint_target(self, name: str) -> WeightTarget | str | None:
        tp_piece = (self.layout.tp_rank, self.layout.tp_size)
        if name == "lm_head.weight":  # a tied checkpoint may carry a copy of the embeddings: not read
            return WeightTarget(name) if self.is_last and not self.cfg.tie_word_embeddings else None
        if not name.startswith("model."):
            return UNEXPECTED
        name = name[len("model."):]
        where = self.local_layer(name)
        if isinstance(where, tuple):
            local, rest = where
            if rest == "self_attn.rotary_emb.inv_freq":
                return None  # a buffer older transformers saved: the frequencies come from config.json
            module, _, kind = rest.rpartition(".")  # e.g. "self_attn.k_proj", "weight"
            owner, _, proj = module.partition(".")
            if owner == "self_attn" and proj in _QKV:
                piece = tp_piece if proj == "q_proj" else self.kv_piece
                return WeightTarget(f"{local}self_attn.qkv_proj.{kind}", 0, piece, _QKV[proj])
            if owner == "mlp" and proj in _GATE_UP:
                return WeightTarget(f"{local}mlp.gate_up_proj.{kind}", 0, tp_piece, _GATE_UP[proj])
            if module in ("self_attn.o_proj", "mlp.down_proj") and kind == "weight":
                return WeightTarget(local + rest, 1, tp_piece)
            return WeightTarget(local + rest)  # norms, and the row-parallel biases (added once, whole)
        if where != NOT_A_LAYER:  # another stage's layer, or one the model does not have
            return where
        if name == "embed_tokens.weight":
            return WeightTarget(name) if hasattr(self, "embed_tokens") else None
        if name == "norm.weight":
            return WeightTarget(name) if self.is_last else None
        return UNEXPECTED

    def forward(
        self,
        inputs: torch.Tensor,  # first stage: token ids [T] long; later stages: hidden [T, E]
        positions: torch.Tensor,  # [T] long, 0-based position of each token in its sequence
        kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D], L = this stage's layers
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        if not self._packed:
            self._pack_weights()
        h = self.embed_tokens(inputs) if self.is_first else inputs
        rotation = self.rotary(positions, h.dtype)  # one for every layer of the step
        if (out := self._decode_layers_in_one_call(h, rotation, kv_cache, meta)) is not None:
            return out
        for i, layer in enumerate(self.layers):
            h = layer(h, rotation, kv_cache, i, meta)
        return h

    def _decode_layers_in_one_call(self, h: torch.Tensor, rotation: Rotation, kv_cache: torch.Tensor,
                                   meta: AttentionMetadata) -> torch.Tensor | None:
        """Every layer of a decode-only batch on the CPU in one compiled call
        (fastserve_kernels/csrc/cpu_decode_llama_layers.cpp: the ops of LlamaDecoderLayer.forward in the same order,
        the same output bit for bit), or None where it does not apply and the Python loop runs: tensor parallel,
        the Triton backend, a batch with a prefill, a cache the compiled decode kernel does not serve (another
        device or dtype), or the kernels not built."""
        if (self.layout.tp_size != 1 or self.attention is not paged_attention or h.shape[0] == 0
                or meta.decode_token_index.numel() != h.shape[0]):
            return None
        op = cpu_decode_llama_layers_op(kv_cache)
        if op is None:
            return None
        if self._layer_weights is None:  # the parameters (and packed copies) as they are now: the same tensors
            self._layer_weights = [t for layer in self.layers for t in (
                layer.input_layernorm.weight, *_matmul(layer.self_attn.qkv_proj), *_matmul(layer.self_attn.o_proj),
                layer.post_attention_layernorm.weight, *_matmul(layer.mlp.gate_up_proj),
                *_matmul(layer.mlp.down_proj))]
        attn = self.layers[0].self_attn
        return op(h, self._layer_weights, attn.num_heads, attn.num_kv_heads, self.layers[0].input_layernorm.eps,
                  rotation.cos, rotation.sin, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                  meta.slot_blocks, meta.slot_offsets, attn.scale)

    def compute_logits(self, h: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if not self._packed:
            self._pack_weights()
        h = self.norm(h[indices])  # [S, E]
        if self._packed_head is not None:
            return cpu_packed_linear.linear(h, self._packed_head, None).float()
        return F.linear(h, self._head()).float()


def _linears(layer: LlamaDecoderLayer) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _matmul(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's (weight, bias) for the compiled loop: the packed copy of the weight where there is one."""
    return (linear.weight if linear.packed is None else linear.packed), linear.bias
