"""The measures past capacity (scripts/experiments/measures.py) and the SLO fields of steady_state.run_point, on
small simulated traces: the OPT-13B A100-40GB profile with a few hundred requests of a lengths file written here,
and the flat profile where a schedule is computed by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest

from engine.simulation import run_trace, simulated_engine
from scripts.experiments.measures import (
    JUDGES,
    Bracket,
    BurstShape,
    burst_trace,
    bursts,
    collapse,
    drive_burst,
    highest_loads,
    load_stats,
    run_burst,
)
from scripts.experiments.steady_state import Runner, Setup, run_point, slo_seconds, table, windowed_metrics


@pytest.fixture(scope="module")
def lengths(tmp_path_factory):
    """A lengths file shaped like a chat dataset: prompts of 10-409 tokens, answers of 5-304."""
    path = tmp_path_factory.mktemp("lengths") / "lengths.csv"
    path.write_text("input_tokens,output_tokens\n"
                    + "".join(f"{10 + (97 * i) % 400},{5 + (61 * i) % 300}\n" for i in range(2000)))
    return str(path)


def setup_of(lengths: str, n: int = 300) -> Setup:
    return Setup("opt-13b", "sharegpt", n, dataset_path=lengths)


# -- the search ---------------------------------------------------------------------------------------------------
def search(passes, **kw) -> Bracket:
    b = Bracket(**kw)
    while (load := b.next()) is not None:
        b.record(load, passes(load))
    return b


@pytest.mark.parametrize("crossing", [0.2, 0.77, 1.0, 1.3, 3.1])
def test_bracket_finds_the_highest_passing_load_within_the_resolution(crossing):
    b = search(lambda x: x <= crossing, resolution=0.02)
    assert crossing / 1.02 <= b.load <= crossing and b.fail > crossing and b.fail <= b.load * 1.02
    assert not b.capped and not b.floored


def test_bracket_edges_and_noise():
    capped = search(lambda x: True)
    assert capped.capped and capped.load == 4.0 and capped.passed == [1.0, 1.5, 2.25, 3.375, 4.0]
    floored = search(lambda x: False)
    assert floored.floored and floored.load == 0.0 and min(floored.failed) == 1 / 16
    # A pass above a fail (noise) is not the answer: the highest pass below the lowest fail is.
    noisy = Bracket(passed=[1.0, 2.0], failed=[1.5])
    assert noisy.load == 1.0 and noisy.next() == pytest.approx(math.sqrt(1.5))


class FakeRunner:
    """Runs nothing: a point's latency is its rate / 10 s (seed 1: / 5), P95 twice that; SLO 0.3 s; attainment
    1 - rate / 20. Records each round's points."""

    def __init__(self):
        self.rounds = []

    def many(self, points):
        self.rounds.append(points)
        return [{"mean_per_token_s": rate / (10 if seed == 0 else 5), "p95_per_token_s": 2 * rate / 10,
                 "slo_s": 0.3, "slo_attainment": 1 - rate / 20} for _, _, rate, seed in points]


def test_highest_loads_runs_every_search_together_and_each_point_once():
    runner = FakeRunner()
    found = highest_loads(runner, "setup", ["fcfs", "other"], [0, 1], 2.0, resolution=0.01)
    # at cap 2 req/s: mean <= 0.3 below load 1.5 (seed 0) and 0.75 (seed 1); P95 below 0.75; goodput below 1.0
    for policy in ("fcfs", "other"):
        loads = {j: [b.load for b in found[(j, policy)]] for j in JUDGES}
        assert loads["slo_mean"][0] == pytest.approx(1.5, rel=0.01) and loads["slo_mean"][1] == pytest.approx(
            0.75, rel=0.01)
        assert all(x == pytest.approx(0.75, rel=0.01) for x in loads["slo_p95"])
        assert all(x == pytest.approx(1.0, rel=0.01) for x in loads["goodput"])
        assert all(x <= want for x, want in zip(loads["slo_mean"], (1.5, 0.75)))
    first = runner.rounds[0]
    assert len(first) == 4 and {rate for _, _, rate, _ in first} == {2.0}  # 3 judges x 2 policies x 2 seeds: 4 runs
    assert all(len(r) == len(set(r)) for r in runner.rounds)
    stats = load_stats(found, 2.0)
    assert stats[("slo_mean", "fcfs")]["vs_ref"] is None
    assert stats[("slo_mean", "other")]["vs_ref"].mean == pytest.approx(1.0)
    assert stats[("slo_mean", "fcfs")]["rate"].mean == pytest.approx((1.5 + 0.75) / 2 * 2.0, rel=0.01)


