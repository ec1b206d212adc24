"""Chunked prefill (issue 25).

Prefill over a cached prefix: any number of new tokens attending to any number of cached tokens in the paged KV
cache (causal within the new tokens), in the reference attention path against dense attention, and the model
running a prompt's tokens [k, n) given the KV of [0, k): every chunking of a prompt (chunks of 1, of a block, of
sizes that do not divide it) gives transformers' logprobs and greedy tokens, and the unchunked run's.
(The Triton kernels' chunked prefill: tests/triton_interpreter_cases.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.batch import ModelBatch, SequenceWork
from engine.executor.local import LocalExecutor
from engine.model.config import OPTConfig
from engine.sampling_params import SamplingParams
from kernels.paged_attention import paged_attention
from tests.conftest import SMALL_POST_LN, SMALL_PRE_LN
from tests.paged_batches import make_batch
from tests.test_model_reference import hf_logprobs

BS = 4


def dense_causal(q, k, v, scale):  # q [n, H, D]: the last n positions of k/v [c, H, D]
    n, c = q.shape[0], k.shape[0]
    mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=scale).transpose(0, 1)


# (cached, new): prefixes of 0, mid-block, on a block boundary, long; chunks of 1, a block, not a divisor
PREFIX_CASES = [(0, 1), (0, 4), (0, 9), (1, 1), (3, 1), (4, 4), (3, 4), (5, 7), (8, 3), (7, 13), (16, 2), (2, 31)]


@pytest.mark.parametrize("seqs", [[c] for c in PREFIX_CASES] + [PREFIX_CASES], ids=[f"{c}+{n}" for c, n in
                                                                                     PREFIX_CASES] + ["all"])
def test_reference_prefill_over_a_cached_prefix_equals_dense_attention(seqs):
    h, d = 3, 8
    q, k, v, kv, meta, tables = make_batch(seqs, h=h, d=d, bs=BS, dtype=torch.float32, seed=7)
    # make_batch's cache holds the prefixes' K/V; rebuild each sequence's full K/V from it and the new tokens
    out = paged_attention(q, k, v, kv, 1, meta, d**-0.5)
    t = 0
    for (cached, new), table in zip(seqs, tables):
        pos = torch.arange(cached + new)
        keys = kv[torch.tensor(table)[pos // BS], 1, 0, :, pos % BS]  # [c + n, H, D], written by this step too
        values = kv[torch.tensor(table)[pos // BS], 1, 1, :, pos % BS]
        torch.testing.assert_close(keys[cached:], k[t : t + new])
        ref = dense_causal(q[t : t + new], keys, values, d**-0.5)
        torch.testing.assert_close(out[t : t + new], ref, atol=1e-5, rtol=1e-5)
        t += new


# -- the model over a cached prefix ------------------------------------------------------------------------------


def chunk_plans(n: int) -> dict[str, list[int]]:
    def cut(size):
        return [size] * (n // size) + ([n % size] if n % size else [])

    return {"whole": [n], "ones": [1] * n, "block": cut(BS), "threes": cut(3), "sevens": cut(7),
            "ragged": [5, 1, 9, n - 15]}


def run_chunks(runner, prompt: list[int], plan: list[int], decode_steps: int, job: str, k: int = 5):
    """The prompt through the runner in chunks (each a step of its own), then greedy decode steps; returns
    (the logprobs dict of each chunk's last row, the generated tokens, their logprobs dicts)."""
    table = list(range(0, -(-(len(prompt) + decode_steps) // BS)))
    params = SamplingParams(temperature=0, logprobs=k, max_tokens=decode_steps + 1)
    chunk_lps, tokens, token_lps = [], [], []

    def step(ids, start):
        work = SequenceWork(job, ids, start, table, params, None, len(tokens))
        batch = ModelBatch([work], eos_token_id=None)
        inputs = runner.prepare(batch)
        return runner.sample(runner.forward(inputs), inputs, batch)[0]

    start = 0
    for size in plan:
        res = step(prompt[start : start + size], start)
        start += size
        chunk_lps.append((start, res.logprobs))
    tokens.append(res.token_id)
    token_lps.append(res.logprobs)
    for _ in range(decode_steps):
        res = step([tokens[-1]], len(prompt) + len(tokens) - 1)
        tokens.append(res.token_id)
        token_lps.append(res.logprobs)
    return chunk_lps, tokens, token_lps


@pytest.mark.parametrize("shape", [SMALL_PRE_LN, SMALL_POST_LN], ids=["pre-ln", "post-ln-project-in-out"])
def test_model_prefill_in_chunks_matches_transformers_and_the_unchunked_run(shape, small_checkpoint):
    model_dir = small_checkpoint(shape)
    ex = LocalExecutor(model_dir, OPTConfig.from_model_dir(model_dir), device="cpu", block_size=BS,
                       num_gpu_blocks_override=64)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, shape["vocab_size"], (23,), generator=g).tolist()
    decode = 5
    runs = {name: run_chunks(ex.runner, prompt, plan, decode, name) for name, plan in chunk_plans(23).items()}
    whole_lps, whole_tokens, whole_token_lps = runs["whole"]
    hf = hf_logprobs(model_dir, prompt + whole_tokens)  # [len, V]
    for name, (chunk_lps, tokens, token_lps) in runs.items():
        assert tokens == whole_tokens, f"{name}: greedy tokens differ from the unchunked run"
        for j, tok in enumerate(tokens):
            assert tok == int(hf[len(prompt) + j - 1].argmax()), f"{name} step {j}: greedy differs from transformers"
            for t, lp in token_lps[j].items():
                assert abs(lp - float(hf[len(prompt) + j - 1, t])) < 1e-4, f"{name} step {j} token {t}"
                assert abs(lp - whole_token_lps[j][t]) < 1e-4, f"{name} step {j} token {t} vs unchunked"
        for end, lps in chunk_lps:  # each chunk's last row predicts the token after it
            assert len(lps) >= 5
            for t, lp in lps.items():
                assert abs(lp - float(hf[end - 1, t])) < 1e-4, f"{name}: chunk ending at {end}, token {t}"


def test_chunks_of_several_prompts_share_a_step_with_decodes(small_checkpoint):
    """One flat step holding a decode, a fresh prompt, a first chunk and a later chunk over a prefix: every row's
    logprobs are transformers'."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    ex = LocalExecutor(model_dir, OPTConfig.from_model_dir(model_dir), device="cpu", block_size=BS,
                       num_gpu_blocks_override=64)
    runner = ex.runner
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (10, 6, 17, 13)]
    params = SamplingParams(temperature=0, logprobs=4)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    # earlier steps: prompt 0 cached up to 9 (it decodes its 10th token now), prompt 3 cached up to 7
    pre = ModelBatch([SequenceWork("p0", prompts[0][:9], 0, tables[0], params, None, 0),
                      SequenceWork("p3", prompts[3][:7], 0, tables[3], params, None, 0)], None)
    inputs = runner.prepare(pre)
    runner.sample(runner.forward(inputs), inputs, pre)
    step = ModelBatch([
        SequenceWork("p0", prompts[0][9:10], 9, tables[0], params, None, 0),  # one token over 9 cached
        SequenceWork("p1", prompts[1], 0, tables[1], params, None, 0),  # a whole fresh prompt
        SequenceWork("p2", prompts[2][:6], 0, tables[2], params, None, 0),  # a first chunk
        SequenceWork("p3", prompts[3][7:13], 7, tables[3], params, None, 0),  # a later chunk, prefix mid-block
    ], None)
    inputs = runner.prepare(step)
    results = runner.sample(runner.forward(inputs), inputs, step)
    for res, prompt, end in zip(results, prompts, (10, 6, 6, 13)):
        hf = hf_logprobs(model_dir, prompt[:end])
        for t, lp in res.logprobs.items():
            assert abs(lp - float(hf[end - 1, t])) < 1e-4
