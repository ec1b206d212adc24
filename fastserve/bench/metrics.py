"""The load generator's arithmetic: a run's metrics, goodput, throughput at SLO, the printed report, the JSON.

What this is: pure functions of RequestResults (client.py) and a run's duration.
  * vLLM benchmark_serving's metrics, the same way: TTFT, TPOT = (e2e - ttft) / (output tokens - 1) over
    requests with more than one token, ITL = every gap between text chunks, E2EL; mean, median, std and
    the requested percentiles (numpy's linear interpolation), in ms; request / output / total token
    throughput; goodput = requests meeting every --goodput SLO (ttft, tpot, e2el in ms; a one-token
    request's tpot counts as 0) per second.
  * The paper's (FastServe's evaluation; docs/experiments.md reports them): per-token latency of a request =
    e2e / output tokens, mean and P95 over requests, in seconds; the mean queued / executing / swap-wait seconds
    per request, from the server's per-request metrics when it sends them.
  * rate_at_slo(): the throughput at SLO of a sweep.
What this is not: I/O, except that format_* return text and result_json() returns a JSON-ready dict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from fastserve.bench.client import BREAKDOWN_KEYS, RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RunMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    request_goodput: float | None  # req/s meeting every SLO; None without --goodput
    per_token_latency_mean_s: float  # the paper's metric: e2e / output tokens, over completed requests
    per_token_latency_p95_s: float
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> {mean, median, std, p99}
    breakdown_s: dict[str, float] | None = None  # mean per request of BREAKDOWN_KEYS; None if the server is silent

    def flat(self) -> dict:
        """vLLM's flat key names (mean_ttft_ms, p99_itl_ms, ...) plus ours."""
        d = {k: v for k, v in asdict(self).items() if k not in ("latency_ms", "breakdown_s")}
        d["duration"] = self.duration_s
        for metric, stats in self.latency_ms.items():
            for stat, value in stats.items():
                d[f"{stat}_{metric}_ms"] = value
        d["breakdown_s"] = self.breakdown_s
        return d


