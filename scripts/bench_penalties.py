"""Repetition / frequency / presence penalties: the batched version the sampler runs (apply_penalties) against
the per-row reference (apply_penalties_reference), same logits and sequences, same run. OPT's vocabulary
(50,272), 128 prompt and 128 output tokens a sequence, every penalty on; batches of 32 and 256 with all rows
penalised, and 256 with one in ten. Prints the median milliseconds of each and the speedup.

    python scripts/bench_penalties.py --threads 1
    python scripts/bench_penalties.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.batch import SequenceWork  # noqa: E402
from engine.logits_processors import apply_penalties, apply_penalties_reference  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 50272


def batch(rows: int, penalised: int, device: torch.device) -> tuple[torch.Tensor, list[SequenceWork]]:
    g = torch.Generator().manual_seed(rows + penalised)
    on = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.25)
    seqs = [SequenceWork("j", [0], 0, [0], on if i < penalised else SamplingParams(), None, 128,
                         prompt_token_ids=torch.randint(0, VOCAB, (128,), generator=g).tolist(),
                         output_token_ids=torch.randint(0, VOCAB, (128,), generator=g).tolist())
            for i in range(rows)]
    return torch.randn(rows, VOCAB, generator=g).to(device), seqs


def median_ms(fn, repeat: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"# penalties on {device}, vocabulary {VOCAB}, {torch.get_num_threads()} threads; median of {args.repeat}")
    for rows, penalised in ((32, 32), (256, 256), (256, 25)):
        logits, seqs = batch(rows, penalised, device)
        ref = median_ms(lambda: apply_penalties_reference(logits, seqs), args.repeat, device)  # noqa: B023
        new = median_ms(lambda: apply_penalties(logits, seqs), args.repeat, device)  # noqa: B023
        print(f"batch {rows:3d}, {penalised:3d} penalised: per-row {ref:8.2f} ms   batched {new:8.2f} ms   "
              f"speedup {ref / new:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