def test_load_stats_pairs_each_seed_with_fcfss():
    def brackets(*loads):
        return [Bracket(passed=[x], failed=[x * 1.01]) for x in loads]

    stats = load_stats({("g", "fcfs"): brackets(1.0, 2.0), ("g", "sj"): brackets(1.5, 2.0)}, 3.0)
    assert stats[("g", "sj")]["vs_ref"].values == [1.5, 1.0]  # per seed, not mean over mean (1.75 / 1.5)
    assert stats[("g", "sj")]["rate"].values == [4.5, 6.0] and stats[("g", "fcfs")]["capped"] == 0


# -- the SLO fields of a steady-state run ------------------------------------------------------------------------
def test_the_slo_is_ten_decode_iterations_of_the_profile():
    from scheduler.cost_model import ProfiledCostModel

    cost = ProfiledCostModel.from_json("profiles/sim/opt-13b-a100-40gb-x1.json")
    assert slo_seconds(Setup()) == pytest.approx(10 * cost.t_dec(1, 16)) == pytest.approx(0.2443, abs=1e-4)


def test_slo_attainment_counts_the_window_requests_meeting_both_bounds(flat_sim_model):
    model, profile = flat_sim_model
    trace = [(i * 0.5, 40, (3, 20)[i % 2]) for i in range(21)]
    res = run_trace(simulated_engine(model, profile, num_device_blocks=2000, scheduling_policy="fcfs",
                                     max_num_seqs=1), trace)
    counted = [o for o in res.outputs if 1.0 <= o.metrics.arrival_time <= 9.0]
    slo = (2.0, 20.0)
    meet = [o for o in counted if o.metrics.e2e_s / len(o.outputs[0].token_ids) <= slo[0]
            and o.metrics.ttft_s <= slo[1]]
    m = windowed_metrics(res.outputs, [t for t, _, _ in trace], slo=slo)
    assert 0 < len(meet) < len(counted) and m["slo_attainment"] == pytest.approx(len(meet) / len(counted))
    assert "slo_attainment" not in windowed_metrics(res.outputs, [t for t, _, _ in trace])


def test_run_point_judges_a_light_load_as_passing_and_a_heavy_one_as_failing(lengths):
    light, heavy = (run_point(setup_of(lengths), "fcfs", rate, 0) for rate in (1.0, 400.0))
    assert light["slo_s"] == pytest.approx(0.2443, abs=1e-4)
    assert all(judge(light) for judge in JUDGES.values()) and light["slo_attainment"] == 1.0
    assert not any(judge(heavy) for judge in JUDGES.values()) and heavy["slo_attainment"] < 0.5
    for r in (light, heavy):
        assert 0 < r["busy_s"] and r["upload_stall_s"] <= r["copy_stall_s"] and 0 <= r["upload_stall_share"] < 1


def test_highest_loads_agrees_with_the_runs_it_made(lengths, tmp_path):
    """A real search (one seed, FCFS, loads in req/s): the run at the answer passes, the one at the lowest failing
    load does not, and they are within the resolution."""
    runner = Runner(jobs=2, cache=tmp_path, version="test")
    setup = setup_of(lengths)
    found = highest_loads(runner, setup, ["fcfs"], [0], 1.0, {"slo_p95": JUDGES["slo_p95"]}, start=4.0,
                          resolution=0.1, highest=64.0)
    b = found[("slo_p95", "fcfs")][0]
    assert 0 < b.load < b.fail <= 1.1 * b.load and not b.capped
    at, above = runner.many([(setup, "fcfs", b.load, 0), (setup, "fcfs", b.fail, 0)])
    assert at["p95_per_token_s"] <= at["slo_s"] < above["p95_per_token_s"]
    runs = runner.runs
    highest_loads(runner, setup, ["fcfs"], [0], 1.0, {"slo_p95": JUDGES["slo_p95"]}, start=4.0,
                  resolution=0.1, highest=64.0)
    assert runner.runs == runs  # all from the cache


