"""Attention over a paged KV cache, and the cache write: plain-torch reference.

What it is: pure functions on tensors that run on any device (CPU here, CUDA
where present). What it is not: a fast kernel; fused CUDA paths come later
and are tested against these. One exception: on the CPU, decode attention
reads the cache in place instead of gathering it, with the compiled kernel
(fastserve_kernels/csrc/cpu_decode_attention.cpp, loaded by cpu_decode_extension.py),
which also writes the step's K/V in a decode-only batch, or where that is not
built with sparse torch ops (fastserve_kernels/cpu_decode_attention.py);
`decode_attention_gathered` stays as their reference.

Legend
    T   tokens in the flattened batch (every job's new tokens, concatenated)
    S   sequences (jobs) in the batch
    H   query heads on this tensor-parallel rank
    Hkv KV heads on this rank (= H, or H / G under grouped-query attention: query head h reads KV head h // G)
    D   head dim
    NB  blocks in the stage's KV cache, bs = block size, MB = max blocks per job
    L   layers of this pipeline stage

KV cache layout, block-major and head-major inside a block:
kv_cache[NB, L, 2, Hkv, bs, D]: the cache holds the KV heads only, so a model with 8 KV heads under 32 query
heads keeps a quarter of the bytes per token. One block holds K (index 0) and V (index 1) of
every layer of the stage for bs tokens, so an offload or upload of a block is
one contiguous copy; inside it, one head's bs positions are contiguous (the
CPU decode path reads them as a run, fastserve_kernels/cpu_decode_attention.py). Token
t of a job lives at block_table[t // bs], offset t % bs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastserve_kernels import cpu_decode_extension
from fastserve_kernels.cpu_decode_attention import (
    DecodeRows,
    decode_attention_in_place,
    row_strides,
    supports_in_place_decode,
)


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and what each sequence attends to."""

    slot_blocks: torch.Tensor  # [T] long: block id of each new token's KV
    slot_offsets: torch.Tensor  # [T] long: offset in that block
    # Sequences with nothing cached before this step (prefill, or recompute):
    # (start, end) spans of the flat token dim; they attend causally to themselves.
    fresh_spans: list[tuple[int, int]]
    # Sequences with one new token (decode), batched together.
    # [S_d] long: position of each one in the flat token dim, increasing (every builder lays sequences out
    # in order), so in a decode-only batch (S_d = T) decode sequence i is token i.
    decode_token_index: torch.Tensor
    decode_block_tables: torch.Tensor  # [S_d, MB] long (padded with 0)
    decode_context_lens: torch.Tensor  # [S_d] long: tokens attended to, including the new one
    # Sequences with several new tokens after a cached prefix (chunked prefill):
    # (start, end, block_table [MB] long, context_len).
    partial: list[tuple[int, int, torch.Tensor, int]]
    workspace: Workspace | None = None  # reused gather buffers (see Workspace)
    # The decode sequences' cache rows, built by the first layer that reads the cache in place and reused by
    # the others (fastserve_kernels/cpu_decode_attention.py).
    decode_rows: DecodeRows | None = None

    @classmethod
    def for_sequences(cls, seqs: list[tuple[int, int]], tables: list[list[int]], block_size: int,
                      device: torch.device | str | None = None, workspace: Workspace | None = None,
                      ) -> AttentionMetadata:
        """The metadata of a flat batch in which sequence i has seqs[i] = (tokens cached before this step,
        new tokens) and KV blocks tables[i], its new tokens laid out one sequence after another: what
        engine/model_runner.py builds from a batch (tests and benchmarks build theirs with this)."""
        slots, offsets, fresh, dec_idx, dec_tables, dec_lens, partial = [], [], [], [], [], [], []
        t = 0
        for (cached, new), table in zip(seqs, tables):
            slots += [table[p // block_size] for p in range(cached, cached + new)]
            offsets += [p % block_size for p in range(cached, cached + new)]
            if cached == 0:
                fresh.append((t, t + new))
            elif new == 1:
                dec_idx.append(t)
                dec_tables.append(table)
                dec_lens.append(cached + new)
            else:
                partial.append((t, t + new, torch.tensor(table, device=device), cached + new))
            t += new
        mb = max((len(x) for x in dec_tables), default=0)
        longs = dict(dtype=torch.long, device=device)
        return cls(
            torch.tensor(slots, **longs), torch.tensor(offsets, **longs), fresh, torch.tensor(dec_idx, **longs),
            torch.tensor([x + [0] * (mb - len(x)) for x in dec_tables], **longs).reshape(len(dec_tables), mb),
            torch.tensor(dec_lens, **longs), partial, workspace,
        )

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """A copy with every tensor on `device` (no workspace, no cached decode rows)."""
        return AttentionMetadata(
            self.slot_blocks.to(device), self.slot_offsets.to(device), self.fresh_spans,
            self.decode_token_index.to(device), self.decode_block_tables.to(device),
            self.decode_context_lens.to(device), [(s, e, t.to(device), c) for s, e, t, c in self.partial],
        )


def write_kv(
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
    layer: int,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    meta: AttentionMetadata,
) -> None:
    if not kv_cache.is_contiguous():
        # Integer and tensor indices around a slice: the indexed dims come first, [T, Hkv, D] like k.
        kv_cache[meta.slot_blocks, layer, 0, :, meta.slot_offsets] = k
        kv_cache[meta.slot_blocks, layer, 1, :, meta.slot_offsets] = v
        return
    # The cache as rows of one head's D (fastserve_kernels/cpu_decode_attention.py row_strides): one row copy per
    # token, head and tensor.
    h, d = kv_cache.shape[3], kv_cache.shape[-1]
    block_stride, layer_stride, v_offset, head_stride, offset_stride = row_strides(kv_cache)
    rows = kv_cache.view(-1, d)
    token_rows = meta.slot_blocks * block_stride + meta.slot_offsets * offset_stride + layer * layer_stride  # [T]
    k_rows = (token_rows[:, None] + torch.arange(h, device=kv_cache.device) * head_stride).reshape(-1)  # [T * Hkv]
    rows.index_copy_(0, k_rows, k.reshape(-1, d))
    rows.index_copy_(0, k_rows + v_offset, v.reshape(-1, d))


class Workspace:
    """Scratch buffers reused across layers and steps.

    Large fresh allocations page-fault on first touch (the CPU allocator hands
    big blocks back to the OS on free), which costs more than the copy itself;
    gathering K/V into a reused buffer avoids that. Buffers only grow.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            grown = max(numel, int(1.25 * buf.numel())) if buf is not None else numel
            buf = torch.empty(grown, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def release(self) -> None:
        """Free every buffer now, views included (an engine closing: engine/device_memory.py says why); a later
        get() allocates anew."""
        for buf in self._buffers.values():
            buf.untyped_storage().resize_(0)
        self._buffers.clear()


def gather_kv(
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, MB]
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole block tables: two [S, Hkv, MB * bs, D], views of one contiguous [Hkv, S, MB * bs, D] copy each
    (one gather per tensor, position-contiguous per head, as attention reads them)."""
    s, mb = block_tables.shape
    _, _, _, h, bs, d = kv_cache.shape
    flat = block_tables.reshape(-1)
    out = []
    for kv in (0, 1):
        src = kv_cache[:, layer, kv].transpose(0, 1)  # [Hkv, NB, bs, D], a strided view
        if workspace is None:
            dst = src.index_select(1, flat)
        else:
            dst = torch.index_select(src, 1, flat, out=workspace.get(f"kv{kv}", (h, s * mb, bs, d), kv_cache))
        out.append(dst.view(h, s, mb * bs, d).transpose(0, 1))
    return out[0], out[1]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Write this step's K/V into the cache, then attend every new token to its
    sequence's context (causally). Query head h attends with KV head h // (H / Hkv)."""
    decode_only = meta.decode_token_index.numel() == q.shape[0]  # token i is decode sequence i (see above)
    if decode_only and (op := _cpu_decode_op(kv_cache)) is not None:  # the fused CPU kernel writes, then attends
        return op(q, k, v, kv_cache, layer, meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks,
                  meta.slot_offsets, scale, True)
    write_kv(kv_cache, layer, k, v, meta)
    if decode_only:
        return _decode_attention(q, kv_cache, layer, meta, scale)
    out = torch.empty_like(q)
    gqa = grouped(q, kv_cache)
    for start, end in meta.fresh_spans:
        # [1, H, n, D] and [1, Hkv, n, D]
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                        enable_gqa=gqa)[0].transpose(0, 1)
    if meta.decode_token_index.numel():
        out[meta.decode_token_index] = _decode_attention(q[meta.decode_token_index], kv_cache, layer, meta, scale)
    for start, end, table, context_len in meta.partial:
        out[start:end] = _partial_attention(q[start:end], kv_cache, layer, table, context_len, scale)
    return out


def grouped(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether query heads share KV heads (q [T, H, D] over a cache of fewer heads): SDPA's enable_gqa."""
    return q.shape[1] != kv_cache.shape[3]


def _decode_attention(
    q: torch.Tensor,  # [S_d, H, D]
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [S_d, H, D]
    """On the CPU the context is read in place: by the compiled kernel (fastserve_kernels/cpu_decode_extension.py), or
    where it is not built by the sparse-op one (fastserve_kernels/cpu_decode_attention.py); elsewhere, the reference."""
    if (op := _cpu_decode_op(kv_cache)) is not None:
        return op(q, q, q, kv_cache, layer, meta.decode_block_tables, meta.decode_context_lens,
                  meta.decode_context_lens, meta.decode_context_lens, scale, False)  # K/V written already
    if supports_in_place_decode(kv_cache):
        if meta.decode_rows is None:
            meta.decode_rows = DecodeRows.build(kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                                                q.shape[1])
        return decode_attention_in_place(q, kv_cache, layer, meta.decode_rows, scale)
    return decode_attention_gathered(q, kv_cache, layer, meta, scale)


def _compiled_decode_serves(kv_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU decode kernel serves this cache: on the CPU, contiguous, float32/64 or bfloat16 (it
    sums bfloat16 in float; the sparse-op path has no bfloat16)."""
    return supports_in_place_decode(kv_cache) or (kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
                                                  and kv_cache.dtype == torch.bfloat16)


def _cpu_decode_op(kv_cache: torch.Tensor):
    """The compiled CPU decode kernel when it serves this cache (CPU, float32/64 or bfloat16, contiguous), else
    None."""
    return cpu_decode_extension.decode_attention_op() if _compiled_decode_serves(kv_cache) else None


def cpu_decode_layers_op(kv_cache: torch.Tensor):
    """The compiled decode-layers loop (fastserve_kernels/csrc/cpu_decode_layers.cpp) where the compiled decode kernel
    serves this cache (decode_layers_op is None where the kernel is), else None."""
    return cpu_decode_extension.decode_layers_op() if supports_in_place_decode(kv_cache) else None


def cpu_decode_llama_layers_op(kv_cache: torch.Tensor):
    """The compiled Llama-family decode-layers loop (fastserve_kernels/csrc/cpu_decode_llama_layers.cpp) where the
    compiled decode kernel serves this cache (bfloat16 included: the loop runs in the cache's dtype), else None."""
    return cpu_decode_extension.decode_llama_layers_op() if _compiled_decode_serves(kv_cache) else None


def decode_attention_gathered(
    q: torch.Tensor,  # [S_d, H, D]
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [S_d, H, D]
    """The reference: each sequence's K/V gathered out of its blocks, then SDPA over the padded context."""
    keys, values = gather_kv(kv_cache, layer, meta.decode_block_tables, meta.workspace)  # [S_d, Hkv, C, D], C = MB*bs
    c = keys.shape[2]
    valid = torch.arange(c, device=q.device)[None, :] < meta.decode_context_lens[:, None]  # [S_d, C]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [S_d, H, 1, D]
        keys,  # [S_d, Hkv, C, D]
        values,
        attn_mask=valid[:, None, None, :],  # [S_d, 1, 1, C]
        scale=scale,
        enable_gqa=grouped(q, kv_cache),
    )  # [S_d, H, 1, D]
    return out.squeeze(2)


def _partial_attention(
    q: torch.Tensor,  # [n, H, D]: the last n tokens of a context of context_len
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,  # [MB]
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    # Only the blocks holding the context, indexed out of the cache (gather_kv's index_select over a strided
    # view of the whole cache copied all of it: 0.45 s a layer for a 1 GiB CPU cache).
    _, _, _, h, bs, d = kv_cache.shape
    nblocks = -(-context_len // bs)
    blocks = kv_cache[block_table[:nblocks], layer]  # [nblocks, 2, Hkv, bs, D]
    keys, values = (blocks[:, i].transpose(0, 1).reshape(h, nblocks * bs, d)[:, :context_len]
                    for i in (0, 1))  # [Hkv, C, D] each
    n = q.shape[0]
    # Query i sits at position context_len - n + i and sees keys 0..that position.
    q_pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos  # [n, C]
    # With a batch dimension ([1, H, n, D]): 3-d inputs take SDPA's math path on the CPU, 4-d ones its flash
    # kernel, 2.5x faster for a 384-token chunk over a 2,000-token context (17 vs 42 ms at one thread).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=grouped(q, kv_cache),
    )[0]  # [H, n, D]
    return out.transpose(0, 1)
