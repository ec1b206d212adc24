"""Helpers of the experiments (scripts/experiments/: the runner, common.py, steady_state.py) and of
scripts/benchmarks/sim_vs_live.py on tiny inputs (not the full run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.simulation import run_trace, simulated_engine
from fastserve.bench.arrivals import interarrival_cv, speedup_for_rate
from memory.kv_manager import blocks_needed
from scripts.benchmarks.sim_vs_live import make_trace
from scripts.experiments.common import KVUsageTracker, phase_latencies, throughput_at_slo


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


def test_fig13_bisection_narrows_every_bracket_to_the_resolution():
    """Fig. 13's goodput searches (scripts/experiments/latency_curves.py) bisect to 2%: after the steps, every
    bracket of the grid (and the one below its lowest point) is narrower than that; one step fewer is not."""
    from scripts.experiments.latency_curves import GOODPUT_GRID, RESOLUTION, bisection_steps

    steps = bisection_steps(GOODPUT_GRID, RESOLUTION)
    widest = max([4.0] + [b / a for a, b in zip(GOODPUT_GRID, GOODPUT_GRID[1:])])
    assert widest ** (0.5 ** steps) <= 1 + RESOLUTION < widest ** (0.5 ** (steps - 1))
    assert bisection_steps((1.0, 1.01), 0.02) == bisection_steps((1.0, 4.0), 0.02) == 7  # below the grid: x4
    # the search itself stops within the resolution on a curve that crosses the limit between grid points
    found = throughput_at_slo(lambda r: r, [0.5, 1.0, 2.0], 1.3, bisection_steps([0.5, 1.0, 2.0], 0.02), 0.02)
    assert 1.3 / 1.02 <= found.rate <= 1.3 and not found.capped
    # and stops there: a narrow bracket takes fewer steps than the widest (1.0 -> 1.25 needs 4, not 7)
    narrow = throughput_at_slo(lambda r: r, [1.0, 1.25], 1.1, 7, 0.02)
    assert len(narrow.evaluated) == 2 + 4 and 1.1 / 1.02 <= narrow.rate <= 1.1


def test_phase_latencies_splits_prefill_and_decode():
    from types import SimpleNamespace as NS

    def out(ttft, e2e, tokens):
        return NS(metrics=NS(ttft_s=ttft, e2e_s=e2e), outputs=[NS(token_ids=list(range(tokens)))])

    outs = [out(1.0, 3.0, 5), out(2.0, 2.0, 1)] + [out(0.1, 0.5, 3) for _ in range(18)]
    ph = phase_latencies(outs)
    # P95 as numpy.percentile: 20 TTFTs (eighteen 0.1, then 1.0, 2.0), position 0.95 * 19 = 18.05: 1.0 + 0.05 * 1.0;
    # TPOTs skip the 1-token job: 19 values, (3 - 1) / 4 = 0.5 once and (0.5 - 0.1) / 2 = 0.2 eighteen times,
    # position 0.95 * 18 = 17.1: 0.2 + 0.1 * 0.3
    assert ph["p95_ttft_s"] == pytest.approx(1.05)
    assert ph["p95_tpot_s"] == pytest.approx(0.23)
    assert phase_latencies([out(0.1, 0.5, 3)] * 19 + [out(1.0, 3.0, 5)] * 2)["p95_tpot_s"] == pytest.approx(0.5)


def test_speedup_for_rate_and_gap_cv():
    times = [0.0, 1.0, 3.0, 6.0, 10.0]  # 4 gaps over 10 s: 0.4 req/s
    assert speedup_for_rate(times, 0.8) == pytest.approx(2.0)  # twice as fast
    scaled = [t / speedup_for_rate(times, 2.0) for t in times]
    assert (len(scaled) - 1) / (scaled[-1] - scaled[0]) == pytest.approx(2.0)
    assert interarrival_cv([0, 1, 2, 3]) == 0.0
    gaps = [1.0, 3.0]  # mean 2, population stdev 1
    assert interarrival_cv([0.0, gaps[0], sum(gaps)]) == pytest.approx(0.5)
    assert interarrival_cv(scaled) == pytest.approx(interarrival_cv(times))  # scaling keeps the shape
    with pytest.raises(ValueError):
        speedup_for_rate([1.0], 1.0)


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
    from scripts.experiments import RUN_FIRST, RUN_LAST, SECTIONS, run_order, section

    assert all(callable(section(name)) for name in SECTIONS)
    middle = [n for n in SECTIONS if n not in RUN_FIRST + RUN_LAST]
    assert run_order(list(SECTIONS)) == [*RUN_FIRST, *middle, *RUN_LAST]
    assert run_order(["live", "fig15", "fig1", "slo"]) == ["slo", "fig1", "live", "fig15"]
    assert next(iter(SECTIONS)) == "slo" and "overload" not in SECTIONS  # the headline first; past C: past_capacity


def test_the_slo_sections_setups_are_the_papers_and_its_flag_names_them():
    from scripts.experiments.slo import SETUPS, parse_setups

    assert len(SETUPS) == 8 and SETUPS[0] == ("opt-13b", "sharegpt") and parse_setups("all") == list(SETUPS)
    assert parse_setups("opt-66b:alpaca,opt-13b:sharegpt") == [("opt-66b", "alpaca"), ("opt-13b", "sharegpt")]
    with pytest.raises(ValueError, match="unknown --slo-setups"):
        parse_setups("opt-13b:azure")


def test_the_slo_sections_other_setups_take_their_own_seeds():
    from types import SimpleNamespace as NS

    from scripts.experiments.slo import HEADLINE, SETUPS, seeds_of

    both = NS(slo_seeds=3, slo_other_seeds=None)
    assert {seeds_of(both, sd) for sd in SETUPS} == {3}
    split = NS(slo_seeds=2, slo_other_seeds=1)
    assert seeds_of(split, HEADLINE) == 2 and [seeds_of(split, sd) for sd in SETUPS if sd != HEADLINE] == [1] * 7


def test_the_slo_sections_headline_setup_is_past_capacitys():
    """The slo section's OPT-13B ShareGPT row runs the very Setup past_capacity runs (so the cache serves both)."""
    from types import SimpleNamespace as NS

    from scripts.experiments.slo import setup_for
    from scripts.experiments.steady_state import DATASETS, Setup

    ctx = NS(args=NS(sharegpt=DATASETS["sharegpt"], alpaca=DATASETS["alpaca"]))
    assert setup_for(ctx, "opt-13b", "sharegpt", 3000) == Setup("opt-13b", "sharegpt", 3000, dataset_path=None)
    moved = NS(args=NS(sharegpt=Path("/elsewhere.csv"), alpaca=DATASETS["alpaca"]))
    assert setup_for(moved, "opt-66b", "sharegpt", 10).path() == "/elsewhere.csv"
    assert setup_for(moved, "opt-66b", "alpaca", 10).path() == str(DATASETS["alpaca"])


