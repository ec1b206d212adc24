"""What a tensor-parallel worker's decode step costs to prepare its inputs (issue 26): the eager path (a tensor
built from a Python list for each input, ModelRunner.prepare_eager) against the staged decode inputs (one host
buffer written through a numpy view, one copy; ModelRunner.use_staged_decode_inputs), interleaved.

    .venv/bin/python scripts/bench_tp_decode_inputs.py [--batch 32,256] [--context 512,2048] [--reps 200]
        [--rounds 5] [--device cpu|cuda]

Every rank of a TP group prepares the same inputs each step, so this is the per-step, per-rank cost. Runs
ModelRunner.prepare on a rank of a 2-way tensor-parallel OPT-13b-shaped stage built on the meta device (only its
config matters to prepare; nothing is computed) with blocks of 16, `batch` decode sequences at about `context`
tokens. Three paths: eager; staged, as the workers run it (one host buffer written through its numpy view and
one copy: on CUDA a pinned, non-blocking host-to-device copy, where the eager path's eight copies are synchronous
ones from pageable memory; on CPU a host-to-host copy); and, on CPU, the same buffers written in place from two
tensors built from the lists (stage=False). Prints, per round, the median microseconds a prepare of each path,
the ratio eager / staged, and the host copies counted (engine/host_copies.py); rounds alternate the order. --threads
(default 1) sets torch's intra-op threads: on a loaded CPU, a copy of 0.3 MB split over two threads waits ~16 ms
for the second one to be scheduled (measured here), which is the machine, not the path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.batch import ModelBatch, SequenceWork  # noqa: E402
from engine.host_copies import HostCopyCounter  # noqa: E402
from engine.model.config import OPTConfig  # noqa: E402
from engine.model.opt import OPTStage  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.parallel import ParallelLayout, TensorParallelGroup  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16
OPT_13B = dict(hidden_size=5120, num_attention_heads=40, num_hidden_layers=40, ffn_dim=20480, vocab_size=50272,
               max_position_embeddings=2048, word_embed_proj_dim=5120)


def runner(device: torch.device, path: str, max_num_seqs: int, num_blocks: int) -> ModelRunner:
    cfg = OPTConfig(**OPT_13B)
    with torch.device("meta"):
        stage = OPTStage(cfg, TensorParallelGroup(ParallelLayout(2, 1, 0, 0)))
    r = ModelRunner(stage, device, torch.float16 if device.type == "cuda" else torch.float32, BLOCK)
    r.kv_cache = torch.empty(num_blocks + 1, 1, device=device)  # prepare reads only the scratch block's id
    if path != "eager":
        r.use_staged_decode_inputs(max_num_seqs, cfg.max_position_embeddings,
                                   stage=path == "staged")
    return r


def decode_batch(batch: int, context: int) -> ModelBatch:
    params = SamplingParams(temperature=0)
    seqs, next_block = [], 0
    for i in range(batch):
        pos = context - batch // 2 + i  # lengths spread around `context`
        blocks = pos // BLOCK + 1
        seqs.append(SequenceWork(f"j{i}", [100 + i], pos, list(range(next_block, next_block + blocks)), params,
                                 None, 1))
        next_block += blocks
    return ModelBatch(seqs, None)


def time_prepare(r: ModelRunner, batch: ModelBatch, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        r.prepare(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="32,256")
    ap.add_argument("--context", default="512,2048")
    ap.add_argument("--reps", type=int, default=200, help="prepares a path per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = ["eager", "staged"] + (["inplace"] if device.type == "cpu" else [])
    print(f"| batch | context | round | {' | '.join(n + ' prepare (us)' for n in names)} | eager / staged | "
          f"copies: {', '.join(names)} |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    for b in (int(x) for x in args.batch.split(",")):
        for context in (int(x) for x in args.context.split(",")):
            batch = decode_batch(b, min(context, 2048 - b))
            num_blocks = sum(len(s.block_table) for s in batch.seqs)
            paths = {name: runner(device, name, b, num_blocks) for name in names}
            counts = {}
            for name, r in paths.items():
                with HostCopyCounter() as c:
                    inputs = r.prepare(batch)
                counts[name] = c.count
                assert (inputs.decode_bucket is not None) == (name != "eager")
            for rnd in range(args.rounds):
                order = names if rnd % 2 == 0 else names[::-1]
                us = {name: time_prepare(paths[name], batch, args.reps, device) * 1e6 for name in order}
                print(f"| {b} | {context} | {rnd} | {' | '.join(f'{us[n]:.0f}' for n in names)} | "
                      f"{us['eager'] / us['staged']:.2f}x | {', '.join(str(counts[n]) for n in names)} |", flush=True)


if __name__ == "__main__":
    main()
