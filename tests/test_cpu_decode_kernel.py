"""The compiled CPU decode kernel (fastserve_kernels/csrc/cpu_decode_attention.cpp, loaded by
fastserve_kernels/cpu_decode_extension.py) against the gathering reference: ragged contexts across block boundaries,
head dims on and off its AVX-512 path, one sequence (heads split across threads) and many, 1 and 2 threads,
float32 and float64, every layer of the cache, and the cache write it does in a decode-only batch; with
grouped-query attention (fewer KV heads in the cache than query heads) too. In bfloat16 it sums in float32 and
rounds once: the float32 reference's output on the same values, rounded to bfloat16.

It must build here (g++ and ninja are on the project's machines; `make install` builds it): a test fails,
and says why, when it does not."""

from __future__ import annotations

import pytest
import torch

from fastserve_kernels import cpu_decode_extension
from fastserve_kernels.paged_attention import AttentionMetadata, decode_attention_gathered, write_kv


@pytest.fixture(scope="module")
def op():
    op = cpu_decode_extension.decode_attention_op()
    assert op is not None, f"the CPU decode kernel did not build: {cpu_decode_extension.unavailable_reason()}"
    return op


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def decode_batch(lens, h, d, bs, dtype, layers=3, seed=0, h_kv=None):
    """A paged cache of random K/V (h_kv heads, default h) over shuffled blocks, tables padded with block 0, this
    step's q [S, h, D] and k/v [S, h_kv, D] as strided views of one fused projection (as the model makes them),
    and the decode metadata."""
    g = torch.Generator().manual_seed(seed)
    h_kv = h_kv or h
    mb = max(-(-n // bs) for n in lens)
    nb = sum(-(-n // bs) for n in lens) + 5
    kv = torch.randn(nb, layers, 2, h_kv, bs, d, generator=g, dtype=dtype)
    perm = torch.randperm(nb - 1, generator=g).add(1).tolist()  # block 0: padding only
    tables = []
    for n in lens:
        own = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(own + [0] * (mb - len(own)))
    qkv = torch.randn(len(lens), h + 2 * h_kv, d, generator=g, dtype=dtype)
    q, k, v = qkv.split([h, h_kv, h_kv], dim=1)
    slot_blocks = torch.tensor([t[(n - 1) // bs] for t, n in zip(tables, lens)])
    slot_offsets = torch.tensor([(n - 1) % bs for n in lens])
    meta = AttentionMetadata(slot_blocks, slot_offsets, [], torch.arange(len(lens)), torch.tensor(tables),
                             torch.tensor(lens), [])
    return q, k, v, kv, meta


SHAPES = [
    ([1, 15, 16, 17, 33, 64, 5, 40, 2], 4, 64, 4),  # block boundaries, many sequences (one per work item)
    ([70], 12, 64, 12),  # one sequence: its heads are split across the threads
    ([3, 31, 48], 2, 80, 2),  # head dim 80 (OPT-2.7b): five AVX-512 registers, an odd one at the end
    ([5, 100, 33], 3, 128, 3),  # head dim 128 (OPT-6.7b and larger): eight registers
    ([7, 20], 3, 40, 3),  # head dim not a multiple of 16: the plain loops
    ([1, 15, 16, 17, 33, 5], 8, 64, 2),  # grouped-query attention: 4 query heads a KV head
    ([70], 12, 64, 4),  # one sequence, 3 query heads a KV head: the threads' head groups cut across KV heads
    ([9, 40], 6, 40, 1),  # one KV head for every query head (multi-query), the plain loops
]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens, h, d, h_kv", SHAPES)
def test_kernel_matches_gathered_reference_on_every_layer(op, threads, dtype, lens, h, d, h_kv):
    bs = 16
    q, _, _, kv, meta = decode_batch(lens, h, d, bs, dtype, h_kv=h_kv)
    before = kv.clone()
    for layer in range(kv.shape[1]):
        got = op(q, q, q, kv, layer, meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks,
                 meta.slot_offsets, d**-0.5, False)
        want = decode_attention_gathered(q, kv, layer, meta, d**-0.5)
        torch.testing.assert_close(got, want)
    assert torch.equal(kv, before)  # write=False writes nothing


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("lens, h, d, h_kv", SHAPES)
def test_bfloat16_sums_in_float32_and_rounds_once(op, threads, lens, h, d, h_kv):
    """A bfloat16 cache and q: the output is the float32 reference's on the same values (every bfloat16 is a
    float32), rounded to bfloat16: within half a bfloat16 step of it (8 significant bits: at most 2^-8 relative),
    plus float32 rounding; a kernel that summed in bfloat16 would be off by several steps over contexts of up to
    100 positions."""
    q, _, _, kv, meta = decode_batch(lens, h, d, 16, torch.bfloat16, h_kv=h_kv)
    for layer in range(kv.shape[1]):
        got = op(q, q, q, kv, layer, meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks,
                 meta.slot_offsets, d**-0.5, False)
        assert got.dtype == torch.bfloat16
        want = decode_attention_gathered(q.float(), kv.float(), layer, meta, d**-0.5)
        torch.testing.assert_close(got.float(), want, rtol=2**-8 + 1e-5, atol=1e-5)
        # and mostly it is the rounded reference itself, bit for bit
        assert (got == want.to(torch.bfloat16)).float().mean() > 0.95


@pytest.mark.parametrize("own_k", [False, True], ids=["fused-k", "own-k"])
def test_bfloat16_writes_the_steps_kv_like_write_kv(op, own_k):
    lens = [1, 16, 17, 47, 9]
    q, k, v, kv, meta = decode_batch(lens, 4, 64, 16, torch.bfloat16, h_kv=2)
    if own_k:
        k = k.contiguous()
    reference = kv.clone()
    write_kv(reference, 1, k, v, meta)
    got = op(q, k, v, kv, 1, meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks,
             meta.slot_offsets, 0.125, True)
    assert torch.equal(kv, reference)
    want = decode_attention_gathered(q.float(), reference.float(), 1, meta, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=2**-8 + 1e-5, atol=1e-5)


@pytest.mark.parametrize("spread", [1e-3, 30.0, 300.0])
def test_kernel_softmax_holds_for_flat_and_peaked_scores(op, spread):
    """Scores from nearly equal to thousands apart (weights down to exp(-87) and below, where the kernel's
    vectorised exp stops being exact and must give ~0): the output still matches the reference."""
    q, _, _, kv, meta = decode_batch([1, 17, 50, 130], 4, 64, 16, torch.float32, seed=3)
    q = q * spread
    args = (meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks, meta.slot_offsets, 0.125, False)
    torch.testing.assert_close(op(q, q, q, kv, 2, *args), decode_attention_gathered(q, kv, 2, meta, 0.125))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("bs", [4, 16, 32])  # a block's scores in part of a register, one, two
@pytest.mark.parametrize("h_kv", [4, 2])  # 2: two query heads a KV head, written once, read by both
@pytest.mark.parametrize("own_k", [False, True], ids=["fused-k", "own-k"])  # own: k rotated, v still a view
def test_kernel_writes_the_steps_kv_like_write_kv_then_attends_to_it(op, threads, bs, h_kv, own_k):
    lens = [1, bs, bs + 1, 3 * bs - 1, 9]
    q, k, v, kv, meta = decode_batch(lens, 4, 64, bs, torch.float32, h_kv=h_kv)
    if own_k:  # as a model with rotary embeddings makes them: k a tensor of its own, v a view of the projection
        k = k.contiguous()
        assert k.stride() != v.stride()
    reference = kv.clone()
    layer = 1
    write_kv(reference, layer, k, v, meta)
    want = decode_attention_gathered(q, reference, layer, meta, 0.125)
    got = op(q, k, v, kv, layer, meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks,
             meta.slot_offsets, 0.125, True)
    assert torch.equal(kv, reference)  # the same rows written, nothing else touched
    torch.testing.assert_close(got, want)


def test_bad_inputs_are_refused_with_a_message(op):
    q, _, _, kv, meta = decode_batch([5], 2, 64, 16, torch.float32)
    args = (meta.decode_block_tables, meta.decode_context_lens, meta.slot_blocks, meta.slot_offsets, 0.125, False)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q.double(), q.double(), q.double(), kv, 0, *args)
    with pytest.raises(RuntimeError, match="contiguous CPU cache"):
        op(q, q, q, kv[::2], 0, *args)


def test_switched_off_it_is_not_used_and_says_why(monkeypatch):
    monkeypatch.setenv(cpu_decode_extension.ENV_SWITCH, "0")
    assert cpu_decode_extension.decode_attention_op() is None
    assert cpu_decode_extension.describe() == "sparse torch ops (FASTSERVE_CPU_KERNEL=0)"


def test_without_a_compiler_it_says_why_and_the_sparse_ops_serve(tmp_path):
    """A machine that cannot build it (no C++ compiler here: CXX fails, and no cached build): one warning, the
    reason, and decode attention on the sparse ops, giving the same answer."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from fastserve_kernels import cpu_decode_extension as e\n"
        "from fastserve_kernels.paged_attention import paged_attention, decode_attention_gathered\n"
        "from tests.test_cpu_decode_kernel import decode_batch\n"
        "assert e.decode_attention_op() is None\n"
        "print(e.describe())\n"
        "q, k, v, kv, meta = decode_batch([5, 17, 40], 4, 64, 16, torch.float32)\n"
        "got = paged_attention(q, k, v, kv, 1, meta, 0.125)\n"
        "torch.testing.assert_close(got, decode_attention_gathered(q, kv, 1, meta, 0.125))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sparse torch ops (CalledProcessError"), proc.stdout
    assert "the CPU decode kernel could not be built" in proc.stderr
