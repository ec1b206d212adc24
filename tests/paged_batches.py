"""Random flat batches over a paged KV cache, for the kernel tests (tests/triton_interpreter_cases.py,
tests/test_triton_kernels.py): what model_runner.prepare() builds, from (cached, new) token counts."""

from __future__ import annotations

import torch

from fastserve_kernels.paged_attention import AttentionMetadata

L = 2  # layers in the test caches; the kernels write and read layer 1


def make_batch(seqs, h, d, bs, dtype, seed=0, num_blocks=None, h_kv=None):
    """A flat batch over a paged cache. seqs: (tokens cached before this step, new tokens) per sequence; h query
    heads over h_kv KV heads (default h; fewer: grouped-query attention).
    Returns (q, k, v, kv_cache, meta, block tables); the cache holds every cached token's K/V, scattered
    over shuffled blocks, and noise elsewhere (so a kernel that reads a wrong slot is caught)."""
    g = torch.Generator().manual_seed(seed)
    h_kv = h_kv or h
    need = sum(-(-(c + n) // bs) for c, n in seqs)
    nb = num_blocks or need + 3
    perm = torch.randperm(nb, generator=g).tolist()
    kv = torch.randn(nb, L, 2, h_kv, bs, d, generator=g).to(dtype)
    tables, full_k, full_v = [], [], []
    for c, n in seqs:
        tables.append([perm.pop() for _ in range(-(-(c + n) // bs))])
        full_k.append(torch.randn(c + n, h_kv, d, generator=g).to(dtype))
        full_v.append(torch.randn(c + n, h_kv, d, generator=g).to(dtype))
    for (c, _), table, k, v in zip(seqs, tables, full_k, full_v):
        for p in range(c):
            kv[table[p // bs], 1, 0, :, p % bs] = k[p]
            kv[table[p // bs], 1, 1, :, p % bs] = v[p]
    qs = [torch.randn(n, h, d, generator=g).to(dtype) for _, n in seqs]
    meta = AttentionMetadata.for_sequences(seqs, tables, bs)
    # q, k, v as the model produces them: strided views of one fused [T, H + 2 Hkv, D] projection.
    k_new = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)])
    qkv = torch.cat([torch.cat(qs), k_new, v_new], dim=1)  # [T, H + 2 Hkv, D]
    q, k, v = qkv.split([h, h_kv, h_kv], dim=1)
    return q, k, v, kv, meta, tables


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
