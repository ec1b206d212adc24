"""scripts/length_hint_ceiling.py, the study of what an output-length predictor could buy (issue 24): the hinted
Gittins order learns one index per hint bucket from that bucket's finished jobs and ranks by it; the synthetic hint's
noise; the predictor's folds never see the answers they predict; a simulation through run_point's make_scheduler.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import length_hint_ceiling as study  # noqa: E402

from scheduler import SchedulerConfig  # noqa: E402
from scheduler.gittins import MIN_HISTORY, REFRESH_EVERY  # noqa: E402
from scheduler.job import Job  # noqa: E402
from tests.scheduler_sim import make_cost  # noqa: E402

COST = make_cost()
# Finished jobs per bucket (two buckets, alternating) that reach the second refresh, the first at which both buckets
# hold MIN_HISTORY lengths.
PER_BUCKET = (MIN_HISTORY + REFRESH_EVERY) // 2


def hinted(hints: dict[str, float]) -> study.HintedGittinsPolicy:
    """Two buckets, split at a hint of 100; the hint of a job is looked up by its id."""
    config = SchedulerConfig(max_prompt_len=64, max_num_seqs=4, starvation_threshold=None, starvation_age=None)
    return study.HintedGittinsPolicy(config, COST, lambda job: hints[job.job_id], [100.0])


def finish(p: study.HintedGittinsPolicy, hints: dict[str, float], job_id: str, hint: float, length: int) -> None:
    hints[job_id] = hint
    j = Job(job_id, 8, 4096, 0.0)
    p.add(j, 0.0)
    j.num_generated, j.finished = length, True
    p.remove(j)


def started(job_id: str, generated: int) -> Job:
    j = Job(job_id, 8, 4096, 0.0)
    j.num_generated, j.num_computed, j.first_scheduled_time = generated, 8 + generated - 1, 0.0
    return j


def test_each_hint_bucket_learns_its_own_lengths_and_ranks_by_them() -> None:
    """Jobs hinted short (< 100) all ended at 20 tokens, jobs hinted long at 20 or 400 (half each). With 10 tokens
    out, a job hinted short is 10 tokens from its end and one hinted long is as likely to be 390 away: the short
    bucket's index is the higher. The pooled order (one distribution for both) ranks the two alike."""
    hints: dict[str, float] = {}
    p = hinted(hints)
    for i in range(PER_BUCKET):
        finish(p, hints, f"s{i}", 10.0, 20)
        finish(p, hints, f"l{i}", 1000.0, 20 if i % 2 else 400)
    assert p._bucket_learned[0] is not None and p._bucket_learned[1] is not None
    short, long = started("short", 10), started("long", 10)
    hints |= {"short": 50.0, "long": 500.0}
    assert p.index(short) > 1.5 * p.index(long)
    assert p._key(short) < p._key(long)  # the lower key runs first
    # The bucket's index is the one a Gittins order computes from that bucket's lengths alone.
    assert p.index(short) == pytest.approx(study.LearnedIndex(np.array([20] * PER_BUCKET), p._d).started(10))
    # The pooled order sees one distribution: both jobs have the same index.
    pooled = study.GittinsPolicy(p.config, COST)
    pooled._lengths.extend(p._lengths)
    pooled._refresh()
    assert pooled.index(short) == pooled.index(long)


def test_fresh_jobs_are_ranked_by_their_buckets_at_a_refresh() -> None:
    """Fresh jobs waiting when a distribution is learned are re-ranked by their own bucket's index."""
    hints: dict[str, float] = {}
    p = hinted(hints)
    hints |= {"fresh-long": 500.0, "fresh-short": 50.0}
    a, b = Job("fresh-long", 8, 4096, 0.0), Job("fresh-short", 8, 4096, 0.0)
    p.add(a, 0.0)
    p.add(b, 0.0)
    for i in range(PER_BUCKET):
        finish(p, hints, f"s{i}", 10.0, 4)
        finish(p, hints, f"l{i}", 1000.0, 4 if i % 4 == 0 else 800)
    p._before_schedule(0.0)
    order = [j.job_id for j in p._priority_order()]
    assert order.index("fresh-short") < order.index("fresh-long")  # arrival order would put fresh-long first


