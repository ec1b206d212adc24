"""/metrics (Prometheus text with vLLM's names, counters that move), --api-key, and CORS."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.server_fixtures import (
    API_KEY,
    AUTH,
    DEFAULT_ARGS,
    RESTRICTED_ARGS,
    get_json,
    metric_samples,
    post_json,
    shared_server,
    wait_idle,
)


@pytest.fixture(scope="module")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, DEFAULT_ARGS)
    wait_idle(srv.url)
    return srv


@pytest.fixture(scope="module")
def restricted(request, tiny_model_dir):
    return shared_server(request, tiny_model_dir, RESTRICTED_ARGS)


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_metrics_parse_and_counters_move_as_requests_finish(server):
    before = metric_samples(server.url)
    status, _, body = post_json(server.url + "/v1/completions",
                                {"prompt": "Count me", "max_tokens": 4, "n": 2, "ignore_eos": True})
    assert status == 200
    wait_idle(server.url)
    after = metric_samples(server.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vllm:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert moved("vllm:generation_tokens_total") == 8
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:time_per_output_token_seconds"):
        assert moved(hist + "_count") == 1, hist
        assert moved(hist + "_sum") >= 0, hist
    # two sequences of 4 tokens in the same steps: 3 gaps (more only if one ran a step without the other)
    assert 3 <= moved("vllm:inter_token_latency_seconds_count") <= 6
    assert moved("vllm:inter_token_latency_seconds_sum") > 0
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:num_requests_swapped") == 0
    assert value(after, "vllm:gpu_cache_usage_perc") == value(after, "vllm:cpu_cache_usage_perc") == 0
    assert value(after, "fastserve:kv_free_blocks") == value(after, "fastserve:kv_total_blocks") == 1024
    assert value(after, "fastserve:kv_host_free_blocks") == value(after, "fastserve:kv_host_total_blocks") == 256
    assert moved("vllm:num_preemptions_total") == 0
    assert ("fastserve:scheduler_promotions_total", (("model_name", body["model"]),)) in after
    for name in ("kv_offloaded_bytes", "kv_uploaded_bytes", "kv_drops", "kv_recomputed_tokens", "kv_swap_wait_seconds",
                 "kv_enst_samples", "kv_enst_abs_error_seconds"):
        assert (f"fastserve:{name}_total", (("model_name", body["model"]),)) in after, name
    assert all(("model_name", "") not in labels for _, labels in after)


def test_request_classes_are_counted_per_priority(server):
    before = metric_samples(server.url)
    for priority in (3, 3, -1):
        status, _, body = post_json(server.url + "/v1/completions",
                                    {"prompt": "Class", "max_tokens": 2, "priority": priority})
        assert status == 200
    wait_idle(server.url)
    after = metric_samples(server.url)

    def started(priority: int, samples) -> float:
        return samples.get(("fastserve:scheduler_class_started_total",
                            (("model_name", body["model"]), ("priority", str(priority)))), 0.0)

    assert started(3, after) - started(3, before) == 2
    assert started(-1, after) - started(-1, before) == 1
    assert not any(name == "fastserve:scheduler_class_jobs" and v for (name, _), v in after.items())  # idle


def test_kv_telemetry_series_carry_the_kv_managers_counts():
    from memory.kv_manager import KVStats
    from serving.server_metrics import EngineSnapshot, _EngineCollector

    stats = KVStats(num_drops=3, num_recomputed_tokens=40, blocks_offloaded=5, blocks_uploaded=2, swap_wait_s=0.5,
                    enst_count=2, enst_abs_error_s=0.25)
    collector = _EngineCollector("m")
    collector.snapshot = EngineSnapshot(0, 0, 1, 10, 10, 4, 8, None, stats, kv_block_bytes=1000)
    got = {m.name: m.samples[0].value for m in collector.collect() if m.name.startswith("fastserve:kv_")
           and m.type == "counter"}
    assert got["fastserve:kv_offloaded_bytes"] == 5000 and got["fastserve:kv_uploaded_bytes"] == 2000
    assert got["fastserve:kv_drops"] == 3 and got["fastserve:kv_recomputed_tokens"] == 40
    assert got["fastserve:kv_enst_samples"] == 2 and got["fastserve:kv_enst_abs_error_seconds"] == 0.25


def test_gauges_show_a_running_request(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "Keep going", "max_tokens": 300, "ignore_eos": True, "stream": True}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                await r.content.readuntil(b"\n\n")  # running now
                during = metric_samples(server.url)
                await r.read()
        return during

    during = asyncio.run(run())
    assert value(during, "vllm:num_requests_running") == 1
    assert 0 < value(during, "vllm:gpu_cache_usage_perc") < 1
    assert value(during, "fastserve:kv_free_blocks") < 1024
    wait_idle(server.url)


def test_api_key_is_required_everywhere_but_health(restricted):
    url = restricted.url
    for path in ("/v1/models", "/metrics", "/version"):
        status, body = get_json(url + path)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", path
        assert get_json(url + path, {"Authorization": "Bearer wrong"})[0] == 401
        assert get_json(url + path, {"Authorization": API_KEY})[0] == 401  # no "Bearer "
    status, _, body = post_json(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 401 and API_KEY not in str(body)
    assert get_json(url + "/health")[0] == 200
    assert get_json(url + "/v1/models", AUTH)[0] == 200
    status, _, body = post_json(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_openai_client_with_and_without_the_key(restricted):
    good = openai.OpenAI(base_url=restricted.url + "/v1", api_key=API_KEY, max_retries=0)
    bad = openai.OpenAI(base_url=restricted.url + "/v1", api_key="nope", max_retries=0)
    model = good.models.list().data[0].id
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="Hi", max_tokens=1)
    out = good.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].message.role == "assistant"


def test_cors_only_for_allowed_origins(server, restricted):
    async def run():
        async with aiohttp.ClientSession() as s:
            async def head(method: str, url: str, **headers: str):
                async with s.request(method, url, headers=headers) as r:
                    return r.status, r.headers

            return [
                await head("GET", server.url + "/health", Origin="http://allowed.example"),  # CORS off
                await head("GET", restricted.url + "/health", Origin="http://allowed.example"),
                await head("GET", restricted.url + "/health", Origin="http://evil.example"),
                await head("OPTIONS", restricted.url + "/v1/completions", Origin="http://allowed.example",
                           **{"Access-Control-Request-Method": "POST",
                              "Access-Control-Request-Headers": "authorization, content-type"}),
                await head("OPTIONS", restricted.url + "/v1/completions", Origin="http://evil.example",
                           **{"Access-Control-Request-Method": "POST"}),
            ]

    off, allowed, evil, preflight, evil_preflight = asyncio.run(run())
    assert off[0] == 200 and "Access-Control-Allow-Origin" not in off[1]
    assert allowed[1]["Access-Control-Allow-Origin"] == "http://allowed.example"
    assert "Access-Control-Allow-Origin" not in evil[1]
    assert preflight[0] == 204 and preflight[1]["Access-Control-Allow-Origin"] == "http://allowed.example"
    assert "POST" in preflight[1]["Access-Control-Allow-Methods"]
    assert "Authorization" in preflight[1]["Access-Control-Allow-Headers"]
    assert evil_preflight[0] != 204 and "Access-Control-Allow-Origin" not in evil_preflight[1]


def test_the_key_never_reaches_the_log(restricted):
    assert API_KEY not in restricted.log()
