"""Regenerate docs/experiments.md and its figures (docs/figures/*.png): the FastServe paper's experiments,
simulated at the paper's scale with roofline profiles, plus a small live measurement.

    python scripts/experiments.py                       # everything (~10 min on 2 shared cores)
    python scripts/experiments.py --only fig5,fig14     # some figures; prints their sections, keeps the doc
    python scripts/experiments.py --no-live --num-prompts 200

Sections: Fig. 1 (queueing share of latency under FCFS), Fig. 5 (first-iteration vs decode cost), Fig. 8
(peak KV memory, MLFQ vs FCFS), Fig. 14 (policies over input:output ratios), Fig. 15a/b (KV policies vs
rate, latency breakdown), throughput at the 0.3 s/token SLO for every policy (table), and sim vs live
(scripts/bench_sim_vs_live.py). Everything simulated runs engine/simulation.py (the real engine, scheduler
and KV manager on a virtual clock) with profiles/sim/*.json, which are roofline estimates from datasheets,
not measurements. The simulations are deterministic (seeded traces, virtual clock); the text of the document
is written from the numbers this run measured. Dataset paths come from flags (default
../shared/datasets/*_lengths.csv, relative to the repository root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from workload import LengthFilter, load_workload, synthetic_lengths  # noqa: E402  (scripts/ is on the path)

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
}
MAIN = "opt-13b"  # the scale of the figures
FIGURES = ("fig1", "fig5", "fig8", "fig14", "fig15", "slo", "overload", "enst_ablation", "alpha", "robustness",
           "live_slo", "live")


# -- helpers (tested in tests/test_experiments.py) -----------------------------------------------------------
@dataclass
class SLOSearch:
    """The highest rate whose latency stays <= slo: a geometric grid, then bisection of the bracket.

    `latency_at(rate)` must be (roughly) non-decreasing in rate. `rate` is the highest rate seen to meet the
    SLO (0.0 if even the lowest grid rate misses it); `capped` is True when every grid rate met it (the true
    throughput is then above `rate`). `evaluated` holds every (rate, latency) computed, in order.
    """

    rate: float
    capped: bool
    evaluated: list[tuple[float, float]] = field(default_factory=list)


def throughput_at_slo(latency_at: Callable[[float], float], grid: Sequence[float], slo: float,
                      iters: int = 4) -> SLOSearch:
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


def clip_trace(items, limit: int) -> list[tuple[float, int, int]]:
    """WorkItems -> run_trace tuples whose prompt + output fit a context of `limit` tokens."""
    out = []
    for it in items:
        prompt = max(1, min(it.prompt_len, limit - 1))
        out.append((it.arrival_s, prompt, max(1, min(it.output_len, limit - prompt))))
    return out


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
        from make_tiny_model import config_only_model  # torch: only when a simulation runs

        return config_only_model(shape), REPO / profile

    def trace(self, dataset: str, rate: float, n: int | None = None) -> list[tuple[float, int, int]]:
        """Poisson at `rate`: at least the dataset's request count, and enough to span --span seconds (capped
        at --max-prompts), so that high rates are not a short burst."""
        n = n or min(self.args.max_prompts, max(self.n[dataset], int(rate * self.args.span)))
        items = load_workload("lengths", n, path=self.datasets[dataset], rate=rate,
                              seed=self.args.seed, length_filter=LengthFilter())
        return clip_trace(items, 2048)

    def engine(self, shape: str, policy: str, kv_policy: str = "proactive", **kw):
        from engine.simulation import simulated_engine

        model, profile = self.model(shape)
        return simulated_engine(model, profile, scheduling_policy=policy, kv_policy=kv_policy,
                                max_num_seqs=self.args.max_num_seqs, **kw)

    def simulate(self, shape: str, trace, policy: str, kv_policy: str = "proactive", track: bool = False, **kw):
        from engine.simulation import run_trace

        key = (shape, tuple(trace), policy, kv_policy, track, tuple(sorted(kw.items())))
        if key not in self.cache:
            eng = self.engine(shape, policy, kv_policy, **kw)
            tracker = KVUsageTracker(eng) if track else None
            res = run_trace(eng, trace)
            self.sim_runs += 1
            self.cache[key] = (res.summary() | {"offloads": eng.kv.stats.num_offloads,
                                                "drops": eng.kv.stats.num_drops}, tracker, eng)
        return self.cache[key]

    def cmd(self, only: str) -> str:
        a = self.args
        extra = "" if a.num_prompts == DEFAULTS["num_prompts"] else f" --num-prompts {a.num_prompts}"
        if a.num_prompts_alpaca != DEFAULTS["num_prompts_alpaca"]:
            extra += f" --num-prompts-alpaca {a.num_prompts_alpaca}"
        return f"python scripts/experiments.py --only {only}{extra}"


DEFAULTS = {"num_prompts": 300, "num_prompts_alpaca": 600}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 80, "font.size": 9})
    return plt


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"figures/{path.name}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


# -- throughput at SLO (also gives each dataset's load scale to the figures) ------------------------------------
RATE_GRID = {"ShareGPT": (1, 2, 4, 8, 16, 32, 64, 128, 256), "Alpaca": (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)}


def slo_table(ctx: Ctx) -> dict:
    if "slo" in ctx.cache:
        return ctx.cache["slo"]
    out: dict = {}
    for shape in ctx.args.scales:
        for ds in ctx.datasets:
            for policy in POLICIES:
                for metric in ("mean_per_token_s", "p95_per_token_s"):
                    def lat(rate, ds=ds, policy=policy, metric=metric, shape=shape):
                        return ctx.simulate(shape, ctx.trace(ds, rate), policy)[0][metric]
                    grid = [r * SCALE_RATE[SCALES[shape][0]] for r in RATE_GRID[ds]]
                    s = throughput_at_slo(lat, grid, SLO_S, iters=ctx.args.bisect)
                    out[(shape, ds, policy, metric)] = s
                    print(f"  SLO {shape} {ds:8} {policy:15} {metric[:4]}: {s.rate:7.2f} req/s"
                          f"{' (grid cap)' if s.capped else ''}", flush=True)
    ctx.cache["slo"] = out
    return out


SCALE_RATE = {"opt-13b": 1.0, "opt-66b": 0.5, "opt-175b": 0.25}


def section_slo(ctx: Ctx) -> str:
    table = slo_table(ctx)
    lines = ["## Throughput at the SLO (0.3 s/token), all policies", "",
             f"Command: `{ctx.cmd('slo')}`", "",
             "The highest Poisson rate (req/s) whose mean (or P95) per-token latency over "
             f"max({ctx.n['ShareGPT']} ShareGPT / {ctx.n['Alpaca']} Alpaca, rate x {ctx.args.span:.0f} s) requests "
             f"(at most {ctx.args.max_prompts}) (lengths from the *_lengths.csv "
             "files, vLLM's length filter: prompt <= 1024, total <= 2048) stays <= 0.3 s/token: a geometric grid "
             f"of rates, then {ctx.args.bisect} bisection steps (resolution "
             f"~{100 * (2 ** 0.5 ** ctx.args.bisect - 1):.0f}% of the rate). KV policy proactive, max_num_seqs "
             f"{ctx.args.max_num_seqs}, starvation threshold 0.3 s, block size 16.", ""]
    for shape in ctx.args.scales:
        data = json.loads((REPO / SCALES[shape][1]).read_text())
        tp, pp = data["key"]["tensor_parallel_size"], data["key"]["pipeline_parallel_size"]
        layout = (f"{tp * pp} GPU{'s' if tp * pp > 1 else ''}" + (f", tensor parallel {tp}" if tp > 1 else "")
                  + (f" x pipeline parallel {pp} with {pp} batches in flight" if pp > 1 else ""))
        lines += [f"### {shape} ({SCALES[shape][1]}: {layout}; roofline estimate)", "",
                  "| dataset | metric | " + " | ".join(POLICIES) + " | skip-join / fcfs |",
                  "|---|---|" + "---|" * (len(POLICIES) + 1)]
        for ds in ctx.datasets:
            for metric, name in (("mean_per_token_s", "mean"), ("p95_per_token_s", "P95")):
                rates = [table[(shape, ds, p, metric)] for p in POLICIES]
                cells = [f"{s.rate:.2f}{'+' if s.capped else ''}" for s in rates]
                fc, sj = rates[0].rate, rates[-1].rate
                ratio = f"{sj / fc:.2f}x" if fc > 0 else "n/a"
                lines.append(f"| {ds} | {name} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    lines += ["(`+`: every grid rate met the SLO; the throughput is above this.)", ""]
    ratios = []
    for shape in ctx.args.scales:
        for ds in ctx.datasets:
            for metric in ("mean_per_token_s", "p95_per_token_s"):
                fc = table[(shape, ds, "fcfs", metric)].rate
                sj = table[(shape, ds, "skip-join-mlfq", metric)].rate
                if fc > 0:
                    ratios.append((shape, ds, metric[:4].rstrip("_"), sj / fc))
    if ratios:
        desc = "; ".join(f"{s} {d} {m}: {r:.2f}x" for s, d, m, r in ratios)
        lines += [f"Skip-join MLFQ over FCFS, throughput at the SLO: {desc}. The paper reports 1.9x-2.9x "
                  "(mean, and more at P95) at the same SLO against vLLM (FCFS) on real A100s.", "",
                  "**Defaults changed since the last run of this table.** These numbers are with the overload-robust "
                  "defaults (`--kv-overcommit 2`: a job with no KV starts only while the started jobs' KV fits two "
                  "device caches; docs/benchmarks.md, \"Past capacity\"). The run before that change (the paper's "
                  "admission, `--kv-overcommit none`) gave skip-join over FCFS 1.68x (mean) and 2.83x (P95) on "
                  "OPT-13B / A100 40GB ShareGPT. The remedy keeps skip-join from collapsing past capacity but also "
                  "gives up most of its lead at the knee, where this table measures; the paragraph below describes "
                  "the paper's behaviour. Which default to ship is open (issue 12).", ""]
    lines += ["**Why the GPU's memory decides it.** On an A100 40GB, OPT-13B has "
              f"{kv_gib(ctx, MAIN):.1f} GiB of KV cache (about {kv_tokens(ctx, MAIN) / 1e3:.1f}K tokens; the vLLM "
              "paper's Table 1 gives 12 GB for this setup), which holds the whole context of only a few dozen "
              "ShareGPT jobs: FCFS's batch is bounded by memory, and jobs with long outputs hold it while short "
              "ones queue behind them (head-of-line blocking). Skip-join MLFQ runs the short jobs first and parks "
              "the preempted ones' KV in host memory (proactive offloading), so it keeps more jobs in flight. "
              "On an A100 80GB "
              f"({kv_gib(ctx, 'opt-13b-80gb'):.1f} GiB, ~{kv_tokens(ctx, 'opt-13b-80gb') / 1e3:.0f}K tokens) "
              "FCFS batches up to max_num_seqs = 256 jobs continuously and memory rarely binds; with so many "
              "slots, head-of-line blocking is rare, and MLFQ's preemptions and offloads cost about what they "
              "save.", ""]
    lines += section_slo_long(ctx)
    return "\n".join(lines)


BLOCK = 16  # tokens per KV block in every simulated run


def kv_capacity(ctx: Ctx, scale: str) -> tuple[float, int]:
    """(device KV bytes of the scale's profile, bytes of one float16 KV block of its model)."""
    import torch

    from engine.kv_cache import kv_block_bytes
    from engine.model.config import OPTConfig
    from engine.parallel import ParallelLayout

    model, profile = ctx.model(scale)
    block = kv_block_bytes(OPTConfig.from_model_dir(model), ParallelLayout(), BLOCK, torch.float16)
    return json.loads(profile.read_text())["capacity"]["device_kv_bytes"], block


def kv_tokens(ctx: Ctx, scale: str) -> float:
    capacity, block = kv_capacity(ctx, scale)
    return capacity / (block / BLOCK)


def kv_gib(ctx: Ctx, scale: str) -> float:
    return kv_capacity(ctx, scale)[0] / 2**30


def section_slo_long(ctx: Ctx) -> list[str]:
    """The same search with long traces (a steady state, not a transient), FCFS and skip-join, ShareGPT."""
    n = ctx.args.long_prompts
    found = {}
    for policy in ("fcfs", "skip-join-mlfq"):
        for metric in ("mean_per_token_s", "p95_per_token_s"):
            def lat(rate, policy=policy, metric=metric):
                return ctx.simulate(MAIN, ctx.trace("ShareGPT", rate, n), policy)[0][metric]
            grid = [r * SCALE_RATE[SCALES[MAIN][0]] for r in RATE_GRID["ShareGPT"]]
            found[(policy, metric)] = throughput_at_slo(lat, grid, SLO_S, iters=ctx.args.bisect)
            print(f"  SLO long {policy:15} {metric[:4]}: {found[(policy, metric)].rate:7.2f} req/s", flush=True)
    lines = ["### Long traces: a steady state", "",
             f"The table above, like the paper's and vLLM's benchmarks, runs a few hundred requests per point: "
             f"at the highest rates the queue is still growing when the trace ends. Here the same search on "
             f"{MAIN}, ShareGPT, with {n} requests per point (arrivals spanning ~{n} / rate s):", "",
             "| metric | fcfs | skip-join-mlfq | skip-join / fcfs |", "|---|---|---|---|"]
    for metric, name in (("mean_per_token_s", "mean"), ("p95_per_token_s", "P95")):
        fc, sj = found[("fcfs", metric)].rate, found[("skip-join-mlfq", metric)].rate
        lines.append(f"| {name} | {fc:.2f} | {sj:.2f} | {sj / fc:.2f}x |" if fc > 0 else f"| {name} | {fc:.2f} | "
                     f"{sj:.2f} | n/a |")
    evaluated = {p: dict(found[(p, "mean_per_token_s")].evaluated) for p in ("fcfs", "skip-join-mlfq")}
    common = sorted(set(evaluated["fcfs"]) & set(evaluated["skip-join-mlfq"]))
    lines += ["", "Mean per-token latency (s) at the rates both searches ran: "
              + ", ".join(f"{r:.2f} req/s: fcfs {evaluated['fcfs'][r]:.3f}, skip-join "
                          f"{evaluated['skip-join-mlfq'][r]:.3f}" for r in common) + ".", "",
              "In a steady state both policies saturate at about the same rate: skip-join MLFQ reorders work, it "
              "does not add capacity (its offloads and preemptions cost a little), and once the arrival rate "
              "passes capacity the queue grows without bound under any policy; with starvation promotion every "
              "job is then promoted in turn and skip-join degrades to round robin, worse than FCFS. Its gain is "
              "the latency just below the knee, where FCFS's head-of-line blocking is worst; the short traces "
              "measure that region plus the transient above it, which is where the paper-sized ratios come "
              "from.", ""]
    return lines


# -- Fig. 1 -----------------------------------------------------------------------------------------------------
def section_fig1(ctx: Ctx) -> str:
    plt = _plt()
    table = slo_table(ctx)
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    lines = ["## Fig. 1: queueing share of latency under FCFS", "", f"Command: `{ctx.cmd('fig1')}`", "",
             "![fig1](figures/fig1_queueing_share.png)", "",
             "OPT-13B on one A100 40GB (roofline profile), FCFS, proactive KV policy. Rates are multiples of FCFS's "
             "own throughput at the mean-latency SLO (the table below). Share = total queueing time / total "
             "end-to-end latency over all requests.", "",
             "| dataset | load (x FCFS SLO rate) | rate req/s | queueing share | mean s/token |",
             "|---|---|---|---|---|"]
    loads = (0.25, 0.5, 0.8, 1.0, 1.25, 1.5)
    for ds in ctx.datasets:
        base = table[(MAIN, ds, "fcfs", "mean_per_token_s")].rate or 1.0
        shares = []
        for load in loads:
            s = ctx.simulate(MAIN, ctx.trace(ds, base * load), "fcfs")[0]
            shares.append(s["queueing_share"])
            lines.append(f"| {ds} | {load} | {base * load:.2f} | {100 * s['queueing_share']:.1f}% | "
                         f"{s['mean_per_token_s']:.3f} |")
        ax.plot(loads, [100 * x for x in shares], marker="o", label=ds)
    ax.set_xlabel("load (x FCFS throughput at 0.3 s/token)")
    ax.set_ylabel("queueing share of e2e latency (%)")
    ax.set_title("FCFS, OPT-13B / 1xA100-40GB (simulated)")
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, ctx.figdir / "fig1_queueing_share.png")
    top = {ds: ctx.simulate(MAIN, ctx.trace(ds, (table[(MAIN, ds, "fcfs", "mean_per_token_s")].rate
                                                      or 1.0) * loads[-1]), "fcfs")[0]["queueing_share"]
           for ds in ctx.datasets}
    lines += ["", "At 1.5x the FCFS SLO rate queueing is "
              + ", ".join(f"{100 * v:.0f}% ({k})" for k, v in top.items())
              + " of end-to-end latency. The paper measures up to ~90% on vLLM with real workloads; the trend "
                "(queueing dominates once FCFS saturates, because head-of-line jobs with long outputs hold the "
                "batch slots and the KV memory) is what this figure reproduces.", ""]
    return "\n".join(lines)


