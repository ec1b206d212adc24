"""`fastserve profile`, the job profiler: measure a model's iteration costs on this hardware
and write them as a job profile, which the engine's scheduler uses for
skip-join placement, quanta and ENST (FastServe section 4.1).

    fastserve profile                       # the built-in tiny model, full grid
    fastserve profile --model DIR --dtype float16 --device cuda
    fastserve profile --model SmolLM2-135M-Instruct --quick     # what `fastserve serve` serves with no model
    fastserve profile --model CONFIG_ONLY_DIR --load-format dummy   # a shape without its weights
    fastserve profile --quick --out /tmp/p.json

--model takes what `fastserve serve` does: a Hugging Face directory (OPT, Llama, Qwen2, Mistral), a GGUF file,
or a name (SmolLM2-135M-Instruct, tiny-opt; engine/model_names.py).

It loads the model into a LocalExecutor and times real ModelBatches
(engine/job_profiler.py): t_init(s), the first iteration of one prompt of s
tokens alone, over a grid of prompt lengths; t_dec(b, c), one decode step
of b sequences of context c, over batch sizes x context lengths; and F(n), one
iteration of n one-token sequences (the forward table that prices mixed
iterations, scheduler/cost_model.py). Each point is
the median of --repeats runs after --warmup untimed ones. Lengths past the
model's context are clipped to it.

Output: JSON in the schema "fastserve.profile/1" (scheduler/cost_model.py
documents every field):

    {"schema": "fastserve.profile/1",
     "key": {"model": "tiny-opt", "dtype": "float32", "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1, "hardware": "cpu: AMD EPYC"},
     "prefill": {"prompt_lens": [1, 16, ...], "seconds": [...]},
     "decode": {"batch_sizes": [1, 4, ...], "context_lens": [16, 128, ...],
                "seconds": [[...], ...]},                  # [batch_i][context_j]
     "forward": {"tokens": [1, 4, ...], "seconds": [...]}}

By default it is written to the profile folder (profiles/, or
$FASTSERVE_PROFILE_DIR) under a name made from the key, where the engine finds
it by key at start-up (engine/profiles.py, profiles/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine.config import LOAD_FORMATS
from engine.errors import CheckpointError
from engine.executor.local import LocalExecutor
from engine.job_profiler import FULL_GRID, QUICK_GRID, profile_executor, profile_key
from engine.model.registry import load_model_config
from engine.model_names import TINY_OPT, is_tiny_opt, model_path
from engine.profiles import profile_dir, profile_filename
from modelmaker.tiny_model import ensure_tiny_model


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help=f"a Hugging Face model directory, a GGUF file or a name (default: {TINY_OPT}, "
                                   "the built-in tiny model)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="auto: the model's weights; dummy: random weights from its config.json (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV blocks to allocate (default: the engine's memory budget)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds on the tiny model)")
    p.add_argument("--prompt-lens", type=_ints, help="comma-separated prompt lengths (overrides the grid's)")
    p.add_argument("--batch-sizes", type=_ints, help="comma-separated decode batch sizes")
    p.add_argument("--context-lens", type=_ints, help="comma-separated decode context lengths")
    p.add_argument("--forward-tokens", type=_ints, help="comma-separated token counts of the forward table F(n)")
    p.add_argument("--repeats", type=int, help="timed runs per point (the median is kept)")
    p.add_argument("--warmup", type=int, help="untimed runs per point first")
    p.add_argument("--out", type=Path, help="output file (default: the profile folder, named by key)")
    p.add_argument("--quiet", action="store_true", help="do not print each measurement")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    grid = QUICK_GRID if args.quick else FULL_GRID
    overrides = {"prompt_lens": args.prompt_lens, "batch_sizes": args.batch_sizes,
                 "context_lens": args.context_lens, "forward_tokens": args.forward_tokens, "repeats": args.repeats,
                 "warmup": args.warmup}
    grid = replace(grid, **{k: v for k, v in overrides.items() if v is not None})
    if grid.repeats < 1 or grid.warmup < 0:
        print(f"{parser.prog}: error: --repeats must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2

    try:
        model_dir = ensure_tiny_model() if is_tiny_opt(args.model) else model_path(args.model)
        cfg = load_model_config(model_dir)
        # the lengths the engine serves: the context, or a sliding window shorter than it (engine/model/llama_config.py)
        max_len = min(cfg.max_position_embeddings, getattr(cfg, "sliding_window", None) or cfg.max_position_embeddings)
        executor = LocalExecutor(model_dir, cfg, dtype=args.dtype, device=args.device, block_size=args.block_size,
                                 num_gpu_blocks_override=args.num_gpu_blocks_override, max_model_len=max_len,
                                 load_format=args.load_format)
    except (CheckpointError, OSError) as e:  # no such model or weights, an architecture not served, not installed
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    grid = grid.clipped(max_len)
    key = profile_key(cfg.name, executor.dtype, executor.device)
    print(f"profiling {key} ({len(grid.prompt_lens)} prompt lengths, "
          f"{len(grid.batch_sizes)}x{len(grid.context_lens)} decode points)", file=sys.stderr)
    start = time.perf_counter()
    cost = profile_executor(executor, cfg.vocab_size, key, grid,
                            progress=None if args.quiet else lambda msg: print("  " + msg, file=sys.stderr))
    out = args.out or profile_dir() / profile_filename(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in cost.to_dict().items())
                   + "\n}\n")
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
