"""A short soak (`fastserve bench soak`, fastserve/bench/soak.py) in the default suite: a few hundred requests at
1.5x the measured capacity with disconnecting clients, malformed bodies and a mix of n / stop / logprobs / chat,
against a real server process with a small KV cache; every check of the script must pass. `make soak` runs
10,000."""

from __future__ import annotations

import asyncio

import pytest

from fastserve.bench.soak import SERVER_ARGS, SoakConfig, format_report, soak
from tests.server_fixtures import shared_server, wait_idle


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, SERVER_ARGS)
    wait_idle(srv.url)
    return srv


def test_short_soak_keeps_every_promise(server):
    report = asyncio.run(soak(server.url, server.proc.pid, SoakConfig(requests=240, max_tokens=24, calibration=16)))
    print(format_report(report))
    assert report.ok, format_report(report)
    names = [name for name, _, _ in report.checks]
    assert len(names) == 10 and any(name.startswith("RSS grew") for name in names)  # RSS was measured
    sent = report.outcomes
    assert sent["disconnect"]["sent"] > 20 and sent["malformed"]["sent"] > 3 and sent["kept"]["sent"] > 150
    assert report.finished["abort"] > 0  # disconnects really ended work on the server
    assert report.offered_rps == pytest.approx(1.5 * report.capacity_rps)
