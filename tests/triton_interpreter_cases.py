"""The Triton kernels (fastserve_kernels/triton_attention.py) against the plain-torch
reference (fastserve_kernels/paged_attention.py) on CPU, under Triton's interpreter: the
cache write, decode attention through shuffled block tables (contexts of 1,
on and just past block boundaries, ragged, cut into several splits), prefill
and chunked prefill in mixed batches, float32 and float16, with as many KV
heads as query heads and with fewer (grouped-query attention); and the whole
engine on attention_backend="triton" against transformers' logprobs, once
through Engine with a fixed cache, once through LLM(...) as a user starts it
(the KV cache sized from the defaults, max_num_batched_tokens 8,192), and with
chunked prefill on OPT and on a Llama of 2 KV heads under 8 query heads.

Not collected by the suite (no test_ prefix): tests/test_triton_kernels.py
runs it in a fresh pytest process with TRITON_INTERPRET=1 set before triton is
first imported (triton decorates its own library then, interpreter or
compiler, once per process), so no other test module's imports can change it.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py (TRITON_INTERPRET=1)"

import transformers  # noqa: E402
import triton  # noqa: E402, F401  (a test requirement: its absence is a failure, not a skip)
from transformers import OPTForCausalLM  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from fastserve_kernels import paged_attention as ref  # noqa: E402
from fastserve_kernels import triton_attention as tri  # noqa: E402
from tests.conftest import SMALL_PRE_LN  # noqa: E402
from tests.paged_batches import make_batch, tol  # noqa: E402
from tests.test_llama_reference import ROPE, TRAITS  # noqa: E402
from tests.test_model_reference import hf_logprobs, run_staggered  # noqa: E402


def test_kernels_are_interpreted():
    assert tri.interpreter_ready()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_stores_each_token_in_its_slot_like_the_reference(dtype):
    q, k, v, kv, meta, _ = make_batch([(0, 5), (6, 1), (3, 4)], h=3, d=24, bs=4, dtype=dtype)
    expected = kv.clone()
    ref.write_kv(expected, 1, k, v, meta)
    tri.write_kv(kv, 1, k, v, meta.slot_blocks, meta.slot_offsets)
    assert torch.equal(kv, expected)


# The cache is read a tile of 16 tokens at a time under the interpreter (tri.cache_tile): block size 4 puts 4
# blocks in a tile (a base a token), 16 one block a tile, 32 half a block a tile (one base pointer a tile).
TILE_PATHS = [4, 16, 32]


def test_cache_tiles_cover_each_path():
    assert [tri.cache_tile(bs, 16) for bs in TILE_PATHS] == [16, 16, 16]
    assert [tri.cache_tile(bs, 64) for bs in (1, 8, 16, 32, 64, 128)] == [16, 16, 16, 32, 64, 64]
    assert tri.decode_config(16, 64)[0] == 16  # the interpreter's tile


@pytest.mark.parametrize(("d", "dtype", "bs"), [(16, torch.float32, 4), (24, torch.float16, 4), (32, torch.float32, 4),
                                                (24, torch.float16, 16), (32, torch.float32, 32)])
# 24: a head dim that is not a power of two
def test_decode_matches_reference_across_block_boundaries_and_splits(dtype, d, bs):
    # Contexts (cached + 1): 1 (a lone token), 4, 5, 8, 13, 16, 17, 33, 41, 67 (several 16-token splits): on,
    # just past and inside block boundaries for each block size.
    seqs = [(0, 1), (3, 1), (4, 1), (7, 1), (12, 1), (15, 1), (16, 1), (32, 1), (40, 1), (66, 1)]
    q, k, v, kv, meta, tables = make_batch(seqs, h=2, d=d, bs=bs, dtype=dtype)
    # The reference takes the context-1 row as a fresh span; the kernel takes every row as a decode row.
    rows = torch.arange(len(seqs))
    mb = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (mb - len(t)) for t in tables])
    lens = torch.tensor([c + n for c, n in seqs])
    expected_kv = kv.clone()
    expected = ref.paged_attention(q, k, v, expected_kv, 1, meta, d**-0.5)
    tri.write_kv(kv, 1, k, v, meta.slot_blocks, meta.slot_offsets)
    for tokens_per_split in (16, 512):  # 67 tokens in 5 splits; everything in one
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        tri.decode_attention(q.contiguous(), kv, 1, rows, block_tables, lens, d**-0.5, out, tokens_per_split)
        torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize(("dtype", "bs"), [(torch.float32, 4), (torch.float16, 4), (torch.float32, 16),
                                         (torch.float16, 32)])
def test_mixed_batch_of_prefill_chunked_prefill_and_decode_matches_reference(dtype, bs):
    d = 16
    seqs = [
        (0, 1),  # a one-token prompt
        (0, 21),  # a fresh prompt longer than one 16-query tile
        (9, 1),  # decode
        (3, 6),  # chunked prefill: a prefix ending mid-block, new tokens crossing blocks
        (8, 18),  # a prefix of exactly 2 blocks (bs 4), 18 new tokens (two query tiles)
        (0, 5),
        (30, 1),
        (37, 20),  # a prefix of 2 tiles and a part (bs 16: 2 blocks and 5 tokens; bs 32: one and 5)
    ]
    q, k, v, kv, meta, _ = make_batch(seqs, h=2, d=d, bs=bs, dtype=dtype, seed=3)
    expected_kv = kv.clone()
    expected = ref.paged_attention(q, k, v, expected_kv, 1, meta, d**-0.5)
    out = tri.paged_attention(q, k, v, kv, 1, meta, d**-0.5)
    assert torch.equal(kv, expected_kv)
    torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize(("h", "h_kv", "bs"), [(4, 2, 4), (3, 1, 16)])
def test_grouped_query_attention_matches_reference(h, h_kv, bs):
    """Fewer KV heads than query heads (2 query heads a KV head; one KV head for 3): the cache write of the KV
    heads, decode over several splits, prefill and chunked prefill over a cached prefix, in one mixed batch."""
    seqs = [(0, 1), (0, 19), (9, 1), (3, 6), (8, 18), (40, 1), (37, 5)]
    q, k, v, kv, meta, _ = make_batch(seqs, h=h, d=16, bs=bs, dtype=torch.float32, seed=7, h_kv=h_kv)
    assert kv.shape[3] == h_kv and k.shape[1] == h_kv and q.shape[1] == h
    expected_kv = kv.clone()
    expected = ref.paged_attention(q, k, v, expected_kv, 1, meta, 16**-0.5)
    out = tri.paged_attention(q, k, v, kv, 1, meta, 16**-0.5)
    assert torch.equal(kv, expected_kv)
    torch.testing.assert_close(out, expected, **tol(torch.float32))
    rows = meta.decode_token_index
    split = torch.full(q.shape, float("nan"))
    tri.decode_attention(q.contiguous(), kv, 1, rows, meta.decode_block_tables, meta.decode_context_lens, 16**-0.5,
                         split, 16)  # the 41-token context in 3 splits
    torch.testing.assert_close(split[rows], expected[rows], **tol(torch.float32))


def decode_batch(h, h_kv, bs, dtype, seed=13):
    """Decode rows only, contexts 1 to 100 tokens (up to 25 blocks of 4, 7 of 16, 4 of 32; 7 splits of 16), their
    K/V already in the cache, and the reference's output for them."""
    seqs = [(0, 1), (3, 1), (15, 1), (16, 1), (40, 1), (66, 1), (99, 1)]
    q, k, v, kv, meta, tables = make_batch(seqs, h=h, d=16, bs=bs, dtype=dtype, seed=seed, h_kv=h_kv)
    expected = ref.paged_attention(q, k, v, kv, 1, meta, 16**-0.5)  # writes this step's K/V into kv
    mb = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (mb - len(t)) for t in tables])
    lens = torch.tensor([c + n for c, n in seqs])
    return q, kv, torch.arange(len(seqs)), block_tables, lens, expected


