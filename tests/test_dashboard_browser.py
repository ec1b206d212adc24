"""The dashboard in a real headless Chromium (Debian's package, over the DevTools protocol): while a load runs,
every number the page shows is the JSON endpoint's for the sample the page says it shows, formatted by the
page's documented rules; the page logs no console error (its CSP turns any outside fetch into one); and
after the load it shows the server idle. Without Chromium this test fails, saying how to install it."""

from __future__ import annotations

import asyncio
import json
import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import aiohttp
import pytest

from scripts.tools.dashboard_screenshot import SERVER_ARGS, page_numbers, steady_load
from scripts.tools.headless_chromium import Chromium, ChromiumMissing, find_chromium
from tests.server_fixtures import shared_server, wait_idle


def js_fixed(x: float, digits: int) -> str:
    """Number.prototype.toFixed: the exact binary value, ties away from zero (for x >= 0)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def js_format(kind: str, v) -> str:
    """dashboard.js's FORMATS."""
    if v is None:
        return "–"
    if kind == "text":
        return str(v)
    if kind == "dur":
        s = int(v)
        return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"
    scale, digits = {"int": (1, 0), "f1": (1, 1), "f2": (1, 2), "ms": (1000, 1), "mib": (1 / 1048576, 2),
                     "pct": (1, 0)}[kind]
    return js_fixed(v / 1048576 if kind == "mib" else v * scale, digits)


def lookup(data: dict, path: str):
    for part in path.split("."):
        if data is None:
            return None
        data = data[int(part)] if isinstance(data, list) else data.get(part)
    return data


def test_format_mirror_matches_javascript_rules():
    assert js_fixed(0.125, 2) == "0.13" and js_fixed(2.5, 0) == "3" and js_fixed(1.005, 2) == "1.00"
    assert js_format("ms", 0.0123456) == "12.3" and js_format("mib", 3 * 1048576) == "3.00"
    assert js_format("dur", 3725.9) == "1h02m05s" and js_format("int", None) == "–"


@pytest.fixture(scope="module")
def chromium() -> str:
    try:
        return find_chromium()
    except ChromiumMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, SERVER_ARGS)
    wait_idle(srv.url)
    return srv


async def _watch(url: str, page, seen: dict[int, dict], rounds: int, stop: asyncio.Event) -> list[tuple[dict, dict]]:
    """Collect every sample's JSON (5 reads a second) and, `rounds` times, the page with the JSON of the
    sample it shows."""
    pairs: list[tuple[dict, dict]] = []

    async def poll(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.get(url + "/dashboard/data?since=1000000000") as r:
                d = await r.json()
            seen.setdefault(d["seq"], d)
            await asyncio.sleep(0.2)

    async with aiohttp.ClientSession() as session:
        poller = asyncio.create_task(poll(session))
        deadline = time.monotonic() + 60
        while len(pairs) < rounds and time.monotonic() < deadline:
            await asyncio.sleep(1.3)
            shown = await page_numbers(page)
            if shown["seq"] in seen:
                pairs.append((shown, seen[shown["seq"]]))
        stop.set()
        await poller
    return pairs


def _mismatches(shown: dict, data: dict) -> list[str]:
    return [f"{path} shows {text!r}, JSON {lookup(data, path)!r} -> {js_format(kind, lookup(data, path))!r}"
            for path, kind, text in shown["fields"] if text != js_format(kind, lookup(data, path))]


def test_page_shows_the_json_numbers_under_load(server, chromium, tmp_path):
    url = server.url

    async def run() -> tuple[list, list, dict, list[str], Path]:
        stop_load, stop_watch = asyncio.Event(), asyncio.Event()
        load = asyncio.create_task(steady_load(url, stop_load, workers=10))
        async with Chromium(chromium) as browser:
            page = await browser.new_page(1400, 1000)
            await page.goto(url + "/dashboard")
            await page.wait_for("document.body.dataset.seq", timeout=15)
            seen: dict[int, dict] = {}
            busy = await _watch(url, page, seen, 4, stop_watch)
            shot = await page.screenshot(tmp_path / "dashboard.png")
            stop_load.set()
            finished = await load
            await asyncio.to_thread(wait_idle, url, 30)
            # Idle now: the page catches up within a few samples.
            stop_idle = asyncio.Event()
            idle_seen: dict[int, dict] = {}
            idle = await _watch(url, page, idle_seen, 2, stop_idle)
            return busy, idle, {"finished": finished}, list(page.errors), shot

    busy, idle, load, errors, shot = asyncio.run(run())
    assert errors == [], "the page logged errors:\n" + "\n".join(errors[:10])
    assert len(busy) >= 3 and len(idle) == 2, (len(busy), len(idle))
    assert load["finished"] > 0
    for shown, data in busy + idle:
        assert not _mismatches(shown, data), "\n".join(_mismatches(shown, data)[:20])
        assert shown["recent_rows"] == len(data["recent_requests"])
        assert shown["status"] == "live"
        n_queues = len(data["now"]["scheduler"]["queue_lengths"])
        assert ("chart-queues", n_queues) in [tuple(c) for c in shown["charts"]], shown["charts"]
    # The load was visible: work running, KV in use, and the numbers on the page are of those samples.
    assert any(d["now"]["requests"]["running"] > 0 and d["now"]["kv"]["device_used"] > 0 for _, d in busy), \
        [json.dumps(d["now"]["requests"]) for _, d in busy]
    last = idle[-1][1]["now"]
    assert last["requests"]["running"] == 0 and last["kv"]["device_used"] == last["kv"]["host_used"] == 0
    # Finished requests reach the page's table (not necessarily by the first sample: on a loaded machine the
    # first request may finish after it).
    assert any(f[0].startswith("recent_requests.") for shown, _ in busy for f in shown["fields"])
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
