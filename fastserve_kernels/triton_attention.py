"""Attention over a paged KV cache, and the cache write: Triton kernels.

What it is: the fast path of fastserve_kernels/paged_attention.py (same layout, same
AttentionMetadata, same results up to float rounding), for CUDA. On CPU the
same kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is first imported: it decides at decoration time, for its own library
too), which is how tests/triton_interpreter_cases.py checks them against the
reference. What it is not: the choice of backend (fastserve_kernels/attention_backend.py).

Legend (as in fastserve_kernels/paged_attention.py)
    T   tokens in the flattened batch
    S   sequences in the batch (S_d: decode rows, S_p: prefill rows)
    H   query heads on this rank, D head dim (Dp: D rounded up to a power of two, >= 16)
    Hkv KV heads on this rank, G = H / Hkv (grouped-query attention: query head h reads KV head h // G)
    NB  blocks in the cache, bs block size, MB max blocks per sequence, L layers of the stage
    P   context splits of a decode row (flash-decoding)

KV cache layout, block-major and head-major inside a block: kv_cache[NB, L, 2,
Hkv, bs, D]; token t of a sequence lives at block_table[t // bs], offset t % bs. Every kernel reads the
cache in place through the block table (no gather), a tile of tokens at a time:
with blocks of 16 tokens or more a tile is one block or a slice of one, read
as one 64-bit base pointer and 32-bit offsets from it (a 64-bit pointer an
element held 226-255 registers and spilled); with smaller blocks a 16-token
tile spans blocks, one base a token. Tiles and warps: decode_config,
prefill_config (register counts for sm_90: scripts/triton_registers.py).

The kernels:
    _write_kv_kernel        this step's K/V (Hkv heads) into their slots grid (T, 2)
    _decode_split_kernel    one new token per sequence, the context cut  grid (S_d, Hkv * ceil(G / BLOCK_G), P)
      + _decode_reduce_kernel  into P splits, then the splits combined   grid (S_d, H)
    _prefill_kernel         several new tokens after a cached prefix     grid (S_p, H, ceil(n / BLOCK_M))
                            (prefix from the cache, then the new tokens
                            causally from k/v; fresh prefill = empty prefix)
Softmax is online (running max and sum), accumulated in float32 whatever the
cache dtype. Grouped-query attention: a decode program handles one KV head and
the query heads of its group, BLOCK_G = 16 rows (DECODE_GROUP_ROWS; the rows
past G are padding, computed on zeros and not stored; a group over 16 heads
takes ceil(G / 16) programs), so each K/V tile is read once for the group:
scores [BLOCK_G, BLOCK_N] = tl.dot(q [BLOCK_G, Dp], K tile^T), then
tl.dot(probs, V tile). decode_kv_bytes gives the K/V bytes a decode call reads.
A prefill program handles one query head (a tile of its queries) and reads its
KV head's rows: the G programs of a group read the same ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastserve_kernels.paged_attention import AttentionMetadata

# True when this module's kernels were built for Triton's interpreter (CPU tensors); fixed at import.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def interpreter_ready() -> bool:
    """Whether kernels can run under the interpreter: triton's own library (tl.zeros, tl.sum, ...) is decorated
    when triton is first imported, so TRITON_INTERPRET=1 must already have been set then, not only here."""
    return INTERPRETED and type(tl.zeros).__name__ == "InterpretedFunction"

# BLOCK_G, the rows of a decode program: the query heads of one KV head's group it handles, padded past G (16: the
# height of the tensor-core tile Triton fills for a smaller tl.dot anyway). A group of more is cut over
# ceil(G / 16) programs a KV head. 32 took 94-103 registers on sm_90 (docs/gpu.md), past the limit of 96
# (tests/test_triton_kernels.py).
DECODE_GROUP_ROWS = 16

# A decode row's context is cut into splits of this many tokens (flash-decoding); each split is one program.
DEFAULT_TOKENS_PER_SPLIT = 512


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_blocks_ptr, slot_offsets_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_co, stride_ch, layer_offset,
    H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)  # 0: K, 1: V
    block = tl.load(slot_blocks_ptr + t)
    offset = tl.load(slot_offsets_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    if which == 0:
        x = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    else:
        x = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + block * stride_cb + layer_offset + which * stride_ckv + offset * stride_co + h * stride_ch + d
    tl.store(dst, x, mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, rows_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_qt, stride_qh, stride_ts,
    stride_cb, stride_ckv, stride_co, stride_ch, layer_offset,
    scale, H, D, P,
    G: tl.constexpr, BLOCK_G: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS_PER_SPLIT: tl.constexpr,
):
    # One program: one KV head, BLOCK_G query heads of its group (all G of them when G <= BLOCK_G), one split.
    CHUNKS: tl.constexpr = (G + BLOCK_G - 1) // BLOCK_G  # programs a KV head (1 when G <= BLOCK_G)
    s = tl.program_id(0)
    kv_h = tl.program_id(1) // CHUNKS
    p = tl.program_id(2)
    context_len = tl.load(lens_ptr + s)
    row = tl.load(rows_ptr + s)
    g0 = (tl.program_id(1) % CHUNKS) * BLOCK_G  # the program's first query head within the group
    r = tl.arange(0, BLOCK_G)  # [BLOCK_G] rows: query heads g0 + r of the group
    g_ok = g0 + r < G  # rows past the group (padding) are computed on zeros and never stored
    h = kv_h * G + g0 + r  # [BLOCK_G] query heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row * stride_qt + (h[:, None] * stride_qh + d[None, :]), mask=q_mask,
                other=0.0)  # [BLOCK_G, Dp], in the cache's dtype (tl.dot's operands)
    start = p * TOKENS_PER_SPLIT
    end = tl.minimum(start + TOKENS_PER_SPLIT, context_len)
    run_max = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    run_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + s.to(tl.int64) * stride_ts
    head = cache_ptr + layer_offset + kv_h * stride_ch  # this layer's K of the KV head, block 0
    n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):  # n0 is a multiple of BLOCK_N (TOKENS_PER_SPLIT is)
        live = n0 + n < end  # n0 < end: the tile has a live token
        tile_mask = live[:, None] & d_ok[None, :]
        if BLOCK_N <= BS:
            # The tile lies in one block: one 64-bit base pointer, 32-bit offsets from it.
            block = tl.load(table + n0 // BS)
            base = head + block * stride_cb + (n0 % BS) * stride_co
            offsets = n[:, None] * stride_co + d[None, :]  # [BLOCK_N, Dp]
        else:
            # Blocks smaller than a tile (block size < 16): a base a token.
            block = tl.load(table + (n0 + n) // BS, mask=live, other=0)
            base = head
            offsets = (block * stride_cb + ((n0 + n) % BS) * stride_co)[:, None] + d[None, :]
        # K and V tiles are read once for the BLOCK_G query heads.
        k = tl.load(base + offsets, mask=tile_mask, other=0.0)  # [BLOCK_N, Dp]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(live[None, :], scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))  # [BLOCK_G]
        correction = tl.exp(run_max - new_max)
        probs = tl.exp(scores - new_max[:, None])  # [BLOCK_G, BLOCK_N]
        v = tl.load(base + stride_ckv + offsets, mask=tile_mask, other=0.0)
        run_sum = run_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        run_max = new_max
    # Query head h's split p is part (s * H + h) * P + p: a 64-bit base (row 0's), 32-bit offsets (a 64-bit offset
    # a row spilled on sm_90).
    first = (s * H + kv_h * G + g0) * P + p
    rows = r * P  # [BLOCK_G]
    tl.store(part_acc_ptr + first.to(tl.int64) * BLOCK_D + (rows[:, None] * BLOCK_D + d[None, :]), acc,
             mask=g_ok[:, None])
    tl.store(part_max_ptr + first + rows, run_max, mask=g_ok)  # -inf and 0 for a split past the context
    tl.store(part_sum_ptr + first + rows, run_sum, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, rows_ptr,
    stride_ot, stride_oh,
    H, D, P,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + s)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < P
    first = (s * H + h) * P
    maxes = tl.load(part_max_ptr + first + p, mask=p_ok, other=float("-inf"))  # [BLOCK_P]; split 0 is never empty
    sums = tl.load(part_sum_ptr + first + p, mask=p_ok, other=0.0)
    weights = tl.exp(maxes - tl.max(maxes, axis=0))  # 0 for empty splits
    d = tl.arange(0, BLOCK_D)
    accs = tl.load(part_acc_ptr + (first + p).to(tl.int64)[:, None] * BLOCK_D + d[None, :], mask=p_ok[:, None],
                   other=0.0)  # [BLOCK_P, Dp]
    out = tl.sum(weights[:, None] * accs, axis=0) / tl.sum(weights * sums, axis=0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cache_ptr, tables_ptr, q_starts_ptr, q_lens_ptr, prefix_lens_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_ts,
    stride_cb, stride_ckv, stride_co, stride_ch, layer_offset,
    scale, G, D,
    BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFIX_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    kv_h = h // G  # the KV head this query head reads
    mb = tl.program_id(2)
    q_start = tl.load(q_starts_ptr + s)
    q_len = tl.load(q_lens_ptr + s)
    prefix_len = tl.load(prefix_lens_ptr + s)
    m = tl.arange(0, BLOCK_M)
    i = mb * BLOCK_M + m  # [BLOCK_M] query index within the sequence's new tokens
    i_ok = i < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # Every tile is read as one 64-bit base pointer (its first row) plus 32-bit offsets.
    first_row = q_start + mb * BLOCK_M  # int64 (loaded)
    q_mask = i_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + first_row * stride_qt + h * stride_qh + (m[:, None] * stride_qt + d[None, :]), mask=q_mask,
                other=0.0)  # [BLOCK_M, Dp]
    run_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    live_tile = mb * BLOCK_M < q_len  # programs past the sequence's queries do nothing
    # 1. The cached prefix: every new token sees all of it, PREFIX_N tokens a tile.
    prefix_end = tl.where(live_tile, prefix_len, 0)
    table = tables_ptr + s.to(tl.int64) * stride_ts
    head = cache_ptr + layer_offset + kv_h * stride_ch  # this layer's and KV head's K in block 0
    c = tl.arange(0, PREFIX_N)
    for n0 in range(0, prefix_end, PREFIX_N):
        live = n0 + c < prefix_len
        tile_mask = live[:, None] & d_ok[None, :]
        if PREFIX_N <= BS:  # the tile lies in one block
            block = tl.load(table + n0 // BS)
            base = head + block * stride_cb + (n0 % BS) * stride_co
            offsets = c[:, None] * stride_co + d[None, :]  # [PREFIX_N, Dp]
        else:  # blocks smaller than 16 tokens: a base a token
            block = tl.load(table + (n0 + c) // BS, mask=live, other=0)
            base = head
            offsets = (block * stride_cb + ((n0 + c) % BS) * stride_co)[:, None] + d[None, :]
        k = tl.load(base + offsets, mask=tile_mask, other=0.0)  # [PREFIX_N, Dp]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, PREFIX_N]
        scores = tl.where(live[None, :], scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        correction = tl.exp(run_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        v = tl.load(base + stride_ckv + offsets, mask=tile_mask, other=0.0)
        run_sum = run_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        run_max = new_max
    # 2. This step's tokens, causally (up to the diagonal of this query tile), BLOCK_N a tile.
    self_end = tl.where(live_tile, tl.minimum(q_len, (mb + 1) * BLOCK_M), 0)
    j = tl.arange(0, BLOCK_N)
    k_offsets = j[:, None] * stride_kt + d[None, :]  # [BLOCK_N, Dp]
    v_offsets = j[:, None] * stride_vt + d[None, :]
    k_head = k_ptr + q_start * stride_kt + kv_h * stride_kh  # the sequence's first new token's K
    v_head = v_ptr + q_start * stride_vt + kv_h * stride_vh
    for n0 in range(0, self_end, BLOCK_N):
        live = n0 + j < q_len
        tile_mask = live[:, None] & d_ok[None, :]
        k = tl.load(k_head + n0 * stride_kt + k_offsets, mask=tile_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(live[None, :] & ((n0 + j)[None, :] <= i[:, None]), scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        correction = tl.exp(run_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        v = tl.load(v_head + n0 * stride_vt + v_offsets, mask=tile_mask, other=0.0)
        run_sum = run_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        run_max = new_max
    out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]  # 0 only in tiles past the queries (not stored)
    tl.store(out_ptr + first_row * stride_ot + h * stride_oh + (m[:, None] * stride_ot + d[None, :]),
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


# -- host side -------------------------------------------------------------------------------------


def _padded_head_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs >= 16 on GPUs


def _cache_strides(kv_cache: torch.Tensor, layer: int) -> tuple[int, int, int, int, int]:
    """(block, k/v, offset, head) strides and the layer's offset, in elements."""
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's head dim must be contiguous")
    sb, sl, skv, sh, so, _ = kv_cache.stride()
    return sb, skv, so, sh, layer * sl


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
    layer: int,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_blocks: torch.Tensor,  # [T] long
    slot_offsets: torch.Tensor,  # [T] long
) -> None:
    """Store each new token's K and V at (slot_blocks[t], layer, slot_offsets[t])."""
    t, h, d = k.shape
    if t == 0:
        return
    k, v = _unit_last(k), _unit_last(v)
    _write_kv_kernel[(t, 2)](
        k, v, kv_cache, slot_blocks, slot_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *_cache_strides(kv_cache, layer),
        h, d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
    )


