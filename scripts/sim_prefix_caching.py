"""Prefix caching in the simulator (issue 28's simulator goal): multi-turn ShareGPT chat on the OPT-13B A100-40GB
profile, measured as scripts/steady_state.py measures (the team's design notes, "How a comparison is measured").

    python scripts/sim_prefix_caching.py --seeds 3 --conversations 1100 --loads 0.8,1.0,1.5

- Workload: --conversations ShareGPT conversations per point (drawn with replacement from the 1,000 of
  ../shared/datasets/sharegpt, seeded; each turn's user and answer texts counted with OPT's GPT-2 BPE, once, into
  .cache/), opened at Poisson arrivals (conversations/s); each turn is sent with the whole history after the
  previous answer plus an exponential think time (5 s mean); a conversation ends before a turn that would not fit
  the 2,048-token context (engine/simulation.py, run_conversations).
- A point's metrics count the turns sent while conversations were arriving in the middle 80% of their arrival
  span; the served rate is the turns that finished in that window per second; the run lasts until every turn has
  finished.
- Capacity C (conversations/s) of a configuration: its served turn rate when offered more than it serves (the
  offered turn rate, conversations/s x turns per conversation, >= 1.3x served), divided by the run's turns per
  conversation. Measured for FCFS with and without prefix caching: the capacity gain from caching is their ratio.
- Then FCFS and skip-join MLFQ, caching on for both (and FCFS without caching, for reference), at --loads x C of
  FCFS with caching: mean and P95 per-token latency, mean TTFT, hit rate, served rate, with paired ratios per seed
  and whether the mean per-token latency meets the SLO (0.3 s/token, the paper's).

Runs go to a pool of --jobs worker processes and are cached on disk (.cache/sim-prefix/) by their parameters and
the simulation code's hash (steady_state.code_version), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from steady_state import WINDOW, code_version, fmt, ratio_stat, stat  # noqa: E402

PROFILE = REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"
SHAREGPT = REPO.parent / "shared" / "datasets" / "sharegpt" / "sharegpt_v3_random1000.json"
GPT2_BPE = REPO.parent / "shared" / "datasets" / "gpt2-bpe"
CACHE = REPO / ".cache" / "sim-prefix"
SLO_S = 0.3
THINK_S = 5.0
# (name, scheduling policy, prefix caching)
CONFIGS = {"fcfs-uncached": ("fcfs", False), "fcfs": ("fcfs", True), "skip-join": ("skip-join-mlfq", True)}


def conversation_lengths(dataset: Path = SHAREGPT, bpe: Path = GPT2_BPE) -> list[list[tuple[int, int]]]:
    """Every conversation of the dataset as (user, answer) token counts per turn (GPT-2 BPE), cached on disk."""
    key = hashlib.sha256(f"{dataset.resolve()}|{dataset.stat().st_size}".encode()).hexdigest()[:16]
    path = CACHE / f"lengths-{key}.json"
    if path.is_file():
        return [[tuple(t) for t in c] for c in json.loads(path.read_text())]
    from fastserve.bench.tokens import gpt2_bpe_counter
    from fastserve.bench.workload import read_sharegpt_conversations

    count = gpt2_bpe_counter(str(bpe)).count
    convs = [[(count(u), count(a)) for u, a in c.turns] for c in read_sharegpt_conversations(dataset)]
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(convs))
    return convs


def windowed(result, arrivals: list[float]) -> dict:
    first, last = arrivals[0], arrivals[-1]
    lo, hi = first + WINDOW[0] * (last - first), first + WINDOW[1] * (last - first)
    counted = [t for t in result.turns if lo <= t.output.metrics.arrival_time <= hi]
    per_token = sorted(t.output.metrics.e2e_s / max(1, len(t.output.outputs[0].token_ids)) for t in counted)
    ttft = [t.output.metrics.ttft_s for t in counted]
    prompt = sum(t.prompt_len for t in counted)
    s = result.summary()
    return {"counted": len(counted), "turns": s["turns"], "conversations": s["conversations"],
            "turns_per_conversation": s["turns"] / s["conversations"],
            "served_turn_rate": sum(1 for t in result.turns if lo <= t.output.metrics.finished_time <= hi) / (hi - lo),
            "mean_per_token_s": statistics.fmean(per_token),
            "p95_per_token_s": per_token[min(len(per_token) - 1, int(0.95 * len(per_token)))],
            "mean_ttft_s": statistics.fmean(ttft),
            "hit_rate": sum(t.cached_tokens for t in counted) / prompt if prompt else 0.0,
            "hit_rate_all": s["hit_rate"], "preemptions": s["preemptions"]}


def run_point(config: str, rate: float, seed: int, n: int) -> dict:
    from make_tiny_model import config_only_model

    from engine.simulation import run_conversations, simulated_engine
    from fastserve.bench.arrivals import gamma_arrivals

    policy, caching = CONFIGS[config]
    pool = conversation_lengths()
    rng = random.Random(seed)
    convs = [pool[rng.randrange(len(pool))] for _ in range(n)]
    arrivals = gamma_arrivals(n, rate, 1.0, seed)
    engine = simulated_engine(config_only_model("opt-13b"), PROFILE, scheduling_policy=policy,
                              enable_prefix_caching=caching)
    t = time.perf_counter()
    result = run_conversations(engine, convs, arrivals, think_time_s=THINK_S, seed=seed)
    return windowed(result, arrivals) | {"config": config, "rate": rate, "seed": seed,
                                         "wall_s": time.perf_counter() - t}


class Runner:
    def __init__(self, jobs: int, n: int) -> None:
        self.jobs, self.n, self.version, self.runs = jobs, n, code_version(), 0
        CACHE.mkdir(parents=True, exist_ok=True)

    def _path(self, config: str, rate: float, seed: int) -> Path:
        text = json.dumps([config, round(rate, 9), seed, self.n, THINK_S, self.version])
        return CACHE / (hashlib.sha256(text.encode()).hexdigest()[:24] + ".json")

    def many(self, points: list[tuple[str, float, int]]) -> list[dict]:
        out: dict[int, dict] = {}
        todo = []
        for i, p in enumerate(points):
            path = self._path(*p)
            if path.is_file():
                out[i] = json.loads(path.read_text())
            else:
                todo.append(i)
        if todo:
            conversation_lengths()  # counted once, before the workers read it
            from make_tiny_model import config_only_model

            config_only_model("opt-13b")
            with ProcessPoolExecutor(min(self.jobs, len(todo))) as pool:
                futures = {i: pool.submit(run_point, *points[i], self.n) for i in todo}
                for i, fut in futures.items():
                    out[i] = fut.result()
                    self._path(*points[i]).write_text(json.dumps(out[i]))
                    self.runs += 1
                    r = out[i]
                    print(f"  {r['config']:>14} {r['rate']:.4f} conv/s seed {r['seed']}: served "
                          f"{r['served_turn_rate']:.3f} turns/s, mean {r['mean_per_token_s']:.4f} s/token, TTFT "
                          f"{r['mean_ttft_s']:.3f} s, hit {r['hit_rate']:.1%} ({r['wall_s']:.0f} s)", flush=True)
        return [out[i] for i in range(len(points))]


def capacity(runner: Runner, config: str, seeds: range, start: float) -> dict:
    offered = start
    while True:
        res = runner.many([(config, offered, s) for s in seeds])
        served = statistics.fmean(r["served_turn_rate"] for r in res)
        per_conv = statistics.fmean(r["turns_per_conversation"] for r in res)
        if offered * per_conv >= 1.3 * served:
            return {"C": served / per_conv, "served_turn_rate": served, "turns_per_conversation": per_conv,
                    "offered": offered, "per_seed": [r["served_turn_rate"] / r["turns_per_conversation"]
                                                     for r in res]}
        offered = max(offered * 2, 1.5 * served / per_conv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=1100, help="per point (about 3,000 turns)")
    ap.add_argument("--loads", default="0.8,1.0,1.5", help="in units of FCFS's capacity with caching")
    ap.add_argument("--start-rate", type=float, default=2.0, help="conversations/s, the capacity search's first")
    ap.add_argument("--also-offer", type=float, default=None,
                    help="also run FCFS with and without caching at this offered conversation rate (e.g. just past "
                         "capacity) and report the served turn rates")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    runner = Runner(args.jobs, args.conversations)
    seeds = range(args.seeds)
    t0 = time.perf_counter()
    caps = {c: capacity(runner, c, seeds, args.start_rate) for c in ("fcfs-uncached", "fcfs")}
    for c, cap in caps.items():
        print(f"capacity {c}: C = {cap['C']:.4f} conversations/s ({cap['served_turn_rate']:.3f} turns/s served under "
              f"{cap['offered']:.3f} conversations/s; {cap['turns_per_conversation']:.2f} turns per conversation)",
              flush=True)
    gain = ratio_stat(caps["fcfs"]["per_seed"], caps["fcfs-uncached"]["per_seed"])
    cap = caps["fcfs"]["C"]
    loads = [float(x) for x in args.loads.split(",")]
    configs = list(CONFIGS)
    points = [(c, load * cap, s) for load in loads for c in configs for s in seeds]
    res = iter(runner.many(points))
    data = {(load, c): [next(res) for _ in seeds] for load in loads for c in configs}
    lines = [f"OPT-13B A100-40GB profile, multi-turn ShareGPT: {args.conversations} conversations per point, think "
             f"time {THINK_S:g} s (exponential), {args.seeds} seeds, turns sent in the middle 80% of the arrivals.",
             "",
             f"FCFS capacity without caching {fmt(stat(caps['fcfs-uncached']['per_seed']), 4)} conversations/s, with "
             f"caching {fmt(stat(caps['fcfs']['per_seed']), 4)}; gain with caching (paired per seed): {fmt(gain)}x.",
             "", "| load (x C cached FCFS) | config | mean s/token | P95 s/token | mean TTFT s | hit rate | "
             "served turns/s | meets 0.3 s/token |", "|---|---|---|---|---|---|---|---|"]
    for load in loads:
        for c in configs:
            d = data[(load, c)]
            m = stat([r["mean_per_token_s"] for r in d])
            lines.append(f"| {load:g}C | {c} | {fmt(m)} | {fmt(stat([r['p95_per_token_s'] for r in d]))} | "
                         f"{fmt(stat([r['mean_ttft_s'] for r in d]))} | "
                         f"{fmt(stat([100 * r['hit_rate'] for r in d]), 3, '%')} | "
                         f"{fmt(stat([r['served_turn_rate'] for r in d]), 4)} | "
                         f"{'yes' if m.mean <= SLO_S else 'no'} |")
    lines += ["", "Paired ratios per seed (mean ± 95% interval):", "",
              "| load | skip-join / FCFS mean s/token | skip-join / FCFS mean TTFT | "
              "FCFS cached / uncached mean s/token | FCFS cached / uncached mean TTFT |", "|---|---|---|---|---|"]
    for load in loads:
        sj, f, fu = data[(load, "skip-join")], data[(load, "fcfs")], data[(load, "fcfs-uncached")]
        col = lambda a, b, k: fmt(ratio_stat([r[k] for r in a], [r[k] for r in b]))  # noqa: E731
        lines.append(f"| {load:g}C | {col(sj, f, 'mean_per_token_s')} | {col(sj, f, 'mean_ttft_s')} | "
                     f"{col(f, fu, 'mean_per_token_s')} | {col(f, fu, 'mean_ttft_s')} |")
    if args.also_offer:
        r = runner.many([(c, args.also_offer, s) for c in ("fcfs-uncached", "fcfs") for s in seeds])
        un, ca = r[:len(seeds)], r[len(seeds):]
        lines += ["", f"Offered {args.also_offer:g} conversations/s ({args.also_offer / caps['fcfs']['C']:.2f}x C): "
                  f"FCFS served {fmt(stat([x['served_turn_rate'] for x in un]), 4)} turns/s without caching, "
                  f"{fmt(stat([x['served_turn_rate'] for x in ca]), 4)} with (hit rate "
                  f"{fmt(stat([100 * x['hit_rate'] for x in ca]), 3, '%')}); served with / without, paired: "
                  f"{fmt(ratio_stat([x['served_turn_rate'] for x in ca], [x['served_turn_rate'] for x in un]))}x; "
                  f"mean TTFT {fmt(stat([x['mean_ttft_s'] for x in un]))} s without, "
                  f"{fmt(stat([x['mean_ttft_s'] for x in ca]))} s with."]
    lines.append(f"\n{runner.runs} simulations run now, {time.perf_counter() - t0:.0f} s wall; simulation code "
                 f"version {runner.version}")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"capacity": caps, "data": {f"{k[0]}|{k[1]}": v for k, v in data.items()}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
