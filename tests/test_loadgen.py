"""fastserve/bench/ (the load generator): metric arithmetic on hand-computed fake timings, SSE parsing, goodput,
sweep selection, the saved JSON, the CLI against a tiny in-test fake OpenAI server, and end to end against the
real server.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from fastserve.bench import loadgen
from fastserve.bench.client import DONE, RequestResult, StreamState, parse_sse_line, send_request
from fastserve.bench.metrics import (
    compute_metrics,
    format_report,
    parse_goodput,
    rate_at_slo,
    run_json,
    slo_points,
)
from fastserve.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]


# -- metric arithmetic on fake timings ------------------------------------------------------------------------
def fake_results() -> list[RequestResult]:
    """Three finished requests and one failure; every expected number below is worked out by hand."""
    r1 = RequestResult(10, 4, success=True, output_tokens=4, ttft=0.1, itl=[0.1, 0.2, 0.3], latency=0.7,
                       server_metrics={"queued_s": 0.05, "executing_s": 0.6, "swap_wait_s": 0.05, "preemptions": 1})
    r2 = RequestResult(20, 1, success=True, output_tokens=1, ttft=0.5, itl=[], latency=0.5,
                       server_metrics={"queued_s": 0.2, "executing_s": 0.3, "swap_wait_s": 0.0, "preemptions": 0})
    r3 = RequestResult(30, 3, success=True, output_tokens=3, ttft=0.2, itl=[0.4, 0.4], latency=1.0)  # no metrics
    r4 = RequestResult(40, 5, success=False, error="boom")
    return [r1, r2, r3, r4]


def test_metrics_match_hand_computed_values():
    m = compute_metrics(fake_results(), duration_s=2.0, percentiles=[99])
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (3, 1, 60, 8)
    assert m.request_throughput == pytest.approx(1.5)  # 3 / 2 s
    assert m.output_throughput == pytest.approx(4.0)  # 8 / 2 s
    assert m.total_token_throughput == pytest.approx(34.0)  # (60 + 8) / 2 s
    assert m.request_goodput is None
    # TTFT ms [100, 500, 200]: p99 at position 0.99 * 2 = 1.98 of [100, 200, 500] -> 200 + 0.98 * 300.
    assert m.latency_ms["ttft"] == pytest.approx({"mean": 800 / 3, "median": 200, "std": 169.967317, "p99": 494})
    # TPOT over requests with > 1 token: (0.7 - 0.1) / 3 = 200 ms, (1.0 - 0.2) / 2 = 400 ms.
    assert m.latency_ms["tpot"] == pytest.approx({"mean": 300, "median": 300, "std": 100, "p99": 398})
    # ITL: every gap, [100, 200, 300, 400, 400]; p99 at 0.99 * 4 = 3.96 -> 400.
    assert m.latency_ms["itl"] == pytest.approx({"mean": 280, "median": 300, "std": 116.619038, "p99": 400})
    assert m.latency_ms["e2el"] == pytest.approx({"mean": 2200 / 3, "median": 700, "std": 205.480467, "p99": 994})
    # Per-token latency e2e / tokens: 0.175, 0.5, 1/3; P95 at 0.95 * 2 = 1.9 of the sorted -> 1/3 + 0.9 / 6.
    assert m.per_token_latency_mean_s == pytest.approx((0.175 + 0.5 + 1 / 3) / 3)
    assert m.per_token_latency_p95_s == pytest.approx(1 / 3 + 0.9 * (0.5 - 1 / 3))
    # Breakdown: means over the two requests whose server reported metrics.
    assert m.breakdown_s == pytest.approx({"queued_s": 0.125, "executing_s": 0.45, "swap_wait_s": 0.025,
                                           "preemptions": 0.5})


def test_requested_percentiles_and_names():
    m = compute_metrics(fake_results(), 2.0, percentiles=[50, 90, 99.9])
    assert set(m.latency_ms["e2el"]) == {"mean", "median", "std", "p50", "p90", "p99.9"}
    assert m.latency_ms["e2el"]["p90"] == pytest.approx(700 + 0.8 * 300)  # position 1.8 of [500, 700, 1000]
    flat = m.flat()
    assert flat["p90_e2el_ms"] == pytest.approx(940) and flat["mean_ttft_ms"] == pytest.approx(800 / 3)


def test_goodput_counts_requests_meeting_every_slo():
    # r1: ttft 100, tpot 200 -> good; r2: ttft 500 -> bad; r3: tpot 400 -> bad.
    assert compute_metrics(fake_results(), 2.0, goodput={"ttft": 300, "tpot": 250}).request_goodput == 0.5
    # A one-token request's tpot counts as 0: r2 is good (ttft 500 <= 600), r1 and r3 fail tpot 0.
    assert compute_metrics(fake_results(), 2.0, goodput={"ttft": 600, "tpot": 0}).request_goodput == 0.5
    assert compute_metrics(fake_results(), 2.0, goodput={"e2el": 1000}).request_goodput == 1.5
    assert compute_metrics(fake_results(), 2.0, goodput={"e2el": 100}).request_goodput == 0.0


def test_parse_goodput_in_vllms_format():
    assert parse_goodput(["ttft:500 tpot:50 e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(["ttft:500", "tpot:2.5"]) == {"ttft": 500.0, "tpot": 2.5}
    for bad in ("itl:5", "ttft", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="bad --goodput item"):
            parse_goodput([bad])


def test_no_results_give_zeros_not_errors():
    m = compute_metrics([RequestResult(5, 5, error="x")], 1.0)
    assert (m.completed, m.failed, m.per_token_latency_mean_s, m.breakdown_s) == (0, 1, 0.0, None)
    assert m.latency_ms["ttft"]["p99"] == 0.0


def test_report_has_every_section():
    text = format_report(compute_metrics(fake_results(), 2.0), "1 req/s", ["ttft", "tpot", "itl", "e2el"], [99],
                         {"ttft": 300})
    for line in ("Successful requests:                     3", "Failed requests:                         1",
                 "Request goodput (req/s):", "Mean per-token latency (s):              0.3361",
                 "P99 TTFT (ms):                           494.00", "Median ITL (ms):", "Mean E2EL (ms):",
                 "Mean TPOT (ms):", "swap_wait_s:                             0.0250"):
        assert line in text
    silent = format_report(compute_metrics(fake_results()[2:], 2.0), "x", ["ttft"], [99], None)
    assert "the server sent no per-request metrics" in silent and "goodput" not in silent


# -- throughput at SLO ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("points, expected", [
    ([(1, 0.1), (2, 0.2), (4, 0.29), (8, 0.5)], 4),
    ([(8, 0.5), (1, 0.1), (4, 0.29), (2, 0.2)], 4),  # order of the sweep does not matter
    ([(1, 0.1), (2, 0.3), (4, 0.31)], 2),  # at the SLO counts as meeting it
    ([(1, 0.1), (2, 0.4), (4, 0.2)], 1),  # noise above the knee does not count
    ([(1, 0.1), (2, None), (4, 0.2)], 1),  # a run with failures never meets the SLO
    ([(1, 0.5), (2, 0.6)], None),
    ([(1, 0.1), (2, 0.2)], 2),
    ([], None),
])
def test_rate_at_slo(points, expected):
    assert rate_at_slo(points, 0.3) == expected


def test_sweep_picks_rates_by_mean_and_by_p95():
    def run(mean: float, p95: float, failed: int = 0):
        m = compute_metrics(fake_results()[:1], 1.0)
        m.per_token_latency_mean_s, m.per_token_latency_p95_s, m.failed = mean, p95, failed
        return m

    runs = [(1.0, run(0.1, 0.2)), (2.0, run(0.2, 0.35)), (4.0, run(0.25, 0.5)), (8.0, run(0.2, 0.2, failed=1))]
    assert rate_at_slo(slo_points(runs, "mean"), 0.3) == 4.0
    assert rate_at_slo(slo_points(runs, "p95"), 0.3) == 1.0


def test_saved_run_is_strict_json_with_per_request_arrays():
    results = fake_results()
    run = run_json(float("inf"), 1.0, compute_metrics(results, 2.0), results)
    text = json.dumps(loadgen.jsonable(run), allow_nan=False)
    back = json.loads(text)
    assert back["request_rate"] == "inf" and back["completed"] == 3 and back["duration"] == 2.0
    for key in ("ttfts", "itls", "e2els", "input_lens", "output_lens", "errors", "start_times", "server_metrics"):
        assert len(back[key]) == 4, key
    assert back["errors"] == ["", "", "", "boom"] and back["itls"][0] == [0.1, 0.2, 0.3]


# -- SSE parsing ---------------------------------------------------------------------------------------------------
def chunk(text: str = "", finish: str | None = None, **extra) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish, **extra}
    return "data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [choice]})


def test_parse_sse_line():
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line('data: {"a": 1}\n') == {"a": 1}
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    for ignored in ("", ": keep-alive", "event: message", "id: 7"):
        assert parse_sse_line(ignored) is None
    with pytest.raises(ValueError, match="not JSON"):
        parse_sse_line("data: {oops")


def feed(lines: list[tuple[float, str]], sent_at: float = 10.0, end: float = 99.0) -> RequestResult:
    state = StreamState(RequestResult(5, 3), sent_at)
    for now, line in lines:
        if state.feed_line(line, now):
            break
    return state.finish(end)


def test_stream_timings_usage_and_server_metrics():
    metrics = {"queued_s": 0.01, "executing_s": 0.5, "swap_wait_s": 0.02, "preemptions": 2, "ttft_s": 0.3}
    r = feed([(10.3, chunk("Hel")), (10.3, ""), (10.45, chunk("")), (10.5, chunk("lo")),
              (10.9, chunk(" you", "length", metrics=metrics)),
              (10.95, 'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}'),
              (11.0, "data: [DONE]"), (12.0, chunk("ignored after DONE"))])
    assert r.success and not r.error
    assert r.ttft == pytest.approx(0.3) and r.itl == pytest.approx([0.2, 0.4]) and r.latency == pytest.approx(0.9)
    assert r.output_tokens == 4  # usage wins over the 3 text chunks
    assert r.generated_text == "Hello you"
    assert r.server_metrics == {"queued_s": 0.01, "executing_s": 0.5, "swap_wait_s": 0.02, "preemptions": 2}


def test_stream_without_usage_counts_text_chunks_and_reads_chat_deltas():
    delta = lambda t: "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": t}}]})
    r = feed([(10.1, delta("")), (10.2, delta("a")), (10.4, delta("b")), (10.5, "data: [DONE]")])
    assert r.success and r.output_tokens == 2 and r.server_metrics is None  # as on vLLM without include_usage
    assert r.ttft == pytest.approx(0.2) and r.itl == pytest.approx([0.2])


def test_error_chunk_missing_done_and_bad_json_fail_the_request():
    r = feed([(10.1, chunk("a")), (10.2, 'data: {"error": {"message": "engine died", "type": "server_error"}}'),
              (10.3, "data: [DONE]")])
    assert not r.success and r.error == "engine died"
    r = feed([(10.1, chunk("a"))])
    assert not r.success and "without data: [DONE]" in r.error
    r = feed([(10.1, "data: {truncated")])
    assert not r.success and "not JSON" in r.error


def test_a_stream_with_no_text_sees_its_first_output_at_the_end():
    r = feed([(10.2, chunk("", "length")), (10.3, "data: [DONE]")], end=10.4)
    assert r.success and r.ttft == pytest.approx(0.4) == r.latency


# -- a tiny fake OpenAI server, for the HTTP side ------------------------------------------------------------------
class FakeServer:
    """An aiohttp app on a loopback port, run by its own thread so that loadgen.main() can call asyncio.run."""

    def __init__(self):
        self.bodies: list[dict] = []
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/flaky", self.flaky)
        app.router.add_post("/bad", lambda r: web.json_response({"error": {"message": "no such model"}}, status=400))
        app.router.add_post("/errchunk", self.error_chunk)
        app.router.add_post("/slow", self.slow)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake-model", "max_model_len": 64, "vocab_size": 50}]})

    async def _open(self, request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        resp = await self._open(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.002)
            extra = {"metrics": {"queued_s": 0.25, "executing_s": 0.5, "swap_wait_s": 0.125}} if i == n - 1 else {}
            await resp.write((chunk(f"t{i}", "length" if i == n - 1 else None, **extra) + "\n\n").encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def chat(self, request):
        """Chat chunks (role first, then content deltas) for a body with messages and max_completion_tokens."""
        body = await request.json()
        self.bodies.append(body)
        resp = await self._open(request)
        deltas = [{"role": "assistant", "content": ""}] + [{"content": f"w{i}"}
                                                           for i in range(body["max_completion_tokens"])]
        for i, delta in enumerate(deltas):
            finish = "length" if i == len(deltas) - 1 else None
            event = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                     "finish_reason": finish}]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def flaky(self, request):
        """Every third request fails with a 400; the others are served as /v1/completions."""
        self.flaky_calls = getattr(self, "flaky_calls", 0) + 1
        if self.flaky_calls % 3 == 0:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        return await self.completions(request)

    async def error_chunk(self, request):
        resp = await self._open(request)
        await resp.write((chunk("a") + "\n\n" + 'data: {"error": {"message": "out of blocks"}}\n\ndata: [DONE]\n\n')
                         .encode())
        return resp

    async def slow(self, request):
        await asyncio.sleep(5)
        return web.json_response({})


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.close()


def send(url: str, timeout_s: float = 10.0) -> RequestResult:
    async def go():
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
            return await send_request(session, url, body, RequestResult(3, 3), timeout_s)

    return asyncio.run(go())


def test_send_request_against_the_fake_server(fake):
    r = send(fake.url + "/v1/completions")
    assert r.success and r.output_tokens == 3 and len(r.itl) == 2 and r.generated_text == "t0t1t2"
    assert 0 < r.ttft <= r.latency and r.server_metrics == {"queued_s": 0.25, "executing_s": 0.5, "swap_wait_s": 0.125}


def test_send_request_failures_are_results_not_exceptions(fake):
    assert send(fake.url + "/bad").error == "HTTP 400: no such model"
    assert send(fake.url + "/errchunk").error == "out of blocks"
    assert send(fake.url + "/slow", timeout_s=0.2).error == "timed out after 0.2 s"
    refused = send("http://127.0.0.1:1/v1/completions")
    assert not refused.success and "ClientConnectorError" in refused.error


def test_cli_against_the_fake_server_writes_report_json_and_plot(fake, tmp_path, capsys):
    lengths = tmp_path / "lengths.csv"
    # vLLM's filter within the fake's 64-token context: 0 (< 4 tokens), 60+10 (> 64) and 8,3 (< 4) dropped
    lengths.write_text("input_tokens,output_tokens\n5,4\n8,4\n0,4\n60,10\n12,4\n8,3\n")
    rc = loadgen.main(["--base-url", fake.url, "--dataset-name", "lengths", "--dataset-path", str(lengths),
                       "--num-prompts", "3", "--sweep", "50,100", "--seed", "3", "--disable-tqdm",
                       "--goodput", "e2el:60000", "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "out.json", "--label", "fake", "--plot", str(tmp_path / "p.png"),
                       "--slo-per-token", "10"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dropped 3 of 6 dataset items" in out
    assert "Serving Benchmark Result (50 req/s)" in out and "Serving Benchmark Result (100 req/s)" in out
    assert "Throughput at SLO (mean per-token latency <= 10 s): 100 req/s" in out
    result = json.loads((tmp_path / "out.json").read_text(), parse_constant=lambda c: pytest.fail(f"JSON has {c}"))
    assert result["model_id"] == "fake-model" and result["rates"] == [50, 100] and result["label"] == "fake"
    assert result["throughput_at_slo_mean"] == 100 and result["throughput_at_slo_p95"] == 100
    for run in result["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0 and run["request_goodput"] > 0
        assert sorted(run["input_lens"]) in ([5, 8, 12], [5, 5, 8], [5, 8, 8], [5, 12, 12], [8, 12, 12], [5, 5, 12])
        assert run["breakdown_s"] == pytest.approx({"queued_s": 0.25, "executing_s": 0.5, "swap_wait_s": 0.125,
                                                    "preemptions": 0.0})
    # Token-id prompts: exactly the dataset's prompt length, ids in [4, the server's vocab), ignore_eos.
    for body in fake.bodies[-6:]:
        assert body["model"] == "fake-model" and body["stream"] and body["ignore_eos"] is True
        assert all(4 <= t < 50 for t in body["prompt"]) and len(body["prompt"]) in (5, 8, 12)
        assert body["stream_options"] == {"include_usage": True}
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_refuses_bad_flags(tmp_path):
    with pytest.raises(SystemExit, match="needs --dataset-path"):
        loadgen.main(["--dataset-name", "lengths"])
    with pytest.raises(SystemExit, match="--text-prompts needs a dataset with text"):
        loadgen.main(["--dataset-name", "synthetic", "--text-prompts"])
    with pytest.raises(SystemExit, match="unknown itl2"):
        loadgen.main(["--dataset-name", "synthetic", "--percentile-metrics", "ttft,itl2"])
    assert loadgen.main(["--base-url", "http://127.0.0.1:1", "--dataset-name", "synthetic"]) == 1  # unreachable


# -- end to end against the real server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_server(tiny_model_dir, tmp_path_factory):
    srv = ServerProcess(["--model", str(tiny_model_dir)], tmp_path_factory.mktemp("server"))
    try:
        srv.wait_ready(timeout=180)  # no --profile: the start-up profile is measured
    except RuntimeError as e:
        pytest.fail(f"{e}:\n{srv.log()[-3000:]}")
    try:
        yield srv.url
    finally:
        srv.stop()


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastserve.bench.loadgen", *args, "--disable-tqdm"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_end_to_end_small_trace_against_the_real_server(real_server, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:00:0{s}.0,{p},{o}\n" for s, p, o in ((0, 20, 8), (1, 35, 12), (2, 12, 6), (3, 50, 10))))
    proc = run_cli(["--base-url", real_server, "--dataset-name", "azure-conv", "--dataset-path", str(trace),
                    "--num-prompts", "4", "--trace-speedup", "2", "--goodput", "e2el:120000", "--save-result",
                    "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("Serving Benchmark Result (trace)", "Successful requests:                     4",
                 "Failed requests:                         0", "Request goodput (req/s):", "P95 per-token latency",
                 "P99 TTFT (ms):", "Median TPOT (ms):", "Mean ITL (ms):", "P99 E2EL (ms):", "queued_s:",
                 "executing_s:", "swap_wait_s:"):
        assert line in proc.stdout, line
    result = json.loads((tmp_path / "r.json").read_text())
    (run,) = result["runs"]
    assert run["completed"] == 4 and run["input_lens"] == [20, 35, 12, 50] and run["output_lens"] == [8, 12, 6, 10]
    assert run["start_times"][3] >= 1.5 * 0.9  # the trace's 3 s, sped up twice
    assert all(t > 0 for t in run["ttfts"]) and all(e >= t for e, t in zip(run["e2els"], run["ttfts"]))
    assert all(m is not None and m["executing_s"] > 0 for m in run["server_metrics"])
    assert run["breakdown_s"]["swap_wait_s"] >= 0 and run["trace_speedup"] == 2.0


def test_end_to_end_sweep_against_the_real_server(real_server):
    proc = run_cli(["--base-url", real_server, "--dataset-name", "synthetic", "--num-prompts", "3",
                    "--random-input-len", "16", "--random-output-len", "6", "--sweep", "2,4",
                    "--slo-per-token", "100"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Throughput at SLO (mean per-token latency <= 100 s): 4 req/s" in proc.stdout
    assert "Throughput at SLO (p95 per-token latency <= 100 s): 4 req/s" in proc.stdout