def test_update_replaces_one_section_and_the_header_names_it(tmp_path):
    import datetime

    from scripts.experiments.__main__ import note_replaced, update_doc

    doc = tmp_path / "experiments.md"
    doc.write_text("# Experiments\n\nGenerated by `make experiments` in one run.\n\n## A\n\nold a\n\n## B\n\nold b\n")
    update_doc(doc, {"a": "## A\n\nnew a\n"})
    note_replaced(doc, ["a"])
    update_doc(doc, {"b": "## B\n\nnew b\n"})
    note_replaced(doc, ["b", "a"])
    today = datetime.date.today().isoformat()
    text = doc.read_text()
    assert "old a" not in text and "old b" not in text and text.count("## A") == text.count("## B") == 1
    assert "new a\n\n## B\n\nnew b" in text
    lines = text.split("\n")
    assert lines[3] == "" and lines[4].endswith(f": a ({today}); b ({today}).")  # under the Generated line, once
    assert sum("replaced since" in ln for ln in lines) == 1


def test_update_puts_a_new_section_in_the_documents_order(tmp_path):
    from scripts.experiments.__main__ import update_doc

    doc = tmp_path / "experiments.md"
    doc.write_text("# E\n\n## A\n\nCommand: `python -m scripts.experiments --only a`\n\n"
                   "## C\n\nCommand: `python -m scripts.experiments --only c --num-prompts 9`\n")
    update_doc(doc, {"b": "## B\n\nCommand: `python -m scripts.experiments --only b`\n"}, order=("a", "b", "c"))
    update_doc(doc, {"d": "## D\n\nd\n"}, order=("a", "b", "c", "d"))
    text = doc.read_text()
    assert [ln for ln in text.split("\n") if ln.startswith("## ")] == ["## A", "## B", "## C", "## D"]
    assert "--only b`\n\n## C\n" in text


