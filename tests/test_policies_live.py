"""Every scheduling policy on the live engine (tiny model, pinned profile):
greedy outputs do not depend on the policy or on evictions, every KV block
comes back, and skip-join MLFQ preempts at token granularity where FCFS runs
to completion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine import Engine

PINNED_PROFILE = str(Path(__file__).parent / "data" / "tiny_profile.json")
POLICIES = ["fcfs", "skip-join-mlfq", "mlfq", "fixed-priority", "gittins"]

# Ten requests: (prompt length, max_tokens, the step at which it arrives).
WORKLOAD = [(3, 12, 0), (40, 6, 0), (7, 20, 1), (18, 9, 2), (1, 15, 2),
            (29, 4, 4), (12, 18, 5), (55, 7, 7), (5, 10, 9), (23, 14, 12)]


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(4, 500, (length - 1,), generator=g).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(model_dir: Path, policy: str, num_blocks: int = 512, **kw) -> Engine:
    llm = LLM(model=str(model_dir), block_size=4, num_gpu_blocks_override=num_blocks, profile=PINNED_PROFILE,
              scheduling_policy=policy, kv_policy="recompute", **kw)
    return llm.engine


def run_staggered(engine: Engine) -> dict[str, list[int]]:
    """Drive the engine step by step, adding each request at its arrival step; the greedy outputs."""
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(WORKLOAD):
        for i, (length, max_tokens, arrival) in enumerate(WORKLOAD):
            if arrival == step:
                engine.add_request(f"r{i}", prompt(length, seed=i), greedy(max_tokens))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 2000, "the workload did not finish"
    return done


def assert_all_blocks_free(engine: Engine) -> None:
    engine.kv.check_invariants()
    assert engine.kv.device.num_free == engine.kv.device.num_blocks


def count_evictions(engine: Engine) -> list[str]:
    """Record every kv.evict() the policy makes (whatever the KV manager counts internally)."""
    calls: list[str] = []
    evict = engine.kv.evict

    def counting(job) -> None:
        calls.append(job.job_id)
        evict(job)

    engine.kv.evict = counting
    return calls


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    engine = make_engine(tiny_model_dir, "fcfs")
    out = run_staggered(engine)
    assert_all_blocks_free(engine)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_outputs_do_not_depend_on_the_policy(tiny_model_dir, reference, policy):
    engine = make_engine(tiny_model_dir, policy)
    assert run_staggered(engine) == reference
    assert all(len(reference[f"r{i}"]) == w[1] for i, w in enumerate(WORKLOAD))
    assert_all_blocks_free(engine)
    stats = engine.scheduler_stats()
    assert stats.policy == policy and stats.num_jobs == 0
    keyed = policy in ("fcfs", "fixed-priority", "gittins")  # no queues
    assert sum(stats.queue_lengths) == 0 and (stats.queue_lengths == []) == keyed


@pytest.mark.parametrize("policy", ["fcfs", "skip-join-mlfq", "gittins"])
def test_greedy_outputs_survive_eviction_and_recompute(tiny_model_dir, reference, policy):
    # 18 blocks of 4 tokens: the longest request (55 + 7 tokens) fits alone, but not beside the others.
    # Starvation promotion off, so which jobs get evicted depends on profiled costs, not the wall clock.
    engine = make_engine(tiny_model_dir, policy, num_blocks=18, starvation_threshold=None)
    evictions = count_evictions(engine)
    assert run_staggered(engine) == reference
    assert evictions, "the device tier was meant to be too small to keep every job resident"
    assert_all_blocks_free(engine)


def test_skip_join_preempts_a_long_job_for_a_short_one_fcfs_does_not(tiny_model_dir):
    """One batch slot. A long job is running when a short one arrives: skip-join MLFQ
    runs the short one at the next iteration and it finishes first; FCFS finishes the long one first."""
    finish_order = {}
    for policy in ("fcfs", "skip-join-mlfq"):
        # Starvation promotion off: the schedule then depends on profiled costs only, not the wall clock.
        engine = make_engine(tiny_model_dir, policy, max_num_seqs=1, starvation_threshold=None)
        engine.add_request("long", prompt(8, seed=100), greedy(100))
        long_job = engine.requests["long"].seqs[0].job
        short_len = 4
        for _ in range(3):
            engine.step()
        if policy == "skip-join-mlfq":
            # Run the long job until it has sunk below the queue a short job skip-joins into.
            entry = engine.scheduler.entry_queue(short_len)
            for _ in range(100):
                if long_job.queue > entry:
                    break
                engine.step()
            assert long_job.queue > entry, f"the long job never left queue {entry}"
        assert long_job.num_generated > 0 and not long_job.finished
        engine.add_request("short", prompt(short_len, seed=101), greedy(3))
        order = []
        while engine.has_unfinished():
            order += [out.request_id for out in engine.step() if out.finished]
        finish_order[policy] = order
        if policy == "skip-join-mlfq":
            assert long_job.num_preemptions >= 1
            assert engine.scheduler_stats().num_policy_preemptions >= 1
        assert_all_blocks_free(engine)
    assert finish_order == {"fcfs": ["long", "short"], "skip-join-mlfq": ["short", "long"]}
