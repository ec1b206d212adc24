"""Prometheus metrics of the HTTP server, in a per-app CollectorRegistry.

Names follow vLLM's where vLLM has a counterpart, so its dashboards work. Every
series carries vLLM's `model_name` label.

  read from the engine at scrape time (EngineSnapshot):
    vllm:num_requests_running, vllm:num_requests_waiting   requests (not sequences)
    vllm:num_requests_swapped                              jobs whose KV is on the host tier
    vllm:gpu_cache_usage_perc, vllm:cpu_cache_usage_perc   device / host KV blocks in use, 0..1 (as vLLM)
    fastserve:kv_free_blocks, fastserve:kv_total_blocks    device KV blocks (all free when idle)
    fastserve:kv_host_free_blocks, fastserve:kv_host_total_blocks
    fastserve:scheduler_queue_jobs{queue}                  jobs per MLFQ level (1 = highest)
    fastserve:scheduler_promotions_total, ..._demotions_total, ..._policy_preemptions_total
  recorded as each request finishes (observe_finished):
    vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds,
    vllm:request_queue_time_seconds                        histograms
    vllm:time_per_output_token_seconds                     histogram of each request's mean time per
                                                           output token after the first (the engine
                                                           reports cumulative snapshots, not each token)
    vllm:inter_token_latency_seconds                       histogram of every gap between successive steps
                                                           that gave a request tokens (RequestMetrics.itl_s),
                                                           observed when the request finishes
    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total
  read from the prefix cache at scrape time (0 with --no-enable-prefix-caching):
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   tokens looked up / found cached (vLLM's)
    fastserve:prefix_cache_blocks, fastserve:prefix_cache_evictable_blocks   device blocks cached / of those
                                                           held by no job (counted free)
    vllm:request_success_total{finished_reason}            every finished request, labelled by its
                                                           first sequence's reason: stop, length,
                                                           abort or error
  counted by the server:
    fastserve:request_body_timeouts_total                  requests whose body did not arrive within
                                                           --request-body-timeout (answered 408)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # vLLM's
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class EngineSnapshot:
    """The engine's state now, as /health and /metrics report it."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_free: int
    kv_total: int
    host_free: int
    host_total: int
    scheduler: object | None = None  # engine.engine.SchedulerStats
    kv_stats: object | None = None  # memory.kv_manager.KVStats
    kv_block_bytes: int = 0
    devices: list[dict] = field(default_factory=list)  # serving/gpu_probe.py rows (none without a GPU)
    prefix_cache: tuple[int, int, int, int] = (0, 0, 0, 0)  # queried tokens, hit tokens, cached, evictable blocks


