"""What scripts/device_check.sh should measure on a GPU, computed from the model shapes: the HBM floor of a
decode step and the pinned host<->device copy time of a swap (docs/gpu.md lists them).

    .venv/bin/python -m scripts.device_expectations [--contexts 512,2048] [--batches 1,32] [--dtype float16]
        [--models opt-13b,opt-1.3b]

HBM floor of one decode step = (weight bytes + KV bytes read) / HBM bandwidth, the time it takes only to read
what the step must read once; a step cannot be faster, and the device check's bench_gpu reports each decode
step against the same floor with its measured copy bandwidth in place of the datasheet figure.
- weight bytes: every parameter of the model built on the meta device (engine/model/opt.py OPTStage, world size
  1) except the position table, of which a decode step reads a few rows (scripts/benchmarks/gpu.py weight_bytes_read);
  the tied lm head is the token embedding, read once.
- KV bytes read: batch x context x layers x 2 (K, V) x hidden x dtype bytes (every cached token's K and V, every
  layer; engine/kv_cache.kv_block_bytes per token).
- HBM bandwidth: the datasheets' figures, H100 SXM 3.35 TB/s, H200 4.8 TB/s and A100 80GB 2.0 TB/s (decimal:
  1 TB/s = 1e12 B/s). Achievable is ~85-92% of them (the H100 image's own copy test measured ~3.0 TB/s), so a
  step at 1.1-1.2x the floor is as good as it gets.
- Models: by default the shape the device check measures (scripts/benchmarks/gpu.py CUDA_SHAPE, OPT-13B); the
  check measures no other shape's floor, so the others are printed only when --models asks for them.
Pinned copies: PCIe Gen5 x16 carries 64 GB/s a direction raw, ~50 GB/s achievable with pinned memory (Gen4
x16, an A100 PCIe: ~25 GB/s); the table gives one KV block's and one 2,048-token sequence's copy at that rate.
"""

from __future__ import annotations

import argparse

import torch

from engine.kv_cache import kv_block_bytes
from engine.model.config import OPTConfig
from engine.model.opt import OPTStage
from engine.parallel import ParallelLayout, TensorParallelGroup
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config
from scripts.benchmarks.gpu import CUDA_SHAPE

MODELS = [CUDA_SHAPE]
HBM_TB_S = {"H100": 3.35, "H200": 4.8, "A100": 2.0}
PCIE_PINNED_GB_S = {"H100/H200 (PCIe Gen5 x16)": 50.0, "A100 (PCIe Gen4 x16)": 25.0}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def model_config(name: str) -> OPTConfig:
    return OPTConfig.from_dict(opt_config(**OPT_SHAPES[name]), name)


def weight_bytes(cfg: OPTConfig, dtype: torch.dtype) -> int:
    """Bytes a decode step reads of the weights: every parameter but the position table."""
    with torch.device("meta"):
        model = OPTStage(cfg, TensorParallelGroup(ParallelLayout()))
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_positions")) * \
        dtype.itemsize


def kv_bytes_per_token(cfg: OPTConfig, dtype: torch.dtype, block_size: int = 16) -> int:
    return kv_block_bytes(cfg, ParallelLayout(), block_size, dtype) // block_size


def rows(contexts: list[int], batches: list[int], dtype: torch.dtype, models: list[str] = MODELS) -> list[dict]:
    out = []
    for name in models:
        cfg = model_config(name)
        w, kv = weight_bytes(cfg, dtype), kv_bytes_per_token(cfg, dtype)
        for context in contexts:
            for batch in batches:
                read = w + batch * context * kv
                out.append(dict(model=name, context=context, batch=batch, weight_bytes=w,
                                kv_bytes=batch * context * kv, **{f"floor_ms_{gpu}": read / (tb * 1e12) * 1e3
                                                                  for gpu, tb in HBM_TB_S.items()}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048", help="tokens in each sequence's context (bench_gpu: 512)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtype", default="float16", choices=list(DTYPES))
    ap.add_argument("--models", default=",".join(MODELS), help=f"OPT shapes (default: {', '.join(MODELS)}, the one "
                    "the device check measures)")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    models = args.models.split(",")
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    gpus = list(HBM_TB_S)
    print(f"## HBM floor of a decode step, {args.dtype}: (weights + KV read) / bandwidth "
          f"({', '.join(f'{g} {tb} TB/s' for g, tb in HBM_TB_S.items())})\n")
    print("| model | context | batch | weights (GB) | KV read (GB) | " + " | ".join(f"floor {g} (ms)" for g in gpus)
          + " |")
    print("|---|---|---|---|---|" + "---|" * len(gpus))
    for r in rows(contexts, batches, dtype, models):
        print(f"| {r['model']} | {r['context']} | {r['batch']} | {r['weight_bytes'] / 1e9:.3f} | "
              f"{r['kv_bytes'] / 1e9:.3f} | " + " | ".join(f"{r[f'floor_ms_{g}']:.3f}" for g in gpus) + " |")
    print("\n## Pinned host <-> device copies (a swap), one direction\n")
    print("| model | KV bytes a token | a 16-token block | a 2,048-token sequence | "
          + " | ".join(f"the sequence at {g}: {bw:.0f} GB/s (ms)" for g, bw in PCIE_PINNED_GB_S.items()) + " |")
    print("|---|---|---|---|" + "---|" * len(PCIE_PINNED_GB_S))
    for name in models:
        kv = kv_bytes_per_token(model_config(name), dtype)
        seq = 2048 * kv
        print(f"| {name} | {kv / 1024:.0f} KiB | {16 * kv / 2**20:.2f} MiB | {seq / 2**20:.0f} MiB | "
              + " | ".join(f"{seq / (bw * 1e9) * 1e3:.1f}" for bw in PCIE_PINNED_GB_S.values()) + " |")


if __name__ == "__main__":
    main()
