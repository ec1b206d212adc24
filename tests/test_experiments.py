"""Helpers of scripts/experiments.py (in scripts/experiment_sections/common.py) and scripts/bench_sim_vs_live.py
on tiny inputs (not the full run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_sim_vs_live import make_trace  # noqa: E402
from experiment_sections.common import KVUsageTracker, clip_trace, throughput_at_slo  # noqa: E402

from engine.simulation import run_trace, simulated_engine  # noqa: E402
from memory.kv_manager import blocks_needed  # noqa: E402


def test_throughput_at_slo_finds_the_crossing_of_a_monotone_latency():
    calls = []

    def latency(rate):  # crosses 0.3 at rate 20
        calls.append(rate)
        return 0.1 + rate / 100

    s = throughput_at_slo(latency, [1, 2, 4, 8, 16, 32, 64], 0.3, iters=6)
    assert not s.capped
    assert 16 <= s.rate <= 20
    assert s.rate == pytest.approx(20, rel=0.03)
    assert 64 not in calls  # the grid stops at the first miss
    assert len(calls) == len(set(calls)) == len(s.evaluated)  # each rate computed once
    assert all(latency(r) <= 0.3 for r in [s.rate])


def test_throughput_at_slo_edges():
    capped = throughput_at_slo(lambda r: 0.0, [1, 2, 4], 0.3)
    assert capped.capped and capped.rate == 4
    never = throughput_at_slo(lambda r: 1.0, [1, 2, 4], 0.3, iters=3)
    assert not never.capped and never.rate == 0.0
    below_grid = throughput_at_slo(lambda r: r, [1, 2], 0.5, iters=8)  # crossing under the lowest grid rate
    assert below_grid.rate == pytest.approx(0.5, rel=0.1) and below_grid.rate <= 0.5


def test_clip_trace_fits_the_context():
    class Item:
        def __init__(self, p, o, t):
            self.prompt_len, self.output_len, self.arrival_s = p, o, t

    out = clip_trace([Item(3000, 10, 0.0), Item(100, 5000, 1.0), Item(0, 0, 2.0)], 2048)
    assert out == [(0.0, 2047, 1), (1.0, 100, 1948), (2.0, 1, 1)]


def test_make_trace_is_seeded_and_in_range():
    a = make_trace(20, 5.0, (16, 32), (4, 8), seed=3)
    assert a == make_trace(20, 5.0, (16, 32), (4, 8), seed=3)
    assert all(16 <= p <= 32 and 4 <= o <= 8 for _, p, o in a)
    assert [t for t, _, _ in a] == sorted(t for t, _, _ in a)


@pytest.fixture(scope="module")
def sim_model(flat_sim_model):
    return flat_sim_model


def test_kv_usage_tracker_peak_of_one_job(sim_model):
    """One job of 20 prompt + 13 output tokens holds at most ceil(33/16) = 3 blocks, and all are freed."""
    model, profile = sim_model
    eng = simulated_engine(model, profile, num_device_blocks=100, scheduling_policy="fcfs", max_num_seqs=4)
    tr = KVUsageTracker(eng)
    res = run_trace(eng, [(0.0, 20, 13)])
    assert blocks_needed(20, 16) <= tr.peak_device <= blocks_needed(33, 16)
    assert tr.peak_total >= tr.peak_device
    assert tr.device[-1] == 0  # freed at the end
    assert len(tr.times) == len(tr.device) == eng.num_steps
    s = res.summary()
    assert s["requests"] == 1 and s["mean_per_token_s"] == pytest.approx(res.outputs[0].metrics.e2e_s / 13)


def test_kv_usage_tracker_sums_concurrent_jobs_and_queueing_share(sim_model):
    """Two jobs at once (batch of 2): the peak holds both; with a batch of 1 the second one queues."""
    model, profile = sim_model
    trace = [(0.0, 20, 5), (0.0, 40, 5)]
    both = simulated_engine(model, profile, num_device_blocks=100, scheduling_policy="fcfs", max_num_seqs=2)
    tr = KVUsageTracker(both)
    res = run_trace(both, trace)
    assert tr.peak_device >= blocks_needed(20, 16) + blocks_needed(40, 16)
    one = run_trace(simulated_engine(model, profile, num_device_blocks=100, scheduling_policy="fcfs",
                                     max_num_seqs=1), trace)
    assert one.summary()["queueing_share"] > res.summary()["queueing_share"]
    assert 0.0 <= res.summary()["queueing_share"] < 1.0


def test_every_registered_section_has_its_function_and_runs_in_order():
    from experiment_sections import RUN_FIRST, SECTIONS, run_order, section

    assert all(callable(section(name)) for name in SECTIONS)
    assert run_order(list(SECTIONS)) == [*RUN_FIRST, *(n for n in SECTIONS if n not in RUN_FIRST)]
    assert run_order(["live", "fig1", "slo"]) == ["slo", "fig1", "live"]
