"""Decode attention that reads the paged KV cache in place, once: the CPU path where the compiled kernel
(fastserve_kernels/csrc/cpu_decode_attention.cpp, fastserve_kernels/cpu_decode_extension.py) is not built or is
switched off.

What it is: attention of one new token per sequence (decode) over that
sequence's cached K/V, computed straight from the block-major cache with two
sparse primitives of plain torch, so no [S, H, MB * bs, D] copy of the context
is made. What it is not: a kernel for CUDA (a later file), nor for prefill or
chunked prefill (fastserve_kernels/paged_attention.py gathers those).

Why: the reference (fastserve_kernels/paged_attention.py `gather_kv` + SDPA) copies each
sequence's K and V out of their blocks and then reads the copy, so the context
crosses memory twice (three times counting the copy's writes). On a CPU the
decode step is memory-bound, and that copy was a quarter of the batch-32 step
of opt-125m.

How: view the cache as rows of one head's vector, rows[NB * L * 2 * Hkv * bs, D]
(the cache is contiguous), so K (or V) of sequence s, query head h, position c is
one row, at

    row(s, h, c) = ((table[s, c // bs] * L + layer) * 2 + kv) * Hkv * bs + (h // G) * bs + c % bs

(G = H / Hkv query heads share a KV head under grouped-query attention; 1 otherwise)

that is, layer 0's K row plus layer * 2 * H * bs plus kv * H * bs (the
layout is head-major inside a block, so one head's positions in a block are
bs consecutive rows: read as a run, not one cache miss a row): one index
tensor serves every layer, read against a window of the rows shifted by the
layer's (and V's) offset. Each (s, h) pair is one row of a ragged [S * H, rows] sparse pattern holding
its context's K rows, so
  - scores = torch.sparse.sampled_addmm(pattern, q, rows^T, out=pattern): one
    dot product per (s, h, c), each K row read once where it lies (CSR row
    pointers, no padding), written into the pattern's own values (no copy);
  - softmax over each (s, h)'s scores (small: S * H * C floats);
  - out = F.embedding_bag(V rows, rows, per_sample_weights=probabilities,
    mode="sum"): each V row read once and summed with its weight.
Both run vectorised and in parallel across (s, h) on the CPU (float32/float64;
other dtypes and devices use the reference).

Legend as fastserve_kernels/paged_attention.py: S decode sequences, H query heads, Hkv KV heads, D head dim,
L layers, bs block size, C = the longest context in the batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torch warns once that CSR tensors are "in beta"; the two ops used here are tested against the reference.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)

SUPPORTED_DTYPES = (torch.float32, torch.float64)  # those both sparse primitives implement on the CPU


def row_strides(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """The strides of a contiguous cache [NB, L, 2, Hkv, bs, D] in rows of D: (block, layer, K/V, head, offset).
    Row of (block b, layer l, kv, head h, offset o) = b * block + l * layer + kv * kv_stride + h * head + o."""
    d = kv_cache.shape[-1]
    return tuple(x // d for x in kv_cache.stride()[:-1])


def supports_in_place_decode(kv_cache: torch.Tensor) -> bool:
    """Whether decode_attention_in_place can run on this cache (CPU, float32/64, contiguous)."""
    return kv_cache.device.type == "cpu" and kv_cache.dtype in SUPPORTED_DTYPES and kv_cache.is_contiguous()


@dataclass
class DecodeRows:
    """Where each decode sequence's context sits in the cache viewed as rows of D, for layer 0's K.

    One step computes it once. Layer `l`'s K rows are the same row numbers in the window of the cache's
    rows that starts `l * layer_stride` rows in, its V rows those in the window starting `v_offset` rows
    later: every layer reuses one index tensor and one sparse pattern, and no per-layer index is built.
    Entries are in (sequence, head, position) order, each (s, h) holding its sequence's context_len
    positions."""

    k_rows: torch.Tensor  # [N] long, N = H * sum(context_len)
    row_ptr: torch.Tensor  # [S * H + 1] long: CSR row pointers of the (s, h) rows into k_rows
    padded_index: torch.Tensor | None  # [N] long: each entry's place in a padded [S, H, C]; None: no padding
    scores: torch.Tensor  # [S, H, C]: scratch for the padded scores, -inf where no entry is (empty: no padding)
    # [S * H, window] CSR of k_rows; sampled_addmm writes each layer's scores into its values (scratch)
    pattern: torch.Tensor
    window: int  # rows of the window every layer's K (or V) rows lie in
    layer_stride: int  # rows between layer l and l + 1 of one block
    v_offset: int  # rows between a token's K and its V

    @classmethod
    def build(
        cls,
        kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
        block_tables: torch.Tensor,  # [S, MB] long (padded)
        context_lens: torch.Tensor,  # [S] long
        num_heads: int | None = None,  # H, the query heads (default Hkv)
    ) -> DecodeRows:
        _, num_layers, _, h_kv, bs, _ = kv_cache.shape
        h = num_heads or h_kv
        block_stride, layer_stride, v_offset, head_stride, offset_stride = row_strides(kv_cache)
        s = block_tables.shape[0]
        dev = kv_cache.device
        c = int(context_lens.max())
        pos = torch.arange(c, device=dev)  # [C]
        # [S, C]: row of (block of position c, layer 0, K, head 0, offset c % bs)
        base = block_tables[:, pos // bs] * block_stride + (pos % bs) * offset_stride
        kv_head = torch.arange(h, device=dev) // (h // h_kv)  # [H]: the KV head each query head reads
        rows = base[:, None, :] + (kv_head * head_stride)[None, :, None]  # [S, H, C]
        valid = (pos[None, :] < context_lens[:, None])[:, None, :].expand(s, h, c)  # [S, H, C]
        padded_index = valid.reshape(-1).nonzero().squeeze(1)  # [N], in (s, h, c) order
        counts = context_lens.repeat_interleave(h)  # [S * H]
        row_ptr = torch.zeros(s * h + 1, dtype=torch.long, device=dev)
        torch.cumsum(counts, 0, out=row_ptr[1:])
        n = padded_index.numel()
        # Every row of layer 0's K plus the last layer's offset and V's lies in the cache: the window.
        window = kv_cache.numel() // kv_cache.shape[-1] - (num_layers - 1) * layer_stride - v_offset
        if n == s * h * c:  # every context as long as the longest: entries and padded places coincide
            k_rows, padded_index, scores = rows.reshape(-1), None, torch.empty(0, dtype=kv_cache.dtype, device=dev)
        else:
            k_rows = rows.reshape(-1)[padded_index]
            scores = torch.full((s, h, c), float("-inf"), dtype=kv_cache.dtype, device=dev)
        pattern = torch.sparse_csr_tensor(row_ptr, k_rows, torch.zeros(n, dtype=kv_cache.dtype, device=dev),
                                          size=(s * h, window), check_invariants=False)
        return cls(k_rows, row_ptr, padded_index, scores, pattern, window, layer_stride, v_offset)


def decode_attention_in_place(
    q: torch.Tensor,  # [S, H, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D], contiguous
    layer: int,
    rows: DecodeRows,
    scale: float,
) -> torch.Tensor:  # [S, H, D]
    s, h, d = q.shape
    cache_rows = kv_cache.view(-1, d)  # [NB * L * 2 * Hkv * bs, D]
    k_window = cache_rows.narrow(0, layer * rows.layer_stride, rows.window)  # layer's K rows = rows.k_rows here
    v_window = cache_rows.narrow(0, layer * rows.layer_stride + rows.v_offset, rows.window)
    # [N]: q[s, h] . K[s, c, h] * scale for every (s, h, c) in order, written into the pattern's values
    scores = torch.sparse.sampled_addmm(rows.pattern, q.reshape(s * h, d), k_window.t(), beta=0.0, alpha=scale,
                                        out=rows.pattern).values()
    if rows.padded_index is None:
        probs = torch.softmax(scores.view(s * h, -1), dim=-1).view(-1)  # [N]
    else:
        padded = rows.scores.view(-1).index_copy_(0, rows.padded_index, scores)  # [S * H * C], -inf elsewhere
        probs = torch.softmax(padded.view(s * h, -1), dim=-1).view(-1).index_select(0, rows.padded_index)  # [N]
    out = F.embedding_bag(rows.k_rows, v_window, offsets=rows.row_ptr[:-1], per_sample_weights=probs,
                          mode="sum")  # [S * H, D]
    return out.view(s, h, d)
