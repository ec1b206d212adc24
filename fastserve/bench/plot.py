"""Plots of load-generator results: the paper's Fig. 11 and Fig. 15b, from result JSONs (loadgen.py --save-result).

What this is: plot_results(results, png, slo) draws, side by side,
  * per-token latency (mean solid, P95 dashed) against request rate, one line per run label (policy),
    with the SLO as a horizontal line (Fig. 11);
  * the mean queued / executing / swap-wait seconds per request, stacked, for each rate and label (Fig. 15b;
    empty when the server sent no per-request metrics, as vLLM does not).
Runs whose rate is not a finite number (rate inf) are left out. matplotlib is imported here only, so the
load generator runs without it. What this is not: a report (metrics.py prints the numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

PARTS = (("queued_s", "queued", "#8da0cb"), ("executing_s", "executing", "#66c2a5"),
         ("swap_wait_s", "swap wait", "#fc8d62"))
HATCHES = ("", "//", "..", "xx", "\\\\", "oo")


def _points(result: dict) -> list[tuple[float, dict]]:
    """(rate, run) for the runs of one result whose rate is a finite number, by rate."""
    out = []
    for run in result.get("runs", []):
        try:
            rate = float(run["request_rate"])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(rate):
            out.append((rate, run))
    return sorted(out, key=lambda p: p[0])


def plot_results(results: Sequence[dict], png: str, slo_s: float) -> list[str]:
    """Draws the PNG; returns the label each result has in the legends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, parts) = plt.subplots(1, 2, figsize=(12, 4.5))
    # The run's --label (compare.py: the policy; --compare files without one: their file name).
    labels = [r.get("label") or Path(str(r.get("model_id", "run"))).name for r in results]
    rates = sorted({rate for r in results for rate, _ in _points(r)})
    width, top = 0.8 / max(1, len(results)), 0.0
    for k, (result, label) in enumerate(zip(results, labels)):
        pts = _points(result)
        xs = [rate for rate, _ in pts]
        line, = lat.plot(xs, [run["per_token_latency_mean_s"] for _, run in pts], "o-", label=f"{label} mean")
        lat.plot(xs, [run["per_token_latency_p95_s"] for _, run in pts], "s--", color=line.get_color(),
                 label=f"{label} P95")
        for rate, run in pts:
            b = run.get("breakdown_s")
            if not b:
                continue
            x, bottom = rates.index(rate) - 0.4 + (k + 0.5) * width, 0.0
            for key, _, color in PARTS:
                value = float(b.get(key, 0.0))
                parts.bar(x, value, width, bottom=bottom, color=color, edgecolor="black",
                          hatch=HATCHES[k % len(HATCHES)])
                bottom += value
            top = max(top, bottom)
    lat.axhline(slo_s, color="grey", linestyle=":", label=f"SLO {slo_s:g} s")
    lat.set(xlabel="request rate (req/s)", ylabel="per-token latency (s)", title="Per-token latency (Fig. 11)")
    lat.legend(fontsize="small")
    parts.set_ylim(0, top * 1.1 or 1.0)
    parts.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
    parts.set(xlabel="request rate (req/s)", ylabel="mean seconds per request",
              title="Latency breakdown (Fig. 15b)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, _, c in PARTS]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch=HATCHES[k % len(HATCHES)])
                for k in range(len(results))]
    parts.legend(handles, [n for _, n, _ in PARTS] + labels, fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return labels
