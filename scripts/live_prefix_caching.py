"""Prefix caching live (issue 28's live goal): multi-turn ShareGPT chat against real servers (server.py, the built-in
tiny model) over loopback HTTP, the load generator's multi-turn replay (`fastserve bench serve --multi-turn`), caching
on against --no-enable-prefix-caching at 0.8x of the uncached server's capacity.

    python scripts/live_prefix_caching.py --seeds 3 --num-prompts 120
    python scripts/live_prefix_caching.py --tokenizer word ...   # answers that come back token for token

- The model: the built-in tiny model has random weights, and its greedy answers do not survive the next turn's
  decode -> encode (random byte-level BPE tokens re-merge, stray bytes become U+FFFD), so with it only the
  previous turns' prompts can hit, never the answers; a trained model's text does round-trip. --tokenizer word
  serves the same model shape with a word-level tokenizer whose random answers round-trip, which is what a
  deployed model's cache sees. The summary says which one ran.

- Steady state: a run sends max(--num-prompts, rate x --min-span) conversations, so that new conversations
  arrive for at least --min-span seconds (default 120 s, several conversation lifetimes: 3-4 turns, each after
  the answer and a 5 s think time). With fewer, the window is the ramp-up: few conversations have sent their
  later turns by then, and the server seems to serve only what arrived (session 18: 60 conversations at 2/s
  read a capacity of 2.90 turns/s; 120 at 4/s served 5.31).
- Capacity C (conversations/s): the uncached server's served rate of turns (turns that finished while new
  conversations were arriving in the middle 80% of their arrival span, per second of that window) when offered
  more than it serves (the offered turn rate, conversations/s x turns per conversation, >= 1.3x served), divided
  by the turns per conversation of that run: the conversation rate whose turns it serves.
- Per seed, at --load x C, the cached and the uncached server on the same conversations and arrivals (the seed
  draws both; the two alternate seed by seed, the uncached first in even seeds): the share of prompt tokens
  computed (1 - cached / sent, from usage.prompt_tokens_details.cached_tokens over every turn), mean TTFT over the
  turns sent in the window, the served turn rate, and paired TTFT ratios (uncached / cached) with a 95% interval.

Goals: tokens computed <= 40% of those sent, mean TTFT >= 3x lower cached. Everything after `--` goes to both
servers (default: nothing, the server's own KV size). Each server runs with --server-threads torch threads so the
load generator keeps a core. Results (every load generator JSON and a summary) go to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from server_process import ServerProcess  # scripts/ is this script's folder
from steady_state import WINDOW, stat

REPO = Path(__file__).resolve().parents[1]
SIDES = {"uncached": "--no-enable-prefix-caching", "cached": "--enable-prefix-caching"}
GOAL_COMPUTED, GOAL_TTFT = 0.40, 3.0


def conversations_for(rate: float, num_prompts: int, min_span: float) -> int:
    """Conversations a run at `rate` conversations/s sends: enough that they arrive for min_span seconds."""
    return max(num_prompts, math.ceil(rate * min_span))


def window_metrics(result: dict, arrivals_span: tuple[float, float]) -> dict:
    """Turns sent (start time) in the middle 80% of the conversations' arrival span count for TTFT; the served
    rate counts turns that finished in that window."""
    starts, e2e, ttft, outs = result["start_times"], result["e2els"], result["ttfts"], result["output_lens"]
    first, last = arrivals_span
    lo, hi = first + WINDOW[0] * (last - first), first + WINDOW[1] * (last - first)
    done = [i for i, n in enumerate(outs) if n > 0]
    counted = [i for i in done if lo <= starts[i] <= hi]
    mt = result["multi_turn"]
    prompt, cached = mt["prompt_tokens"], mt["cached_tokens"]
    return {"turns": mt["turns_ok"], "conversations": mt["conversations"],
            "turns_per_conversation": mt["turns_ok"] / mt["conversations"],
            "counted": len(counted), "failed": mt["turns"] - mt["turns_ok"],
            "served_turn_rate": sum(1 for i in done if lo <= starts[i] + e2e[i] <= hi) / (hi - lo),
            "started_turn_rate": len([i for i in done if lo <= starts[i] <= hi]) / (hi - lo),
            "mean_ttft_s": statistics.fmean(ttft[i] for i in counted) if counted else float("nan"),
            "mean_per_token_s": statistics.fmean(e2e[i] / outs[i] for i in counted) if counted else float("nan"),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_share": 1 - cached / prompt if prompt else float("nan")}


class Live:
    def __init__(self, args: argparse.Namespace, server_args: list[str]) -> None:
        self.args, self.server_args = args, server_args
        self.servers: dict[str, ServerProcess] = {}

    def server(self, side: str) -> ServerProcess:
        if side not in self.servers:
            threads = str(self.args.server_threads)
            env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
            self.servers[side] = ServerProcess([SIDES[side], *self.server_args], self.args.result_dir, name=side,
                                               env=env).wait_ready(timeout=900)
        return self.servers[side]

    def run(self, side: str, rate: float, seed: int) -> dict:
        n = conversations_for(rate, self.args.num_prompts, self.args.min_span)
        out = self.args.result_dir / f"{side}-rate{rate:.4f}-n{n}-seed{seed}.json"
        if not out.exists():
            cmd = [sys.executable, "-m", "fastserve.bench.loadgen", "--base-url", self.server(side).url,
                   "--multi-turn", "--dataset-name", "sharegpt", "--dataset-path", str(self.args.dataset_path),
                   "--num-prompts", str(n), "--request-rate", f"{rate:.6f}", "--seed", str(seed),
                   "--think-time", str(self.args.think_time), "--ignore-eos", "--label", side, "--disable-tqdm",
                   "--save-result", "--result-dir", str(self.args.result_dir), "--result-filename", out.name]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if not out.exists():
                raise RuntimeError(f"loadgen failed for {side} at {rate} (rc {proc.returncode}): {proc.stderr[-800:]}")
        from fastserve.bench.arrivals import gamma_arrivals

        arrivals = gamma_arrivals(n, rate, 1.0, seed)  # the load generator's own arrivals
        return window_metrics(json.loads(out.read_text()), (arrivals[0], arrivals[-1]))

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=120, help="conversations per run, at least")
    ap.add_argument("--min-span", type=float, default=120.0,
                    help="seconds over which new conversations arrive, at least (steady state; default %(default)s)")
    ap.add_argument("--load", type=float, default=0.8, help="in units of the uncached server's capacity")
    ap.add_argument("--start-rate", type=float, default=2.0, help="first offered conversation rate of the search")
    ap.add_argument("--capacity", type=float, default=None, help="skip the search: C in conversations/s")
    ap.add_argument("--think-time", type=float, default=5.0)
    ap.add_argument("--dataset-path", type=Path,
                    default=REPO.parent / "shared" / "datasets" / "sharegpt" / "sharegpt_v3_random1000.json")
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--tokenizer", default="bpe", choices=["bpe", "word"],
                    help="bpe: the built-in tiny model; word: the same model with a word-level tokenizer "
                         "(models/tiny-opt-word, built if missing), whose random answers survive the next turn's "
                         "decode -> encode as a trained model's text does, so a previous answer can hit the cache")
    ap.add_argument("--result-dir", type=Path, default=Path("results/live-prefix-caching"))
    args = ap.parse_args(argv[:split])
    server_args = argv[split + 1:]
    if args.tokenizer == "word":
        from modelmaker.tiny_model import ensure_tiny_model

        server_args = ["--model", str(ensure_tiny_model(tokenizer="word")), *server_args]
    args.result_dir.mkdir(parents=True, exist_ok=True)
    live = Live(args, server_args)
    t0 = time.perf_counter()
    search = []
    try:
        if args.capacity is None:
            offered = args.start_rate
            while True:
                m = live.run("uncached", offered, 0)
                demand = offered * m["turns_per_conversation"]
                search.append({"offered_conversations_s": offered, **m})
                print(f"capacity search: {offered:.3f} conversations/s ({demand:.2f} turns/s asked), uncached "
                      f"served {m['served_turn_rate']:.3f} turns/s, {m['turns_per_conversation']:.2f} turns per "
                      f"conversation", flush=True)
                if demand >= 1.3 * m["served_turn_rate"]:
                    break
                offered = max(offered * 2, 1.5 * m["served_turn_rate"] / m["turns_per_conversation"])
            cap = m["served_turn_rate"] / m["turns_per_conversation"]
        else:
            cap = args.capacity
        rate = args.load * cap
        data: dict[str, list[dict]] = {s: [] for s in SIDES}
        for seed in range(args.seeds):
            for side in (("uncached", "cached") if seed % 2 == 0 else ("cached", "uncached")):
                data[side].append(live.run(side, rate, seed))
                d = data[side][-1]
                print(f"  seed {seed} {side}: computed {d['computed_share']:.1%} of prompt tokens, mean TTFT "
                      f"{d['mean_ttft_s'] * 1e3:.1f} ms, served {d['served_turn_rate']:.3f} turns/s", flush=True)
    finally:
        live.stop()
    lines = [f"model: tiny ({args.tokenizer} tokenizer); uncached capacity C = {cap:.4f} conversations/s; "
             f"runs at {args.load:g}C = {rate:.4f} conversations/s, "
             f"{conversations_for(rate, args.num_prompts, args.min_span)} conversations a run, "
             f"think time {args.think_time:g} s (exponential), {args.seeds} seeds, "
             f"turns sent in the middle 80% of the arrivals",
             f"{'side':>9} {'computed share':>16} {'mean TTFT ms':>18} {'mean s/token':>18} {'served turns/s':>18} "
             f"{'turns':>6} {'failed':>6}"]
    for side in SIDES:
        c, t, p, s = (stat([d[k] for d in data[side]]) for k in ("computed_share", "mean_ttft_s", "mean_per_token_s",
                                                                 "served_turn_rate"))
        lines.append(f"{side:>9} {c.mean:>9.1%} ± {c.half:<5.1%} {t.mean * 1e3:>9.1f} ± {t.half * 1e3:<6.1f} "
                     f"{p.mean:>9.4f} ± {p.half:<6.4f} {s.mean:>9.3f} ± {s.half:<6.3f} "
                     f"{sum(d['turns'] for d in data[side]):>6} {sum(d['failed'] for d in data[side]):>6}")
    ratio = stat([u["mean_ttft_s"] / c["mean_ttft_s"] for u, c in zip(data["uncached"], data["cached"])])
    computed = stat([d["computed_share"] for d in data["cached"]])
    lines.append(f"mean TTFT uncached / cached, paired per seed: {ratio.mean:.2f} ± {ratio.half:.2f}x "
                 f"(goal >= {GOAL_TTFT:g}x: {'met' if ratio.mean >= GOAL_TTFT else 'NOT met'}); cached server "
                 f"computed {computed.mean:.1%} of the prompt tokens sent (goal <= {GOAL_COMPUTED:.0%}: "
                 f"{'met' if computed.mean <= GOAL_COMPUTED else 'NOT met'})")
    lines.append(f"{time.perf_counter() - t0:.0f} s wall")
    print("\n".join(lines))
    (args.result_dir / "summary.json").write_text(json.dumps(
        {"capacity_conversations_s": cap, "rate": rate, "tokenizer": args.tokenizer, "seeds": args.seeds,
         "num_prompts": args.num_prompts, "min_span": args.min_span,
         "think_time": args.think_time, "server_args": server_args, "search": search, "data": data,
         "ttft_ratio": ratio.values, "computed_share": computed.values}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