# -- collapse -----------------------------------------------------------------------------------------------------
def test_collapse_is_the_window_token_rate_paired_with_fcfss(lengths, tmp_path):
    runner = Runner(jobs=2, cache=tmp_path, version="test")
    setup, cap = setup_of(lengths), 6.0
    c = collapse(runner, setup, ["fcfs", "skip-join-mlfq"], [0, 1], cap, loads=(2.0,))
    raw = table(runner, setup, (2.0,), ["fcfs", "skip-join-mlfq"], [0, 1], cap)
    f, s = raw[(2.0, "fcfs")]["window_tokens_per_s"], raw[(2.0, "skip-join-mlfq")]["window_tokens_per_s"]
    assert c[(2.0, "fcfs")]["vs_ref"] is None and c[(2.0, "fcfs")]["tokens_per_s"].values == f
    assert c[(2.0, "skip-join-mlfq")]["vs_ref"].values == pytest.approx([s[0] / f[0], s[1] / f[1]])
    assert all(x > 0 for x in f + s) and s != f
    assert c[(2.0, "skip-join-mlfq")]["swap_wait_share"].values == raw[(2.0, "skip-join-mlfq")]["swap_wait_share"]


def test_the_swap_wait_share_is_the_counted_requests_swap_wait_over_their_latency(lengths):
    """Past capacity (the upload stall reads 0 there: another job is always ready) the picked jobs still wait on their
    KV: windowed_metrics' swap-wait share is the counted requests' swap_wait_s over their e2e."""
    from fastserve.make_model import config_only_model
    from scripts.experiments.common import SCALES
    from scripts.experiments.steady_state import REPO, trace_for, window

    trace, _ = trace_for(setup_of(lengths, 400), 12.0, 0)
    engine = simulated_engine(config_only_model("opt-13b"), REPO / SCALES["opt-13b"][1],
                              scheduling_policy="skip-join-mlfq")
    res = run_trace(engine, trace)
    lo, hi = window([t for t, _, _ in trace])
    counted = [o for o in res.outputs if lo <= o.metrics.arrival_time <= hi]
    m = windowed_metrics(res.outputs, [t for t, _, _ in trace])
    waits = sum(o.metrics.swap_wait_s for o in counted)
    assert waits > 0 and m["swap_wait_share"] == pytest.approx(waits / sum(o.metrics.e2e_s for o in counted))
    assert m["mean_swap_wait_s"] == pytest.approx(waits / len(counted)) and 0 < m["swap_wait_share"] < 1


# -- run_trace's stop hook and cut ------------------------------------------------------------------------------
def test_run_trace_stops_the_arrivals_when_its_hook_says_and_cuts_at_until(flat_sim_model):
    """Flat profile, one request at a time, each 1 s (a 1-token answer is its prefill), one arriving every second
    from 0. The hook turns true at 2: the requests of 0 and 1 are sent, no other; a cut at 2.5 leaves the request
    started at 2 to finish at 3 (a step is not interrupted), and with 2-token answers leaves one unfinished."""
    model, profile = flat_sim_model

    def engine():
        return simulated_engine(model, profile, num_device_blocks=200, scheduling_policy="fcfs", max_num_seqs=1)

    trace = [(float(t), 20, 1) for t in range(6)]
    asked = []
    stopped = run_trace(engine(), trace, stop=lambda e: asked.append(e.clock.now()) or e.clock.now() >= 2.0)
    assert stopped.sent == 2 and [o.request_id for o in stopped.outputs] == ["0", "1"] and not stopped.unfinished
    assert asked == pytest.approx([0.0, 1.0, 2.0])  # once true it is not asked again; the run ends when drained
    cut = run_trace(engine(), trace, until=2.5)
    assert cut.sent == 3 and [o.request_id for o in cut.outputs] == ["0", "1", "2"] and not cut.unfinished
    assert cut.engine.clock.now() == pytest.approx(3.0)
    # 2-token answers (a 0.1 s decode after the prefill): 0 ends at 1.1, 1 at 2.2, 2 starts at 2.2 and is cut at 3.2
    longer = run_trace(engine(), [(t, 20, 2) for t, _, _ in trace], until=2.5)
    assert longer.sent == 3 and [o.request_id for o in longer.outputs] == ["0", "1"]
    assert [o.request_id for o in longer.unfinished] == ["2"] and len(longer.unfinished[0].outputs[0].token_ids) == 1
    whole = run_trace(engine(), trace)  # neither: every request, as before
    assert whole.sent == 6 and len(whole.outputs) == 6 and not whole.unfinished


