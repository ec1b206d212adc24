"""A Llama-family model (2 KV heads under 8 query heads) on the live engine: the KV cache holds the KV heads (its
block count for a memory budget follows from them), and greedy outputs do not depend on where the KV lives:
kept, offloaded to the host and uploaded, dropped and recomputed, built in chunks, found in the prefix cache,
or split over tensor-parallel workers."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache import DEFAULT_CPU_KV_BYTES
from tests.conftest import settle_kv_copies

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


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    """Every prompt's greedy tokens with room for every job's KV on the device."""
    llm = LLM(model=str(llama_checkpoint()), block_size=4, num_gpu_blocks_override=1024, kv_policy="recompute",
              scheduling_policy="fcfs", profile="analytic")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive", "recompute"])
@pytest.mark.parametrize("policy", ["fcfs", "skip-join-mlfq"])
def test_greedy_output_survives_offload_and_recompute(llama_checkpoint, reference, policy, kv_policy):
    # 24 device blocks of 4 tokens: six jobs of up to ~50 tokens cannot all stay resident.
    llm = LLM(model=str(llama_checkpoint()), block_size=4, num_gpu_blocks_override=24, scheduling_policy=policy,
              kv_policy=kv_policy, num_host_blocks_override=256, max_num_seqs=3, profile="analytic")
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    kv = llm.engine.kv
    if kv_policy == "recompute":
        assert kv.stats.num_offloads == 0 and kv.stats.num_drops > 0
    else:
        assert kv.stats.num_offloads > 0, "the device tier was meant to be too small to keep every job resident"
    settle_kv_copies(llm.engine)
    kv.check_invariants()


@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_gives_the_unchunked_outputs(llama_checkpoint, reference, budget):
    """Prompts cut into chunks of at most `budget` tokens (each chunk attending to the cached prefix), beside
    decodes, give the same greedy tokens."""
    llm = LLM(model=str(llama_checkpoint()), block_size=4, num_gpu_blocks_override=1024, enable_chunked_prefill=True,
              max_num_batched_tokens=budget, profile="analytic")
    chunks = []  # (tokens cached before, new tokens) of each prompt chunk that samples nothing
    real_finish = llm.engine.finish_step

    def finish(plan, result):
        chunks.extend((w.start_pos, len(w.token_ids)) for w in plan.batch.seqs if not w.sample)
        assert plan.batch.num_tokens <= budget
        return real_finish(plan, result)

    llm.engine.finish_step = finish
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert any(start > 0 for start, _ in chunks), "no chunk ran over a cached prefix"


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


def test_prefix_cache_hits_give_the_outputs_computed_from_scratch(llama_checkpoint):
    """Prompts that extend earlier ones reuse their cached KV blocks (the KV heads' blocks) and give the greedy
    tokens a run without prefix caching computes."""
    model_dir = str(llama_checkpoint())
    later = [p + [40 + i, 41, 42, 43, 44] for i, p in enumerate(PROMPTS)]
    with LLM(model=model_dir, block_size=4, num_gpu_blocks_override=512, profile="analytic") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(later, greedy(8))]
    with LLM(model=model_dir, block_size=4, num_gpu_blocks_override=512, profile="analytic",
             enable_prefix_caching=True) as llm:
        llm.generate(PROMPTS, greedy(8))
        outs = llm.generate(later, greedy(8))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.num_cached_tokens for o in outs) >= sum(len(p) // 4 * 4 for p in PROMPTS)