def percentile_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and percentiles of seconds, in ms (0 for no values, as vLLM)."""
    a = np.asarray(values, dtype=float) * 1000.0
    if a.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{percentile_name(p): 0.0 for p in percentiles}}
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({percentile_name(p): float(np.percentile(a, p)) for p in percentiles})
    return out


def tpot_s(r: RequestResult) -> float:
    """(e2e - ttft) / (output tokens - 1); 0 for a one-token request."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """vLLM's --goodput "ttft:500 tpot:50" (ms; given as one string or several) -> {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for part in " ".join(specs or []).split():
        name, sep, value = part.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad --goodput item {part!r}: expected NAME:MS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)} (e.g. ttft:500 tpot:50)")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput item {part!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0:
            raise ValueError(f"bad --goodput item {part!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_goodput(r: RequestResult, slos: dict[str, float]) -> bool:
    ms = {"ttft": r.ttft * 1000, "tpot": tpot_s(r) * 1000, "e2el": r.latency * 1000}
    return r.success and all(ms[name] <= limit for name, limit in slos.items())


def compute_metrics(results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = (99,),
                    goodput: dict[str, float] | None = None) -> RunMetrics:
    ok = [r for r in results if r.success]
    per_token = [r.latency / r.output_tokens for r in ok if r.output_tokens > 0]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    rate = lambda x: x / duration_s if duration_s > 0 else 0.0
    samples = {"ttft": [r.ttft for r in ok], "tpot": [tpot_s(r) for r in ok if r.output_tokens > 1],
               "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok]}
    reported = [r.server_metrics for r in ok if r.server_metrics]
    breakdown = ({k: float(np.mean([m.get(k, 0.0) for m in reported])) for k in BREAKDOWN_KEYS}
                 if reported else None)
    return RunMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=rate(len(ok)), output_throughput=rate(total_out),
        total_token_throughput=rate(total_in + total_out),
        request_goodput=rate(sum(meets_goodput(r, goodput) for r in ok)) if goodput else None,
        per_token_latency_mean_s=float(np.mean(per_token)) if per_token else 0.0,
        per_token_latency_p95_s=float(np.percentile(per_token, 95)) if per_token else 0.0,
        latency_ms={m: _stats(v, percentiles) for m, v in samples.items()}, breakdown_s=breakdown)


def rate_at_slo(points: Sequence[tuple[float, float | None]], slo_s: float) -> float | None:
    """The highest swept rate up to which every rate's latency (per token, seconds) is at most slo_s.

    points: (rate, latency); latency None marks a run that had failed requests (it never meets the SLO).
    Rates past the first one that misses are not counted, so noise above the knee cannot raise the answer.
    """
    best = None
    for rate, latency in sorted(points, key=lambda p: p[0]):
        if latency is None or not latency <= slo_s:
            break
        best = rate
    return best


# -- text ---------------------------------------------------------------------------------------------------
def _line(name: str, value: object, digits: int = 2) -> str:
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return f"{name:<40} {text:<10}"


def format_report(m: RunMetrics, rate_label: str, metrics: Sequence[str], percentiles: Sequence[float],
                  goodput: dict[str, float] | None) -> str:
    """A vLLM-style table of one run."""
    rows = ["{:=^50}".format(f" Serving Benchmark Result ({rate_label}) "),
            _line("Successful requests:", m.completed), _line("Failed requests:", m.failed),
            _line("Benchmark duration (s):", m.duration_s), _line("Total input tokens:", m.total_input_tokens),
            _line("Total generated tokens:", m.total_output_tokens),
            _line("Request throughput (req/s):", m.request_throughput)]
    if goodput:
        rows.append(_line("Request goodput (req/s):", m.request_goodput))
    rows += [_line("Output token throughput (tok/s):", m.output_throughput),
             _line("Total Token throughput (tok/s):", m.total_token_throughput),
             "{:-^50}".format("Per-token latency (e2e / output tokens)"),
             _line("Mean per-token latency (s):", m.per_token_latency_mean_s, 4),
             _line("P95 per-token latency (s):", m.per_token_latency_p95_s, 4)]
    for metric in metrics:
        stats = m.latency_ms[metric]
        rows.append(f"{_TITLES[metric]:-^50}")
        name = metric.upper()
        rows += [_line(f"Mean {name} (ms):", stats["mean"]), _line(f"Median {name} (ms):", stats["median"])]
        rows += [_line(f"{percentile_name(p).upper()} {name} (ms):", stats[percentile_name(p)]) for p in percentiles]
    rows.append("{:-^50}".format("Server breakdown (mean s per request)"))
    if m.breakdown_s is None:
        rows.append("(the server sent no per-request metrics)")
    else:
        rows += [_line(f"{k}:", float(v), 4) for k, v in m.breakdown_s.items()]
    rows.append("=" * 50)
    return "\n".join(rows)


def format_sweep(points: Sequence[tuple[str, RunMetrics]], slo_s: float) -> str:
    """One row per rate, then the throughput at SLO by mean and by P95 per-token latency."""
    rows = ["{:=^81}".format(" Sweep "),
            f"{'rate':>11} {'done':>6} {'failed':>6} {'req/s':>8} {'mean s/tok':>11} {'p95 s/tok':>10} "
            f"{'queued s':>9} {'swap s':>8}"]
    for label, m in points:
        b = m.breakdown_s or {}
        rows.append(f"{label:>11} {m.completed:>6} {m.failed:>6} {m.request_throughput:>8.2f} "
                    f"{m.per_token_latency_mean_s:>11.4f} {m.per_token_latency_p95_s:>10.4f} "
                    f"{b.get('queued_s', math.nan):>9.3f} {b.get('swap_wait_s', math.nan):>8.3f}")
    return "\n".join(rows)


def slo_points(runs: Sequence[tuple[float, RunMetrics]], which: str) -> list[tuple[float, float | None]]:
    """(rate, per-token latency) for rate_at_slo; `which` is "mean" or "p95"; runs with failures -> None."""
    attr = "per_token_latency_mean_s" if which == "mean" else "per_token_latency_p95_s"
    return [(rate, None if m.failed or not m.completed else getattr(m, attr)) for rate, m in runs]


def run_json(rate: float, burstiness: float, m: RunMetrics, results: Sequence[RequestResult]) -> dict:
    """One run in the spirit of vLLM's --save-result: flat metrics plus per-request arrays."""
    d = {"request_rate": rate, "burstiness": burstiness, **m.flat()}
    d.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
             ttfts=[r.ttft for r in results], itls=[r.itl for r in results], e2els=[r.latency for r in results],
             start_times=[r.start_s for r in results], errors=[r.error for r in results],
             generated_texts=[r.generated_text for r in results],
             server_metrics=[r.server_metrics for r in results])
    return d