class _EngineCollector:
    """Yields the scrape-time series from the snapshot render() was given."""

    @staticmethod
    def _kv_series(s: EngineSnapshot, labels: list[str]):
        """KV-manager telemetry: bytes moved, drops, recomputed tokens, swap wait, ENST accuracy."""
        kv = s.kv_stats
        if kv is None:
            return
        for name, doc, value in (
            ("kv_offloaded_bytes", "KV bytes copied device -> host.", kv.blocks_offloaded * s.kv_block_bytes),
            ("kv_uploaded_bytes", "KV bytes copied host -> device.", kv.blocks_uploaded * s.kv_block_bytes),
            ("kv_drops", "Evictions that dropped KV (to be recomputed).", kv.num_drops),
            ("kv_recomputed_tokens", "Tokens whose KV was dropped and recomputed.", kv.num_recomputed_tokens),
            ("kv_host_full_fallbacks", "Evictions that found the host tier full.", kv.host_full_fallbacks),
            ("kv_swap_misses", "Jobs scheduled while their KV was on the host (uploaded on demand).",
             kv.num_swap_misses),
            ("kv_swap_wait_seconds", "Seconds steps waited on KV copies.", kv.swap_wait_s),
            ("kv_enst_samples", "Uploads whose next run was observed (ENST accuracy).", kv.enst_count),
            ("kv_enst_abs_error_seconds", "Sum of |ENST - actual wait| over those uploads.", kv.enst_abs_error_s),
        ):
            c = CounterMetricFamily(f"fastserve:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c

    @staticmethod
    def _device_series(s: EngineSnapshot):
        """Per-GPU gauges from NVML's rows; a series is left out where a device does not give the reading."""
        for key, name, doc in (
            ("memory_used_bytes", "gpu_memory_used_bytes", "GPU memory in use (all processes)."),
            ("memory_total_bytes", "gpu_memory_total_bytes", "GPU memory."),
            ("utilization_pct", "gpu_utilization_percent", "GPU utilization over NVML's last sample period."),
            ("temperature_c", "gpu_temperature_celsius", "GPU temperature."),
            ("pcie_tx_bytes_per_s", "gpu_pcie_tx_bytes_per_second", "PCIe transmit throughput (GPU to host)."),
            ("pcie_rx_bytes_per_s", "gpu_pcie_rx_bytes_per_second", "PCIe receive throughput (host to GPU)."),
        ):
            rows = [r for r in s.devices if r.get(key) is not None]
            if rows:
                g = GaugeMetricFamily(f"fastserve:{name}", doc, labels=["gpu", "name"])
                for r in rows:
                    g.add_metric([str(r["id"]), r["name"]], r[key])
                yield g

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.snapshot: EngineSnapshot | None = None

    def collect(self):
        s, labels = self.snapshot, [self.model]
        if s is None:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        yield gauge("vllm:num_requests_running", "Requests scheduled at least once, not finished.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests admitted, not yet scheduled.", s.num_waiting)
        yield gauge("vllm:num_requests_swapped", "Jobs whose KV cache is on the host tier.", s.num_swapped)
        yield gauge("vllm:gpu_cache_usage_perc", "Fraction of device KV blocks in use (0..1).",
                    (s.kv_total - s.kv_free) / s.kv_total if s.kv_total else 0.0)
        yield gauge("vllm:cpu_cache_usage_perc", "Fraction of host KV blocks in use (0..1).",
                    (s.host_total - s.host_free) / s.host_total if s.host_total else 0.0)
        yield gauge("fastserve:kv_free_blocks", "Free device KV blocks.", s.kv_free)
        yield gauge("fastserve:kv_total_blocks", "All device KV blocks.", s.kv_total)
        yield gauge("fastserve:kv_host_free_blocks", "Free host KV blocks.", s.host_free)
        yield gauge("fastserve:kv_host_total_blocks", "All host KV blocks.", s.host_total)
        yield from self._kv_series(s, labels)
        queries, hits, cached, evictable = s.prefix_cache
        for name, doc, value in (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
                                 ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c
        yield gauge("fastserve:prefix_cache_blocks", "Device KV blocks in the prefix cache.", cached)
        yield gauge("fastserve:prefix_cache_evictable_blocks", "Cached device blocks no job holds (counted free).",
                    evictable)
        yield from self._device_series(s)
        st = s.scheduler
        if st is None:
            return
        queues = GaugeMetricFamily("fastserve:scheduler_queue_jobs", "Jobs per MLFQ level (1 = highest).",
                                   labels=["model_name", "queue"])
        for level, n in enumerate(st.queue_lengths, start=1):
            queues.add_metric(labels + [str(level)], n)
        yield queues
        by_class = GaugeMetricFamily("fastserve:scheduler_class_jobs",
                                     "Unfinished jobs per request class (the request's priority; lower runs first).",
                                     labels=["model_name", "priority"])
        for priority, n in st.jobs_by_priority.items():
            by_class.add_metric(labels + [str(priority)], n)
        yield by_class
        started = CounterMetricFamily("fastserve:scheduler_class_started", "Jobs started (first run) per request "
                                      "class.", labels=["model_name", "priority"])
        for priority, n in st.started_by_priority.items():
            started.add_metric(labels + [str(priority)], n)
        yield started
        for name, doc, value in (("promotions", "Starvation promotions to Q1.", st.num_promotions),
                                 ("demotions", "MLFQ demotions.", st.num_demotions),
                                 ("policy_preemptions", "Jobs that ran one iteration and not the next.",
                                  st.num_policy_preemptions)):
            c = CounterMetricFamily(f"fastserve:scheduler_{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        self._model = model_name
        self._engine = _EngineCollector(model_name)
        reg.register(self._engine)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=reg)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", _TPOT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between successive tokens of a request.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time a request spent waiting.",
                               _LATENCY_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated by finished requests.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions of finished requests' sequences.")
        self.success = counter("vllm:request_success", "Finished requests by finish reason.", ["finished_reason"])
        for metric in (self.ttft, self.tpot, self.itl, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                       self.preemptions):
            metric.labels(model_name)  # every series exists (at zero) from the first scrape
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        self.body_timeouts = counter("fastserve:request_body_timeouts", "Requests whose body did not arrive "
                                     "within --request-body-timeout (answered 408).").labels(model_name)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished request (an AsyncEngine finish listener)."""
        m, name = out.metrics, self._model
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(name).inc(sum(len(c.token_ids) for c in out.outputs))
        self.preemptions.labels(name).inc(m.preemptions)
        reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"
        self.success.labels(name, reason).inc()
        if m.ttft_s is not None:
            self.ttft.labels(name).observe(m.ttft_s)
        itl = self.itl.labels(name)
        for gap in m.itl_s:
            itl.observe(gap)
        if m.e2e_s is not None:
            self.e2e.labels(name).observe(m.e2e_s)
            self.queue.labels(name).observe(m.queued_s)
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if m.ttft_s is not None and m.e2e_s is not None and longest > 1:
            self.tpot.labels(name).observe((m.e2e_s - m.ttft_s) / (longest - 1))

    def render(self, snapshot: EngineSnapshot) -> bytes:
        """The exposition text, with the engine's series as of `snapshot`."""
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)
