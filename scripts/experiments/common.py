"""What every section of `make experiments` shares: the scales and policies, the experiment context `Ctx`
(arguments, the figures' folder), plotting helpers, the SLO search (Fig. 13's), the KV capacity of a scale, and the
tiny model's measured profile.

The helpers SLOSearch/throughput_at_slo, phase_latencies and KVUsageTracker are tested in tests/test_experiments.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

POLICIES = ("fcfs", "fixed-priority", "mlfq", "skip-join-mlfq")
KV_POLICIES = ("proactive", "reactive", "recompute")
SLO_S = 0.3  # paper default: seconds per output token
SCALES = {  # name -> (model shape, profile): OPT-13B on 1 A100, 66B on 4, 175B on 16; 40GB A100s unless named
    "opt-13b": ("opt-13b", "profiles/sim/opt-13b-a100-40gb-x1.json"),
    "opt-66b": ("opt-66b", "profiles/sim/opt-66b-a100-40gb-x4.json"),
    "opt-175b": ("opt-175b", "profiles/sim/opt-175b-a100-40gb-x16.json"),
    "opt-13b-80gb": ("opt-13b", "profiles/sim/opt-13b-a100-80gb-x1.json"),
    "opt-66b-80gb": ("opt-66b", "profiles/sim/opt-66b-a100-80gb-x4.json"),
    "opt-175b-80gb": ("opt-175b", "profiles/sim/opt-175b-a100-80gb-x16.json"),
    # Llama-3 (grouped-query attention, 8 KV heads): 8B on one H100 80GB or one H200, 70B on 8 H100s (TP 8)
    "llama-3-8b": ("llama-3-8b", "profiles/sim/llama-3-8b-h100-80gb-x1.json"),
    "llama-3-8b-h200": ("llama-3-8b", "profiles/sim/llama-3-8b-h200-141gb-x1.json"),
    "llama-3-70b": ("llama-3-70b", "profiles/sim/llama-3-70b-h100-80gb-x8.json"),
}
MAIN = "opt-13b"  # the scale of the figures


# -- helpers (tested in tests/test_experiments.py) -----------------------------------------------------------
@dataclass
class SLOSearch:
    """The highest rate whose latency stays <= slo: a geometric grid, then bisection of the bracket (at most
    `iters` steps, fewer once its ends are within `resolution` of each other).

    `latency_at(rate)` must be (roughly) non-decreasing in rate. `rate` is the highest rate seen to meet the
    SLO (0.0 if even the lowest grid rate misses it); `capped` is True when every grid rate met it (the true
    throughput is then above `rate`). `evaluated` holds every (rate, latency) computed, in order.
    """

    rate: float
    capped: bool
    evaluated: list[tuple[float, float]] = field(default_factory=list)


def throughput_at_slo(latency_at: Callable[[float], float], grid: Sequence[float], slo: float,
                      iters: int = 4, resolution: float = 0.0) -> SLOSearch:
    cache: dict[float, float] = {}
    evaluated: list[tuple[float, float]] = []

    def lat(rate: float) -> float:
        if rate not in cache:
            cache[rate] = latency_at(rate)
            evaluated.append((rate, cache[rate]))
        return cache[rate]

    ok, bad = 0.0, None
    for rate in sorted(grid):
        if lat(rate) <= slo:
            ok = rate
        else:
            bad = rate
            break
    if bad is None:
        return SLOSearch(ok, True, evaluated)
    lo = ok if ok > 0 else bad / 4
    for _ in range(iters):
        if bad <= lo * (1 + resolution):  # the bracket is already as narrow as asked
            break
        mid = math.sqrt(lo * bad)
        if lat(mid) <= slo:
            ok = lo = mid
        else:
            bad = mid
    return SLOSearch(ok, False, evaluated)


class KVUsageTracker:
    """Records KV blocks in use after every engine step (wraps engine.step; run_trace calls it)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.times: list[float] = []
        self.device: list[int] = []
        self.host: list[int] = []
        inner = engine.step

        def step():
            out = inner()
            kv = engine.kv
            self.times.append(engine.clock.now())
            self.device.append(kv.device.num_used)
            self.host.append(kv.host.num_used)
            return out

        engine.step = step

    @property
    def peak_device(self) -> int:
        return max(self.device, default=0)

    @property
    def peak_total(self) -> int:
        return max((d + h for d, h in zip(self.device, self.host)), default=0)