@pytest.mark.parametrize(("h", "h_kv", "bs", "group_tile", "dtype"), [
    (9, 3, 4, None, torch.float32),  # SmolLM2's 9 query heads over 3 KV heads: G = 3 in a 16-row tile
    (9, 3, 16, None, torch.float32),
    (8, 2, 16, None, torch.float32),  # G = 4
    (8, 2, 32, None, torch.float16),
    (3, 3, 16, None, torch.float32),  # G = 1: one query head a program, 15 padded rows
    (12, 2, 16, 4, torch.float32),  # G = 6 cut over 2 programs a KV head, the second half padded
    (9, 3, 16, 1, torch.float32),  # one program a query head
])
def test_decode_with_query_head_groups_matches_reference_over_blocks_and_splits(h, h_kv, bs, group_tile, dtype):
    """One decode program a KV head (and group_tile query heads of it): every query head's output, through
    shuffled block tables, with the context in one split and in up to 7."""
    q, kv, rows, block_tables, lens, expected = decode_batch(h, h_kv, bs, dtype)
    assert q.stride(-1) == 1 and not q.is_contiguous()  # a view of the fused projection, as the model gives it
    for tokens_per_split in (16, 512):
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        tri.decode_attention(q, kv, 1, rows, block_tables, lens, 16**-0.5, out, tokens_per_split, group_tile)
        torch.testing.assert_close(out, expected, **tol(dtype))


