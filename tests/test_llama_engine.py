"""A Llama-family model on the live engine: the KV cache holds the KV heads (its block count for a memory budget
follows from them), and the logprobs do not depend on where the KV lives: kept, offloaded to the host and
uploaded, dropped and recomputed, built in chunks, or found in the prefix cache, every prompt logprob and every
generated token's logprob equal transformers' own LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM
(tests/test_llama_reference.py's TRAITS) within 1e-4 in float32, with 2 KV heads under 8 query heads and with a KV
head per query head, rope_scaling off and on; greedy outputs are the same split over tensor-parallel workers."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.kv_cache import DEFAULT_CPU_KV_BYTES
from tests.conftest import settle_kv_copies
from tests.test_llama_reference import ARCHITECTURES, ROPE, TRAITS
from tests.test_model_reference import check_output_against_transformers

LAYERS, HEADS, HEAD_DIM, BLOCK = 3, 8, 8, 16  # modelmaker's llama_config defaults (hidden 64 over 8 heads)
PROMPTS = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (11, 3, 27, 17, 6, 20)]


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_kv_cache_blocks_come_from_the_kv_heads(llama_checkpoint):
    """The CPU budget (DEFAULT_CPU_KV_BYTES) over a block of layers x K/V x KV heads x 16 tokens x head dim x 4
    bytes: under the same 8 query heads, 2 KV heads hold four times the blocks of 8; the host tier's blocks are
    the same bytes."""
    blocks = {}
    for kv_heads in (8, 2):
        with LLM(model=str(llama_checkpoint(num_key_value_heads=kv_heads)), device="cpu", profile="analytic") as llm:
            executor = llm.engine.executor
            block_bytes = LAYERS * 2 * kv_heads * BLOCK * HEAD_DIM * 4
            assert executor.kv_block_bytes == block_bytes
            assert executor.runner.kv_cache.shape[1:] == (LAYERS, 2, kv_heads, BLOCK, HEAD_DIM)
            blocks[kv_heads] = llm.engine.kv.device.num_blocks
            assert blocks[kv_heads] == executor.num_device_blocks == DEFAULT_CPU_KV_BYTES // block_bytes
            # The host tier: blocks of the same KV heads, as many as --swap-space's GiB hold.
            host = executor.runner.swapper.host_cache
            assert host.shape == (int(llm.engine.config.swap_space * 2**30) // block_bytes, LAYERS, 2, kv_heads, BLOCK,
                                  HEAD_DIM)
            assert host[0].numel() * host.element_size() == block_bytes
    assert blocks[2] // 4 == blocks[8]


# The models of the conditions below: each architecture with its TRAITS, 2 KV heads under 8 query heads and a KV
# head per query head, rope_scaling off and on. `make test` runs one model an architecture for each condition, a
# different layout each (rotated by the condition's `shift`, so that each architecture meets all four layouts over
# the conditions); the other models are marked slow.
LAYOUTS = [(kv_heads, rope) for kv_heads in (2, 8) for rope in ROPE]


def models(shift: int, *lead) -> list:
    """pytest params (*lead, architecture, kv_heads, rope) of every model; those off the rotation marked slow."""
    return [pytest.param(*lead, arch, kv_heads, rope, id="-".join(
                [*map(str, lead), arch.removesuffix("ForCausalLM"), f"kv{kv_heads}", rope]),
                marks=() if LAYOUTS.index((kv_heads, rope)) == (a + shift) % len(LAYOUTS) else pytest.mark.slow)
            for a, arch in enumerate(ARCHITECTURES) for kv_heads, rope in LAYOUTS]


def checkpoint(llama_checkpoint, architecture: str, kv_heads: int, rope: str) -> str:
    return str(llama_checkpoint(architecture, num_key_value_heads=kv_heads, **TRAITS[architecture], **ROPE[rope]))


def check_against_transformers(outs, model_dir: str, architecture: str, prompt_logprobs: bool = True) -> None:
    for i, out in enumerate(outs):
        check_output_against_transformers(out, model_dir, getattr(transformers, architecture), f"prompt {i}",
                                          prompt_logprobs)


def greedy_with_logprobs(n: int = 24, prompt_logprobs: int | None = 5) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5, prompt_logprobs=prompt_logprobs)


# Each kv policy with its own rotation; skip-join-mlfq (which preempts differently) on the same models.
OFFLOAD_CASES = [case for shift, kv_policy in enumerate(["proactive", "reactive", "recompute"])
                 for policy in ("fcfs", "skip-join-mlfq") for case in models(shift, kv_policy, policy)]


@pytest.mark.parametrize(("kv_policy", "policy", "architecture", "kv_heads", "rope"), OFFLOAD_CASES)
def test_logprobs_match_transformers_through_offload_and_recompute(llama_checkpoint, kv_policy, policy,
                                                                   architecture, kv_heads, rope):
    """Jobs offloaded to the host and uploaded again (proactive, reactive), or dropped and recomputed: every
    prompt logprob and every generated token's logprob equal transformers' within TOL."""
    model_dir = checkpoint(llama_checkpoint, architecture, kv_heads, rope)
    # 24 device blocks of 4 tokens: six jobs of up to ~50 tokens cannot all stay resident.
    with LLM(model=model_dir, device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=24,
             scheduling_policy=policy, kv_policy=kv_policy, num_host_blocks_override=256, max_num_seqs=3,
             profile="analytic") as llm:
        outs = llm.generate(PROMPTS, greedy_with_logprobs())
        kv = llm.engine.kv
        if kv_policy == "recompute":
            assert kv.stats.num_offloads == 0 and kv.stats.num_drops > 0
        else:
            assert kv.stats.num_offloads > 0, "the device tier was meant to be too small to keep every job resident"
        settle_kv_copies(llm.engine)
        kv.check_invariants()
    check_against_transformers(outs, model_dir, architecture)


@pytest.mark.parametrize(("budget", "architecture", "kv_heads", "rope"), models(3, 5) + models(1, 16))
def test_chunked_prefill_matches_transformers(llama_checkpoint, budget, architecture, kv_heads, rope):
    """Prompts cut into chunks of at most `budget` tokens (each chunk attending to the cached prefix), beside
    decodes: the prompt logprobs (gathered over the chunks) and the generated tokens' equal transformers'."""
    model_dir = checkpoint(llama_checkpoint, architecture, kv_heads, rope)
    with LLM(model=model_dir, device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=1024,
             enable_chunked_prefill=True, max_num_batched_tokens=budget, profile="analytic") as llm:
        chunks = []  # (tokens cached before, new tokens) of each prompt chunk that samples nothing
        real_finish = llm.engine.finish_step

        def finish(plan, result):
            chunks.extend((w.start_pos, len(w.token_ids)) for w in plan.batch.seqs if not w.sample)
            assert plan.batch.num_tokens <= budget
            return real_finish(plan, result)

        llm.engine.finish_step = finish
        outs = llm.generate(PROMPTS, greedy_with_logprobs())
    assert any(start > 0 for start, _ in chunks), "no chunk ran over a cached prefix"
    check_against_transformers(outs, model_dir, architecture)


def test_tensor_parallel_workers_with_one_kv_head_give_the_single_process_outputs(llama_checkpoint):
    """Two worker processes (gloo on the CPU), 8 query heads over one KV head: each rank holds that KV head
    (replicated) and its 4 query heads; greedy tokens equal tp = 1's."""
    model_dir = str(llama_checkpoint(num_key_value_heads=1))
    params = greedy(8)
    with LLM(model=model_dir, block_size=4, num_gpu_blocks_override=256, profile="analytic") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    with LLM(model=model_dir, block_size=4, num_gpu_blocks_override=256, profile="analytic", device="cpu",
             tensor_parallel_size=2) as llm:
        assert llm.engine.executor.kv_block_bytes == LAYERS * 2 * 1 * 4 * HEAD_DIM * 4  # one KV head a rank
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    assert got == want


