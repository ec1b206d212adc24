"""scripts/audit_capacity.py (docs/benchmarks.md, "Skip-join at capacity", part 7) keeps counting what it says:
every upload is the planner's or a swap miss, the misses it attributes are the KV manager's own count, and its
work counters add up to the trace."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import audit_capacity  # noqa: E402
from steady_state import Setup  # noqa: E402

LENGTHS = str(REPO / "tests" / "data" / "alpaca_lengths_head20.csv")


def test_misses_are_the_kv_managers_own_count_under_memory_pressure():
    setup = Setup("opt-13b", "alpaca", 20, (("num_device_blocks", 40),), LENGTHS)
    for reserve in (False, True):
        out = audit_capacity.audit_misses(setup, rate=200.0, seed=0, reserve=reserve)
        src = out["upload_sources"]
        misses = src.get("uploads at the scheduler's pick (swap misses)", 0)
        assert out["uploads"] > 0, "the pool is small enough that jobs are offloaded and come back"
        assert misses == out["swap_misses"]
        assert misses + src.get("uploads by the planner", 0) == out["uploads"]
        assert sum(out["miss_rank_at_tick_before"].values()) == src.get("  of which on the host at the tick before", 0)


def test_work_counts_every_prefill_token_once_per_policy():
    setup = Setup("opt-13b", "alpaca", 20, (), LENGTHS)
    totals = set()
    for policy, bound in (("fcfs", None), ("skip-join-mlfq", None), ("skip-join-mlfq", 2)):
        out = audit_capacity.audit_work(setup, policy, rate=200.0, seed=0, max_started_jobs=bound)
        assert out["iterations"] > 0 and out["busy_s"] > 0
        totals.add(out["prefill_tokens"])  # no drops here: the same prompts are computed once under each order
    assert len(totals) == 1