# -- Fig. 5 -----------------------------------------------------------------------------------------------------
def tiny_profile(ctx: Ctx) -> Path:
    if "tiny_profile" not in ctx.cache:
        tmp = Path(tempfile.mkdtemp(prefix="experiments-"))
        out = tmp / "tiny.json"
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run([sys.executable, str(REPO / "scripts" / "profile_model.py"), "--quick", "--device", "cpu",
                        "--quiet", "--out", str(out)], check=True, env=env, cwd=REPO)
        ctx.cache["tiny_profile"] = out
    return ctx.cache["tiny_profile"]


def section_fig5(ctx: Ctx) -> str:
    from scheduler.cost_model import ProfiledCostModel

    plt = _plt()
    profiles = {"tiny-opt, measured here (CPU, 1 thread)": tiny_profile(ctx),
                "OPT-13B / 1xA100-40GB (roofline estimate)": REPO / SCALES[MAIN][1]}
    lens = [1, 16, 64, 256, 1024]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    lines = ["## Fig. 5: first iteration vs decode iteration, by prompt length", "", f"Command: `{ctx.cmd('fig5')}`",
             "", "![fig5](figures/fig5_first_vs_decode.png)", "",
             "t_init(s): the first iteration of one prompt of s tokens alone; t_dec(1, s): one decode step of a "
             "single job with context s. The tiny model's profile is measured on this machine by "
             "`scripts/profile_model.py --quick` (single-threaded; the machine is shared, so it is noisy); the "
             "OPT-13B one is the roofline estimate in profiles/sim/.", "",
             "| profile | s | t_init(s) | t_dec(1, s) | ratio |", "|---|---|---|---|---|"]
    for ax, (name, path) in zip(axes, profiles.items()):
        cost = ProfiledCostModel.from_json(path)
        ti = [cost.t_init(s) for s in lens]
        td = [cost.t_dec(1, s) for s in lens]
        ax.plot(lens, [1e3 * x for x in ti], marker="o", label="first iteration t_init(s)")
        ax.plot(lens, [1e3 * x for x in td], marker="s", label="decode t_dec(1, s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt / context length (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(name, fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        for s, a, b in zip(lens, ti, td):
            lines.append(f"| {name} | {s} | {_ms(a)} | {_ms(b)} | {a / b:.1f}x |")
    _save(fig, ctx.figdir / "fig5_first_vs_decode.png")
    c13 = ProfiledCostModel.from_json(REPO / SCALES[MAIN][1])
    lines += ["", f"At OPT-13B scale a 1024-token first iteration costs {c13.t_init(1024) / c13.t_dec(1, 1024):.1f}x a "
              "decode step, and short prompts cost about one decode step: the first iteration grows with the "
              "prompt while a decode step barely does. The paper's measured Fig. 5 shows the same shape on a "
              "real A100; our OPT-13B numbers are a roofline model (50% of peak FLOP/s, 70% of HBM bandwidth), "
              "not measured kernels. This is why skip-join places a job by its first-iteration cost.", ""]
    return "\n".join(lines)


# -- Fig. 8 -----------------------------------------------------------------------------------------------------
FIG8_LOAD = 2.5


def section_fig8(ctx: Ctx) -> str:
    plt = _plt()
    table = slo_table(ctx)
    capacity, block = kv_capacity(ctx, MAIN)
    block_gb, capacity = block / 1e9, capacity / 1e9
    rate = FIG8_LOAD * (table[(MAIN, "ShareGPT", "fcfs", "mean_per_token_s")].rate or 1.0)
    big = int(8 * capacity / block_gb)  # room for every job's KV: the demand, not the capped use
    trace = ctx.trace("ShareGPT", rate)
    fig, ax = plt.subplots(figsize=(5.6, 3.2))
    lines = ["## Fig. 8: KV memory, MLFQ vs FCFS", "", f"Command: `{ctx.cmd('fig8')}`", "",
             "![fig8](figures/fig8_kv_memory.png)", "",
             f"OPT-13B, {len(trace)} ShareGPT requests at {rate:.2f} req/s ({FIG8_LOAD:g}x FCFS's throughput at the "
             f"SLO, so that more jobs are in the system than max_num_seqs = {ctx.args.max_num_seqs}: below that "
             "every policy runs every job each iteration and none preempts). The "
             f"device KV tier is made 8x the A100's ({8 * capacity:.0f} GB instead of {capacity:.0f} GB) so "
             "nothing has to be offloaded and the curves show each policy's KV demand: blocks in use after "
             "every iteration (engine.kv.device.num_used, polled by wrapping engine.step).", "",
             "| policy | peak KV (GB) | x A100 KV capacity | mean s/token |", "|---|---|---|---|"]
    peaks = {}
    for policy in ("fcfs", "mlfq", "skip-join-mlfq"):
        s, tr, _ = ctx.simulate(MAIN, trace, policy, track=True, num_device_blocks=big)
        peaks[policy] = tr.peak_total * block_gb
        ax.plot(tr.times, [d * block_gb for d in tr.device], label=policy, lw=1)
        lines.append(f"| {policy} | {peaks[policy]:.1f} | {peaks[policy] / capacity:.2f} | "
                     f"{s['mean_per_token_s']:.3f} |")
    ax.axhline(capacity, color="k", ls="--", lw=0.8, label="A100 KV capacity")
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylabel("KV cache in use (GB)")
    ax.set_title("OPT-13B, ShareGPT lengths (simulated)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, ctx.figdir / "fig8_kv_memory.png")
    ratio = peaks["mlfq"] / peaks["fcfs"] if peaks["fcfs"] else float("nan")
    lines += ["", f"Peak KV demand of MLFQ is {ratio:.2f}x FCFS's ({peaks['mlfq']:.1f} vs {peaks['fcfs']:.1f} GB)"
              f"; skip-join MLFQ {peaks['skip-join-mlfq']:.1f} GB. MLFQ preempts jobs that keep their KV while "
              "others start, so more jobs hold memory at once; this is the pressure proactive offloading "
              "relieves (paper Fig. 8 shows the same effect qualitatively).", ""]
    return "\n".join(lines)


# -- Fig. 14 ----------------------------------------------------------------------------------------------------
IO_RATIOS = (0.25, 1, 4, 16, 64, 256)
NO_STARVE = "skip-join (no promotion)"


def io_rate(ctx: Ctx, prompt: int, output: int, load: float) -> float:
    """A rate giving roughly `load` x the estimated capacity for fixed lengths (decode batches of <= max_num_seqs
    jobs, limited by the device KV; one prefill per job)."""
    from scheduler.cost_model import ProfiledCostModel

    cost = ProfiledCostModel.from_json(ctx.model(MAIN)[1])
    cap_tokens = kv_tokens(ctx, MAIN)
    batch = max(1, min(ctx.args.max_num_seqs, int(cap_tokens / (prompt + output))))
    per_job = cost.t_init(prompt) + output * cost.t_dec(batch, prompt + output // 2) / batch
    return load / per_job


def section_fig14(ctx: Ctx) -> str:
    plt = _plt()
    total, load, n = ctx.args.io_total, ctx.args.io_load, ctx.args.io_prompts
    fig, ax = plt.subplots(figsize=(5.6, 3.2))
    lines = ["## Fig. 14: policies over input:output ratios", "", f"Command: `{ctx.cmd('fig14')}`", "",
             "![fig14](figures/fig14_io_ratio.png)", "",
             f"OPT-13B, {n} requests of fixed total length {total} tokens split input:output = r:1 "
             "(scripts/workload.py synthetic_lengths io_ratio, +-10% uniform), Poisson arrivals at "
             f"{load}x an estimated capacity for each ratio (rates in the table). Mean per-token latency.", "",
             f"The last column but one, `{NO_STARVE}`, is skip-join MLFQ with starvation promotion off "
             "(starvation_threshold None), to show how much of the MLFQ policies' result the 0.3 s promotion "
             "threshold causes.", "",
             "| ratio | prompt/output | rate req/s | " + " | ".join(POLICIES) + f" | {NO_STARVE} | fcfs / skip-join |",
             "|---|---|---|" + "---|" * (len(POLICIES) + 2)]
    from workload_arrivals import poisson_arrivals

    variants = [(p, p, {}) for p in POLICIES] + [(NO_STARVE, "skip-join-mlfq", {"starvation_threshold": None})]
    results = {name: [] for name, _, _ in variants}
    for r in IO_RATIOS:
        items = synthetic_lengths(n, total // 2, total - total // 2, range_ratio=0.1, io_ratio=r, seed=ctx.args.seed)
        prompt = statistics.mean(it.prompt_len for it in items)
        output = statistics.mean(it.output_len for it in items)
        rate = io_rate(ctx, int(prompt), int(output), load)
        times = poisson_arrivals(n, rate, seed=ctx.args.seed)
        trace = clip_trace([it.__class__(it.prompt_len, it.output_len, None, t) for it, t in zip(items, times)], 2048)
        if r == 4:
            ctx.cache["fig14_trace4"] = trace
        row = []
        for name, p, kw in variants:
            m = ctx.simulate(MAIN, trace, p, **kw)[0]["mean_per_token_s"]
            results[name].append(m)
            row.append(m)
        lines.append(f"| {r} | {prompt:.0f}/{output:.0f} | {rate:.2f} | " + " | ".join(f"{x:.3f}" for x in row)
                     + f" | {row[0] / row[3]:.2f}x |")
    for name in results:
        ax.plot(IO_RATIOS, results[name], marker="o", label=name, ls="--" if name == NO_STARVE else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("input : output length ratio")
    ax.set_ylabel("mean per-token latency (s)")
    ax.set_title(f"OPT-13B, total length {total}, load {load} (simulated)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, ctx.figdir / "fig14_io_ratio.png")
    mid = IO_RATIOS.index(4)
    mid_trace = ctx.cache["fig14_trace4"]
    util = {p: ctx.simulate(MAIN, mid_trace, p)[0] for p in ("fcfs", "skip-join-mlfq")}
    best = {r: min(POLICIES, key=lambda p, i=i: results[p][i]) for i, r in enumerate(IO_RATIOS)}
    sj_vs_mlfq = [results["mlfq"][i] / results["skip-join-mlfq"][i] for i in range(len(IO_RATIOS))]
    u_fc, u_sj = util["fcfs"]["utilization"], util["skip-join-mlfq"]["utilization"]
    lines += ["", "Best policy per ratio: " + ", ".join(f"{r}: {p}" for r, p in best.items())
              + ". mlfq / skip-join-mlfq latency: "
              + ", ".join(f"{r}: {x:.2f}x" for r, x in zip(IO_RATIOS, sj_vs_mlfq)) + ".", "",
              f"In the ratio-4 run (fcfs {results['fcfs'][mid]:.3f}, skip-join-mlfq "
              f"{results['skip-join-mlfq'][mid]:.3f} s/token) the executor was busy {100 * u_fc:.0f}% of the run "
              f"under fcfs and {100 * u_sj:.0f}% under skip-join-mlfq, which offloaded "
              f"{util['skip-join-mlfq']['offloads']} times (fcfs {util['fcfs']['offloads']}) and reported a mean "
              f"swap wait of {util['skip-join-mlfq']['mean_swap_wait_s']:.3f} s."]
    if u_sj < 0.8 * u_fc:
        lines[-1] += (" The device idles while jobs wait for KV copies of preempted jobs (the swap wait above): "
                      "a cost of our scheduler / KV-policy interplay, not the paper's result.")
    lines += ["", "The paper finds skip-join best across ratios, with its lead over plain MLFQ growing with the "
              "input share (plain MLFQ demotes a long prompt only after its costly first iteration ran in the top "
              "queue). Our rates come from a rough capacity estimate, so the load differs between ratios; compare "
              "policies within a row."]
    fcfs_rows = sum(best[r] == "fcfs" for r in IO_RATIOS)
    if fcfs_rows > len(IO_RATIOS) // 2:
        lines[-1] += (f" Here FCFS is best in {fcfs_rows} of {len(IO_RATIOS)} rows, unlike the paper. Every job of "
                      "a row has the same total length (+-10%), so there is no short job for MLFQ to favour, and "
                      "the service a job has received says the opposite of what MLFQ assumes: the more a job has "
                      "run, the less it has left. Preempting it after its first token for a newer job (which is "
                      "what least-attained-service ordering does, skip-join or not, with or without starvation "
                      "promotion: see the no-promotion column) only delays both, and under the 40GB memory limit "
                      "the preempted job's KV must leave and come back. MLFQ pays off on heavy-tailed lengths "
                      "(ShareGPT, the SLO table), not on uniform ones.")
    lines.append("")
    return "\n".join(lines)


# -- Fig. 15 ----------------------------------------------------------------------------------------------------
def section_fig15(ctx: Ctx) -> str:
    plt = _plt()
    table = slo_table(ctx)
    base = table[(MAIN, "ShareGPT", "skip-join-mlfq", "mean_per_token_s")].rate or 1.0
    loads = (0.5, 0.75, 1.0, 1.25, 1.5)
    blocks = ctx.args.fig15_device_blocks  # None: the profile's own device KV capacity
    if blocks is None:
        where = "the device KV tier is the A100 40GB's (its profile's capacity)"
    else:
        where = f"the device KV tier is cut to {blocks} blocks ({blocks * 16} tokens)"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(8.4, 3.2))
    lines = ["## Fig. 15: proactive vs reactive offloading vs recompute", "", f"Command: `{ctx.cmd('fig15')}`", "",
             "![fig15](figures/fig15_kv_policies.png)", "",
             f"OPT-13B, skip-join MLFQ, max({ctx.n['ShareGPT']}, rate x {ctx.args.span:.0f} s) ShareGPT requests; "
             "rates are multiples of skip-join's "
             f"throughput at the SLO ({base:.2f} req/s); {where}, so memory binds, as in the paper's "
             "memory-constrained runs; host tier 256 GiB over 25 GB/s PCIe (profile transfer fields). "
             "(a) mean per-token latency; (b) the mean latency breakdown at the highest rate.", "",
             "| rate req/s | kv policy | mean s/token | P95 s/token | queued s | executing s | swap wait s | "
             "offloads | drops |", "|---|---|---|---|---|---|---|---|---|"]
    series = {k: [] for k in KV_POLICIES}
    rates = [base * x for x in loads]
    for rate in rates:
        trace = ctx.trace("ShareGPT", rate)
        for kv in KV_POLICIES:
            s = ctx.simulate(MAIN, trace, "skip-join-mlfq", kv, num_device_blocks=blocks)[0]
            series[kv].append(s)
            lines.append(f"| {rate:.2f} | {kv} | {s['mean_per_token_s']:.3f} | {s['p95_per_token_s']:.3f} | "
                         f"{s['mean_queued_s']:.2f} | {s['mean_executing_s']:.2f} | {s['mean_swap_wait_s']:.3f} | "
                         f"{s['offloads']} | {s['drops']} |")
    for kv in KV_POLICIES:
        ax.plot(rates, [s["mean_per_token_s"] for s in series[kv]], marker="o", label=kv)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("mean per-token latency (s)")
    ax.set_title("(a) KV policies vs rate", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    bottom = [0.0] * len(KV_POLICIES)
    for part, color in (("mean_queued_s", "tab:gray"), ("mean_executing_s", "tab:blue"),
                        ("mean_swap_wait_s", "tab:red")):
        vals = [series[kv][-1][part] for kv in KV_POLICIES]
        bx.bar(KV_POLICIES, vals, bottom=bottom, color=color, label=part[5:-2].replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_ylabel("mean latency per job (s)")
    bx.set_title(f"(b) breakdown at {rates[-1]:.2f} req/s", fontsize=8)
    bx.legend(fontsize=7)
    _save(fig, ctx.figdir / "fig15_kv_policies.png")
    hi = {kv: series[kv][-1]["mean_per_token_s"] for kv in KV_POLICIES}
    lines += ["", f"At the highest rate reactive / proactive = {hi['reactive'] / hi['proactive']:.2f}x and "
              f"recompute / proactive = {hi['recompute'] / hi['proactive']:.2f}x mean per-token latency (paper: "
              "1.7x and 2.7x at high load on real hardware). In the simulator the copies follow the profile's "
              "PCIe bandwidth and overlap computation exactly as the engine schedules them; no real copy "
              "contention is modelled.", ""]
    return "\n".join(lines)


# -- live: throughput at the SLO on this machine ---------------------------------------------------------------
# Swept rates of the live section (req/s): around the tiny model's knee on this 2-core machine at the scaled SLO
# (measured: FCFS on ShareGPT lengths ~15 ms/token at 1 req/s, ~66 ms at 3 req/s). The simulator is no guide
# here: with the tiny model it reads the knee ~4x too high (the engine's per-iteration work, the HTTP server
# and the load generator share the two cores; no profile measures them).
LIVE_RATES = {"ShareGPT": "1,2,4", "Alpaca": "8,16,32"}


def main_kv_blocks(ctx: Ctx) -> int:
    """The MAIN scale's device KV capacity in 16-token blocks (OPT-13B on an A100 40GB: ~990)."""
    capacity, block = kv_capacity(ctx, MAIN)
    return int(capacity // block)


def section_live_slo(ctx: Ctx) -> str:
    from scheduler.cost_model import ProfiledCostModel

    profile = tiny_profile(ctx)
    tiny, big = ProfiledCostModel.from_json(profile), ProfiledCostModel.from_json(REPO / SCALES[MAIN][1])
    slo = SLO_S * tiny.t_dec(1, 16) / big.t_dec(1, 16)
    blocks, max_len = main_kv_blocks(ctx), ctx.args.live_max_model_len
    lines = ["## Live: throughput at the SLO on this machine, tiny model", "",
             f"Command: `{ctx.cmd('live_slo')}` (runs `scripts/live_sweep.py`)", "",
             "Every policy served for real: `server.py` (tiny model, one torch thread) started once per policy and "
             "dataset, `scripts/loadgen.py --sweep` against it over loopback HTTP (streaming, token-id prompts of "
             f"the dataset's lengths, ignore_eos), {ctx.args.live_prompts} requests per rate. Scaled to "
             "this machine the way the paper's setup is: the SLO is 0.3 s x t_dec(1, 16) of the tiny model / "
             "t_dec(1, 16) of OPT-13B on an A100 40GB "
             f"= **{slo * 1e3:.0f} ms/token** (the tiny model's decode step measured here: "
             f"{tiny.t_dec(1, 16) * 1e3:.1f} ms); the device KV tier is {blocks} blocks of 16 tokens, OPT-13B's "
             f"on an A100 40GB, so memory binds as it does there; --max-model-len {max_len} (loadgen drops "
             "longer requests, as vLLM's benchmark does), proactive KV policy. Rates (`--live-rates-sharegpt`, "
             "`--live-rates-alpaca`) bracket FCFS's knee on this machine; the simulator on the tiny model's "
             "profile put it ~4x higher in an earlier run (it measures neither the engine's own per-iteration "
             "work nor the server and load generator sharing the two cores), so it does not pick them. A "
             "policy's throughput at the SLO is the highest swept rate at which it (and every lower rate) meets "
             "it: the resolution is a factor of 2. Short wall-clock runs on a shared 2-core machine: noisy, "
             "and each run is partly a burst.", ""]
    header = "| dataset | policy | rate 1 | rate 2 | rate 3 | at SLO (mean) | at SLO (P95) |"
    table = [header, "|---|---|---|---|---|---|---|"]
    found: dict[tuple[str, str], dict] = {}
    figs: list[str] = []
    for ds in ctx.datasets:
        rates = [float(r) for r in getattr(ctx.args, f"live_rates_{ds.lower()}").split(",")]
        n = ctx.args.live_prompts
        with tempfile.TemporaryDirectory() as tmp:
            fig = ctx.figdir / f"fig11_live_{ds.lower()}.png"
            cmd = [sys.executable, str(REPO / "scripts" / "live_sweep.py"), "--dataset-name", "lengths",
                   "--dataset-path", str(ctx.datasets[ds]), "--num-prompts", str(n),
                   "--sweep", ",".join(f"{r:g}" for r in rates), "--slo-per-token", f"{slo:.6f}",
                   "--seed", str(ctx.args.seed), "--result-dir", tmp, "--plot", str(fig), "--",
                   "--model", str(REPO / "models" / "tiny-opt"), "--profile", str(profile),
                   "--num-gpu-blocks-override", str(blocks), "--num-host-blocks-override", "8192",
                   "--max-model-len", str(max_len), "--max-num-seqs", str(ctx.args.max_num_seqs)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            summary_path = Path(tmp) / "summary.json"
            if proc.returncode != 0 or not summary_path.exists():
                return "\n".join(lines + [f"The live sweep on {ds} failed (rc {proc.returncode}):", "", "```",
                                           (proc.stdout + proc.stderr)[-2000:], "```", ""])
            summary = json.loads(summary_path.read_text())["policies"]
        figs.append(f"![fig11 {ds}](figures/{fig.name})")
        for policy, s in summary.items():
            found[(ds, policy)] = s
            cells = [f"{m * 1e3:.0f} / {p * 1e3:.0f}" + (f" ({f} failed)" if f else "")
                     for m, p, f in zip(s["mean_per_token_s"], s["p95_per_token_s"], s["failed"])]
            at = [s["throughput_at_slo_mean"], s["throughput_at_slo_p95"]]
            where = f"{ds} ({', '.join(f'{r:g}' for r in rates)} req/s; {n} requests)"
            table.append(f"| {where} | {policy} | " + " | ".join(cells) + " | "
                         + " | ".join("below the sweep" if a is None else f"{a:g}{'+' if a == rates[-1] else ''}"
                                      for a in at) + " |")
    lines += [" ".join(figs), "", "Cells: mean / P95 per-token latency (ms). Throughput at the SLO in req/s (`+`: the "
              "top swept rate met it; the throughput is above).", "",
              *table, ""]
    verdicts = []
    for ds in ctx.datasets:
        fc, sj = found[(ds, "fcfs")], found[(ds, "skip-join-mlfq")]
        for i, x in enumerate(fc["rates"]):
            verdicts.append(f"{ds} at {x:g} req/s: FCFS / skip-join mean latency "
                            f"{fc['mean_per_token_s'][i] / sj['mean_per_token_s'][i]:.2f}x")
    lines += ["; ".join(verdicts) + ".", ""]
    return "\n".join(lines)


# -- live -------------------------------------------------------------------------------------------------------
def section_live(ctx: Ctx) -> str:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_sim_vs_live.py")]
    lines = ["## Live: simulator vs live engine", "",
             "Command: `python scripts/bench_sim_vs_live.py` (run by this script)", "",
             "The same seeded Poisson trace (24 requests, 1.5 req/s, prompts 16-128, outputs 8-48 tokens) on the "
             "live engine (async API, wall clock, CPU, random-weight OPT-125M, one torch thread) and in the "
             "simulator with a profile measured just before on this machine (`scripts/profile_model.py --quick`)."
             " Numbers vary run to run: the machine is shared.", "",
             "| policy | live mean ms/token | sim mean ms/token | sim / live (mean) | live P95 | sim P95 | "
             "sim / live (P95) |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "live.json"
        proc = subprocess.run(cmd + ["--json", str(out)], cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            return "\n".join(lines[:2] + [f"The live run failed (rc {proc.returncode}):", "",
                                          "```", proc.stderr[-2000:], "```", ""])
        rows = json.loads(out.read_text())["rows"]
    for r in rows:
        lv, sm = r["live"], r["sim"]
        lines.append(f"| {r['policy']} | {lv['mean_per_token_s'] * 1e3:.1f} | {sm['mean_per_token_s'] * 1e3:.1f} | "
                     f"{r['ratio_mean']:.3f} | {lv['p95_per_token_s'] * 1e3:.1f} | {sm['p95_per_token_s'] * 1e3:.1f}"
                     f" | {r['ratio_p95']:.3f} |")
    within = all(abs(r["ratio_mean"] - 1) <= 0.15 for r in rows)
    lines += ["", f"Mean per-token latency: the simulator is {'within' if within else 'NOT within'} 15% of the live "
              "engine for every policy in this run. On the 4-layer tiny model (`--model tiny`) it reads ~25-30% "
              "low, because the engine's own per-iteration work (scheduling, KV bookkeeping, asyncio), which no "
              "profile measures, is then a large share of a ~4 ms iteration.", ""]
    return "\n".join(lines)


SECTIONS = {"slo": section_slo, "fig1": section_fig1, "fig5": section_fig5, "fig8": section_fig8,
            "fig14": section_fig14, "fig15": section_fig15, "live_slo": section_live_slo, "live": section_live}


def _sched_section(name: str):
    def run(ctx: Ctx) -> str:
        import experiments_sched  # scripts/experiments_sched.py (it imports this module's helpers)

        return getattr(experiments_sched, f"section_{name}")(ctx)
    return run


SECTIONS.update({name: _sched_section(name) for name in ("overload", "enst_ablation", "alpha", "robustness")})


def update_doc(path: Path, parts: dict[str, str]) -> None:
    """Replace each part's section (from its '## ' heading to the next) in the doc, or append it."""
    text = path.read_text()
    for part in parts.values():
        heading = part.split("\n", 1)[0]
        start = text.find(heading + "\n")
        if start < 0:
            text = text.rstrip("\n") + "\n\n" + part.rstrip("\n") + "\n"
            continue
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + part.rstrip("\n") + "\n" + (text[end:] if end >= 0 else "")
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "experiments.md")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(FIGURES)}; prints the "
                                                 "sections and writes their figures, not the document")
    ap.add_argument("--sharegpt", type=Path, default=REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv")
    ap.add_argument("--alpaca", type=Path, default=REPO.parent / "shared" / "datasets" / "alpaca_lengths.csv")
    ap.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"], help="ShareGPT requests per run")
    ap.add_argument("--num-prompts-alpaca", type=int, default=DEFAULTS["num_prompts_alpaca"])
    ap.add_argument("--scales", default="opt-13b,opt-13b-80gb,opt-66b,opt-175b",
                    help=f"comma-separated of {','.join(SCALES)} for the SLO table ({MAIN}, the figures' scale, "
                         "is always run)")
    ap.add_argument("--bisect", type=int, default=3, help="bisection steps after the rate grid")
    ap.add_argument("--span", type=float, default=20.0, help="arrivals span at least this many seconds")
    ap.add_argument("--max-prompts", type=int, default=2000, help="cap on requests per simulated run")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=2000, help="requests per point of the long-trace search")
    ap.add_argument("--io-total", type=int, default=1024)
    ap.add_argument("--io-load", type=float, default=1.5)
    ap.add_argument("--io-prompts", type=int, default=120)
    ap.add_argument("--fig15-device-blocks", type=int, default=None, help="default: the profile's capacity")
    ap.add_argument("--no-live", action="store_true", help="skip the live measurements")
    ap.add_argument("--live-prompts", type=int, default=30, help="requests per rate in the live sweep")
    for ds, rates in LIVE_RATES.items():
        ap.add_argument(f"--live-rates-{ds.lower()}", default=rates, help="live sweep rates (req/s)")
    ap.add_argument("--live-max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overload-prompts", type=int, default=1500, help="requests per point of the overload, "
                    "ablation and alpha sections")
    ap.add_argument("--ablation-load", type=float, default=1.0, help="load of the ENST ablation (x capacity)")
    ap.add_argument("--update", action="store_true", help="with --only: replace those sections in --out")
    args = ap.parse_args(argv)
    args.scales = [MAIN] + [s for s in args.scales.split(",") if s != MAIN]
    if set(args.scales) - set(SCALES):
        ap.error(f"unknown scales {sorted(set(args.scales) - set(SCALES))}; choose from {list(SCALES)}")
    names = args.only.split(",") if args.only else [f for f in FIGURES if not (f.startswith("live") and args.no_live)]
    unknown = set(names) - set(FIGURES)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {FIGURES}")
    ctx = Ctx(args)
    t0 = time.perf_counter()
    parts = {}
    for name in ("slo", "fig1", "fig5", "fig8", "fig14", "fig15", "overload", "enst_ablation", "alpha", "robustness",
                 "live_slo", "live"):
        if name in names:
            t = time.perf_counter()
            print(f"== {name}", flush=True)
            parts[name] = SECTIONS[name](ctx)
            print(f"   {name}: {time.perf_counter() - t:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    if args.only:
        print("\n\n".join(parts.values()))
        if args.update:
            update_doc(args.out, parts)
            print(f"updated {', '.join(parts)} in {args.out}")
        return 0
    head = ["# Experiments: FastServe's figures, simulated and measured", "",
            "Generated by `make experiments` (`python scripts/experiments.py`); every number below comes from "
            f"that run ({ctx.sim_runs} simulations, {wall / 60:.1f} min on this 2-core shared machine). Do not "
            "edit by hand.", "",
            "What these are: the paper's experiments run through engine/simulation.py, which drives the real "
            "engine, scheduler and KV manager on a virtual clock with iteration costs from a job profile. The "
            "profiles for OPT-13B/66B/175B on A100s (profiles/sim/, scripts/make_sim_profiles.py) are "
            "**roofline estimates from datasheet numbers, not measurements**: we have no A100. Absolute numbers "
            "therefore differ from the paper's; the comparisons between policies on the same profile and trace "
            "are what these runs show. The live section measures the real engine on this CPU.", "",
            f"Settings shared by all runs unless a section says otherwise: seed {args.seed}, max_num_seqs "
            f"{args.max_num_seqs}, block size 16, float16 KV, starvation threshold 0.3 s, proactive KV policy.", ""]
    order = ("fig1", "fig5", "fig8", "fig14", "fig15", "slo", "overload", "enst_ablation", "alpha", "robustness",
             "live_slo", "live")
    args.out.write_text("\n".join(head) + "\n" + "\n".join(parts[k] for k in order if k in parts))
    print(f"wrote {args.out} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
