"""`fastserve make-model`: write random-weight OPT checkpoints in Hugging Face layout (and config-only
Llama-3 directories for the simulator).

    fastserve make-model --out models/tiny-opt               # the built-in tiny model
    fastserve make-model --tokenizer word --out models/tiny-opt-word   # its word-level twin
    fastserve make-model --shape opt-125m --out models/opt-125m-random
    fastserve make-model --shape opt-66b --out models/opt-66b-config   # config only
    fastserve make-model --shape llama-3-8b --out models/llama-3-8b-config   # config only

Deterministic: the same bytes on every machine. opt-125m, opt-350m and
opt-1.3b get weights (fp32 on disk unless --dtype); larger shapes get a
config.json only (for the profiler and simulator), unless --weights is given.
The Llama-3 shapes (llama-3-8b, llama-3-70b: Meta's config.json, grouped-query
attention with 8 KV heads) are config only the same way. Every checkpoint
carries the tiny model's tokenizer (its ids are a subset of either vocabulary;
real checkpoints bring their own).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL_DIR
from modelmaker.llama_checkpoint import LLAMA_SHAPES, llama_config, write_llama_checkpoint
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config, write_opt_checkpoint
from modelmaker.tiny_model import MODEL_DIRS, build_tiny_model, ensure_tiny_model

WEIGHTS_BY_DEFAULT = {"opt-125m", "opt-350m", "opt-1.3b"}
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
MODELS_DIR = DEFAULT_MODEL_DIR.parent  # where the built-in tiny model is: the checkout's models/ by default
SHAPES = (*OPT_SHAPES, *LLAMA_SHAPES)  # the shape names a config-only directory can be written for


def config_only_model(shape: str) -> Path:
    """MODELS_DIR/<shape>-config (config.json + the tiny tokenizer, no weights): what the simulator and the
    experiments need for a large OPT or a Llama-3; written on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    out = MODELS_DIR / f"{shape}-config"
    if not (out / "config.json").is_file():
        write_checkpoint(shape, out, with_weights=False)
    return out


def write_checkpoint(shape: str, out: Path, with_weights: bool, weight_format: str = "safetensors",
                     dtype: str = "float32", seed: int = 0) -> None:
    """An OPT or Llama-3 checkpoint of `shape` (weights or config only) carrying the tiny model's tokenizer."""
    fmt = weight_format if with_weights else "none"
    if shape in LLAMA_SHAPES:
        write_llama_checkpoint(out, llama_config(**LLAMA_SHAPES[shape]), seed=seed, weight_format=fmt,
                               dtype=getattr(torch, dtype))
    else:
        write_opt_checkpoint(out, opt_config(**OPT_SHAPES[shape]), seed=seed, weight_format=fmt,
                             dtype=getattr(torch, dtype))
    tiny = ensure_tiny_model()
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copyfile(tiny / name, out / name)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES], help="model shape (default: tiny)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: models/<shape>)")
    ap.add_argument("--format", default="safetensors", choices=["safetensors", "sharded", "bin"],
                    help="weight file layout")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--weights", action="store_true", help="write weights even for shapes above opt-1.3b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="bpe", choices=["bpe", "word"],
                    help="the tiny model's tokenizer: byte-level BPE (the built-in model's) or word-level, whose "
                         "random outputs survive decode -> encode (for multi-turn prefix caching benchmarks)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing directory")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    if args.tokenizer != "bpe" and args.shape != "tiny":
        ap.error("--tokenizer applies to --shape tiny only (other shapes carry the built-in model's tokenizer)")
    out = args.out or (MODEL_DIRS[args.tokenizer] if args.shape == "tiny" else Path("models") / f"{args.shape}-random")
    if (out / "config.json").exists():
        if not args.force:
            print(f"{out} already exists (use --force to rewrite it)")
            return 0
        shutil.rmtree(out)
    if args.shape == "tiny":
        build_tiny_model(out, args.tokenizer)
        print(f"wrote the tiny model ({args.tokenizer} tokenizer) to {out}")
        return 0
    with_weights = args.shape in WEIGHTS_BY_DEFAULT or args.weights
    write_checkpoint(args.shape, out, with_weights, args.format, args.dtype, args.seed)
    what = "weights" if with_weights else "config only"
    print(f"wrote {args.shape} ({what}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