def decode_attention(
    q: torch.Tensor,  # [T, H, D]: the flat batch's queries (only the decode rows are read)
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D], this step's K/V already written
    layer: int,
    rows: torch.Tensor,  # [S_d] long: the decode rows of q (and of out)
    block_tables: torch.Tensor,  # [S_d, MB] long
    context_lens: torch.Tensor,  # [S_d] long, >= 1
    scale: float,
    out: torch.Tensor,  # [T, H, D]: rows `rows` are written
    tokens_per_split: int = DEFAULT_TOKENS_PER_SPLIT,
    group_tile: int | None = None,
) -> None:
    """Attention of one new token per sequence to its whole context, read through the block table.

    The context (at most MB * bs tokens) is cut into P = ceil(MB * bs / tokens_per_split) splits; each split
    keeps its own softmax max, sum and weighted values, and a second kernel combines them. A split program
    handles one KV head and group_tile query heads of its group (default DECODE_GROUP_ROWS: the whole group up
    to 16), so it reads each K/V tile once for them; group_tile=1 runs one program per query head."""
    s_d = rows.shape[0]
    if s_d == 0:
        return
    _, _, _, h_kv, bs, d = kv_cache.shape
    h = q.shape[1]
    mb = block_tables.shape[1]
    splits = max(1, triton.cdiv(mb * bs, tokens_per_split))
    dp = _padded_head_dim(d)
    part_acc = torch.empty(s_d * h * splits, dp, dtype=torch.float32, device=q.device)  # [S_d * H * P, Dp]
    part_max = torch.empty(s_d * h * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    group = h // h_kv
    block_n, num_warps = decode_config(bs, dp)
    block_g = group_tile or DECODE_GROUP_ROWS
    if block_g < 1 or block_g & (block_g - 1):
        raise ValueError(f"group_tile ({group_tile}) must be a power of two")
    if tokens_per_split % block_n:
        raise ValueError(f"tokens_per_split ({tokens_per_split}) must be a multiple of the decode tile ({block_n})")
    _decode_split_kernel[(s_d, decode_head_programs(h, h_kv, block_g), splits)](
        q, kv_cache, block_tables, context_lens, rows, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), block_tables.stride(0),
        *_cache_strides(kv_cache, layer),
        scale, h, d, splits,
        G=group, BLOCK_G=block_g,
        BS=bs, BLOCK_N=block_n, BLOCK_D=dp, TOKENS_PER_SPLIT=tokens_per_split, num_warps=num_warps,
    )
    _decode_reduce_kernel[(s_d, h)](
        part_acc, part_max, part_sum, out, rows, out.stride(0), out.stride(1), h, d, splits,
        BLOCK_P=triton.next_power_of_2(splits), BLOCK_D=dp,
    )


