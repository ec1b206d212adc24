"""scripts/benchmarks/scheduler.py (the tick-speed benchmark) on a small load: every timed tick schedules a full
batch, finished jobs are replaced so the queues keep their size, and the baseline times one decode step per step
asked."""

from __future__ import annotations

from engine import LLM
from scripts.benchmarks import scheduler as bench


def test_ticks_keep_the_queues_full_and_the_baseline_times_each_decode_step(tiny_model_dir):
    with LLM(model=str(tiny_model_dir), profile="analytic", kv_policy="recompute", num_gpu_blocks_override=64) as llm:
        times = bench.decode_step_times(llm, 5)
        assert len(times) == 5 and all(t > 0 for t in times) and not llm.engine.has_unfinished()
        cost = llm.engine.cost_model
        for name in ("skip-join-mlfq", "fcfs"):
            policy = bench.loaded_policy(name, cost, waiting=40, running=8, seed=0)
            t = bench.tick_times(policy, cost, warmup=5, ticks=600)  # a job asks for 512 tokens at most
            assert len(t["tick"]) == 600 and all(s > 0 for s in t["tick"])
            assert set(t["batch"]) == {8}  # the KV always fits: every tick runs max_num_seqs jobs
            assert len(policy.jobs) == 48 and any(j.job_id.startswith("new") for j in policy.jobs), name