@pytest.mark.datasets  # (its trace is drawn from ../shared/datasets/sharegpt_lengths.csv)
def test_steady_state_mix_replaces_a_seeded_share_of_prompts_whatever_the_rate():
    """The chunked section's workload: with long_share each request's prompt is replaced, by its own seeded draw,
    with one of long_range tokens (its output cut to fit 2,048); the same requests at any rate, none without one."""
    from scripts.experiments.steady_state import Setup, trace_for

    plain, stats0 = trace_for(Setup(n=400), 1.0, 3)
    mixed, stats = trace_for(Setup(n=400, long_share=0.1), 1.0, 3)
    fast, stats2 = trace_for(Setup(n=400, long_share=0.1), 4.0, 3)
    assert stats0["long"] == set() and stats["long"] == stats2["long"]
    assert 20 <= len(stats["long"]) <= 60  # ~40 of 400
    for i, ((t0, p0, o0), (t1, p1, o1)) in enumerate(zip(plain, mixed)):
        assert t0 == t1
        if i in stats["long"]:
            assert 1500 <= p1 <= 2000 and 1 <= o1 == min(o0, 2048 - p1)
        else:
            assert (p1, o1) == (p0, o0)
    assert [p for _, p, _ in fast] == [p for _, p, _ in mixed]


def test_windowed_metrics_report_itl_and_the_short_requests_alone(sim_model):
    """ITL: every gap between a counted request's tokens; the short requests' metrics leave out the long ones."""
    from engine.simulation import quantile
    from scripts.experiments.steady_state import windowed_metrics

    model, profile = sim_model
    trace = [(i * 0.5, 1800 if i % 4 == 1 else 40, 6) for i in range(21)]
    res = run_trace(simulated_engine(model, profile, num_device_blocks=2000, scheduling_policy="fcfs"), trace)
    long = {i for i in range(21) if i % 4 == 1}
    m = windowed_metrics(res.outputs, [t for t, _, _ in trace], long)
    counted = [o for o in res.outputs if 1.0 <= o.metrics.arrival_time <= 9.0]
    short = [o for o in counted if int(o.request_id) not in long]
    assert 0 < len(short) < len(counted) == m["counted"]
    gaps = [g for o in counted for g in o.metrics.itl_s]
    assert len(gaps) == 5 * len(counted)
    assert m["p99_itl_s"] == quantile(gaps, 0.99) and m["median_itl_s"] == quantile(gaps, 0.5)
    assert m["short_mean_per_token_s"] == pytest.approx(sum(o.metrics.e2e_s / 6 for o in short) / len(short))
    assert m["short_p99_ttft_s"] == quantile([o.metrics.ttft_s for o in short], 0.99)
    everyone = windowed_metrics(res.outputs, [t for t, _, _ in trace])
    assert everyone["short_mean_per_token_s"] == pytest.approx(everyone["mean_per_token_s"])
    # Fig. 13's phases: TTFT, and the time per output token after the first, over the counted requests
    assert m["p95_ttft_s"] == quantile(sorted(o.metrics.ttft_s for o in counted), 0.95)
    tpot = sorted((o.metrics.e2e_s - o.metrics.ttft_s) / 5 for o in counted)
    assert m["p95_tpot_s"] == pytest.approx(quantile(tpot, 0.95)) and m["p95_tpot_s"] != m["p95_ttft_s"]


