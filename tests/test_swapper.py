"""The Swapper's block copies: consecutive blocks in one copy, the same bytes as block-by-block copies."""

from __future__ import annotations

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.swapper import Swapper, contiguous_runs
from memory.transfers import Direction


def _wait(handle) -> None:
    deadline = time.monotonic() + 10
    while not handle.done():
        assert time.monotonic() < deadline, "copy did not complete"
        time.sleep(0.001)


def test_runs_join_blocks_consecutive_on_both_tiers():
    assert contiguous_runs([(5, 0), (3, 8), (4, 9), (6, 1), (7, 3)]) == [(3, 8, 2), (5, 0, 2), (7, 3, 1)]
    assert contiguous_runs([]) == []


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_copies_move_exactly_the_paired_blocks(data):
    n_dev, n_host = 12, 10
    k = data.draw(st.integers(0, 8))
    src_ids = data.draw(st.permutations(range(n_dev)))[:k]
    dst_ids = data.draw(st.permutations(range(n_host)))[:k]
    device = torch.randn(n_dev, 2, 2, 1, 4, 3)  # [NB, L, 2, H, bs, D]
    host = torch.zeros(n_host, 2, 2, 1, 4, 3)
    expected = host.clone()
    for s, d in zip(src_ids, dst_ids):
        expected[d] = device[s]
    swapper = Swapper(device, host)
    try:
        _wait(swapper.copy(Direction.OFFLOAD, list(zip(src_ids, dst_ids))))
        assert torch.equal(host, expected)
        device_before = device.clone()
        device.zero_()
        _wait(swapper.copy(Direction.UPLOAD, list(zip(dst_ids, src_ids))))
        for s in src_ids:
            assert torch.equal(device[s], device_before[s])
    finally:
        swapper.shutdown()
