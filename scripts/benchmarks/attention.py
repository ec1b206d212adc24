"""Attention over the paged KV cache: the Triton kernels against the plain-torch
reference, measured in the same run on the same inputs (CUDA only: on CPU the
kernels run under Triton's interpreter, which says nothing about speed).

Three cases at an OPT layer's shape (heads, head dim from --shape), one layer:
decode (a batch of sequences, one new token each, long contexts), prefill (fresh
prompts) and chunked prefill (new tokens after a cached prefix). Prints the
milliseconds of each and the speedup (reference time / triton time), and checks
that the two agree: the largest |triton - torch| of each case must be within
--tolerance (default: TOLERANCE of the dtype), else it says which cases are not
and exits 1 (the JSON says so too).

    python -m scripts.benchmarks.attention --shape opt-13b --dtype float16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fastserve_kernels import paged_attention as ref

SHAPES = {"opt-125m": (12, 64), "opt-1.3b": (32, 64), "opt-2.7b": (32, 80), "opt-13b": (40, 128)}
# Largest |triton - torch| allowed per dtype: both round their float16 outputs (an output near 1 is off by up to
# 2^-11 ~ 5e-4 each) after summing in different orders; tests/test_triton_kernels.py holds float16 to 5e-3 against
# a float32 reference. float32: both accumulate in float32 (the kernels' dots are IEEE, no TF32).
TOLERANCE = {"float16": 1e-2, "float32": 1e-4}


def build(seqs: list[tuple[int, int]], h: int, d: int, bs: int, dtype, device, seed: int = 0):
    """q, k, v, a block-major cache holding each sequence's cached tokens, and the metadata (as model_runner
    builds it) for seqs = (cached, new) per sequence, on shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // bs) for c, n in seqs]
    perm = torch.randperm(sum(blocks_needed), generator=g).tolist()
    kv = torch.randn(len(perm), 1, 2, h, bs, d, dtype=dtype, device=device)
    tables = [[perm.pop() for _ in range(nb)] for nb in blocks_needed]
    meta = ref.AttentionMetadata.for_sequences(seqs, tables, bs, device, ref.Workspace())
    t = sum(n for _, n in seqs)
    qkv = torch.randn(t, 3, h, d, dtype=dtype, device=device)  # [T, 3, H, D], as the fused projection gives
    q, k, v = qkv.unbind(1)
    return q, k, v, kv, meta


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def disagreements(cases: dict[str, dict], tolerance: float) -> list[str]:
    """The cases whose largest |triton - torch| is over the tolerance (or not a number)."""
    return [name for name, r in cases.items() if not r["max_abs_diff"] <= tolerance]


def report(cases: dict[str, dict], shape: str, dtype: str, tolerance: float, json_path: str | None) -> int:
    """Write the JSON (with the tolerance and whether every case kept to it); 0 if all did, else 1 (said why)."""
    bad = disagreements(cases, tolerance)
    if json_path:
        Path(json_path).write_text(json.dumps({"shape": shape, "dtype": dtype, "tolerance": tolerance,
                                               "agree": not bad, "cases": cases}, indent=1))
    if bad:
        print(f"FAIL: triton and torch differ by more than {tolerance:g} in: "
              + "; ".join(f"{name} ({cases[name]['max_abs_diff']:.3g})" for name in bad))
        return 1
    print(f"triton and torch agree within {tolerance:g} in every case")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="opt-13b")
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--tolerance", type=float, help="largest |triton - torch| allowed (default: float16 "
                    f"{TOLERANCE['float16']:g}, float32 {TOLERANCE['float32']:g})")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("python -m scripts.benchmarks.attention needs a CUDA device (on CPU the Triton kernels only run "
                 "interpreted)")
    from fastserve_kernels.attention_backend import attention_function

    device = torch.device("cuda")
    triton_attention = attention_function("triton", device)
    dtype = getattr(torch, args.dtype)
    h, d = SHAPES[args.shape]
    cases = {
        "decode 64 x 1024 ctx": [(1023, 1)] * 64,
        "decode 8 x 4096 ctx (splits)": [(4095, 1)] * 8,
        "prefill 8 x 512": [(0, 512)] * 8,
        "chunked prefill 4 x (1024 cached + 256)": [(1024, 256)] * 4,
    }
    results = {}
    print(f"{args.shape}: {h} heads x {d}, {args.dtype}, block size {args.block_size}")
    for name, seqs in cases.items():
        q, k, v, kv, meta = build(seqs, h, d, args.block_size, dtype, device)
        scale = d**-0.5
        kv_ref = kv.clone()
        out_ref = ref.paged_attention(q, k, v, kv_ref, 0, meta, scale)
        out_tri = triton_attention(q, k, v, kv, 0, meta, scale)
        err = (out_ref.float() - out_tri.float()).abs().max().item()
        t_ref = time_ms(lambda: ref.paged_attention(q, k, v, kv_ref, 0, meta, scale), args.iters)  # noqa: B023
        t_tri = time_ms(lambda: triton_attention(q, k, v, kv, 0, meta, scale), args.iters)  # noqa: B023
        results[name] = {"torch_ms": t_ref, "triton_ms": t_tri, "speedup": t_ref / t_tri, "max_abs_diff": err}
        print(f"  {name:42s} torch {t_ref:8.3f} ms  triton {t_tri:8.3f} ms  speedup {t_ref / t_tri:5.2f}x"
              f"  max |diff| {err:.2e}")
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    return report(results, args.shape, args.dtype, tolerance, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
