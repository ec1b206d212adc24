"""CUDA checks (run by scripts/device_check.sh on a GPU machine; skipped here).

The same engine code on CUDA: float32 logprobs agree with transformers, greedy
tokens agree with the CPU run, and float16/bfloat16 serve without error."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import SMALL_POST_LN, SMALL_PRE_LN

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[2, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], [2, 7], [2] + list(range(100, 140))]


def greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)


@pytest.mark.parametrize("shape", [SMALL_PRE_LN, SMALL_POST_LN], ids=["pre-ln", "post-ln"])
def test_cuda_float32_matches_transformers(shape, small_checkpoint):
    from transformers import OPTForCausalLM

    d = small_checkpoint(shape)
    llm = LLM(model=str(d), device="cuda", dtype="float32", block_size=4, num_gpu_blocks_override=256,
              profile="analytic")
    outs = llm.generate(PROMPTS, greedy(logprobs=1))
    hf = OPTForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for out in outs:
        full = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], -1)
        p = len(out.prompt_token_ids)
        for j, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert tok == int(ref[p + j - 1].argmax())
            assert abs(lp[tok] - float(ref[p + j - 1, tok])) < 1e-3


def test_cuda_greedy_equals_cpu(tiny_model_dir):
    cpu = LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks_override=256,
              profile="analytic")
    gpu = LLM(model=str(tiny_model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=256,
              profile="analytic")
    a = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy())]
    b = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, greedy())]
    assert a == b


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_half_precision_serves(tiny_model_dir, dtype):
    """Both dtypes in one process: the first LLM's close() gives its memory back, so the second sizes
    its cache against the whole device, not against what is left (0 blocks before)."""
    free_before = torch.cuda.mem_get_info()[0]
    with LLM(model=str(tiny_model_dir), device="cuda", dtype=dtype, profile="analytic") as llm:
        assert llm.engine.executor.num_device_blocks > 1000  # sized from gpu_memory_utilization
        outs = llm.generate(PROMPTS * 4, greedy())
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    # slack for what stays by design: cuBLAS workspaces, kernels loaded lazily into the context
    assert torch.cuda.mem_get_info()[0] >= free_before - (1 << 30), "close() left device memory allocated"


def test_the_gpu_row_the_engine_runs_on_carries_rank_0(tiny_model_dir):
    """The executor's own description of its GPU matches exactly one of NVML's rows (by UUID or PCI id)."""
    from serving.gpu_probe import NvmlProbe

    llm = LLM(model=str(tiny_model_dir), device="cuda", num_gpu_blocks_override=64, profile="analytic")
    (gpu,) = llm.engine.executor.worker_devices()
    assert gpu.cuda_device == torch.cuda.current_device() and (gpu.uuid or gpu.pci_bus_id)
    probe = NvmlProbe(llm.engine.executor.worker_devices())
    if probe.note is not None:
        pytest.skip(f"NVML unavailable: {probe.note}")
    labelled = [r for r in probe.rows() if r["worker"] is not None]
    assert [r["worker"] for r in labelled] == [{"rank": 0, "tp_rank": 0, "pp_stage": 0,
                                                "cuda_device": gpu.cuda_device}]
    assert labelled[0]["name"] == torch.cuda.get_device_name(gpu.cuda_device)


def test_cuda_host_tier_is_locked_in_the_background_and_copies_round_trip():
    """The host tier starts pageable and page-aligned, is page-locked chunk by chunk in a thread
    (cudaHostRegister), copies through it round-trip on the copy streams, shutdown() keeps it locked and close()
    unlocks it (tests/test_device_check_host_tier.py runs the same with a fake locker)."""
    from engine.host_tier import PAGE_BYTES, HostTier
    from tests.test_device_check_host_tier import BLOCK, round_trip_then_close

    device = torch.randn(16, *BLOCK, device="cuda")
    block_bytes = device[0].numel() * 4
    tier = HostTier(40, BLOCK, torch.float32, pin=True, chunk_bytes=8 * block_bytes)  # 5 chunks
    assert tier.blocks.data_ptr() % PAGE_BYTES == 0
    round_trip_then_close(device, tier, lambda: tier.blocks[0].is_pinned() and tier.blocks[39].is_pinned())


def test_chunked_prefill_is_on_by_default_on_cuda_with_the_profiles_budget(tiny_model_dir):
    """Chunked prefill is on by default where the model runs on CUDA, with the budget the job profile picks; a
    prompt split under a small budget gives the unchunked run's greedy tokens."""
    from engine.config import UNCHUNKED_BATCHED_TOKENS
    from scheduler.cost_model import chunk_budget

    prompt = [2] + [(7 * i) % 2000 + 3 for i in range(700)]
    with LLM(model=str(tiny_model_dir), device="cuda", dtype="float32", profile="analytic") as llm:
        engine = llm.engine
        cfg = engine.scheduler.config
        assert cfg.enable_chunked_prefill
        assert cfg.max_num_batched_tokens == chunk_budget(engine.cost_model, engine.executor.block_size,
                                                          engine.config.max_num_seqs, UNCHUNKED_BATCHED_TOKENS)
        picked = cfg.max_num_batched_tokens
    outs = {}
    for chunked in (True, False):
        with LLM(model=str(tiny_model_dir), device="cuda", dtype="float32", profile="analytic",
                 enable_chunked_prefill=chunked, max_num_batched_tokens=256 if chunked else None) as llm:
            outs[chunked] = [o.outputs[0].token_ids for o in llm.generate([prompt] + PROMPTS, greedy())]
    assert outs[True] == outs[False] and picked >= 256


def test_async_scheduling_on_cuda_gives_the_synchronous_tokens(tiny_model_dir):
    """Async scheduling on the device: step k+1 queued while step k runs (CUDA graphs for its decode
    steps), its placeholders filled from step k's tokens: the greedy tokens of the synchronous engine."""
    params = [greedy(), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), greedy(logprobs=1)]
    outs = {}
    for ahead in (False, True):
        with LLM(model=str(tiny_model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=256,
                 profile="analytic", async_scheduling=ahead) as llm:
            assert llm.engine.async_scheduling == ahead
            outs[ahead] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 3, params * 3)]
            assert llm.engine.kv.device.num_free == llm.engine.kv.device.num_blocks
    assert outs[True] == outs[False]