# -- a burst ------------------------------------------------------------------------------------------------------
def test_drive_burst_stops_arrivals_once_the_queue_has_drained(flat_sim_model):
    """Flat profile, one request at a time, each 1 s (a 1-token answer is its prefill). Four arrive at 0; the burst
    ends at 2: at 2 two are in the engine and one runs, at 3 the last runs alone: drained at 3, so the request
    arriving at 3.5 is never sent, and the run ends at 4."""
    model, profile = flat_sim_model
    trace = [(0.0, 20, 1)] * 4 + [(3.5, 20, 1)]

    def engine():
        return simulated_engine(model, profile, num_device_blocks=200, scheduling_policy="fcfs", max_num_seqs=1)

    run = drive_burst(engine(), trace, burst_end=2.0, cut_at=100.0)
    assert run["sent"] == 4 and run["drained_at"] == pytest.approx(3.0) and run["end"] == pytest.approx(4.0)
    assert [o.metrics.finished_time for o in run["finished"]] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert run["unfinished"] == []
    cut = drive_burst(engine(), trace, burst_end=2.0, cut_at=2.5)  # the step from 2 to 3 runs; then the cut
    assert cut["end"] == pytest.approx(3.0) and len(cut["finished"]) == 3
    assert [o.request_id for o in cut["unfinished"]] == ["3"] and not cut["unfinished"][0].outputs[0].token_ids
    # Arrivals every 0.5 s after four at 0, twice what one slot serves: the queue lasts until the arrivals end, and
    # drains when the last request starts, at 42
    late = drive_burst(engine(), [(0.0, 20, 1)] * 4 + [(t / 2, 20, 1) for t in range(1, 40)], 0.5, 100.0)
    assert late["sent"] == 43 and late["drained_at"] == pytest.approx(42.0) and late["end"] == pytest.approx(43.0)


def test_burst_trace_offers_the_high_then_the_low_load():
    shape = BurstShape(seconds=100.0, high=1.5, low=0.5, limit=4.0)
    trace = burst_trace(Setup(n=1, synthetic=(512, 1.0, 0.5)), 4.0, 0, shape)
    times = [t for t, _, _ in trace]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 400
    burst = sum(t < 100 for t in times)
    assert abs(burst - 600) < 4 * 600 ** 0.5 and abs((len(times) - burst) - 600) < 4 * 600 ** 0.5
    assert all(128 <= p <= 384 and 128 <= o <= 384 for _, p, o in trace)  # the setup's lengths: 256 each, +-50%
    assert trace == burst_trace(Setup(n=1, synthetic=(512, 1.0, 0.5)), 4.0, 0, shape)
    assert trace != burst_trace(Setup(n=1, synthetic=(512, 1.0, 0.5)), 4.0, 1, shape)


