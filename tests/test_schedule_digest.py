"""scripts/benchmarks/schedule_digest.py: its digest is the same for the same run, moves with a decision, and is
today's on a pinned trace (OPT-13B's simulated decisions)."""

from __future__ import annotations

from fastserve.bench.workload import load_workload
from scripts.benchmarks.schedule_digest import run_digest


def synthetic_trace(n: int = 300, rate: float = 8.0) -> list[tuple[float, int, int]]:
    """Past capacity, lengths spread widely: jobs are preempted and their KV swapped."""
    items = load_workload("synthetic", n, rate=rate, seed=0,
                          synthetic=dict(input_len=400, output_len=300, range_ratio=0.9))
    return [(it.arrival_s, it.prompt_len, it.output_len) for it in items]


def test_the_digest_is_deterministic_and_changes_with_a_decision():
    trace = synthetic_trace()
    digest, ticks = run_digest("skip-join-mlfq", "proactive", trace)
    assert ticks > len(trace)
    assert run_digest("skip-join-mlfq", "proactive", trace) == (digest, ticks)
    assert run_digest("fcfs", "proactive", trace)[0] != digest  # another order
    assert run_digest("skip-join-mlfq", "reactive", trace)[0] != digest  # the same order, other copies


def test_a_chat_run_has_a_digest_of_its_own():
    trace = synthetic_trace(120, 4.0)
    digest, _ = run_digest("skip-join-mlfq", "proactive", trace, "chat")
    assert run_digest("skip-join-mlfq", "proactive", trace, "chat")[0] == digest
    assert run_digest("skip-join-mlfq", "proactive", trace)[0] != digest


# Today's decisions on the synthetic trace, pinned: a change that is meant to leave scheduling alone (a refactoring,
# a new model family beside OPT) must leave these; one that changes a decision on purpose updates them in the same
# commit and says why.
PINNED = {"fcfs": ("74a8d4c532fddfa79418cad1c1b57a541f63555ae362a74d75da1686271e5561", 3610),
          "skip-join-mlfq": ("7b065863f66ca440fd569c3ce8007c1df097be229d19f9bcc623e56f7071e8f5", 3598)}


def test_opts_simulated_decisions_are_the_pinned_ones():
    trace = synthetic_trace()
    assert {policy: run_digest(policy, "proactive", trace) for policy in PINNED} == PINNED
