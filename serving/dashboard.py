"""The operator's dashboard: `GET /dashboard`, one page (dashboard.html/.js/.css beside this file; no build
step, nothing fetched from outside the server, enforced by its Content-Security-Policy), and
`GET /dashboard/data`, the JSON it polls once a second (tests read the same JSON).

A sampler task takes one sample of the engine every second and keeps the last five minutes; the data route
returns the latest sample as it was taken, so any number of open pages cost the engine nothing and two
reads of the same `seq` give the same numbers. The page is public (static, no data); the data route needs
the API key like every other route: open `/dashboard#key=KEY`, the page sends it as a Bearer header.

GET /dashboard/data[?since=SEQ]  ->  (schema 1)
  schema, interval_s (1.0), history_s (300), model, policy, kv_policy, kv_block_bytes, quanta_s (the MLFQ
                        quanta in profiled seconds, Q1 first; [] for FCFS)
  seq                   the latest sample's number (1, 2, ... since the server started)
  now                   the latest sample (below)
  history               samples with seq > SEQ (all kept samples without ?since), oldest first
  recent_requests       the last 30 finished requests, newest first, as of `now`: request_id, finish_reason
                        (stop | length | abort | error: the first sequence's, as /metrics counts), prompt_tokens,
                        output_tokens (longest sequence), n, ttft_s, e2e_s, per_token_s (e2e / output tokens),
                        queued_s, executing_s, swap_wait_s, preemptions, age_s (seconds before `now`)
  device_source         "nvml" (this process's view of the machine's GPUs) or what supplied the rows
  device_note           why there are no device rows (e.g. no GPU visible to nvidia-ml-py), else null
A sample:
  seq, time (unix seconds), uptime_s
  requests      running, waiting (as /health), batch_size (sequences in the last iteration; 0 when idle),
                steps_per_s (iterations over the last interval)
  scheduler     queue_lengths (jobs per MLFQ level, Q1 first; [] for FCFS), promotions, demotions,
                preemptions (cumulative)
  kv            device_used, device_total, host_used, host_total (blocks), swapped_jobs, offloaded_bytes,
                uploaded_bytes, swap_misses, drops (cumulative), offload_bytes_per_s, upload_bytes_per_s,
                swap_misses_per_s (over the last interval)
  throughput    window_s (10), span_s (the seconds measured: from the last sample at or before window_s ago,
                or from start-up),
                requests_per_s (requests finished with stop/length), tokens_per_s (tokens generated, by any
                request), both over the last span_s
  latency       window_s (60), count (stop/length requests finished in the window), ttft_s and
                per_token_s: {p50, p90, p99} (linear interpolation, as numpy.percentile), null when count=0
  totals        finished {stop, length, abort, error}, generated_tokens (cumulative since start)
  devices       one row per device NVML sees: id (NVML's index), name, worker ({rank, tp_rank, pp_stage,
                cuda_device} of the executor's rank that runs on this GPU, matched by UUID or PCI address; null
                for a GPU no rank uses), memory_used_bytes, memory_total_bytes, utilization_pct, error,
                temperature_c, pcie_tx_bytes_per_s, pcie_rx_bytes_per_s
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from serving.gpu_probe import DeviceRows, NvmlProbe
from serving.openai_protocol import error_body
from serving.routing import add_get

log = logging.getLogger("fastserve.dashboard")

SCHEMA = 1
INTERVAL_S = 1.0
HISTORY_S = 300
LATENCY_WINDOW_S = 60.0
RATE_WINDOW_S = 10.0
RECENT = 30
PERCENTILES = (50, 90, 99)
_ASSETS = Path(__file__).with_name("dashboard_assets")
_STATIC = {"/dashboard": ("dashboard.html", "text/html"),
           "/dashboard/dashboard.js": ("dashboard.js", "text/javascript"),
           "/dashboard/dashboard.css": ("dashboard.css", "text/css")}
PUBLIC_PATHS = frozenset(_STATIC)  # static, no data: served without the API key
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def percentile(sorted_values: list[float], p: float) -> float:
    """numpy.percentile's default (linear) on an ascending, non-empty list."""
    pos = (len(sorted_values) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _summary(values: list[float]) -> dict[str, float] | None:
    values = sorted(values)
    return {f"p{p}": percentile(values, p) for p in PERCENTILES} if values else None


@dataclass
class FinishedRequest:
    """One finished request as the dashboard lists it (times in seconds)."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    n: int
    ttft_s: float | None
    e2e_s: float | None
    per_token_s: float | None
    queued_s: float
    executing_s: float
    swap_wait_s: float
    preemptions: int
    finished_at: float  # time.monotonic()

    @staticmethod
    def of(out: RequestOutput, now: float) -> FinishedRequest:
        m = out.metrics
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"  # as /metrics counts it
        return FinishedRequest(out.request_id, reason, len(out.prompt_token_ids), longest, len(out.outputs),
                               m.ttft_s, m.e2e_s, m.e2e_s / longest if m.e2e_s is not None and longest else None,
                               m.queued_s, m.executing_s, m.swap_wait_s, m.preemptions, now)


class Dashboard:
    """Samples an AsyncEngine once a second; `data(since)` is the JSON of /dashboard/data."""

    def __init__(self, aengine: AsyncEngine, model_name: str, devices: DeviceRows | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.aengine, self.model_name = aengine, model_name
        self.devices = devices or NvmlProbe()
        self._clock = clock
        self._started = clock()
        self.history: deque[dict] = deque(maxlen=int(HISTORY_S / INTERVAL_S))
        self._recent: deque[FinishedRequest] = deque(maxlen=RECENT)
        self._window: deque[FinishedRequest] = deque()  # stop/length requests of the last LATENCY_WINDOW_S
        self._finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self._finished_tokens = 0  # tokens of requests that have left the engine
        self._last: tuple[float, int, int, int, int] | None = None  # (t, steps, offloaded, uploaded, misses)
        self._recent_json: list[dict] = []
        self._counts: deque[tuple[float, int, int]] = deque()  # (t, completed, tokens) at the window's samples
        self.seq = 0

    # -- inputs ---------------------------------------------------------------------------------
    def on_finished(self, out: RequestOutput) -> None:
        """An AsyncEngine finish listener (finished, aborted or failed requests)."""
        rec = FinishedRequest.of(out, self._clock())
        self._finished[rec.finish_reason] += 1
        self._finished_tokens += sum(len(c.token_ids) for c in out.outputs)
        self._recent.append(rec)
        if rec.finish_reason in ("stop", "length"):
            self._window.append(rec)

    def _generated_tokens(self) -> int:
        live = sum(len(s.output_ids) for r in self.aengine.engine.requests.values() for s in r.seqs)
        return self._finished_tokens + live

    # -- one sample -------------------------------------------------------------------------------
    def sample(self) -> dict:
        """Take the next sample (on the event loop, between engine steps) and keep it."""
        now, aengine = self._clock(), self.aengine
        engine = aengine.engine
        kv, stats, sched = engine.kv, engine.kv.stats, engine.scheduler_stats()
        block_bytes = self.kv_block_bytes
        offloaded, uploaded = stats.blocks_offloaded * block_bytes, stats.blocks_uploaded * block_bytes
        counters = (now, engine.num_steps, offloaded, uploaded, stats.num_swap_misses)
        prev = self._last or counters
        dt = counters[0] - prev[0]

        def per_s(i: int) -> float:
            return (counters[i] - prev[i]) / dt if dt > 0 else 0.0

        self._last = counters
        while self._window and self._window[0].finished_at < now - LATENCY_WINDOW_S:
            self._window.popleft()
        window = list(self._window)
        completed = self._finished["stop"] + self._finished["length"]
        tokens = self._generated_tokens()
        self.seq += 1
        sample = {
            "seq": self.seq, "time": time.time(), "uptime_s": now - self._started,
            "requests": {"running": aengine.num_running(), "waiting": aengine.num_waiting(),
                         "batch_size": engine.last_batch_size if engine.has_unfinished() else 0,
                         "steps_per_s": per_s(1)},
            "scheduler": {"queue_lengths": list(sched.queue_lengths), "promotions": sched.num_promotions,
                          "demotions": sched.num_demotions,
                          "preemptions": sched.num_policy_preemptions},
            "kv": {"device_used": kv.device.num_used, "device_total": kv.device.num_blocks,
                   "host_used": kv.host.num_used, "host_total": kv.host.num_blocks, "swapped_jobs": kv.num_swapped(),
                   "offloaded_bytes": offloaded, "uploaded_bytes": uploaded, "swap_misses": stats.num_swap_misses,
                   "drops": stats.num_drops, "offload_bytes_per_s": per_s(2), "upload_bytes_per_s": per_s(3),
                   "swap_misses_per_s": per_s(4)},
            "throughput": self._throughput(now, completed, tokens),
            "latency": {"window_s": LATENCY_WINDOW_S, "count": len(window),
                        "ttft_s": _summary([r.ttft_s for r in window if r.ttft_s is not None]),
                        "per_token_s": _summary([r.per_token_s for r in window if r.per_token_s is not None])},
            "totals": {"finished": dict(self._finished), "generated_tokens": tokens},
            "devices": self.devices.rows(),
        }
        self.history.append(sample)
        self._recent_json = [self._request_json(r, now) for r in reversed(self._recent)]
        return sample

    def _throughput(self, now: float, completed: int, tokens: int) -> dict:
        """Rates over the last RATE_WINDOW_S, from the cumulative counts kept at each sample."""
        self._counts.append((now, completed, tokens))
        while len(self._counts) > 2 and self._counts[1][0] <= now - RATE_WINDOW_S:
            self._counts.popleft()  # keep the last sample at or before the window's start
        t0, completed0, tokens0 = self._counts[0] if len(self._counts) > 1 else (self._started, 0, 0)
        span = now - t0
        return {"window_s": RATE_WINDOW_S, "span_s": span,
                "requests_per_s": (completed - completed0) / span if span > 0 else 0.0,
                "tokens_per_s": (tokens - tokens0) / span if span > 0 else 0.0}

    @staticmethod
    def _request_json(r: FinishedRequest, now: float) -> dict:
        d = asdict(r)
        d["age_s"] = now - d.pop("finished_at")
        return d

    @property
    def kv_block_bytes(self) -> int:
        return self.aengine.engine.executor.kv_block_bytes

    # -- outputs -----------------------------------------------------------------------------------
    def data(self, since: int | None = None) -> dict:
        cfg = self.aengine.engine.config
        history = list(self.history) if since is None else [s for s in self.history if s["seq"] > since]
        return {"schema": SCHEMA, "interval_s": INTERVAL_S, "history_s": HISTORY_S, "model": self.model_name,
                "policy": cfg.scheduling_policy, "kv_policy": cfg.kv_policy, "kv_block_bytes": self.kv_block_bytes,
                "quanta_s": list(self.aengine.engine.scheduler_stats().quanta),
                "seq": self.seq, "now": self.history[-1] if self.history else None, "history": history,
                "recent_requests": self._recent_json, "device_source": self.devices.source,
                "device_note": self.devices.note}

    async def run(self) -> None:
        """Sample every INTERVAL_S until cancelled; a failing sample is logged, never fatal."""
        while True:
            try:
                self.sample()
            except Exception:
                log.exception("dashboard sample failed")
            await asyncio.sleep(INTERVAL_S)


DASHBOARD = web.AppKey("dashboard", Dashboard)


async def _static(request: web.Request) -> web.Response:
    name, content_type = _STATIC[request.path]
    return web.Response(body=(_ASSETS / name).read_bytes(), content_type=content_type, charset="utf-8",
                        headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache",
                                 "X-Content-Type-Options": "nosniff"})


async def _data(request: web.Request) -> web.Response:
    since = request.query.get("since")
    if since is not None and not (since.isascii() and since.isdigit() and len(since) < 19):
        message = f"since must be a sample number (0 or more), got {since[:40]!r}"
        return web.json_response(error_body(message, "invalid_request_error", "since", "invalid_value"), status=400)
    return web.json_response(request.app[DASHBOARD].data(None if since is None else int(since)),
                             headers={"Cache-Control": "no-store"})


def add_dashboard(app: web.Application, aengine: AsyncEngine, model_name: str,
                  devices: DeviceRows | None = None) -> Dashboard:
    """Register /dashboard, its assets and /dashboard/data, and the sampler (started and stopped with the app)."""
    app[DASHBOARD] = dash = Dashboard(aengine, model_name, devices)
    aengine.finish_listeners.append(dash.on_finished)
    for path in _STATIC:
        add_get(app, path, _static)
    add_get(app, "/dashboard/data", _data)

    async def sampler(app: web.Application):
        task = asyncio.create_task(dash.run(), name="fastserve-dashboard-sampler")
        yield
        task.cancel()

    app.cleanup_ctx.append(sampler)
    return dash
