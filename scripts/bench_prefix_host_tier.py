"""The host tier's worth for prefix caching (issue 28's goal): multi-turn ShareGPT live on the tiny model with
device KV for about 8 full contexts, the prefix-cache hit rate and mean TTFT with the host tier caching evicted
blocks (--prefix-caching-host-tier, the default) against device-only eviction (--no-prefix-caching-host-tier).

    python scripts/bench_prefix_host_tier.py                        # 2 seeds, the sides alternating
    python scripts/bench_prefix_host_tier.py --seeds 0 1 2 --conversations 40 --rate 0.5
    python scripts/bench_prefix_host_tier.py --tokenizer word      # the tiny model whose answers round-trip

For each seed, both sides run in turn (which goes first alternates seed by seed, since other processes' load on
the machine changes over time), each on a fresh server (server.py: the built-in tiny model, --profile analytic,
--enable-prefix-caching, --max-model-len L, --num-gpu-blocks-override = 8 contexts of L tokens,
--num-host-blocks-override H) replayed by `fastserve bench serve --multi-turn` (ShareGPT conversations arriving
by Poisson at --rate conversations/s, every user turn sent with the whole history after the previous answer plus
an exponential think time of --think-time s mean). The same seed gives both sides the same conversations, arrival
times and think times. Per seed: the hit rate (cached / prompt tokens over every turn, from the responses'
usage.prompt_tokens_details.cached_tokens) and mean TTFT of each side, and their ratios; then the median and range
over seeds. Goal: hit rate with the host tier >= 1.5x without, and mean TTFT lower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from server_process import ServerProcess  # noqa: E402

from modelmaker.tiny_model import ensure_tiny_model  # noqa: E402

DATASET = REPO.parent / "shared" / "datasets" / "sharegpt" / "sharegpt_v3_random1000.json"
SIDES = {"host tier": [], "device only": ["--no-prefix-caching-host-tier"]}
GOAL_HIT_RATIO = 1.5


def run_side(side: str, seed: int, args, tmp: Path) -> dict:
    device_blocks = 8 * args.max_model_len // 16
    flags = ["--profile", "analytic", "--device", "cpu", "--enable-prefix-caching",
             "--max-model-len", str(args.max_model_len), "--num-gpu-blocks-override", str(device_blocks),
             "--num-host-blocks-override", str(args.host_blocks), *SIDES[side]]
    if args.tokenizer == "word":
        flags += ["--model", str(ensure_tiny_model(tokenizer="word"))]
    name = f"{side.replace(' ', '-')}-{seed}"
    server = ServerProcess(flags, tmp, name=name).wait_ready(timeout=600)  # (slow to start on a busy machine)
    try:
        out = tmp / f"{name}.json"
        cmd = [sys.executable, "-m", "fastserve", "bench", "serve", "--base-url", server.url, "--multi-turn",
               "--dataset-name", "sharegpt", "--dataset-path", str(args.dataset), "--num-prompts",
               str(args.conversations), "--request-rate", str(args.rate), "--think-time", str(args.think_time),
               "--seed", str(seed), "--max-model-len", str(args.max_model_len), "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp), "--result-filename", out.name, "--label", name]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
        result = json.loads(out.read_text())
    finally:
        server.stop()
    mt = result["multi_turn"]
    return {"side": side, "seed": seed, "hit_rate": mt["prefix_cache_hit_rate"], "mean_ttft_ms": result["mean_ttft_ms"],
            "turns_ok": mt["turns_ok"], "turns": mt["turns"], "prompt_tokens": mt["prompt_tokens"],
            "cached_tokens": mt["cached_tokens"], "duration_s": result.get("duration"),
            "by_turn": {k: (v["prefix_cache_hit_rate"], v["mean_ttft_ms"]) for k, v in mt["by_turn"].items()}}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f} .. {max(values):.2f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--conversations", type=int, default=80)
    p.add_argument("--rate", type=float, default=1.0, help="new conversations per second")
    p.add_argument("--think-time", type=float, default=5.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--host-blocks", type=int, default=4096)
    p.add_argument("--dataset", type=Path, default=DATASET)
    p.add_argument("--tokenizer", default="bpe", choices=["bpe", "word"],
                   help="bpe: the built-in tiny model; word: its word-level twin, whose random answers survive the "
                        "next turn's decode -> encode (scripts/live_prefix_caching.py says why)")
    p.add_argument("--json", type=Path, help="also write every run's numbers here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(args.seeds):
            order = list(SIDES) if i % 2 == 0 else list(SIDES)[::-1]
            for side in order:
                r = run_side(side, seed, args, Path(tmp))
                rows.append(r)
                print(f"seed {seed} {side:>11}: hit rate {r['hit_rate']:.1%}, mean TTFT {r['mean_ttft_ms']:.1f} ms, "
                      f"turns {r['turns_ok']}/{r['turns']}, by turn {r['by_turn']}", flush=True)
    hit_ratios, ttft_ratios = [], []
    print(f"\n{'seed':>4} {'hit host':>9} {'hit dev':>8} {'ratio':>6} {'TTFT host ms':>13} {'TTFT dev ms':>12} "
          f"{'dev/host':>8}")
    for seed in args.seeds:
        h = next(r for r in rows if r["seed"] == seed and r["side"] == "host tier")
        d = next(r for r in rows if r["seed"] == seed and r["side"] == "device only")
        hr, tr = h["hit_rate"] / d["hit_rate"], d["mean_ttft_ms"] / h["mean_ttft_ms"]
        hit_ratios.append(hr)
        ttft_ratios.append(tr)
        print(f"{seed:>4} {h['hit_rate']:>9.1%} {d['hit_rate']:>8.1%} {hr:>6.2f} {h['mean_ttft_ms']:>13.1f} "
              f"{d['mean_ttft_ms']:>12.1f} {tr:>8.2f}")
    print(f"\nhit rate, host tier / device only: {spread(hit_ratios)} (goal >= {GOAL_HIT_RATIO}: "
          f"{'met' if min(hit_ratios) >= GOAL_HIT_RATIO else 'not met'} at every seed)")
    print(f"mean TTFT, device only / host tier: {spread(ttft_ratios)} (goal > 1: "
          f"{'met' if min(ttft_ratios) > 1 else 'not met'} at every seed)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                         "hit_ratios": hit_ratios, "ttft_ratios": ttft_ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
