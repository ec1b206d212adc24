"""/dashboard/data against what the server's own responses and /metrics say (a real server process), the
page's routes and headers, and the API key. The page in a real browser: tests/test_dashboard_browser.py."""

from __future__ import annotations

import random
import sys
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from serving.dashboard import RECENT, percentile
from serving.gpu_probe import NvmlProbe
from tests.server_fixtures import (
    AUTH,
    QUICK_ARGS,
    RESTRICTED_ARGS,
    get_json,
    metric_samples,
    post_json,
    shared_server,
    wait_idle,
)

# Device KV for ~20 short sequences: eight concurrent n=2 requests preempt and offload.
DASH_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "24", "--max-model-len", "512")


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, DASH_ARGS)
    wait_idle(srv.url)
    return srv


def data(url: str, query: str = "", headers: dict | None = None) -> dict:
    status, body = get_json(url + "/dashboard/data" + query, headers)
    assert status == 200, body
    return body


def wait_sample(url: str, ok, timeout: float = 10.0) -> dict:
    """The first /dashboard/data whose latest sample satisfies ok(sample)."""
    deadline = time.monotonic() + timeout
    while True:
        d = data(url)
        if d["now"] is not None and ok(d["now"]):
            return d
        assert time.monotonic() < deadline, f"no such sample in {timeout} s; last: {d['now']}"
        time.sleep(0.2)


def test_percentile_is_numpys_linear():
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 57):
        values = sorted(rng.uniform(0, 5) for _ in range(n))
        for p in (0, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), abs=1e-12)


def test_numbers_agree_with_the_responses_and_metrics(server):
    url = server.url
    bodies = [{"prompt": f"dashboard request {i}", "max_tokens": 24 + 4 * i, "n": 1 + i % 2, "ignore_eos": True}
              for i in range(8)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: post_json(url + "/v1/completions", b), bodies))
    assert all(status == 200 for status, _, _ in replies), replies
    wait_idle(url)
    sent = len(bodies)
    d = wait_sample(url, lambda s: s["totals"]["finished"]["length"] == sent and s["requests"]["running"] == 0)
    now, health = d["now"], get_json(url + "/health")[1]

    # Every KV block free again, the same totals as /health; nothing queued.
    assert now["kv"]["device_used"] == now["kv"]["host_used"] == now["kv"]["swapped_jobs"] == 0
    assert (now["kv"]["device_total"], now["kv"]["host_total"]) == (health["kv_total_blocks"],
                                                                    health["kv_host_total_blocks"])
    assert sum(now["scheduler"]["queue_lengths"]) == now["requests"]["waiting"] == now["requests"]["batch_size"] == 0
    assert len(now["scheduler"]["queue_lengths"]) == len(d["quanta_s"]) > 1  # skip-join MLFQ's levels

    # Cumulative counters match /metrics (both read at idle), and this load did swap.
    m = {name: v for (name, _), v in metric_samples(url).items()}
    assert now["kv"]["offloaded_bytes"] == m["fastserve:kv_offloaded_bytes_total"] > 0
    assert now["kv"]["uploaded_bytes"] == m["fastserve:kv_uploaded_bytes_total"]
    assert now["kv"]["swap_misses"] == m["fastserve:kv_swap_misses_total"]
    assert now["kv"]["drops"] == m["fastserve:kv_drops_total"]
    assert now["scheduler"]["demotions"] == m["fastserve:scheduler_demotions_total"]
    assert now["totals"]["generated_tokens"] == sum(b["n"] * b["max_tokens"] for b in bodies)

    # The recent requests are these, with the breakdown their responses carried.
    recent = {r["request_id"]: r for r in d["recent_requests"]}
    assert len(recent) == sent <= RECENT
    ttfts, per_token = [], []
    for b, (_, _, body) in zip(bodies, replies):
        r, metrics = recent[body["id"] + "-0"], body["choices"][0]["metrics"]
        for key in ("queued_s", "executing_s", "swap_wait_s", "preemptions", "ttft_s", "e2e_s"):
            assert r[key] == metrics[key], key
        assert (r["finish_reason"], r["output_tokens"], r["n"]) == ("length", b["max_tokens"], b["n"])
        assert r["prompt_tokens"] == body["usage"]["prompt_tokens"]
        ttfts.append(metrics["ttft_s"])
        per_token.append(metrics["e2e_s"] / b["max_tokens"])
    ages = [r["age_s"] for r in d["recent_requests"]]
    assert ages == sorted(ages) and ages[0] >= 0  # newest first

    # Percentiles over the last minute: exactly these requests, as numpy computes them.
    lat = now["latency"]
    assert lat["count"] == sent
    for name, values in (("ttft_s", ttfts), ("per_token_s", per_token)):
        for p in (50, 90, 99):
            assert lat[name][f"p{p}"] == pytest.approx(float(np.percentile(values, p)), rel=1e-9), (name, p)
    # Throughput: rates over the measured span; no more than everything so far fell in it.
    tput = now["throughput"]
    assert 0 < tput["span_s"] <= max(tput["window_s"] + 1.5, now["uptime_s"])
    assert 0 <= tput["tokens_per_s"] * tput["span_s"] <= now["totals"]["generated_tokens"] + 1e-6
    assert 0 <= tput["requests_per_s"] * tput["span_s"] <= sent + 1e-9


