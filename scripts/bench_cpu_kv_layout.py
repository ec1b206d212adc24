"""CPU decode attention's two sparse ops over the KV cache's block layout as it is, head-major inside a block
([NB, L, 2, H, bs, D]), against the token-major one it replaced ([NB, L, 2, bs, H, D]): same rows, same ops, same
memory.

    python scripts/bench_cpu_kv_layout.py [--threads 1] [--repeats 3]

What it measures: fastserve_kernels/cpu_decode_attention.py's scores (torch.sparse.sampled_addmm) and weighted V sum
(F.embedding_bag) for one layer of an opt-125m-shaped cache (H 12, D 64, 12 layers, blocks of 16), batch 32,
context 130, scattered block tables; CPU ms per call (median of 9 timings of a call on each of the 12 layers), the
two layouts alternating, and their ratio. Token-major, one head's rows of consecutive positions lie H * D * 4 bytes
apart (3 KB), a stride the prefetchers do not follow; head-major, a block's 16 rows of one head are contiguous.
What it is not: the engine's whole step (scripts/bench_engine.py); the evidence for, and the size of, the move
to head-major blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)


def cpu_ms(fn, layers: int, n: int = 9) -> float:
    """CPU ms per call: median over n timings of fn(layer) for every layer in turn (a step's worth, each layer
    reading its own K or V as the engine does; and process_time ticks coarsely when several threads run)."""
    fn(0)
    times = []
    for _ in range(n):
        t = time.process_time()
        for layer in range(layers):
            fn(layer)
        times.append((time.process_time() - t) / layers)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="alternations of the two layouts")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s, c, h, d, layers, bs = 32, 130, 12, 64, 12, 16
    mb = -(-c // bs)
    nb = s * mb + 8
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb, generator=g)[: s * mb].view(s, mb)
    cache_rows = torch.randn(nb * layers * 2 * bs * h, d, generator=g)  # one memory, read in either layout
    q = torch.randn(s * h, d, generator=g)
    pos = torch.arange(c)
    block, offset, head = tables[:, pos // bs], pos % bs, torch.arange(h)[None, :, None]
    k_rows = {  # [S * H * C]: layer 0's K row of (s, h, c)
        "token-major": ((block * (layers * 2 * bs * h) + offset * h)[:, None, :] + head).reshape(-1),
        "head-major": ((block * (layers * 2 * h * bs) + offset)[:, None, :] + head * bs).reshape(-1),
    }
    row_ptr = torch.arange(s * h + 1) * c
    stride, v_offset = 2 * bs * h, bs * h
    window = cache_rows.shape[0] - (layers - 1) * stride - v_offset
    k_windows = [cache_rows.narrow(0, layer * stride, window) for layer in range(layers)]
    v_windows = [cache_rows.narrow(0, layer * stride + v_offset, window) for layer in range(layers)]
    print(f"# batch {s}, context {c}, H {h}, D {d}, {args.threads} thread(s): CPU ms per call of one layer")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in k_rows}
    for _ in range(args.repeats):
        for name, rows in k_rows.items():
            pattern = torch.sparse_csr_tensor(row_ptr, rows, torch.zeros(rows.numel()), size=(s * h, window),
                                              check_invariants=False)

            def scores(layer, pattern=pattern):
                return torch.sparse.sampled_addmm(pattern, q, k_windows[layer].t(), beta=0.0, alpha=d**-0.5,
                                                  out=pattern).values()

            probs = torch.softmax(scores(0).view(s * h, c), dim=-1).view(-1)

            def weighted_v(layer, rows=rows, probs=probs):
                return F.embedding_bag(rows, v_windows[layer], offsets=row_ptr[:-1], per_sample_weights=probs,
                                       mode="sum")

            results[name].append((cpu_ms(scores, layers), cpu_ms(weighted_v, layers)))
    for name, runs in results.items():
        print(f"{name:12s} sampled_addmm {statistics.median(r[0] for r in runs):6.2f} ms   "
              f"embedding_bag {statistics.median(r[1] for r in runs):6.2f} ms")
    tm, hm = results["token-major"], results["head-major"]
    print(f"token-major / head-major: sampled_addmm {statistics.median(a[0] / b[0] for a, b in zip(tm, hm)):.2f}x, "
          f"embedding_bag {statistics.median(a[1] / b[1] for a, b in zip(tm, hm)):.2f}x (median of "
          f"{args.repeats} alternations)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