def phase_latencies(outputs) -> dict[str, float]:
    """P95 of each phase over finished RequestOutputs: "p95_ttft_s" (time to first token: the prefill
    phase, queueing included) and "p95_tpot_s" (time per output token after the first: the decode phase,
    (e2e - ttft) / (tokens - 1), over jobs with at least 2 output tokens)."""
    from engine.simulation import p95

    ttft = [o.metrics.ttft_s for o in outputs]
    tpot = [(o.metrics.e2e_s - o.metrics.ttft_s) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs if len(o.outputs[0].token_ids) > 1]
    return {"p95_ttft_s": p95(ttft), "p95_tpot_s": p95(tpot)}


# -- the experiment context ------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args) -> None:
        self.args = args
        self.datasets = {"ShareGPT": args.sharegpt, "Alpaca": args.alpaca}
        self.n = {"ShareGPT": args.num_prompts, "Alpaca": args.num_prompts_alpaca}
        self.figdir = args.out.parent / "figures"
        self.figdir.mkdir(parents=True, exist_ok=True)
        self.sim_runs = 0
        self.cache: dict = {}

    def model(self, scale: str) -> tuple[Path, Path]:
        shape, profile = SCALES[scale]
        from fastserve.make_model import config_only_model  # torch: only when a simulation runs

        return config_only_model(shape), REPO / profile

    def cmd(self, only: str) -> str:
        a = self.args
        extra = "" if a.num_prompts == DEFAULTS["num_prompts"] else f" --num-prompts {a.num_prompts}"
        if a.num_prompts_alpaca != DEFAULTS["num_prompts_alpaca"]:
            extra += f" --num-prompts-alpaca {a.num_prompts_alpaca}"
        return f"python -m scripts.experiments --only {only}{extra}"


DEFAULTS = {"num_prompts": 300, "num_prompts_alpaca": 600}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 80, "font.size": 9})
    return plt


def _errorbar(ax, xs: Sequence[float], stats: Sequence, label: str) -> None:
    """One curve of steady_state Stats (mean, half-width of the 95% interval; no bar where one seed left none)."""
    ax.errorbar(xs, [s.mean for s in stats], yerr=[0 if math.isnan(s.half) else s.half for s in stats],
                marker="o", capsize=2, label=label)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"figures/{path.name}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


# -- KV capacity of a scale ---------------------------------------------------------------------------------------
BLOCK = 16  # tokens per KV block in every simulated run


def kv_capacity(ctx: Ctx, scale: str) -> tuple[float, int]:
    """(device KV bytes of the scale's profile, bytes of one 16-bit KV block of its model: KV heads, not query
    heads, with grouped-query attention)."""
    import torch

    from engine.kv_cache import kv_block_bytes
    from engine.model.registry import load_model_config
    from engine.parallel import ParallelLayout

    model, profile = ctx.model(scale)
    block = kv_block_bytes(load_model_config(model), ParallelLayout(), BLOCK, torch.float16)
    return json.loads(profile.read_text())["capacity"]["device_kv_bytes"], block


def main_kv_blocks(ctx: Ctx) -> int:
    """The MAIN scale's device KV capacity in 16-token blocks (OPT-13B on an A100 40GB: ~990)."""
    capacity, block = kv_capacity(ctx, MAIN)
    return int(capacity // block)


# -- the tiny model's job profile, measured on this machine (Fig. 5, the live SLO) ---------------------------------
def tiny_profile(ctx: Ctx) -> Path:
    if "tiny_profile" not in ctx.cache:
        tmp = Path(tempfile.mkdtemp(prefix="experiments-"))
        out = tmp / "tiny.json"
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "fastserve.profile", "--quick", "--device", "cpu", "--quiet", "--out",
                        str(out)], check=True, env=env, cwd=REPO)
        ctx.cache["tiny_profile"] = out
    return ctx.cache["tiny_profile"]
