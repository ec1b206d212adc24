"""A picture of the dashboard under load: starts server.py (the tiny model unless SERVER FLAGS name one; small
device KV, so jobs are preempted and offloaded), runs a steady mixed load for --seconds, and saves /dashboard as
headless Chromium renders it.

    python -m scripts.tools.dashboard_screenshot --out docs/dashboard.png [--seconds 25] [-- SERVER FLAGS]

The load (`steady_load`) and the page reader (`page_numbers`) are shared with tests/test_dashboard_browser.py.
Exit status: 0, 1 when the page logged errors or the server failed, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

import aiohttp

from engine.model_names import TINY_OPT
from fastserve.server_process import ServerProcess, with_model
from scripts.tools.headless_chromium import Chromium

# Small device KV and host tier: a steady load preempts, offloads and uploads.
SERVER_ARGS = ("--profile", "analytic", "--num-gpu-blocks-override", "40", "--num-host-blocks-override", "192")

# Every [data-field] element of the page: (JSON path, format, shown text), and which sample it shows.
READ_PAGE = """(() => ({
  seq: document.body.dataset.seq ? Number(document.body.dataset.seq) : null,
  fields: [...document.querySelectorAll('[data-field]')].map(e => [e.dataset.field, e.dataset.fmt, e.textContent]),
  recent_rows: document.querySelectorAll('#recent tr').length - 1,
  status: document.getElementById('status').textContent,
  charts: [...document.querySelectorAll('#charts figure')].filter(f => !f.hidden)
            .map(f => [f.id, f.querySelectorAll('.keys span').length]),
}))()"""


async def page_numbers(page) -> dict:
    return await page.evaluate(READ_PAGE)


async def steady_load(url: str, stop: asyncio.Event, workers: int = 12, seed: int = 0) -> int:
    """Each worker sends one completion after another (streamed or not, n 1-2, 8-64 tokens) until `stop`;
    returns how many finished with 200."""
    rng = random.Random(seed)
    done = 0

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal done
        while not stop.is_set():
            body = {"prompt": f"worker {w} says hello {rng.randrange(1000)}", "max_tokens": rng.randint(8, 64),
                    "n": rng.choice((1, 1, 2)), "ignore_eos": True, "stream": rng.random() < 0.5}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                done += resp.status == 200

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(worker(session, w) for w in range(workers)))
    return done


async def capture(url: str, out: Path, seconds: float, width: int = 1400) -> list[str]:
    """Load the server for `seconds`, then save the page; returns the page's console errors."""
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(url, stop))
    async with Chromium() as browser:
        page = await browser.new_page(width, 1000)
        await page.goto(url + "/dashboard")
        await asyncio.sleep(seconds)
        await page.screenshot(out)
        errors = list(page.errors)
    stop.set()
    await load
    return errors


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/dashboard.png"), help="the PNG (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=25.0, help="load before the picture (default: %(default)s)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as logs:
        srv = ServerProcess(with_model([*SERVER_ARGS, *extra], TINY_OPT), Path(logs))
        try:
            srv.wait_ready()
            errors = asyncio.run(capture(srv.url, args.out, args.seconds))
        except RuntimeError as e:
            print(f"scripts.tools.dashboard_screenshot: error: {e}", file=sys.stderr)
            return 1
        finally:
            srv.stop()
    for e in errors:
        print(f"page error: {e}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
