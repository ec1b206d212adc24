"""The system's Chromium, headless, driven over the DevTools protocol (a websocket; aiohttp's client).

    async with Chromium() as browser:
        page = await browser.new_page(1400, 1000)
        await page.goto("http://127.0.0.1:8000/dashboard")
        await page.evaluate("document.title")
        await page.screenshot(Path("shot.png"))
        page.errors            # console errors, uncaught exceptions, failed loads, CSP violations

Used by the dashboard's browser test and scripts/tools/dashboard_screenshot.py. The browser is Debian's
`chromium` package (`make browser` installs it; FASTSERVE_CHROMIUM=/path picks another). What this is not:
a general browser-automation library (one browser, plain pages, no frames).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

INSTALL_HINT = ("Chromium is needed to test the dashboard in a real browser and was not found: install Debian's "
                "package with `apt-get update && apt-get install -y chromium` (`make browser` does that), or set "
                "FASTSERVE_CHROMIUM to a Chromium/Chrome executable")


class ChromiumMissing(RuntimeError):
    pass


def find_chromium() -> str:
    """The Chromium executable to use; ChromiumMissing (saying how to install it) when there is none."""
    if exe := os.environ.get("FASTSERVE_CHROMIUM"):
        if shutil.which(exe):
            return shutil.which(exe)
        raise ChromiumMissing(f"FASTSERVE_CHROMIUM={exe} is not an executable")
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    raise ChromiumMissing(INSTALL_HINT)


class Page:
    """One tab, attached through a flat DevTools session."""

    def __init__(self, browser: Chromium, session_id: str) -> None:
        self.browser, self.session_id = browser, session_id
        self.errors: list[str] = []
        self._load = asyncio.Event()

    async def send(self, method: str, params: dict | None = None) -> dict:
        return await self.browser.send(method, params, self.session_id)

    def _on_event(self, method: str, params: dict) -> None:
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            self.errors.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            e = params["entry"]
            self.errors.append(f"{e['source']}: {e['text']} {e.get('url', '')}".strip())
        elif method == "Page.loadEventFired":
            self._load.set()

    async def goto(self, url: str, timeout: float = 30.0) -> None:
        self._load.clear()
        reply = await self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise RuntimeError(f"cannot load {url}: {reply['errorText']}")
        await asyncio.wait_for(self._load.wait(), timeout)

    async def evaluate(self, expression: str):
        """The expression's value (JSON-serializable; promises are awaited); a JS exception raises."""
        reply = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                     "awaitPromise": True})
        if "exceptionDetails" in reply:
            d = reply["exceptionDetails"]
            raise RuntimeError(f"JS error: {d.get('exception', {}).get('description') or d.get('text')}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0, poll: float = 0.1):
        """Poll until the expression is truthy; returns its value. TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still falsy after {timeout:g} s")
            await asyncio.sleep(poll)

    async def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (not just the viewport)."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        reply = await self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
        path = Path(path)
        path.write_bytes(base64.b64decode(reply["data"]))
        return path


class Chromium:
    """A headless Chromium process with its own throw-away profile, and the DevTools connection to it."""

    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable or find_chromium()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._pages: dict[str, Page] = {}

    async def __aenter__(self) -> Chromium:
        self._profile = tempfile.mkdtemp(prefix="fastserve-chromium-")
        self._stderr = open(Path(self._profile) / "stderr.log", "wb")
        args = [self.executable, "--headless=new", "--disable-gpu", "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--mute-audio", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox (CI containers)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._stderr)
        try:
            url = await self._devtools_url()
            self._http = aiohttp.ClientSession()
            self._ws = await self._http.ws_connect(url, max_msg_size=0)
        except BaseException:
            await self._close()
            raise
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        await self._close()

    async def _devtools_url(self, timeout: float = 30.0) -> str:
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {self._stderr_tail()}")
            if port_file.exists() and len(lines := port_file.read_text().split("\n")) >= 2 and lines[1]:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            await asyncio.sleep(0.05)
        raise RuntimeError(f"chromium did not open its DevTools port in {timeout:g} s: {self._stderr_tail()}")

    def _stderr_tail(self) -> str:
        self._stderr.flush()
        return (Path(self._profile) / "stderr.log").read_text(errors="replace")[-2000:]

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    if "error" in data:
                        fut.set_exception(RuntimeError(f"DevTools error: {data['error']}"))
                    else:
                        fut.set_result(data.get("result", {}))
            elif (page := self._pages.get(data.get("sessionId", ""))) is not None:
                page._on_event(data["method"], data.get("params", {}))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the DevTools connection closed"))

    async def send(self, method: str, params: dict | None = None, session_id: str | None = None,
                   timeout: float = 30.0) -> dict:
        msg_id = next(self._ids)
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session_id:
            msg["sessionId"] = session_id
        fut = self._pending[msg_id] = asyncio.get_running_loop().create_future()
        await self._ws.send_str(json.dumps(msg))
        return await asyncio.wait_for(fut, timeout)

    async def new_page(self, width: int = 1400, height: int = 1000) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = self._pages[attached["sessionId"]] = Page(self, attached["sessionId"])
        for domain in ("Runtime", "Log", "Page"):
            await page.send(f"{domain}.enable")
        await page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                               "deviceScaleFactor": 1, "mobile": False})
        return page

    async def _close(self) -> None:
        try:
            if getattr(self, "_ws", None) is not None and not self._ws.closed:
                try:
                    await asyncio.wait_for(self.send("Browser.close"), 5)
                except (asyncio.TimeoutError, RuntimeError, ConnectionError):
                    pass
                await self._ws.close()
            if getattr(self, "_http", None) is not None:
                await self._http.close()
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._stderr.close()
            shutil.rmtree(self._profile, ignore_errors=True)
