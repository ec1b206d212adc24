"""fastserve_kernels/paged_attention against plain dense causal attention, with
scattered (non-contiguous) block tables and contexts across block boundaries,
with as many KV heads as query heads and with fewer (grouped-query attention);
the CPU decode path that reads the cache in place against the gathering
reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastserve_kernels.paged_attention as paged
from fastserve_kernels import cpu_decode_extension
from fastserve_kernels.cpu_decode_attention import DecodeRows, decode_attention_in_place, supports_in_place_decode
from fastserve_kernels.paged_attention import (
    AttentionMetadata,
    Workspace,
    decode_attention_gathered,
    gather_kv,
    paged_attention,
)

H, D, BS, NB, L = 3, 8, 4, 40, 2


def dense_causal(q, k, v, scale):  # q [n, H, D], k/v [c, Hkv, D]; q: the last n positions of k/v
    n, c = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]  # query head h reads KV head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=scale).transpose(0, 1)


# (cached tokens before this step, new tokens this step)
MIXED = [(0, 7), (9, 1), (4, 1), (0, 1), (5, 6), (12, 1)]
DECODE_ONLY = [(9, 1), (4, 1), (12, 1), (3, 1)]  # the shortcut that returns decode attention unscattered


@pytest.mark.parametrize("seqs", [MIXED, DECODE_ONLY], ids=["mixed", "decode_only"])
# The CPU decode paths: the compiled kernel (fastserve_kernels/csrc), the sparse torch ops, the gathering reference.
@pytest.mark.parametrize("decode_path", ["compiled", "sparse", "gathered"])
@pytest.mark.parametrize("use_workspace", [False, True])
@pytest.mark.parametrize("h_kv", [H, 1], ids=["kv-heads-equal", "grouped"])  # 1: every query head reads one KV head
def test_paged_attention_matches_dense_for_fresh_decode_and_partial(use_workspace, decode_path, seqs, h_kv,
                                                                    monkeypatch):
    if decode_path == "compiled":
        assert cpu_decode_extension.decode_attention_op() is not None, cpu_decode_extension.unavailable_reason()
    elif decode_path == "sparse":
        monkeypatch.setattr(paged, "_cpu_decode_op", lambda kv_cache: None)
    else:
        monkeypatch.setattr(paged, "supports_in_place_decode", lambda kv_cache: False)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(NB, generator=g).tolist()  # scattered block ids
    tables, full_k, full_v = [], [], []
    for cached, new in seqs:
        nblocks = -(-(cached + new) // BS)
        tables.append([perm.pop() for _ in range(nblocks)])
        full_k.append(torch.randn(cached + new, h_kv, D, generator=g))
        full_v.append(torch.randn(cached + new, h_kv, D, generator=g))
    kv = torch.zeros(NB, L, 2, h_kv, BS, D)
    layer = 1
    for (cached, _), table, k, v in zip(seqs, tables, full_k, full_v):  # what earlier steps wrote
        for p in range(cached):
            kv[table[p // BS], layer, 0, :, p % BS] = k[p]
            kv[table[p // BS], layer, 1, :, p % BS] = v[p]
    q_all = [torch.randn(new, H, D, generator=g) for _, new in seqs]
    k_new = [k[cached:] for (cached, _), k in zip(seqs, full_k)]
    v_new = [v[cached:] for (cached, _), v in zip(seqs, full_v)]
    meta = AttentionMetadata.for_sequences(seqs, tables, BS, workspace=Workspace() if use_workspace else None)
    scale = D**-0.5
    out = paged_attention(torch.cat(q_all), torch.cat(k_new), torch.cat(v_new), kv, layer, meta, scale)
    t = 0
    for (_, new), q, k, v in zip(seqs, q_all, full_k, full_v):
        ref = dense_causal(q, k, v, scale)
        torch.testing.assert_close(out[t : t + new], ref, atol=1e-5, rtol=1e-5)
        t += new
    # The new tokens' K/V landed in their blocks, and other layers are untouched.
    assert torch.count_nonzero(kv[:, 0]) == 0
    k_back, v_back = gather_kv(kv, layer, torch.tensor([tables[0]]))  # [1, H, C, D] each
    n0 = sum(seqs[0])
    torch.testing.assert_close(k_back[0, :, :n0].transpose(0, 1), full_k[0])
    torch.testing.assert_close(v_back[0, :, :n0].transpose(0, 1), full_v[0])


def test_write_kv_row_copies_equal_indexed_writes_on_a_strided_cache():
    """The contiguous cache's row-copy write and the indexed write a non-contiguous view takes store the same."""
    g = torch.Generator().manual_seed(2)
    meta = AttentionMetadata.for_sequences([(0, 5), (6, 1), (3, 2)], [[7, 2], [11, 4], [30, 31]], BS)
    k, v = torch.randn(8, H, D, generator=g), torch.randn(8, H, D, generator=g)
    contiguous = torch.zeros(NB, L, 2, H, BS, D)
    strided = torch.zeros(NB, L + 1, 2, H, BS, D)[:, 1:]  # layers 1.. of a bigger cache: not contiguous
    assert not strided.is_contiguous()
    for cache in (contiguous, strided):
        paged.write_kv(cache, 1, k, v, meta)
    torch.testing.assert_close(contiguous, strided)
    assert torch.count_nonzero(contiguous[:, 0]) == 0
    torch.testing.assert_close(contiguous[4, 1, 0, :, 6 % BS], k[5])  # token 6 of [11, 4]: block 4
    torch.testing.assert_close(contiguous[4, 1, 1, :, 6 % BS], v[5])


