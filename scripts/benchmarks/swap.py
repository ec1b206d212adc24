"""KV-policy benchmark: proactive vs reactive vs recompute on the live engine.

    python -m scripts.benchmarks.swap                 # tiny model, ShareGPT lengths, three rates
    python -m scripts.benchmarks.swap --rates 4,8 --num-prompts 40

Drives the engine's async API (no HTTP) with a Poisson trace of ShareGPT
lengths (fastserve/bench/workload.py), on a device KV tier sized so jobs must be
offloaded or dropped, under skip-join MLFQ. For each rate and kv-policy it
prints mean and P95 per-token latency (e2e / output tokens) and swap wait as a
share of end-to-end latency, then the ratios reactive/proactive and
recompute/proactive measured in the same run (paper: 1.7x and 2.7x at high
load). Last, the Swapper's achieved copy bandwidth against a plain copy of the
same bytes in the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.simulation import p95  # the project's one quantile rule
from fastserve.bench.workload import load_workload

REPO = Path(__file__).resolve().parents[2]

DEFAULT_LENGTHS = REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv"


async def drive(engine: Engine, items) -> list:
    aengine = AsyncEngine(engine)
    await aengine.start()
    loop = asyncio.get_running_loop()
    start = loop.time()
    vocab = engine.model_config.vocab_size

    async def one(i: int, item):
        await asyncio.sleep(max(0.0, start + item.arrival_s - loop.time()))
        prompt = [2] + [4 + (7 * i + k) % (vocab - 4) for k in range(item.prompt_len - 1)]
        params = SamplingParams(temperature=0, max_tokens=item.output_len, ignore_eos=True)
        last = None
        async for out in aengine.add_request(f"r{i}", prompt, params):
            last = out
        return last

    outs = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
    await aengine.shutdown()
    return outs


def run_policy(args, kv_policy: str, items) -> dict:
    engine = Engine(EngineConfig(model=args.model, scheduling_policy="skip-join-mlfq", kv_policy=kv_policy,
                                 block_size=args.block_size, num_gpu_blocks_override=args.device_blocks,
                                 num_host_blocks_override=args.host_blocks, max_num_seqs=args.max_num_seqs,
                                 profile=args.profile))
    t = time.perf_counter()
    outs = asyncio.run(drive(engine, items))
    wall = time.perf_counter() - t
    per_token = [o.metrics.e2e_s / len(o.outputs[0].token_ids) for o in outs]
    e2e = sum(o.metrics.e2e_s for o in outs)
    swap = sum(o.metrics.swap_wait_s for o in outs)
    st = engine.kv.stats
    return {"mean": statistics.mean(per_token), "p95": p95(per_token), "swap_share": swap / e2e, "wall": wall,
            "offloads": st.num_offloads, "uploads": st.num_uploads, "drops": st.num_drops,
            "recomputed": st.num_recomputed_tokens, "swapper": engine.executor.swapper}


def copy_bandwidth(swapper, blocks: int = 64) -> tuple[float, float]:
    """(Swapper offload+upload GB/s, plain tensor copy GB/s) for the same bytes."""
    from memory.transfers import Direction

    blocks = min(blocks, swapper.device_cache.shape[0], swapper.host_cache.shape[0])
    pairs = [(i, i) for i in range(blocks)]
    nbytes = blocks * swapper.block_bytes
    swapper.copy(Direction.OFFLOAD, pairs).wait()  # warm-up: first touch of the host pages
    t = time.perf_counter()
    for direction in (Direction.OFFLOAD, Direction.UPLOAD):
        swapper.copy(direction, pairs).wait()
    swap_s = time.perf_counter() - t
    src = swapper.device_cache[:blocks].clone()
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of fresh pages is not copy time
    t = time.perf_counter()
    dst.copy_(src)
    dst.copy_(src)
    plain_s = time.perf_counter() - t
    return 2 * nbytes / swap_s / 1e9, 2 * nbytes / plain_s / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--dataset-path", type=Path, default=DEFAULT_LENGTHS, help="a *_lengths.csv file")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--rates", default="2,6,12", help="Poisson arrival rates, requests/s")
    ap.add_argument("--max-len", type=int, default=96, help="cap on prompt and output lengths")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=48, help="device tier: small, to force swapping")
    ap.add_argument("--host-blocks", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--profile", default="analytic")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"# scripts.benchmarks.swap: {args.num_prompts} ShareGPT-length requests (capped at {args.max_len}), "
          f"{args.device_blocks} device blocks x {args.block_size} tokens, skip-join-mlfq")
    print(f"{'rate':>6} {'kv-policy':>10} {'mean s/tok':>11} {'p95 s/tok':>10} {'swap%':>6} "
          f"{'offl':>5} {'upl':>5} {'drops':>5} {'wall s':>7}")
    swapper = None
    for rate in (float(r) for r in args.rates.split(",")):
        items = load_workload("lengths", args.num_prompts, path=args.dataset_path, rate=rate, seed=args.seed)
        items = [it.__class__(min(args.max_len, max(2, it.prompt_len)), min(args.max_len, max(1, it.output_len)),
                              None, it.arrival_s) for it in items]
        res = {}
        for policy in ("proactive", "reactive", "recompute"):
            r = res[policy] = run_policy(args, policy, items)
            swapper = r["swapper"] or swapper
            print(f"{rate:6.1f} {policy:>10} {r['mean']:11.4f} {r['p95']:10.4f} {100 * r['swap_share']:6.2f} "
                  f"{r['offloads']:5d} {r['uploads']:5d} {r['drops']:5d} {r['wall']:7.1f}")
        pro = res["proactive"]
        for base in ("reactive", "recompute"):
            print(f"{'':6} {base}/proactive: mean {res[base]['mean'] / pro['mean']:.2f}x, "
                  f"p95 {res[base]['p95'] / pro['p95']:.2f}x")
    if swapper is not None:
        from engine.swapper import Swapper

        got, plain = copy_bandwidth(Swapper(swapper.device_cache, swapper.host_cache))
        print(f"\ncopy bandwidth: swapper {got:.2f} GB/s, plain copy of the same bytes {plain:.2f} GB/s "
              f"(ratio {got / plain:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
