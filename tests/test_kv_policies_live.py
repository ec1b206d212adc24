"""The two-tier KV cache on the live engine (tiny model): greedy outputs are
the same whether jobs keep their KV, offload it to the host, or drop and
recompute it; copies are never raced; every block comes back."""

from __future__ import annotations

import threading

import pytest

from engine import LLM, SamplingParams
from memory.kv_manager import Residency
from tests.conftest import settle_kv_copies

PROMPTS = [
    "The scheduler preempts long jobs",
    "Short",
    "A medium length prompt about caches and queues and memory",
    "Tokens stream to clients over server-sent events while the engine keeps running",
    "One more",
    "Numbers 1 2 3 4 5 6 7 8 9",
]


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=1024, kv_policy="recompute",
              scheduling_policy="fcfs", profile="analytic")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


def run_small(tiny_model_dir, policy: str, kv_policy: str, host_blocks: int = 256, copy_delay: float = 0.0):
    # 24 device blocks of 4 tokens: six jobs of up to ~45 tokens cannot all stay resident.
    llm = LLM(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=24, scheduling_policy=policy,
              kv_policy=kv_policy, num_host_blocks_override=host_blocks, max_num_seqs=3,
              profile="analytic")
    if copy_delay:
        llm.engine.executor.swapper.copy_delay_s = copy_delay
    return llm


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive", "recompute"])
@pytest.mark.parametrize("policy", ["fcfs", "skip-join-mlfq"])
def test_greedy_output_survives_offload_and_recompute(tiny_model_dir, reference, policy, kv_policy):
    llm = run_small(tiny_model_dir, policy, kv_policy)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    kv = llm.engine.kv
    moved = kv.stats.num_offloads + kv.stats.num_drops
    assert moved > 0, "the device tier was meant to be too small to keep every job resident"
    if kv_policy == "recompute":
        assert kv.stats.num_offloads == 0 and kv.stats.num_drops > 0
    else:
        assert kv.stats.num_offloads > 0
    settle_kv_copies(llm.engine)  # (the prefix cache's own copies of finished requests' blocks)
    kv.check_invariants()
    assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive"])
def test_host_full_falls_back_to_recompute(tiny_model_dir, reference, kv_policy):
    llm = run_small(tiny_model_dir, "skip-join-mlfq", kv_policy, host_blocks=3)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.kv.stats.host_full_fallbacks > 0 and llm.engine.kv.stats.num_drops > 0


def test_no_job_runs_before_its_upload_completes(tiny_model_dir, reference):
    """With every copy slowed down, each job in every batch is fully resident with no copy pending."""
    llm = run_small(tiny_model_dir, "skip-join-mlfq", "proactive", copy_delay=0.02)
    eng = llm.engine
    submit = eng.executor.submit
    checked = []

    def checked_submit(batch):
        for seq in batch.seqs:
            assert eng.kv.residency(seq.job_id) is Residency.DEVICE, f"{seq.job_id} ran while its KV was moving"
            checked.append(seq.job_id)
        return submit(batch)

    eng.executor.submit = checked_submit
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert checked and eng.kv.stats.num_uploads > 0


def test_abort_while_blocks_are_moving_frees_both_tiers(tiny_model_dir):
    llm = run_small(tiny_model_dir, "skip-join-mlfq", "proactive", copy_delay=0.2)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(40))
    moving = None
    for _ in range(200):
        eng.step()
        moving = next((rid for rid in list(eng.requests) for s in eng.requests[rid].seqs
                       if eng.kv.residency(s.job.job_id) in (Residency.OFFLOADING, Residency.UPLOADING)), None)
        if moving:
            break
    assert moving, "no copy was in flight to abort"
    eng.abort(moving)
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.executor.swapper.shutdown()  # let the slowed copies finish (its copy threads end)
    eng.kv.poll()
    eng.kv.check_invariants()
    assert eng.kv.device.num_free == eng.kv.device.num_blocks
    assert eng.kv.host.num_free == eng.kv.host.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "skip-join-mlfq"])
@pytest.mark.parametrize("kv_policy", ["proactive", "reactive"])
def test_the_engine_never_waits_on_a_copy(tiny_model_dir, reference, policy, kv_policy):
    """Every copy is held until the test releases it. Had any step waited on one, the held copy would
    time out (and say so); instead steps keep returning while copies are pending, the jobs whose KV is
    moving simply do not run, and once the copies land every output is the reference's."""
    llm = run_small(tiny_model_dir, policy, kv_policy)
    eng = llm.engine
    release, timed_out = threading.Event(), []
    copy = eng.executor.swapper._copy_blocks

    def held_copy(src, dst, pairs):
        if not release.wait(120):
            timed_out.append(pairs)
        copy(src, dst, pairs)

    eng.executor.swapper._copy_blocks = held_copy
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy())
    done, steps_while_held = {}, 0
    for _ in range(400):
        for out in eng.step():
            done[out.request_id] = out
        steps_while_held += eng.kv.pending_transfers() > 0
        if steps_while_held >= 10 or not eng.has_unfinished():
            break
    assert steps_while_held >= 10, "no copy was pending: the device tier was meant to be too small"
    release.set()
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out
    assert not timed_out
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    eng.executor.swapper.shutdown()  # the copy threads end once their copies did
    eng.kv.poll()
    eng.kv.check_invariants()
