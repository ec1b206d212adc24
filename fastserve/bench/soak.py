"""Soak test: N requests at 1.5x the server's measured capacity, with clients that disconnect mid-stream,
malformed bodies and a mix of n, stop strings, logprobs, chat and completions; then checks that the server
kept its promises.

    fastserve bench soak --requests 10000      # starts a server of the tiny model (small KV: swapping under load)
    fastserve bench soak --requests 300 -- --kv-policy recompute      # flags after -- go to the server
    fastserve bench soak --base-url http://127.0.0.1:8000 --requests 500   # a running server, no RSS check

Capacity is measured first: a burst of --calibration well-formed requests, all sent at once; capacity =
requests / seconds until the last finished. Then --requests arrive as a Poisson process at --load x capacity:
--malformed (5%) get bodies the server must refuse with a 4xx, --disconnect (20%) are streams whose client
closes the connection after 1-3 chunks, the rest are checked in full.

Afterwards (the checks, all must pass): no client waited past --request-timeout (by default 60 s plus 4x the
time all requests take at capacity: at 1.5x capacity the queue grows all along, and a request may wait most
of the run); every kept request got a complete, valid answer (n choices, each finished, no stop
string in its text, logprobs when asked); every malformed one a 4xx OpenAI error; within --idle-timeout
nothing runs or waits and every KV block of both tiers is free; /metrics counts add up (finished + aborted +
failed = well-formed requests sent, none failed, aborted <= disconnects); the dashboard's totals equal
/metrics'; the server's RSS after the run is within --rss-growth-mib (64 MiB) plus 64 KiB per request in flight
at the peak of its RSS after the calibration (a backlog's state sets a high-water mark that the allocator
keeps); and a settle pass afterwards (a tenth of --requests, kept requests at half the capacity) is answered
in full and grows RSS by at most --leak-mib (16 MiB): a leak would grow it again, a high-water mark does not.
Exit status: 0 all checks passed, 1 a check failed (or the server could not start), 2 bad flags.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine.args import OneLineErrorParser
from engine.model_names import TINY_OPT
from fastserve.server_process import ServerProcess, with_model

# Started by this script: a small device KV (and host tier) so that the load preempts, offloads and recomputes.
SERVER_ARGS = ("--profile", "analytic", "--num-gpu-blocks-override", "64", "--num-host-blocks-override", "256",
               "--max-model-len", "512")
WORDS = ("the", "cat", "server", "token", "queue", "skip", "join", "memory", "block", "host", "swap", "stream")
MALFORMED: tuple[tuple[str, bytes, str], ...] = (  # (endpoint, body, content type); each must get a 4xx
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', "application/json"),
    ("/v1/completions", b"not json at all", "application/json"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', "application/json"),
    ("/v1/completions", b'{"prompt": 12}', "application/json"),
    ("/v1/completions", b'{"max_tokens": 4}', "application/json"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', "application/json"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', "application/json"),
    ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}', "application/json"),
    ("/v1/completions", b'{"prompt": [-5, 3]}', "application/json"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 99}', "application/json"),
    ("/v1/completions", b'{"prompt": "x"}', "text/plain"),
    ("/v1/chat/completions", b'{"messages": "hello"}', "application/json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', "application/json"),
    ("/v1/chat/completions", b"\xff\xfe\x00garbage", "application/json"),
)


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 300
    load: float = 1.5  # arrival rate / measured capacity
    disconnect: float = 0.2
    malformed: float = 0.05
    max_tokens: int = 48  # each request asks for 4..max_tokens tokens
    calibration: int = 32
    request_timeout: float | None = None  # None: 60 s + 4x the time the whole soak takes at capacity
    idle_timeout: float = 60.0
    rss_growth_mib: float = 64.0  # allowed RSS growth over the soak, plus RSS_PER_INFLIGHT_KIB per request in flight
    leak_mib: float = 16.0  # allowed RSS growth over the settle pass
    settle: int | None = None  # requests of the settle pass (None: a tenth of --requests, 40 to 1000)
    seed: int = 0


@dataclass
class Planned:
    kind: str  # "kept" | "disconnect" | "malformed"
    endpoint: str
    body: bytes
    content_type: str = "application/json"
    stream: bool = False
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    read_chunks: int = 0  # disconnect after this many chunks


@dataclass
class Outcome:
    kind: str
    ok: bool
    detail: str = ""
    status: int = 0
    latency_s: float = 0.0
    timed_out: bool = False


def plan(cfg: SoakConfig, vocab: int, rng: random.Random) -> list[Planned]:
    out = []
    for _ in range(cfg.requests):
        u = rng.random()
        if u < cfg.malformed:
            endpoint, body, ctype = rng.choice(MALFORMED)
            out.append(Planned("malformed", endpoint, body, ctype))
            continue
        kind = "disconnect" if u < cfg.malformed + cfg.disconnect else "kept"
        chat = rng.random() < 0.3
        n, stream = rng.choice((1, 1, 1, 2, 3)), kind == "disconnect" or rng.random() < 0.5
        stop = tuple(rng.sample(WORDS, rng.randint(1, 2))) if rng.random() < 0.3 else ()
        logprobs = rng.random() < 0.25
        text = " ".join(rng.choices(WORDS, k=rng.randint(2, 40)))
        body: dict = {"max_tokens": rng.randint(4, cfg.max_tokens), "n": n, "stream": stream,
                      "temperature": rng.choice((0.0, 0.9)), "seed": rng.randrange(1 << 30)}
        if stop:
            body["stop"] = list(stop)
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            if logprobs:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        else:
            body["prompt"] = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 48))] if rng.random() < 0.2 \
                else text
            if logprobs:
                body["logprobs"] = rng.randint(0, 3)
        out.append(Planned(kind, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode(),
                           stream=stream, n=n, stop=stop, logprobs=logprobs, read_chunks=rng.randint(1, 3)))
    return out


def _check_choices(p: Planned, texts: dict[int, str], reasons: dict[int, str | None], logprobs: dict[int, bool]) -> str:
    """'' if the answer is complete and valid, else what is wrong."""
    if sorted(texts) != list(range(p.n)):
        return f"choices {sorted(texts)} for n={p.n}"
    for i in range(p.n):
        if reasons.get(i) not in ("stop", "length"):
            return f"choice {i} finish_reason {reasons.get(i)!r}"
        if any(s in texts[i] for s in p.stop):
            return f"choice {i} text contains a stop string {p.stop}"
        if p.logprobs and not logprobs.get(i):
            return f"choice {i} has no logprobs"
    return ""


def _take(choice: dict, texts: dict, reasons: dict, logprobs: dict) -> None:
    i = choice["index"]
    part = choice.get("text")
    if part is None:
        part = (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    texts[i] = texts.get(i, "") + part
    if choice.get("finish_reason"):
        reasons[i] = choice["finish_reason"]
    logprobs[i] = logprobs.get(i, False) or bool(choice.get("logprobs"))


async def send(session: aiohttp.ClientSession, url: str, p: Planned, timeout: float) -> Outcome:
    start = time.monotonic()
    try:
        return await asyncio.wait_for(_send(session, url, p, start), timeout)
    except asyncio.TimeoutError:
        return Outcome(p.kind, False, f"no answer in {timeout:g} s", timed_out=True)
    except (aiohttp.ClientError, ValueError) as e:  # ValueError: a body that is not the JSON it should be
        return Outcome(p.kind, False, f"{type(e).__name__}: {e}")


async def _send(session: aiohttp.ClientSession, url: str, p: Planned, start: float) -> Outcome:
    async with session.post(url + p.endpoint, data=p.body, headers={"Content-Type": p.content_type}) as resp:
        if p.kind == "malformed":
            body = await resp.json(content_type=None)
            ok = 400 <= resp.status < 500 and isinstance(body.get("error", {}).get("message"), str)
            return Outcome(p.kind, ok, "" if ok else f"{resp.status} {body}", resp.status)
        if resp.status != 200:
            return Outcome(p.kind, False, f"HTTP {resp.status}: {(await resp.text())[:200]}", resp.status)
        texts: dict[int, str] = {}
        reasons: dict[int, str | None] = {}
        logprobs: dict[int, bool] = {}
        if not p.stream:
            for choice in (await resp.json())["choices"]:
                _take(choice, texts, reasons, logprobs)
        else:
            chunks, done = 0, False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(p.kind, False, f"error chunk: {chunk['error']}", 200)
                for choice in chunk.get("choices", []):
                    _take(choice, texts, reasons, logprobs)
                chunks += 1
                if p.kind == "disconnect" and chunks >= p.read_chunks:
                    resp.close()  # the client goes away mid-stream
                    return Outcome(p.kind, True, "", 200, time.monotonic() - start)
            if not done:
                return Outcome(p.kind, False, "stream ended without [DONE]", 200)
        problem = _check_choices(p, texts, reasons, logprobs)
        return Outcome(p.kind, not problem, problem, 200, time.monotonic() - start)


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as r:
        return r.status, await r.text()


async def finished_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    _, text = await _get(session, url + "/metrics")
    return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "vllm:request_success_total"}


RSS_PER_INFLIGHT_KIB = 64  # the server's state per request in flight (~40 KiB measured at 3,000 in flight)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


@dataclass
class SoakReport:
    config: SoakConfig
    capacity_rps: float = 0.0
    offered_rps: float = 0.0
    served_rps: float = 0.0  # requests finished with stop/length per second over the soak
    request_timeout_s: float = 0.0
    duration_s: float = 0.0
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> {ok, failed, timed_out}
    finished: dict[str, float] = field(default_factory=dict)  # server's finish reasons during the soak
    rss_mib: dict[str, float | None] = field(default_factory=dict)  # after calibration, peak, end, after settle
    peak_in_flight: int = 0  # most soak requests sent and not yet answered at once
    rss_trace: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the soak, MiB), each second
    latency_s: dict[str, float] = field(default_factory=dict)  # kept requests: p50, p99
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the first few failed requests

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


async def soak(url: str, pid: int | None, cfg: SoakConfig, progress=None) -> SoakReport:
    """Run the soak against a server at `url` (`pid`: its process, for RSS; None skips that check).
    `progress`, if given, is called with a one-line status every 30 s."""
    rng, report = random.Random(cfg.seed), SoakReport(cfg)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # every request its own connection, none queued here
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        _, models = await _get(session, url + "/v1/models")
        vocab = json.loads(models)["data"][0]["vocab_size"]
        calib = plan(SoakConfig(requests=cfg.calibration, disconnect=0, malformed=0, max_tokens=cfg.max_tokens),
                     vocab, rng)
        t0 = time.monotonic()
        warm = await asyncio.gather(*(send(session, url, p, cfg.request_timeout or 600.0) for p in calib))
        report.capacity_rps = len(calib) / (time.monotonic() - t0)
        if not all(o.ok for o in warm):
            report.failures += [o.detail for o in warm if not o.ok][:5]
        report.offered_rps = cfg.load * report.capacity_rps
        report.request_timeout_s = cfg.request_timeout or 60.0 + 4 * cfg.requests / report.capacity_rps
        rss0 = rss_mib(pid)
        before = await finished_counts(session, url)
        planned = plan(cfg, vocab, rng)
        peak = [rss0 or 0.0]

        in_flight = [0]

        async def arrive(p: Planned, at: float) -> Outcome:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            in_flight[0] += 1
            report.peak_in_flight = max(report.peak_in_flight, in_flight[0])
            try:
                return await send(session, url, p, report.request_timeout_s)
            finally:
                in_flight[0] -= 1

        def arrivals(items: list[Planned], rate: float) -> list[asyncio.Task]:
            at, tasks = time.monotonic(), []
            for p in items:
                at += rng.expovariate(rate)
                tasks.append(asyncio.create_task(arrive(p, at)))
            return tasks

        async def watch_rss() -> None:
            last_note = time.monotonic()
            while True:
                if progress is not None and time.monotonic() - last_note >= 30:
                    last_note = time.monotonic()
                    progress(f"{last_note - start:.0f} s: {sum(t.done() for t in tasks)}/{len(tasks)} requests done, "
                             f"server RSS {rss_mib(pid) or 0:.0f} MiB")
                now = rss_mib(pid) or 0.0
                peak[0] = max(peak[0], now)
                if pid is not None and len(report.rss_trace) < 10_000:
                    report.rss_trace.append((round(time.monotonic() - start, 1), round(now, 1)))
                await asyncio.sleep(1.0)

        start = time.monotonic()
        tasks = arrivals(planned, report.offered_rps)
        watcher = asyncio.create_task(watch_rss())
        outcomes = await asyncio.gather(*tasks)
        report.duration_s = time.monotonic() - start
        health = await _wait_idle(session, url, cfg.idle_timeout)
        watcher.cancel()
        after = await finished_counts(session, url)
        dash_totals = await _dashboard_totals(session, url)
        # The settle pass: the same mix (kept requests only) at half the capacity, after the soak. The soak set
        # the allocator's high-water mark; a leak would grow RSS again here, a high-water mark would not.
        rss_end = rss_mib(pid)
        n_settle = cfg.settle if cfg.settle is not None else min(1000, max(40, cfg.requests // 10))
        settle = plan(SoakConfig(requests=n_settle, disconnect=0, malformed=0, max_tokens=cfg.max_tokens), vocab, rng)
        settled = await asyncio.gather(*arrivals(settle, 0.5 * report.capacity_rps))
        settle_health = await _wait_idle(session, url, cfg.idle_timeout)
    report.finished = {k: after.get(k, 0) - before.get(k, 0) for k in ("stop", "length", "abort", "error")}
    report.served_rps = (report.finished["stop"] + report.finished["length"]) / report.duration_s
    report.rss_mib = {"after_calibration": rss0, "peak": peak[0] if pid else None, "end": rss_end,
                      "after_settle": rss_mib(pid)}
    _summarize(report, planned, outcomes, health, after, dash_totals)
    report.checks.append((f"settle pass of {n_settle} requests: all answered, idle after",
                          all(o.ok for o in settled) and settle_health["idle"],
                          f"{sum(o.ok for o in settled)}/{n_settle} ok, idle {settle_health['idle']}"))
    report.failures += [f"settle: {o.detail}" for o in settled if not o.ok][:5]
    _rss_checks(report)
    return report


async def _wait_idle(session: aiohttp.ClientSession, url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, text = await _get(session, url + "/health")
        h = json.loads(text)
        idle = h["running"] == h["waiting"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"] \
            and h["kv_host_free_blocks"] == h["kv_host_total_blocks"]
        if (status == 200 and idle) or time.monotonic() > deadline:
            return {**h, "status": status, "idle": idle}
        await asyncio.sleep(0.1)


async def _dashboard_totals(session: aiohttp.ClientSession, url: str) -> dict | None:
    """The dashboard's finish counts from a sample taken after now (None if it has none)."""
    status, text = await _get(session, url + "/dashboard/data?since=1000000000")
    if status != 200:
        return None
    seq = json.loads(text)["seq"]
    for _ in range(50):
        d = json.loads((await _get(session, url + "/dashboard/data?since=1000000000"))[1])
        if d["seq"] > seq:
            return d["now"]["totals"]["finished"]
        await asyncio.sleep(0.1)
    return None