@contextlib.contextmanager
def bytes_loaded_from(x: torch.Tensor):
    """Inside: the bytes that interpreted kernels load from x's memory (unmasked lanes whose address lies in x),
    counted at the interpreter's loads; yields a one-element list holding the count."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    lo = x.data_ptr()
    hi = lo + x.numel() * x.element_size()
    count = [0]
    real = builder.create_masked_load

    def load(ptrs, mask, *args):
        addresses = ptrs.data.astype(np.uint64)
        lanes = np.broadcast_to(mask.data, addresses.shape) & (addresses >= lo) & (addresses < hi)
        count[0] += int(lanes.sum()) * x.element_size()
        return real(ptrs, mask, *args)

    builder.create_masked_load = load
    try:
        yield count
    finally:
        del builder.create_masked_load


@pytest.mark.parametrize(("h", "h_kv", "dtype"), [(9, 3, torch.float32), (8, 2, torch.float16), (4, 4, torch.float32),
                                                  (12, 2, torch.float32)])
def test_decode_reads_the_kv_cache_once_per_group(h, h_kv, dtype):
    """The KV bytes a decode call loads, counted at the interpreter's loads: decode_kv_bytes's figure, and 1/G of
    the same kernel run one program per query head (group_tile=1), which reads every tile G times."""
    q, kv, rows, block_tables, lens, expected = decode_batch(h, h_kv, 16, dtype)
    g = h // h_kv
    loaded = {}
    for group_tile in (None, 1):
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        with bytes_loaded_from(kv) as count:
            tri.decode_attention(q, kv, 1, rows, block_tables, lens, 16**-0.5, out, 32, group_tile)  # 4 splits
        torch.testing.assert_close(out, expected, **tol(dtype))
        loaded[group_tile] = count[0]
        assert count[0] == tri.decode_kv_bytes(lens.tolist(), h, h_kv, 16, dtype, group_tile)
    assert loaded[1] == g * loaded[None] == h * int(lens.sum()) * 2 * 16 * kv.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_over_any_cached_prefix_matches_reference(dtype):
    """Chunked prefill: any number of new tokens over any number of cached ones (prefixes of 0, mid-block, on a block
    boundary, past one query tile; chunks of 1, a block, sizes that divide nothing), in one flat batch."""
    seqs = [(0, 1), (1, 1), (3, 1), (4, 4), (3, 4), (5, 7), (8, 3), (7, 13), (16, 2), (2, 31), (21, 17), (0, 9)]
    q, k, v, kv, meta, _ = make_batch(seqs, h=2, d=16, bs=4, dtype=dtype, seed=11)
    expected_kv = kv.clone()
    expected = ref.paged_attention(q, k, v, expected_kv, 1, meta, 16**-0.5)
    out = tri.paged_attention(q, k, v, kv, 1, meta, 16**-0.5)
    assert torch.equal(kv, expected_kv)
    torch.testing.assert_close(out, expected, **tol(dtype))


def test_engine_on_triton_kernels_matches_transformers(small_checkpoint):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, num_gpu_blocks_override=64, seed=0,
                                 profile="analytic", device="cpu", attention_backend="triton"))
    assert engine.executor.runner.attention_backend == "triton"
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(3, SMALL_PRE_LN["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    done = run_staggered(engine, {
        0: [("a", prompt(13), params), ("b", prompt(4), params)],
        2: [("c", prompt(9), params)],  # a prefill beside two decodes
    })
    assert sorted(done) == ["a", "b", "c"]
    for rid, out in done.items():
        comp = out.outputs[0]
        full = out.prompt_token_ids + comp.token_ids
        hf = hf_logprobs(model_dir, full)  # [len, V]
        p = len(out.prompt_token_ids)
        checked = 0
        for pos in range(1, p):
            for tok, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(hf[pos - 1, tok])) < 1e-3, f"{rid} prompt pos {pos} token {tok}"
                checked += 1
        for j, tok in enumerate(comp.token_ids):
            assert tok == int(hf[p + j - 1].argmax()), f"{rid} step {j}: greedy token differs from transformers"
            for t, lp in comp.logprobs[j].items():
                assert abs(lp - float(hf[p + j - 1, t])) < 1e-3, f"{rid} step {j} token {t}"
                checked += 1
        assert checked >= 3 * (p - 1 + len(comp.token_ids))


@pytest.mark.timeout(150)  # it finishes in seconds; before start-up skipped the peak-memory forward on CPU, LLM(...)
# ran 8,192 tokens through the interpreted prefill kernel and did not finish in 25 minutes
def test_llm_with_default_sizing_on_triton_kernels_matches_transformers(small_checkpoint):
    """LLM(...) with no blocks override: start-up sizes the KV cache (no warm-up forward off CUDA), then 4
    prompts x 8 greedy tokens whose logprobs match transformers' on the same random-weight checkpoint."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    with LLM(model=str(model_dir), device="cpu", attention_backend="triton", profile="analytic", seed=0) as llm:
        executor = llm.engine.executor
        assert executor.runner.attention_backend == "triton" and executor.num_device_blocks > 1000
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, SMALL_PRE_LN["vocab_size"], (n,), generator=g).tolist() for n in (11, 3, 20, 6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 4
    for out in outs:
        comp = out.outputs[0]
        hf = hf_logprobs(model_dir, out.prompt_token_ids + comp.token_ids)  # [len, V]
        p = len(out.prompt_token_ids)
        for j, tok in enumerate(comp.token_ids):
            assert tok == int(hf[p + j - 1].argmax()), f"step {j}: greedy token differs from transformers"
            assert len(comp.logprobs[j]) >= 2
            for t, lp in comp.logprobs[j].items():
                assert abs(lp - float(hf[p + j - 1, t])) < 1e-3, f"step {j} token {t}"


def test_engine_chunked_prefill_on_triton_kernels_matches_transformers(small_checkpoint):
    """Chunked prefill: prompts split under a 5-token budget (chunks over a cached prefix through the prefill kernel,
    one-token chunks through the decode kernel, beside decodes) give transformers' greedy tokens and logprobs."""
    check_chunked_prefill_on_triton(small_checkpoint(SMALL_PRE_LN), SMALL_PRE_LN["vocab_size"], OPTForCausalLM)


@pytest.mark.parametrize(("architecture", "kv_heads", "rope"), [
    ("LlamaForCausalLM", 2, "rope-llama3"), ("Qwen2ForCausalLM", 2, "rope-off"),
    ("MistralForCausalLM", 2, "rope-llama3"), ("LlamaForCausalLM", 8, "rope-off")],
    ids=["llama-kv-heads-2-of-8-rope-llama3", "qwen2-kv-heads-2-of-8", "mistral-kv-heads-2-of-8-rope-llama3",
         "llama-kv-heads-8-of-8"])
def test_llama_family_on_triton_kernels_matches_transformers(llama_checkpoint, architecture, kv_heads, rope):
    """The same with the Llama family (tests/test_llama_reference.py's TRAITS: Qwen2's q/k/v biases and tied
    embeddings, Mistral's head_dim of 16): 2 KV heads under 8 query heads, the kernels writing and reading the KV
    heads a query head group shares, with Llama 3's rope scaling and without; and a KV head per query head."""
    model_dir = llama_checkpoint(architecture, num_key_value_heads=kv_heads, **TRAITS[architecture], **ROPE[rope])
    check_chunked_prefill_on_triton(model_dir, 512, getattr(transformers, architecture))


def check_chunked_prefill_on_triton(model_dir, vocab_size: int, model_class) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, num_gpu_blocks_override=64, seed=0,
                                 profile="analytic", device="cpu", attention_backend="triton",
                                 enable_chunked_prefill=True, max_num_batched_tokens=5))
    g = torch.Generator().manual_seed(4)
    prompt = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    done = run_staggered(engine, {0: [("a", prompt(14), params), ("b", prompt(3), params)],
                                  2: [("c", prompt(11), params)]})
    assert sorted(done) == ["a", "b", "c"]
    for rid, out in done.items():
        comp = out.outputs[0]
        hf = hf_logprobs(model_dir, out.prompt_token_ids + comp.token_ids, model_class)
        p = len(out.prompt_token_ids)
        assert len(out.prompt_logprobs) == p
        for pos in range(1, p):
            for tok, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(hf[pos - 1, tok])) < 1e-4, f"{rid} prompt pos {pos} token {tok}"
        for j, tok in enumerate(comp.token_ids):
            assert tok == int(hf[p + j - 1].argmax()), f"{rid} step {j}: greedy token differs from transformers"
            for t, lp in comp.logprobs[j].items():
                assert abs(lp - float(hf[p + j - 1, t])) < 1e-4, f"{rid} step {j} token {t}"