def test_history_since_and_bad_since(server):
    d = wait_sample(server.url, lambda s: s["seq"] >= 4)
    seq = d["seq"]
    assert [s["seq"] for s in d["history"]] == list(range(d["history"][0]["seq"], d["history"][-1]["seq"] + 1))
    part = data(server.url, f"?since={seq - 2}")
    assert [s["seq"] for s in part["history"]] == list(range(seq - 1, part["seq"] + 1))
    assert part["history"][-1] == part["now"]
    assert data(server.url, f"?since={part['seq']}")["history"] in ([], [data(server.url)["now"]])
    for bad in ("-1", "abc", "1.5", "9" * 30, ""):
        status, body = get_json(server.url + "/dashboard/data?since=" + bad)
        assert status == 400 and body["error"]["param"] == "since", (bad, body)


def test_devices_rows_or_a_note_saying_why_none(server):
    d = data(server.url)
    rows = d["now"]["devices"]
    assert d["device_source"] == "nvml"
    if rows:  # a GPU machine: nvidia-ml-py's numbers
        assert d["device_note"] is None
        assert all(r["memory_total_bytes"] > 0 and 0 <= r["utilization_pct"] <= 100 for r in rows)
    else:
        assert "nvidia-ml-py" in d["device_note"]


def test_page_and_assets_are_self_contained(server):
    for path, kind in (("/dashboard", "text/html"), ("/dashboard/dashboard.js", "text/javascript"),
                       ("/dashboard/dashboard.css", "text/css")):
        with urllib.request.urlopen(server.url + path, timeout=10) as r:
            text = r.read().decode()
            assert r.headers["Content-Type"].startswith(kind)
            csp = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        assert "http://" not in text and "https://" not in text, path  # nothing fetched from elsewhere


def test_page_is_public_but_its_data_needs_the_key(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, RESTRICTED_ARGS)
    with urllib.request.urlopen(srv.url + "/dashboard", timeout=10) as r:
        assert r.status == 200 and b"dashboard.js" in r.read()
    status, body = get_json(srv.url + "/dashboard/data")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = get_json(srv.url + "/dashboard/data", AUTH)
    assert status == 200 and body["schema"] == 1


def test_nvml_rows_from_a_stand_in_library(monkeypatch):
    """NvmlProbe's reading of nvidia-ml-py's calls (no GPU here: a stand-in module with pynvml's names);
    a device that fails to answer shows as an error on its own row."""
    def utilization(handle):
        if handle == 1:
            raise RuntimeError("GPU is lost")
        return types.SimpleNamespace(gpu=37)

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200" if h == 0 else "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) << 30, total=141 << 30),
        nvmlDeviceGetUtilizationRates=utilization)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    probe = NvmlProbe()
    assert probe.note is None
    ok, lost = probe.rows()
    assert ok == {"id": 0, "name": "NVIDIA H200", "worker": None, "memory_used_bytes": 1 << 30,
                  "memory_total_bytes": 141 << 30, "utilization_pct": 37.0, "error": None,
                  "temperature_c": None, "pcie_tx_bytes_per_s": None, "pcie_rx_bytes_per_s": None}
    assert lost["id"] == 1 and lost["memory_used_bytes"] is None and "GPU is lost" in lost["error"]

    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    probe = NvmlProbe()
    assert probe.rows() == [] and "NVML Shared Library Not Found" in probe.note