def _summarize(report: SoakReport, planned: list[Planned], outcomes: list[Outcome], health: dict, after: dict,
               dash: dict | None) -> None:
    check = report.checks.append
    for kind in ("kept", "disconnect", "malformed"):
        mine = [o for o in outcomes if o.kind == kind]
        report.outcomes[kind] = {"sent": len(mine), "ok": sum(o.ok for o in mine),
                                 "timed_out": sum(o.timed_out for o in mine)}
    report.failures += [f"{o.kind}: {o.detail}" for o in outcomes if not o.ok][:10]
    lat = sorted(o.latency_s for o in outcomes if o.kind == "kept" and o.ok)
    if lat:
        report.latency_s = {"p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}
    well_formed = sum(p.kind != "malformed" for p in planned)
    fin, disconnects = report.finished, report.outcomes["disconnect"]["sent"]
    timed_out = sum(o.timed_out for o in outcomes)
    check(("no request hung", timed_out == 0, f"{timed_out} clients waited over {report.request_timeout_s:.0f} s"))
    for kind, what in (("kept", "complete, valid answers"), ("malformed", "4xx OpenAI errors"),
                       ("disconnect", "streams started before the disconnect")):
        o = report.outcomes[kind]
        check((f"{kind}: {what}", o["ok"] == o["sent"], f"{o['ok']}/{o['sent']}"))
    check(("idle afterwards, all KV free", health["idle"] and health["status"] == 200,
           f"/health {health['status']}: running {health['running']}, waiting {health['waiting']}, device free "
           f"{health['kv_free_blocks']}/{health['kv_total_blocks']}, host free "
           f"{health['kv_host_free_blocks']}/{health['kv_host_total_blocks']}"))
    total = sum(fin.values())
    check(("/metrics: finished + aborted + failed = sent",
           total == well_formed and fin["error"] == 0 and fin["abort"] <= disconnects,
           f"stop {fin['stop']:g} + length {fin['length']:g} + abort {fin['abort']:g} + error {fin['error']:g} = "
           f"{total:g}; well-formed sent {well_formed}; disconnects {disconnects}"))
    dash_ok = dash is not None and all(dash[k] == after.get(k, 0) for k in ("stop", "length", "abort", "error"))
    check(("dashboard totals = /metrics", dash_ok, f"dashboard {dash}, /metrics {after}"))


def _rss_checks(report: SoakReport) -> None:
    cfg, rss, check = report.config, report.rss_mib, report.checks.append
    if rss["after_calibration"] is None or rss["end"] is None or rss["after_settle"] is None:
        check(("RSS bound", True, "not measured (not a server this script started)"))
        return
    bound = cfg.rss_growth_mib + report.peak_in_flight * RSS_PER_INFLIGHT_KIB / 1024
    check((f"RSS grew <= {cfg.rss_growth_mib:g} MiB + {RSS_PER_INFLIGHT_KIB} KiB x peak in flight",
           rss["end"] - rss["after_calibration"] <= bound,
           f"{rss['after_calibration']:.0f} MiB after calibration -> {rss['end']:.0f} MiB at the end (peak "
           f"{rss['peak']:.0f}); bound +{bound:.0f} MiB with {report.peak_in_flight} requests in flight at most"))
    check((f"no RSS growth on the settle pass (<= {cfg.leak_mib:g} MiB)",
           rss["after_settle"] - rss["end"] <= cfg.leak_mib,
           f"{rss['end']:.0f} -> {rss['after_settle']:.0f} MiB"))


def format_report(r: SoakReport) -> str:
    lines = [f"soak: {r.config.requests} requests at {r.offered_rps:.2f} req/s = {r.config.load:g} x capacity "
             f"{r.capacity_rps:.2f} req/s; {r.duration_s:.1f} s; served {r.served_rps:.2f} req/s",
             "  outcomes: " + "; ".join(f"{k} {v['ok']}/{v['sent']} ok" for k, v in r.outcomes.items()),
             "  server finish reasons: " + ", ".join(f"{k} {v:g}" for k, v in r.finished.items())]
    if r.latency_s:
        lines.append(f"  kept requests' latency: p50 {r.latency_s['p50']:.2f} s, p99 {r.latency_s['p99']:.2f} s")
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}" for name, ok, detail in r.checks]
    lines += [f"  failed request: {f}" for f in r.failures[:10]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    d = SoakConfig()
    p = OneLineErrorParser(prog="fastserve bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (default: start one with a small KV cache)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the soak (default: %(default)s)")
    for name, default, doc in (("load", d.load, "arrival rate / capacity"),
                               ("disconnect", d.disconnect, "fraction of clients that disconnect mid-stream"),
                               ("malformed", d.malformed, "fraction of malformed bodies"),
                               ("request-timeout", d.request_timeout,
                                "seconds a client waits at most (default: 60 + 4x the soak's time at capacity)"),
                               ("idle-timeout", d.idle_timeout, "seconds the server gets to be idle afterwards"),
                               ("rss-growth-mib", d.rss_growth_mib,
                                f"allowed RSS growth over the soak, plus {RSS_PER_INFLIGHT_KIB} KiB per request in "
                                "flight at the peak"),
                               ("leak-mib", d.leak_mib, "allowed RSS growth over the settle pass")):
        p.add_argument(f"--{name}", type=float, default=default, help=f"{doc} (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="longest output asked (default: %(default)s)")
    p.add_argument("--calibration", type=int, default=d.calibration, help="burst that measures capacity")
    p.add_argument("--settle", type=int, help="requests of the settle pass (default: a tenth of --requests, 40-1000)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.requests < 1 or args.calibration < 1 or args.max_tokens < 4 or not 0 < args.load:
        p.error("--requests and --calibration must be >= 1, --max-tokens >= 4, --load > 0")
    if not (0 <= args.disconnect and 0 <= args.malformed and args.disconnect + args.malformed <= 1):
        p.error("--disconnect and --malformed are fractions that add up to at most 1")
    cfg = SoakConfig(args.requests, args.load, args.disconnect, args.malformed, args.max_tokens, args.calibration,
                     args.request_timeout, args.idle_timeout, args.rss_growth_mib, args.leak_mib, args.settle,
                     args.seed)
    with tempfile.TemporaryDirectory() as logs:
        srv = None if args.base_url else ServerProcess(with_model([*SERVER_ARGS, *server_flags], TINY_OPT), Path(logs))
        try:
            if srv is not None:
                srv.wait_ready()
            report = asyncio.run(soak(args.base_url or srv.url, srv.proc.pid if srv else None, cfg,
                                      progress=lambda line: print(line, file=sys.stderr, flush=True)))
        except (RuntimeError, OSError, aiohttp.ClientError) as e:
            print(f"fastserve bench soak: error: {e}", file=sys.stderr)
            return 1
        finally:
            if srv is not None:
                srv.stop()
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps({"report": {k: v for k, v in vars(report).items() if k != "config"},
                                         "config": vars(cfg)}, indent=1, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