def decode_head_programs(h: int, h_kv: int, block_g: int) -> int:
    """The decode split kernel's programs over heads (its grid's second axis): ceil(G / BLOCK_G) a KV head."""
    return h_kv * triton.cdiv(h // h_kv, block_g)


def decode_kv_bytes(context_lens: list[int], h: int, h_kv: int, d: int, dtype: torch.dtype,
                    group_tile: int | None = None) -> int:
    """Bytes of K and V that decode_attention reads from the cache for decode rows of these contexts. Each program
    over heads (decode_head_programs, as launched) reads, in its split, the K and V of every context token once,
    D elements each (its loads are masked to the context; the splits partition it), whatever G and BLOCK_G.
    group_tile=1 gives one program per query head: the same kernel reading every tile G times."""
    block_g = group_tile or DECODE_GROUP_ROWS
    return decode_head_programs(h, h_kv, block_g) * sum(context_lens) * 2 * d * dtype.itemsize


class PrefillRows:
    """The sequences of a step that bring several new tokens (fresh prefills and chunked prefills), as tensors."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        starts, lens, prefixes, tables = [], [], [], []
        for start, end in meta.fresh_spans:
            starts.append(start)
            lens.append(end - start)
            prefixes.append(0)
            tables.append(None)
        for start, end, table, context_len in meta.partial:
            starts.append(start)
            lens.append(end - start)
            prefixes.append(context_len - (end - start))
            tables.append(table)
        self.num_seqs = len(starts)
        self.max_len = max(lens, default=0)
        self.q_starts = torch.tensor(starts, dtype=torch.long, device=device)  # [S_p]
        self.q_lens = torch.tensor(lens, dtype=torch.long, device=device)  # [S_p]
        self.prefix_lens = torch.tensor(prefixes, dtype=torch.long, device=device)  # [S_p]
        width = max((t.shape[0] for t in tables if t is not None), default=1)
        self.block_tables = torch.zeros(max(1, self.num_seqs), width, dtype=torch.long, device=device)  # [S_p, MB]
        for i, table in enumerate(tables):
            if table is not None:
                self.block_tables[i, : table.shape[0]] = table


# Launch configurations: tile sizes and warps, chosen by register count and spills compiled for sm_90
# (scripts/triton_registers.py; the limits are checked by tests/test_triton_kernels.py, the counts are in
# docs/benchmarks.md). Under the interpreter the tiles are small, for speed, and the warps are ignored.


def cache_tile(block_size: int, limit: int) -> int:
    """Tokens of a tile read from the cache: one block or a slice of one (one base pointer a tile) when the
    block size is at least 16, else 16 tokens over several blocks (tl.dot needs 16 on GPUs)."""
    return max(16, min(block_size, limit))


def prefill_config(dtype: torch.dtype, padded_head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the prefill kernel: queries a tile, new keys a tile, warps.

    16-bit: 8 warps, on [128, 64] tiles up to D = 64 and [64, 64] above (sm_90, D = 128: 158 registers, 112 KiB
    of shared memory; [128, 64] took 222 there and spilled on sm_80 with 128-token blocks; 4 warps on [64, 64]
    took 246). float32 (tests, references): [32, 32] over 4 warps."""
    if INTERPRETED:
        return 16, 16, 4
    if dtype == torch.float32:
        return 32, 32, 4
    return (128, 64, 8) if padded_head_dim <= 64 else (64, 64, 8)


def decode_config(block_size: int, padded_head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel: context tokens a tile (a KV block or a slice of one), warps:
    4 on tiles up to 32 tokens (40-56 registers on sm_90), 8 on 64-token tiles (block size >= 64)."""
    if INTERPRETED:
        return cache_tile(block_size, 16), 4
    block_n = cache_tile(block_size, 64)
    return block_n, 8 if block_n >= 64 else 4


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
    layer: int,
    seqs: PrefillRows,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: the rows of seqs are written
) -> None:
    """Each new token of seqs attends to its sequence's cached prefix (through the block table) and causally
    to the sequence's new tokens (from k and v)."""
    if seqs.num_seqs == 0:
        return
    _, _, _, h_kv, bs, d = kv_cache.shape
    h = q.shape[1]
    k, v = _unit_last(k), _unit_last(v)
    dp = _padded_head_dim(d)
    block_m, block_n, num_warps = prefill_config(q.dtype, dp)
    _prefill_kernel[(seqs.num_seqs, h, triton.cdiv(seqs.max_len, block_m))](
        q, k, v, out, kv_cache, seqs.block_tables, seqs.q_starts, seqs.q_lens, seqs.prefix_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        seqs.block_tables.stride(0),
        *_cache_strides(kv_cache, layer),
        scale, h // h_kv, d,
        BS=bs, BLOCK_M=block_m, BLOCK_N=block_n, PREFIX_N=cache_tile(bs, block_n), BLOCK_D=dp,
        num_warps=num_warps,
    )


# The last step's PrefillRows: every layer of a step shares one AttentionMetadata, so it is built once a step.
_last_prefill: tuple[AttentionMetadata, PrefillRows] | None = None


def forget_last_step() -> None:
    """Drop the last step's PrefillRows (and the metadata it holds on to): an engine closing frees its memory."""
    global _last_prefill
    _last_prefill = None


def _prefill_rows(meta: AttentionMetadata, device: torch.device) -> PrefillRows:
    global _last_prefill
    last = _last_prefill
    if last is not None and last[0] is meta:
        return last[1]
    rows = PrefillRows(meta, device)
    _last_prefill = (meta, rows)
    return rows


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, Hkv, bs, D]
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """fastserve_kernels.paged_attention.paged_attention, on Triton kernels: write this step's K/V into the cache,
    then attend every new token to its sequence's context (causally)."""
    q = _unit_last(q)
    write_kv(kv_cache, layer, k, v, meta.slot_blocks, meta.slot_offsets)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_attention(q, kv_cache, layer, meta.decode_token_index, meta.decode_block_tables, meta.decode_context_lens,
                     scale, out)
    prefill_attention(q, k, v, kv_cache, layer, _prefill_rows(meta, q.device), scale, out)
    return out