def test_a_bucket_without_history_is_ranked_by_the_pooled_index() -> None:
    """10 jobs hinted short end at 20 tokens (too few for their bucket), 150 hinted long at 20 or 400: the long bucket
    has its own index, the short one falls back to the pooled index (all 160 lengths), which differs from both."""
    hints: dict[str, float] = {}
    p = hinted(hints)
    for i in range(10):
        finish(p, hints, f"s{i}", 10.0, 20)
    for i in range(MIN_HISTORY + REFRESH_EVERY - 10):
        finish(p, hints, f"l{i}", 1000.0, 20 if i % 2 else 400)
    assert p._bucket_learned[0] is None and p._bucket_learned[1] is not None
    hints["short"] = 5.0
    short = started("short", 10)
    assert p.index(short) == p._learned.started(10)
    assert p._learned.started(10) != p._bucket_learned[1].started(10)


def test_the_hint_is_the_true_length_at_sigma_zero_and_noisy_otherwise() -> None:
    j = Job("req-7#0", 8, 300, 0.0)
    assert study.noisy_hint(0.0, 1)(j) == 300
    noisy = study.noisy_hint(1.0, 1)
    assert noisy(j) == noisy(j) != 300  # one draw per (seed, job): the same every time it is asked
    assert noisy(j) != study.noisy_hint(1.0, 2)(j)
    draws = [math.log(study.noisy_hint(1.0, 0)(Job(f"r{i}", 8, 100, 0.0)) / 100) for i in range(2000)]
    assert abs(np.mean(draws)) < 0.1 and abs(np.std(draws) - 1.0) < 0.1


def test_spearman() -> None:
    assert study.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert study.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert study.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # ranks, not values


def synthetic_pairs(n: int = 200) -> list[tuple[int, str, int, int]]:
    """Prompts whose words say the answer's length: 'brief' answers 8 tokens, 'essay' 600."""
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(n):
        long = bool(rng.integers(2))
        words = " ".join(rng.choice(["tell", "me", "about", "cats", "the", "sea"], 6))
        pairs.append((i, f"{'write an essay' if long else 'brief answer'} {words}", 10, 600 if long else 8))
    return pairs


def test_the_predictor_learns_what_the_words_say() -> None:
    pairs = synthetic_pairs()
    pred = study.out_of_fold_predictions(pairs)
    long = np.array([p[3] == 600 for p in pairs])
    assert pred[long].min() > 5 * pred[~long].max()


def test_a_fold_is_predicted_without_its_own_answers() -> None:
    """Changing the answers of fold 0 leaves fold 0's predictions as they were (and changes the others')."""
    pairs = synthetic_pairs()
    before = study.out_of_fold_predictions(pairs)
    changed = [(c, t, n_in, 5000 if c % 5 == 0 else n_out) for c, t, n_in, n_out in pairs]
    after = study.out_of_fold_predictions(changed)
    fold0 = np.array([c % 5 == 0 for c, *_ in pairs])
    np.testing.assert_allclose(after[fold0], before[fold0])
    assert not np.allclose(after[~fold0], before[~fold0])


@pytest.mark.datasets  # the trace is drawn from ../shared/datasets/sharegpt_lengths.csv
def test_run_point_runs_a_study_s_own_order(monkeypatch) -> None:
    """run_point's make_scheduler swaps the engine's order for the hinted one, and run_one reports the hint's rank
    correlation: 1 at sigma 0 (a 300-request trace, to keep it short)."""
    import steady_state

    monkeypatch.setattr(study, "Setup", lambda: steady_state.Setup(n=300))
    out = study.run_one(("hinted", 0.0, [100.0, 300.0], 2.0, 0))
    assert out["label"] == "hinted sigma=0" and out["requests"] == 300
    assert out["hint_spearman"] == pytest.approx(1.0)
    assert out["mean_per_token_s"] > 0