def test_windowed_metrics_split_the_per_token_latency_by_output_length(sim_model):
    import math

    from scripts.experiments.steady_state import windowed_metrics

    model, profile = sim_model
    trace = [(i * 0.5, 40, (3, 20, 40, 200)[i % 4]) for i in range(21)]
    res = run_trace(simulated_engine(model, profile, num_device_blocks=2000, scheduling_policy="fcfs"), trace)
    m = windowed_metrics(res.outputs, [t for t, _, _ in trace])
    counted = [o for o in res.outputs if 1.0 <= o.metrics.arrival_time <= 9.0]
    for lo, want in ((1, 3), (8, 20), (32, 40), (128, 200)):
        mine = [o for o in counted if len(o.outputs[0].token_ids) == want]
        assert m[f"n_out{lo}"] == len(mine) > 0
        assert m[f"mean_per_token_s_out{lo}"] == pytest.approx(sum(o.metrics.e2e_s / want for o in mine) / len(mine))
    assert m["n_out512"] == 0 and math.isnan(m["mean_per_token_s_out512"])
    assert sum(m[f"n_out{lo}"] for lo in (1, 8, 32, 128, 512)) == m["counted"]
    assert m["served_rate"] > 0 and m["window_s"] == pytest.approx(8.0)
    # every token made inside the window, by any request, finished in it or not
    times = []
    for o in res.outputs:
        t = o.metrics.first_token_time
        times += [t] + [t + sum(o.metrics.itl_s[:i + 1]) for i in range(len(o.metrics.itl_s))]
    assert len(times) == sum(len(o.outputs[0].token_ids) for o in res.outputs)
    inside = sum(1.0 <= t <= 9.0 for t in times)
    assert m["window_tokens_per_s"] == pytest.approx(inside / 8.0) and 0 < inside < len(times)


def test_setup_fields_at_their_defaults_leave_the_cache_key_as_it_was(tmp_path):
    """Burstiness and profiler error are in the key only when set: a plain setup's cached results keep their key."""
    from dataclasses import asdict

    from scripts.experiments.steady_state import REPO, Runner, Setup, file_hash, setup_key

    plain = asdict(Setup())
    for name in ("burstiness", "profiler_error", "planner_ranking", "synthetic", "arrivals", "track_kv"):
        del plain[name]
    assert setup_key(Setup()) == plain | {"profile": file_hash(REPO / "profiles/sim/opt-13b-a100-40gb-x1.json")}
    assert setup_key(Setup(burstiness=0.5))["burstiness"] == 0.5
    assert setup_key(Setup(profiler_error=(1.2, 0.8)))["profiler_error"] == (1.2, 0.8)
    assert setup_key(Setup(track_kv=True))["track_kv"] is True
    runner = Runner(jobs=1, cache=tmp_path, version="v")
    keys = {runner._key(s, "fcfs", 1.0, 0) for s in (Setup(), Setup(burstiness=0.5), Setup(profiler_error=(1.2, 1.0)),
                                                      Setup(planner_ranking="lru"), Setup(track_kv=True))}
    assert len(keys) == 5


def test_the_profile_is_in_the_key_except_under_a_version_that_hashed_every_profile(tmp_path):
    """Versions of 16 digits hashed profiles/sim whole: their keys are as they were written, with no profile."""
    import hashlib
    import json

    from scripts.experiments.steady_state import Runner, Setup, setup_key

    assert setup_key(Setup(scale="opt-66b"))["profile"] != setup_key(Setup())["profile"]
    old = Runner(jobs=1, cache=tmp_path, version="9b9cafca5f385877")
    legacy = {k: v for k, v in setup_key(Setup()).items() if k != "profile"}
    text = json.dumps([legacy, "fcfs", 1.0, 0, old.version], sort_keys=True, default=str)
    assert old._key(Setup(), "fcfs", 1.0, 0).name == hashlib.sha256(text.encode()).hexdigest()[:24] + ".json"
    new = Runner(jobs=1, cache=tmp_path, version="0" * 20)
    text = json.dumps([setup_key(Setup()), "fcfs", 1.0, 0, new.version], sort_keys=True, default=str)
    assert new._key(Setup(), "fcfs", 1.0, 0).name == hashlib.sha256(text.encode()).hexdigest()[:24] + ".json"


