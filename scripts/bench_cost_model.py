"""Check the cost model against the live engine: predicted vs measured times of mixed iterations.

    python scripts/bench_cost_model.py                     # the built-in tiny model, 300 mixed steps
    python scripts/bench_cost_model.py --model DIR --steps 200 --threads 2 --seed 1

It profiles the model on this machine (engine/job_profiler.py: t_init, t_dec and the forward table F),
then times `--steps` random iterations as the engine runs them (LocalExecutor.execute of one ModelBatch):
each prefills 0-6 prompts of ShareGPT-like lengths (log-uniform 4-1024 tokens) and decodes one token for
0-64 sequences of contexts 16-1024 (at least two parts per step, at least one prompt in most). For each it
prints nothing; at the end it prints the median and P90 absolute error of two predictions:

- "engine": ProfiledCostModel.batch_cost, one pass over the weights for all the iteration's tokens plus each
  part's attention (scheduler/cost_model.py), the model the scheduler and the simulator use;
- "per-prompt": the old rule, the sum of every prompt's t_init plus a decode step, as if each prompt read
  all the weights alone.

Exit 1 if the engine model's median absolute error exceeds --max-median-error (default 15%).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.simulation import quantile  # noqa: E402  (the project's one quantile rule)


def random_step(rng: random.Random, max_len: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, decode contexts) of one mixed iteration."""
    while True:
        k = rng.choice([0, 1, 1, 2, 2, 3, 4, 6])
        b = rng.choice([0, 1, 4, 8, 16, 32, 64])
        if k + b >= 2 and (k or b):
            break
    prompts = [min(max_len, int(math.exp(rng.uniform(math.log(4), math.log(1024))))) for _ in range(k)]
    contexts = [rng.randint(16, min(1024, max_len)) for _ in range(b)]
    return prompts, contexts


def per_prompt_cost(cost, prompts: list[int], contexts: list[int]) -> float:
    t = sum(cost.t_init(p) for p in prompts)
    if contexts:
        t += cost.t_dec(len(contexts), sum(contexts) // len(contexts))
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an OPT directory (default: the built-in tiny model)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per step (the median is kept)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-median-error", type=float, default=0.15)
    ap.add_argument("--json", type=Path, help="write every (prompts, contexts, measured, predicted) here")
    args = ap.parse_args(argv)

    import torch

    from engine.executor.local import LocalExecutor
    from engine.job_profiler import FULL_GRID, measure_mixed, profile_executor, profile_key
    from engine.model.config import OPTConfig
    from modelmaker.tiny_model import ensure_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_tiny_model()
    cfg = OPTConfig.from_model_dir(model_dir)
    executor = LocalExecutor(model_dir, cfg, dtype="auto", device="cpu", block_size=16,
                             num_gpu_blocks_override=4096)
    key = profile_key(cfg.name, executor.dtype, executor.device)
    t0 = time.perf_counter()
    grid = FULL_GRID.clipped(min(cfg.max_position_embeddings, 2048))
    cost = profile_executor(executor, cfg.vocab_size, key, grid)
    print(f"profiled {cfg.name} in {time.perf_counter() - t0:.0f} s ({torch.get_num_threads()} threads, "
          f"pid {os.getpid()})", flush=True)
    rng = random.Random(args.seed)
    rows = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        prompts, contexts = random_step(rng, cfg.max_position_embeddings - 1)
        measured = measure_mixed(executor, cfg.vocab_size, prompts, contexts, args.repeats, 1, seed=i)
        rows.append({"prompts": prompts, "contexts": contexts, "measured_s": measured,
                     "engine_s": cost.batch_cost(prompts, contexts),
                     "per_prompt_s": per_prompt_cost(cost, prompts, contexts)})
    print(f"timed {args.steps} mixed steps in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for name in ("engine", "per_prompt"):
        errs = sorted(abs(r[f"{name}_s"] / r["measured_s"] - 1) for r in rows)
        signed = statistics.median(r[f"{name}_s"] / r["measured_s"] - 1 for r in rows)
        out[name] = {"median_abs_error": statistics.median(errs), "p90_abs_error": quantile(errs, 0.9),
                     "median_signed_error": signed}
        print(f"{name:>11}: median |error| {out[name]['median_abs_error']:6.1%}, P90 {out[name]['p90_abs_error']:6.1%},"
              f" median signed {signed:+6.1%}")
    multi = [r for r in rows if len(r["prompts"]) >= 2]
    if multi:
        for name in ("engine", "per_prompt"):
            med = statistics.median(abs(r[f"{name}_s"] / r["measured_s"] - 1) for r in multi)
            print(f"{name:>11}: median |error| {med:6.1%} over the {len(multi)} steps with 2+ prompts")
    if args.json:
        args.json.write_text(json.dumps({"summary": out, "rows": rows}, indent=1) + "\n")
    ok = out["engine"]["median_abs_error"] <= args.max_median_error
    print(("OK" if ok else "FAIL") + f": the engine model's median |error| vs {args.max_median_error:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
