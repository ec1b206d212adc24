"""K/V bytes one layer's Triton decode attention reads from the paged cache, per model shape, without a GPU.

    .venv/bin/python -m scripts.decode_kv_traffic [--batch 32] [--context 512] [--dtype float16]

For a batch of decode rows of one context length: the bytes the decode split kernel reads as launched (one
program a KV head and split, the group's query heads its rows: fastserve_kernels/triton_attention.py
decode_kv_bytes) and as the same kernel reads them launched one program a query head (group_tile=1), and their
ratio. Counted from the launch grid and the tile loads (each program reads the K and V of every context token of
its split once), not measured on a device; tests/triton_interpreter_cases.py checks the count against the bytes
the interpreted kernel loads."""

from __future__ import annotations

import argparse

import torch

# name: (query heads, KV heads, head dim), from each model's config.json.
SHAPES = {
    "opt-13b": (40, 40, 128),
    "llama-3-8b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "smollm2-135m": (9, 3, 64),
    "smollm2-360m": (15, 5, 64),
    "falcon-7b": (71, 1, 64),
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def rows(batch: int, context: int, dtype: torch.dtype) -> list[tuple[str, int, int, int, int, float]]:
    """(shape, H, Hkv, bytes read one program a KV head, bytes one program a query head, ratio) per shape."""
    from fastserve_kernels.triton_attention import decode_kv_bytes

    out = []
    for name, (h, h_kv, d) in SHAPES.items():
        grouped = decode_kv_bytes([context] * batch, h, h_kv, d, dtype)
        per_head = decode_kv_bytes([context] * batch, h, h_kv, d, dtype, group_tile=1)
        out.append((name, h, h_kv, grouped, per_head, per_head / grouped))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="decode rows (default 32)")
    parser.add_argument("--context", type=int, default=512, help="tokens of each row's context (default 512)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    args = parser.parse_args()
    if args.batch < 1 or args.context < 1:
        parser.error("--batch and --context must be at least 1")
    print(f"one layer, {args.batch} decode rows x {args.context} tokens of context, {args.dtype}")
    print("| shape | H | Hkv | MB read, a program a KV head | MB read, a program a query head | ratio |")
    print("|---|---|---|---|---|---|")
    for name, h, h_kv, grouped, per_head, ratio in rows(args.batch, args.context, DTYPES[args.dtype]):
        print(f"| {name} | {h} | {h_kv} | {grouped / 1e6:.1f} | {per_head / 1e6:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