def test_the_code_version_hashes_the_modules_a_simulation_imports_and_no_other(tmp_path):
    from scripts.experiments.steady_state import code_version

    files = {"scheduler/__init__.py": "",
             "scheduler/a.py": "from memory import b\n\ndef f():\n    import engine.lazy\n",
             "memory/__init__.py": "", "memory/b.py": "from . import c\n", "memory/c.py": "X = 1\n",
             "engine/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.typed\n",
             "engine/lazy.py": "", "engine/typed.py": "", "engine/unrelated.py": "", "engine/run.py": "",
             "scripts/entry.py": "import os\nimport scheduler.a\n\ndef run():\n    from engine import run\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    entry = tmp_path / "scripts/entry.py"
    before = code_version(entry, tmp_path)
    for name in ("engine/unrelated.py", "engine/lazy.py", "engine/typed.py"):  # not imported, or only in functions
        (tmp_path / name).write_text("Y = 2\n")  # of other modules, or for type checkers
        assert code_version(entry, tmp_path) == before, name
    for name in ("scheduler/a.py", "memory/c.py", "engine/__init__.py", "engine/run.py", "scripts/entry.py"):
        (tmp_path / name).write_text((tmp_path / name).read_text() + "# changed\n")
        assert code_version(entry, tmp_path) != before, name
        before = code_version(entry, tmp_path)


def test_the_code_version_covers_every_module_a_simulation_loads(tmp_path):
    """A real (small) run in a fresh interpreter: each module of scheduler/, memory/, engine/ it loaded is hashed."""
    import json
    import subprocess
    import sys

    from scripts.experiments.steady_state import REPO, simulation_files

    csv = tmp_path / "lengths.csv"
    csv.write_text("input_tokens,output_tokens\n" + "".join(f"{10 + i % 50},{5 + i % 70}\n" for i in range(100)))
    code = ("import json, sys\nfrom scripts.experiments.steady_state import Setup, run_point\n"
            f"run_point(Setup(n=60, dataset_path={str(csv)!r}, track_kv=True), 'skip-join-mlfq', 5.0, 0)\n"
            "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()"
            " if n.split('.')[0] in ('scheduler', 'memory', 'engine'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = {Path(f) for f in json.loads(out.stdout.splitlines()[-1])}
    assert loaded and loaded <= set(simulation_files())
    assert REPO / "engine/loader.py" not in simulation_files()


def test_a_bursty_setup_draws_gamma_arrivals_of_the_same_requests(tmp_path):
    from scripts.experiments.steady_state import Setup, trace_for

    csv = tmp_path / "lengths.csv"
    csv.write_text("input_tokens,output_tokens\n" + "".join(f"{10 + i % 50},{5 + i % 70}\n" for i in range(500)))

    def gaps_cv(trace):
        gaps = [b[0] - a[0] for a, b in zip(trace, trace[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    poisson, _ = trace_for(Setup(n=400, dataset_path=str(csv)), 2.0, 1)
    bursty, _ = trace_for(Setup(n=400, dataset_path=str(csv), burstiness=0.25), 2.0, 1)
    assert [t[1:] for t in poisson] == [t[1:] for t in bursty]
    assert 0.8 < gaps_cv(poisson) < 1.25 and 1.5 < gaps_cv(bursty) < 3  # CV 1 and 1 / sqrt(0.25) = 2, sampled


def test_a_misprofiled_engine_schedules_by_the_scaled_costs_and_runs_at_the_true_ones(sim_model):
    from scheduler.cost_model import ProfiledCostModel
    from scripts.experiments.steady_state import misprofiled_engine

    model, profile = sim_model
    true = ProfiledCostModel.from_json(profile)
    eng = misprofiled_engine(Path(model), Path(profile), (1.2, 0.8), "skip-join-mlfq", {"num_device_blocks": 100})
    assert eng.cost_model.t_init(100) == pytest.approx(1.2 * true.t_init(100))
    assert eng.cost_model.t_dec(4, 100) == pytest.approx(0.8 * true.t_dec(4, 100))
    assert eng.executor.cost.t_init(100) == pytest.approx(true.t_init(100))
    res = run_trace(eng, [(0.0, 20, 5), (0.1, 30, 4)])
    assert len(res.outputs) == 2


@pytest.mark.parametrize("kind", ["lru", "random"])
def test_the_planner_ranking_replaces_enst_for_the_planner_alone(sim_model, kind):
    from scripts.experiments.steady_state import rank_planner

    model, profile = sim_model
    eng = simulated_engine(model, profile, num_device_blocks=100, scheduling_policy="skip-join-mlfq")
    seen = []
    inner = eng.kv.plan

    def spy(batch, estimated_wait, now):
        seen.append(estimated_wait)
        return inner(batch, estimated_wait, now)

    eng.kv.plan = spy
    rank_planner(eng, kind)
    run_trace(eng, [(0.0, 20, 5), (0.1, 30, 4)])
    assert seen and all(rank is not eng.scheduler.estimated_wait for rank in seen)
    if kind == "lru":
        job = type("J", (), {"last_scheduled_time": 3.0})()
        assert seen[0](job, 0.0) == -3.0
    with pytest.raises(ValueError, match="unknown planner ranking"):
        rank_planner(eng, "enst2")


def test_a_synthetic_setup_splits_its_lengths_by_the_ratio_unfiltered():
    """Fig. 14's workload: mean total 1,024 tokens split r:1, each length uniform over [0.5, 1.5] x its mean, the
    same lengths at any rate, and no length filter (prompts over 1,024 tokens stay, as in vLLM's random dataset)."""
    from scripts.experiments.steady_state import Setup, trace_for

    trace, stats = trace_for(Setup(n=3000, synthetic=(1024, 16, 0.5)), 2.0, 0)
    faster, _ = trace_for(Setup(n=3000, synthetic=(1024, 16, 0.5)), 5.0, 0)
    assert len(trace) == 3000 and stats["dropped"] == 0
    prompts, outputs = [p for _, p, _ in trace], [o for _, _, o in trace]
    assert 482 <= min(prompts) and max(prompts) <= 1446 and max(prompts) > 1024
    assert 30 <= min(outputs) and max(outputs) <= 90
    assert abs(sum(prompts) / len(prompts) / (sum(outputs) / len(outputs)) - 16) < 1
    assert [t[1:] for t in faster] == [t[1:] for t in trace] and faster[-1][0] < trace[-1][0]


@pytest.mark.datasets  # (the Azure 2023 trace and the lengths are in ../shared/datasets)
def test_azure_arrivals_carry_the_gamma_runs_lengths_at_the_asked_mean_rate():
    from scripts.experiments.steady_state import Setup, trace_for

    plain, _ = trace_for(Setup(n=3000), 4.0, 1)
    azure, _ = trace_for(Setup(n=3000, arrivals="azure-conv"), 4.0, 1)
    other, _ = trace_for(Setup(n=3000, arrivals="azure-conv"), 4.0, 2)
    assert [t[1:] for t in azure] == [t[1:] for t in plain]
    times = [t for t, _, _ in azure]
    assert times[0] == 0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0)
    assert times != [t for t, _, _ in plain]
    assert [t for t, _, _ in other] != times  # another seed, another window of the trace


@pytest.mark.datasets  # (the Azure 2023 traces are in ../shared/datasets)
@pytest.mark.parametrize("name", ["azure-conv", "azure-code"])
def test_a_whole_azure_trace_is_its_filtered_requests_in_order_at_the_asked_rate(name):
    """Setup.dataset azure-*: the trace's requests kept by vLLM's length filter, in order, a window of n by seed,
    their own lengths and gaps, scaled to the asked mean rate."""
    from fastserve.bench.workload import LengthFilter, load_workload
    from scripts.experiments.steady_state import TRACE_WORKLOADS, Setup, trace_for

    kept = load_workload(name, 10**9, path=TRACE_WORKLOADS[name], length_filter=LengthFilter())
    trace, stats = trace_for(Setup(n=500, dataset=name), 3.0, 2)
    assert stats["read"] > stats["kept"] == len(kept) and stats["dropped"] > 0
    assert [t[1:] for t in trace] == [(it.prompt_len, it.output_len) for it in kept[1000:1500]]  # seed 2 x 500
    times = [t for t, _, _ in trace]
    assert times[0] == 0 and (len(times) - 1) / times[-1] == pytest.approx(3.0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(kept[1000:1500], kept[1001:1500])]
    scale = (times[-1] - times[0]) / sum(gaps)
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([g * scale for g in gaps])
    assert [t[1:] for t in trace_for(Setup(n=500, dataset=name), 6.0, 2)[0]] == [t[1:] for t in trace]
    with pytest.raises(ValueError, match="fewer than"):
        trace_for(Setup(n=10**6, dataset=name), 3.0, 0)


def test_windowed_metrics_queueing_share_is_over_the_counted_requests(sim_model):
    """Fig. 1's queueing share: the counted requests' time queued over their end-to-end time (one slot: the
    requests wait their turn, so some of it is queueing)."""
    from scripts.experiments.steady_state import window, windowed_metrics

    model, profile = sim_model
    trace = [(i * 0.01, 40, 8) for i in range(21)]
    res = run_trace(simulated_engine(model, profile, num_device_blocks=200, scheduling_policy="fcfs",
                                     max_num_seqs=1), trace)
    lo, hi = window([t for t, _, _ in trace])
    counted = [o for o in res.outputs if lo <= o.metrics.arrival_time <= hi]
    m = windowed_metrics(res.outputs, [t for t, _, _ in trace])
    share = sum(o.metrics.queued_s for o in counted) / sum(o.metrics.e2e_s for o in counted)
    assert m["queueing_share"] == pytest.approx(share)
    assert 0.5 < m["queueing_share"] < 1.0  # the later ones wait for all the earlier ones
    assert m["queueing_share"] != pytest.approx(res.summary()["queueing_share"])  # not over every request


def test_kv_usage_holds_each_steps_count_until_the_next():
    """Blocks in use after steps at t = 0, 1, 2, 4 (device + host): over the window [0.5, 3] the counts 3 (0.5 s),
    5 (1 s) and 9 (1 s) hold, and the 4-block start and the 1-block end lie outside it."""
    from scripts.experiments.steady_state import kv_usage

    u = kv_usage([0.0, 1.0, 2.0, 4.0], [3, 4, 6, 1], [0, 1, 3, 0], lo=0.5, hi=3.0, bins=4)
    assert u["kv_peak_blocks"] == 9 and u["kv_run_peak_blocks"] == 9 and u["kv_peak_device_blocks"] == 6
    assert u["kv_mean_blocks"] == pytest.approx((3 * 0.5 + 5 * 1 + 9 * 1) / 2.5)
    assert u["kv_series"] == [[0.0, 3], [1.0, 5], [2.0, 9], [3.0, 9]]  # the highest count holding in each second
    assert kv_usage([], [], [], 0.0, 1.0)["kv_peak_blocks"] == 0


@pytest.mark.datasets  # (its trace is drawn from ../shared/datasets/sharegpt_lengths.csv)
def test_run_point_with_kv_tracking_reports_the_usage_beside_the_same_metrics():
    from scripts.experiments.steady_state import Setup, run_point

    plain = run_point(Setup(n=60), "fcfs", 20.0, 0)
    tracked = run_point(Setup(n=60, track_kv=True), "fcfs", 20.0, 0)
    assert {k: v for k, v in tracked.items() if not k.startswith("kv_") and k != "wall_s"} == \
        {k: v for k, v in plain.items() if k != "wall_s"}
    assert 0 < tracked["kv_mean_blocks"] <= tracked["kv_peak_blocks"] <= tracked["kv_run_peak_blocks"]
    assert len(tracked["kv_series"]) == 400 and max(n for _, n in tracked["kv_series"]) == tracked["kv_run_peak_blocks"]


@pytest.mark.parametrize("flags, message", [(["--only", "slo", "--slo-setups", "opt-13b:azure"],
                                             "unknown --slo-setups"),
                                            (["--only", "past_capacity", "--past-workloads", "fig14-3"],
                                             "unknown --past-workloads"),
                                            (["--only", "capacity", "--steady-goal-seeds", "0"],
                                             "argument --steady-goal-seeds: must be at least 1, got 0")])
def test_a_bad_section_flag_is_a_one_line_error_before_anything_runs(flags, message, tmp_path, capsys):
    from scripts.experiments.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([*flags, "--out", str(tmp_path / "doc.md")])
    assert exit_.value.code == 2 and f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "doc.md").exists()


def test_fig14_past_judges_against_the_best_baseline_the_right_way_up():
    """Goodput (higher is better): the best baseline's over each one's; burst latency (lower is better): each one's
    over the best's. Either way a ratio <= 1.1 is within the goal; the oracle is never the best."""
    from scripts.experiments.fig14_past import ALL, ORACLE, best_of, versus

    goodput = {p: [1.0, 0.8] for p in ALL} | {"fixed-priority": [1.2, 1.0], ORACLE: [4.0, 4.0]}
    best = best_of(goodput, higher=True)
    assert best == "fixed-priority"
    vs = versus(goodput, best, higher=True)
    assert vs["skip-join-mlfq"].values == pytest.approx([1.2, 1.25]) and vs[ORACLE].values == [0.3, 0.25]
    latency = {p: [0.5, 0.6] for p in ALL} | {"fcfs": [0.4, 0.5], ORACLE: [0.1, 0.1]}
    best = best_of(latency, higher=False)
    assert best == "fcfs"
    assert versus(latency, best, higher=False)["skip-join-mlfq"].values == pytest.approx([1.25, 1.2])