@pytest.mark.parametrize(("architecture", "kv_heads", "rope"), models(2))
def test_prefix_cache_hits_match_transformers(llama_checkpoint, architecture, kv_heads, rope):
    """Prompts that extend earlier ones reuse their cached KV blocks (the KV heads' blocks): their generated
    tokens' logprobs equal transformers'. Prompt logprobs need every prompt position computed, so a request that
    asks for them skips the cache (vLLM does the same): the first round and one later prompt ask for them."""
    model_dir = checkpoint(llama_checkpoint, architecture, kv_heads, rope)
    later = [p + [40 + i, 41, 42, 43, 44] for i, p in enumerate(PROMPTS)]
    params = [greedy_with_logprobs(8, prompt_logprobs=None)] * (len(later) - 1) + [greedy_with_logprobs(8)]
    with LLM(model=model_dir, device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=512,
             profile="analytic", enable_prefix_caching=True) as llm:
        first = llm.generate(PROMPTS, greedy_with_logprobs(8))
        outs = llm.generate(later, params)
    assert all(o.num_cached_tokens == 0 for o in first)
    hits = outs[:-1]
    assert sum(o.num_cached_tokens for o in hits) >= sum(len(p) // 4 * 4 for p in PROMPTS[:-1])
    assert outs[-1].num_cached_tokens == 0  # it asked for prompt logprobs
    check_against_transformers(first, model_dir, architecture)
    check_against_transformers(hits, model_dir, architecture, prompt_logprobs=False)
    check_against_transformers(outs[-1:], model_dir, architecture)
