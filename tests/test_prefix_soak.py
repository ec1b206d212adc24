"""No leaks with prefix caching on two tiers (issue 28): multi-turn conversations with disconnects (aborts) through
the engine (scripts/prefix_soak.py), every block of both tiers audited after every step; at the end no job holds
a block, no reference is left, and clearing the cache frees every block. The run must have used the host tier
(blocks evicted to it and hits uploaded from it), else it would say nothing about it."""

from __future__ import annotations

import sys

import pytest

from tests.server_fixtures import REPO

sys.path.insert(0, str(REPO / "scripts"))
from prefix_soak import SMALL, SoakConfig, make_engine, soak  # noqa: E402


def run(small_checkpoint, cfg: SoakConfig) -> dict:
    engine = make_engine(small_checkpoint(SMALL), cfg)
    try:
        return soak(engine, cfg)
    finally:
        engine.shutdown()


def test_a_few_hundred_multi_turn_requests_with_disconnects_leave_every_block_accounted_for(small_checkpoint):
    report = run(small_checkpoint, SoakConfig(requests=300, seed=1))
    assert report["requests_sent"] == 300 and report["finished"] + report["aborted"] == 300
    assert report["aborted"] >= 20
    assert report["cache_evicted_to_host"] > 0 and report["host_hit_tokens"] > 0 and report["prefix_uploads"] > 0
    assert report["prefix_prefetches"] > 0  # waiting turns were uploaded ahead of need


@pytest.mark.slow
def test_ten_thousand_multi_turn_requests_with_disconnects(small_checkpoint):
    report = run(small_checkpoint, SoakConfig(requests=10_000, seed=0, audit_every=10))
    assert report["finished"] + report["aborted"] == 10_000 and report["host_hit_tokens"] > 0