def test_workspace_reuses_and_grows():
    ws = Workspace()
    like = torch.zeros(1)
    a = ws.get("x", (4, 5), like)
    b = ws.get("x", (2, 5), like)
    assert a.data_ptr() == b.data_ptr()
    c = ws.get("x", (10, 10), like)
    assert c.shape == (10, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens", [[1, 4, 5, 16, 17, 3, 30], [9, 9, 9]], ids=["unequal", "equal"])
@pytest.mark.parametrize("h_kv", [H, 1], ids=["kv-heads-equal", "grouped"])
def test_in_place_decode_matches_gathered_reference(dtype, lens, h_kv):
    """Sequences of unequal lengths (one block, partial blocks, full blocks) or equal ones, scattered tables
    padded with block 0, every layer of a multi-layer cache: the in-place path equals the gathering one."""
    g = torch.Generator().manual_seed(1)
    nb, layers = 64, 3
    kv = torch.randn(nb, layers, 2, h_kv, BS, D, generator=g, dtype=dtype)
    assert supports_in_place_decode(kv)
    perm = torch.randperm(nb, generator=g).tolist()
    mb = max(-(-n // BS) for n in lens)
    tables = []
    for n in lens:
        own = [perm.pop() for _ in range(-(-n // BS))]
        tables.append(own + [0] * (mb - len(own)))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [],
                             torch.arange(len(lens)), torch.tensor(tables), torch.tensor(lens), [])
    rows = DecodeRows.build(kv, meta.decode_block_tables, meta.decode_context_lens, H)
    assert rows.k_rows.numel() == H * sum(lens)
    q = torch.randn(len(lens), H, D, generator=g, dtype=dtype)
    for layer in range(layers):
        got = decode_attention_in_place(q, kv, layer, rows, D**-0.5)
        want = decode_attention_gathered(q, kv, layer, meta, D**-0.5)
        torch.testing.assert_close(got, want)


def test_in_place_decode_is_cpu_float_only():
    """Other dtypes and non-contiguous caches take the gathering reference."""
    kv = torch.zeros(4, 1, 2, H, BS, D)
    assert supports_in_place_decode(kv)
    assert not supports_in_place_decode(kv.to(torch.bfloat16))
    assert not supports_in_place_decode(kv[::2])