def test_run_burst_counts_every_request_and_drains(lengths, tmp_path):
    setup, cap, shape = setup_of(lengths), 4.0, BurstShape(seconds=60.0)
    runner = Runner(jobs=2, cache=tmp_path, version="test")
    out = bursts(runner, setup, ["fcfs", "skip-join-mlfq"], [0], cap, shape)
    assert runner.runs == 2
    again = bursts(runner, setup, ["fcfs", "skip-join-mlfq"], [0], cap, shape)
    assert runner.runs == 2 and again["fcfs"]["drain_s"].values == out["fcfs"]["drain_s"].values  # cached
    trace = burst_trace(setup, cap, 0, shape)
    for policy in ("fcfs", "skip-join-mlfq"):
        r = runner.many([(setup, policy, cap, 0, shape)], fn=run_burst)[0]
        assert r["lost"] == 0 and r["unfinished"] == 0 and r["drained"] and 0 < r["drain_s"] < r["end_s"] - 60
        drained_at = 60 + r["drain_s"]
        assert trace[r["requests"] - 1][0] <= drained_at <= trace[r["requests"]][0]  # arrivals stop at the drain
        assert r["burst_requests"] == sum(t < 60 for t, _, _ in trace)
        assert r["mean_per_token_s"] <= r["p95_per_token_s"] and r["p99_ttft_s"] > 0
        assert 0 <= r["swap_wait_share"] < 1
    assert out["skip-join-mlfq"]["mean_per_token_s"].mean < out["fcfs"]["mean_per_token_s"].mean


def test_a_lost_request_fails_the_burst(lengths, monkeypatch):
    from scripts.experiments import measures

    inner = measures.drive_burst

    def losing(*args):
        run = inner(*args)
        run["finished"] = run["finished"][1:]
        return run

    monkeypatch.setattr(measures, "drive_burst", losing)
    with pytest.raises(RuntimeError, match="lost 1 of"):
        run_burst(setup_of(lengths), "fcfs", 4.0, 0, BurstShape(seconds=20.0))
    errored = NS(outputs=[NS(finish_reason="error")])
    monkeypatch.setattr(measures, "drive_burst", lambda *a: {**inner(*a), "finished": [errored]})
    with pytest.raises(RuntimeError, match="lost"):
        run_burst(setup_of(lengths), "fcfs", 4.0, 0, BurstShape(seconds=20.0))


def test_the_section_takes_its_oracles_from_one_constant_and_marks_no_difference():
    from scripts.experiments.past_capacity import ORACLE_NAMES, ORACLES, POLICIES, ratio_cell
    from scripts.experiments.steady_state import stat

    assert "srpt" in ORACLES and set(ORACLES) <= set(ORACLE_NAMES) and POLICIES == ("fcfs", "skip-join-mlfq",
                                                                                     *ORACLES)
    assert ratio_cell(None) == "-"
    assert ratio_cell(stat([0.9, 1.2])).endswith("(no difference)")  # interval 1.05 +- 1.9: holds 1.0
    assert "no difference" not in ratio_cell(stat([1.5, 1.6, 1.55])) + ratio_cell(stat([1.1]))  # 1.55 +- 0.12; one seed


def test_the_other_workloads_are_named_by_the_flag_and_built_as_their_sections_build_them():
    from types import SimpleNamespace as NS

    from scripts.experiments.fig14 import IO_RATIOS
    from scripts.experiments.past_capacity import WORKLOAD_START, WORKLOADS, parse_workloads, workload_setup

    assert parse_workloads("all") == list(WORKLOADS) and parse_workloads("none") == []
    assert len(WORKLOADS) == 3 + len(IO_RATIOS) and set(WORKLOAD_START) == set(WORKLOADS)
    assert parse_workloads("azure-code, fig14-64") == ["azure-code", "fig14-64"]
    with pytest.raises(ValueError, match="unknown --past-workloads"):
        parse_workloads("fig14-3")
    ctx = NS(args=NS(io_total=1024, io_spread=0.5))
    assert workload_setup(ctx, "fig14-64", 300) == Setup("opt-13b", "sharegpt", 300, synthetic=(1024, 64, 0.5))
    assert workload_setup(ctx, "azure-code", 300) == Setup("opt-13b", "azure-code", 300)
    assert workload_setup(ctx, "alpaca", 300).path().endswith("alpaca_lengths.csv")


def test_the_failing_loads_beside_an_answer_are_each_seeds_bracket_end():
    from scripts.experiments.past_capacity import fail_cell

    assert fail_cell([Bracket(passed=[1.0], failed=[1.225, 1.5]), Bracket(passed=[1.0, 1.107], failed=[1.225])]) \
        == "1.23, 1.23"
    assert fail_cell([Bracket(passed=[4.0]), Bracket(passed=[1.0], failed=[1.5])]) == "-, 1.5"
    assert fail_cell([Bracket(passed=[4.0])]) == "-"
