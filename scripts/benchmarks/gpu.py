"""GPU benchmark of one model stage: decode, prefill and swaps against floors measured in the same run.

    python -m scripts.benchmarks.gpu --device cuda            # OPT-13B-shaped dummy weights, float16
    python -m scripts.benchmarks.gpu                          # CPU: opt-125m shape, float32, the parts CPU has

Runs the ModelRunner directly (no scheduler, no HTTP) on random weights
(--load-format dummy, engine/dummy_weights.py) made from a config alone, so
nothing is downloaded. Every number is a ratio against a baseline measured in
the same run on the same device:

1. copy bandwidth: one device-to-device copy of a large buffer, counted as
   bytes read + bytes written per second (what a memory-bound kernel can
   stream);
2. decode step (prepare + forward + greedy sampling, context 512) at batch
   1 and 32 / the floor = (weight bytes + the KV bytes the step reads)
   / copy bandwidth; goal within 1.3x at batch 1. For each attention backend
   (torch; triton when fastserve_kernels/attention_backend.py is in the tree and Triton
   runs) with CUDA graphs and eagerly, on the same batches; graphs/eager is
   printed as a ratio too. Each backend's rows run with that backend's graph
   buckets (engine/decode_inputs.graph_buckets: torch pads the block table to
   the next power of two, Triton to the widest), and each row says the table
   width it ran with. (Batch 256 at context 512 is 107 GB of OPT-13B KV: it fits
   neither an H100 nor an H200 beside the weights, so it is not a default;
   --batches asks for it, and a batch that does not fit is left out, saying so);
3. prefill of 8 x 1024 tokens / bare GEMMs of the same FLOPs (matmul
   FLOPs of every layer + causal attention + the sampled rows' lm_head; the
   GEMM is the model's fc1 shape, tokens x E x F, timed and scaled), with
   each attention backend the decode rows use (the Triton prefill kernel is
   what serving runs on CUDA);
4. swaps: a batched offload and upload of many jobs' blocks through the
   Swapper (copy streams, pinned host tier) / one memcpy of the same bytes
   made the way the swapper copies: one pinned host buffer (a single
   allocation, so the copy crosses no boundary between separately pinned
   chunks, which the swapper never crosses either) and the device blocks
   block-major contiguous, one copy per direction; goal at least 80%;
5. (CUDA) sampling a mixed batch on the device / copying the logits to the
   host and sampling there (the path it replaced).

On CPU, CUDA graphs and Triton do not run: the decode rows compare the
padded persistent-buffer path (what a graph replays) with the eager one,
and the script says what needs CUDA. Results print as a table and, with
--json, are written to a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.batch import ModelBatch, SequenceWork
from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup
from engine.sampling_params import SamplingParams
from fastserve_kernels.paged_attention import paged_attention
from memory.transfers import Direction
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config, write_opt_checkpoint

GREEDY = SamplingParams(temperature=0)
# What a CUDA run measures by default (the device check's bench_gpu step; docs/gpu.md lists the expected figures).
CUDA_SHAPE = "opt-13b"
CUDA_BATCHES = (1, 32)
CONTEXT = 512
KV_RESERVE_BYTES = 12 << 30  # headroom left beside a batch's KV (activations, graphs, the swap benchmark's blocks)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- 1. the device's copy bandwidth ------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, nbytes: int, repeat: int) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), device, repeat)  # the buffers go with the frame


# -- 2. decode ---------------------------------------------------------------------------------------------------
def decode_batch(batch: int, context: int, block_size: int, vocab: int) -> ModelBatch:
    """`batch` sequences, each computing its token number `context` (context - 1 cached) in its own blocks."""
    n_blocks = -(-context // block_size)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(4, vocab, (batch,), generator=g).tolist()
    seqs = [SequenceWork(f"d{i}", [ids[i]], context - 1, list(range(i * n_blocks, (i + 1) * n_blocks)), GREEDY,
                         None, num_generated=1) for i in range(batch)]
    return ModelBatch(seqs)


def run_step(runner: ModelRunner, batch: ModelBatch) -> None:
    inputs = runner.prepare(batch)
    hidden = runner.forward(inputs)
    runner.sample(hidden, inputs, batch)  # waits for the ids: the step is done


def weight_bytes_read(runner: ModelRunner) -> int:
    """Bytes a decode step reads of the weights: every parameter but the position table (a few rows of it)."""
    return sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
               if not n.startswith("embed_positions"))


def kv_bytes_read(runner: ModelRunner, batch: int, context: int) -> int:
    return batch * context * runner.kv_block_bytes // runner.block_size


def use_backend(runner: ModelRunner, name: str, fn) -> None:
    """Run the model on attention backend `name` (its function `fn`), the runner's graph buckets included: they
    depend on the backend (graph_buckets), so a model switched alone would replay torch through Triton's
    widest-table buckets."""
    runner.model.use_attention(fn)
    runner.attention_backend = name


def attention_backends(device: torch.device) -> tuple[dict, str | None]:
    """{name: paged_attention function} available here, and why triton is missing (None when it is there)."""
    fns = {"torch": paged_attention}
    try:
        from fastserve_kernels.attention_backend import AttentionBackendError, attention_function
    except ImportError:
        return fns, "fastserve_kernels/attention_backend.py is not in this tree"
    try:
        fns["triton"] = attention_function("triton", device)
    except AttentionBackendError as e:
        return fns, str(e)
    return fns, None


def bench_decode(runner: ModelRunner, batches: list[int], context: int, max_model_len: int, bandwidth: float,
                 repeat: int) -> tuple[list[dict], list[str]]:
    dev, notes = runner.device, []
    backends, why_not = attention_backends(dev)
    if why_not:
        notes.append(f"triton backend not measured: {why_not}")
    cuda = dev.type == "cuda"
    first_backend = runner.attention_backend
    if not cuda:
        notes.append("CUDA graphs need CUDA: 'padded' rows run the persistent padded buffers eagerly (what a graph "
                     "replays), 'eager' the unpadded path")
    modes = ["graphs", "eager"] if cuda else ["padded", "eager"]
    vocab = runner.model.cfg.vocab_size
    rows = []
    weights = weight_bytes_read(runner)
    for name, fn in backends.items():
        use_backend(runner, name, fn)
        for b in batches:
            batch = decode_batch(b, context, runner.block_size, vocab)
            floor = (weights + kv_bytes_read(runner, b, context)) / bandwidth
            times, widths = {}, {}
            for mode in modes:
                if mode == "eager":
                    runner.stop_decode_graphs()
                else:
                    runner.use_decode_graphs(max(batches), max_model_len, capture=cuda)
                widths[mode] = table_width(runner, batch)
                times[mode] = median_time(lambda batch=batch: run_step(runner, batch), dev, repeat)
            runner.stop_decode_graphs()
            for mode in modes:
                rows.append({"backend": name, "mode": mode, "batch": b, "context": context,
                             "table_width": widths[mode], "step_ms": times[mode] * 1e3, "floor_ms": floor * 1e3,
                             "vs_floor": times[mode] / floor, "vs_eager": times[mode] / times["eager"]})
                r = rows[-1]
                print(f"{name:<7} {mode:<7} batch {b:4d}: step {r['step_ms']:9.3f} ms  floor {r['floor_ms']:9.3f} ms"
                      f"  {r['vs_floor']:6.2f}x floor  {r['vs_eager']:5.2f}x eager  ({r['table_width']} blocks a "
                      "row)", flush=True)
    use_backend(runner, first_backend, backends.get(first_backend, paged_attention))
    return rows, notes


def table_width(runner: ModelRunner, batch: ModelBatch) -> int:
    """Blocks a row of the block table holds in this batch's decode step as the runner prepares it now: the
    bucket's width through the persistent buffers, the batch's own widest table eagerly."""
    inputs = runner.prepare(batch)
    if inputs.decode_bucket is not None:
        return inputs.decode_bucket[1]
    return max(len(s.block_table) for s in batch.seqs)


# -- 3. prefill --------------------------------------------------------------------------------------------------
def prefill_flops(cfg: OPTConfig, seqs: int, tokens: int) -> float:
    e, f, layers = cfg.hidden_size, cfg.ffn_dim, cfg.num_hidden_layers
    per_token_layer = 2 * (3 * e * e + e * e + 2 * e * f)  # qkv, out, fc1, fc2
    attention = 2 * 2 * e * tokens * (tokens + 1) / 2  # QK^T and PV over the causal triangle, per sequence
    lm_head = 2 * cfg.word_embed_proj_dim * cfg.vocab_size  # the sampled row of each sequence
    return seqs * (tokens * layers * per_token_layer + layers * attention + lm_head)


def bench_prefill(runner: ModelRunner, seqs: int, tokens: int, repeat: int) -> list[dict]:
    """One row per attention backend available here (attention_backends: the decode rows' set), each against the
    same GEMM baseline; the model is left on the torch backend."""
    backends, _ = attention_backends(runner.device)
    rows = []
    first_backend = runner.attention_backend
    for name, fn in backends.items():
        use_backend(runner, name, fn)
        rows.append(dict(bench_prefill_once(runner, seqs, tokens, repeat, name), backend=name))
    use_backend(runner, first_backend, backends.get(first_backend, paged_attention))
    return rows


def bench_prefill_once(runner: ModelRunner, seqs: int, tokens: int, repeat: int, backend: str = "torch") -> dict:
    cfg, dev = runner.model.cfg, runner.device
    n_blocks = -(-tokens // runner.block_size)
    g = torch.Generator().manual_seed(7)
    work = [SequenceWork(f"p{i}", [2] + torch.randint(4, cfg.vocab_size, (tokens - 1,), generator=g).tolist(), 0,
                         list(range(i * n_blocks, (i + 1) * n_blocks)), GREEDY, None, 0) for i in range(seqs)]
    batch = ModelBatch(work)
    step_s = median_time(lambda: run_step(runner, batch), dev, repeat, warmup=1)
    flops = prefill_flops(cfg, seqs, tokens)
    # The baseline: the model's largest GEMM shape (tokens x E x F, fc1), timed once and scaled to the same FLOPs
    # (one GEMM of all of them would need tens of GB for its operands).
    m, k, n = seqs * tokens, cfg.hidden_size, cfg.ffn_dim
    a = torch.randn(m, k, dtype=runner.dtype, device=dev)
    w = torch.randn(n, k, dtype=runner.dtype, device=dev)
    one_gemm_s = median_time(lambda: torch.nn.functional.linear(a, w), dev, repeat)
    gemm_s = one_gemm_s * flops / (2 * m * k * n)
    r = {"seqs": seqs, "tokens": tokens, "tflop": flops / 1e12, "step_ms": step_s * 1e3, "gemm_ms": gemm_s * 1e3,
         "gemm_shape": [m, k, n], "vs_gemm": step_s / gemm_s, "step_tflops": flops / step_s / 1e12,
         "gemm_tflops": flops / gemm_s / 1e12}
    print(f"prefill {backend:<7} {seqs} x {tokens}: step {r['step_ms']:.2f} ms ({r['step_tflops']:.3f} TFLOP/s)   GEMM "
          f"{m}x{k}x{n} scaled to {flops / 1e12:.2f} TFLOP {r['gemm_ms']:.2f} ms ({r['gemm_tflops']:.3f} TFLOP/s)   "
          f"{r['vs_gemm']:.2f}x GEMM", flush=True)
    return r


# -- 4. swaps ----------------------------------------------------------------------------------------------------
def memcpy_times(device_cache: torch.Tensor, n: int, repeat: int) -> dict[str, float]:
    """The swaps' baseline: seconds of one copy of device blocks 0..n-1 (block-major: one contiguous range) to and
    from one host buffer of n blocks, pinned in a single allocation on CUDA (cudaHostAlloc), as the swapper
    copies. Not through the host tier: its blocks are pinned chunk by chunk (engine/host_tier.py), and a copy
    across two separately pinned chunks, which the swapper never makes, is slower than either."""
    dev, src = device_cache.device, device_cache[:n]
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=dev.type == "cuda")
    times = {"memcpy_d2h": median_time(lambda: host.copy_(src, non_blocking=True), dev, repeat),
             "memcpy_h2d": median_time(lambda: src.copy_(host, non_blocking=True), dev, repeat)}
    return times  # the buffer goes back to the pinned allocator's cache before the swaps run


def bench_swap(runner: ModelRunner, jobs: int, blocks_per_job: int, repeat: int) -> dict:
    """Offload then upload `jobs` jobs of `blocks_per_job` blocks each, every other block (fragmented on the device,
    as a live cache is), against one pinned memcpy of the same bytes in each direction."""
    dev = runner.device
    n = jobs * blocks_per_job
    swapper = runner.attach_host_tier(n)
    swapper.tier.wait_pinned()  # locked in the background; only locked host blocks may be copied (engine/swapper.py)
    device_blocks = list(range(0, 2 * n, 2))  # every other block: n runs of one block, the worst case
    contiguous = list(range(n))  # whole jobs in a row: jobs runs
    nbytes = n * swapper.block_bytes

    def swap(direction: Direction, dev_ids: list[int]) -> None:
        pairs = [(d, h) for d, h in zip(dev_ids, range(n))] if direction is Direction.OFFLOAD else \
            [(h, d) for d, h in zip(dev_ids, range(n))]
        swapper.copy(direction, pairs).wait()

    times = {
        **memcpy_times(swapper.device_cache, n, repeat),
        "offload_contiguous": median_time(lambda: swap(Direction.OFFLOAD, contiguous), dev, repeat),
        "upload_contiguous": median_time(lambda: swap(Direction.UPLOAD, contiguous), dev, repeat),
        "offload_fragmented": median_time(lambda: swap(Direction.OFFLOAD, device_blocks), dev, repeat),
        "upload_fragmented": median_time(lambda: swap(Direction.UPLOAD, device_blocks), dev, repeat),
    }
    gbs = {k: nbytes / s / 1e9 for k, s in times.items()}
    r = {"blocks": n, "bytes": nbytes, "gb_per_s": gbs,
         "pinned": swapper.host_cache.is_pinned() if dev.type == "cuda" else False,
         "memcpy": "one host buffer (pinned in one allocation on CUDA), device blocks 0..n-1, one copy a direction"}
    for kind in ("offload", "upload"):
        base = gbs["memcpy_d2h" if kind == "offload" else "memcpy_h2d"]
        for layout in ("contiguous", "fragmented"):
            got = gbs[f"{kind}_{layout}"]
            r[f"{kind}_{layout}_vs_memcpy"] = got / base
            print(f"{kind:<7} {layout:<10} {n} blocks ({nbytes / 2**30:.2f} GiB): {got:7.2f} GB/s   one pinned memcpy "
                  f"{base:7.2f} GB/s   {got / base:5.1%} of it", flush=True)
    swapper.shutdown()
    runner.swapper = None
    return r


def goals(results: dict) -> list[str]:
    """The targets (decode within 1.3x of its floor at batch 1, swaps at 80% of a memcpy), met or not, from this
    run's ratios."""
    out = []
    for r in results["decode"]:
        if r["batch"] == 1 and r["mode"] in ("graphs", "eager"):
            out.append(f"decode batch 1, {r['backend']} {r['mode']}: {r['vs_floor']:.2f}x the floor (goal <= 1.3x): "
                       + ("met" if r["vs_floor"] <= 1.3 else "not met"))
    for key in ("offload_contiguous", "upload_contiguous", "offload_fragmented", "upload_fragmented"):
        frac = results["swap"][f"{key}_vs_memcpy"]
        out.append(f"swap {key.replace('_', ' ')}: {frac:.0%} of one memcpy (goal >= 80%): "
                   + ("met" if frac >= 0.8 else "not met"))
    return out


# -- 5. sampling -------------------------------------------------------------------------------------------------
def bench_sampling(runner: ModelRunner, batch: int, repeat: int) -> dict:
    """The sampler where the logits are vs the host path it replaced (all logits copied to the host, sampled
    there by the same code): a mixed batch, half greedy, half top-p at temperature 0.8, some asking logprobs."""
    from engine.sampler import Sampler

    dev, vocab = runner.device, runner.model.cfg.vocab_size
    logits = torch.randn(batch, vocab, device=dev) * 4  # float32, as compute_logits returns them
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9, logprobs=5 if i % 16 == 1 else None)
              for i in range(batch)]
    seqs = [SequenceWork(f"s{i}", [0], 1, [0], p, None, 1) for i, p in enumerate(params)]
    sampler = Sampler(seed=0)
    on_device = median_time(lambda: sampler(logits, seqs, None), dev, repeat)
    on_host = median_time(lambda: sampler(logits.cpu(), seqs, None), dev, repeat)
    r = {"batch": batch, "vocab": vocab, "device_ms": on_device * 1e3, "host_ms": on_host * 1e3,
         "host_vs_device": on_host / on_device}
    print(f"sampling batch {batch} x {vocab}: on the device {r['device_ms']:.2f} ms   logits to the host and sampled "
          f"there {r['host_ms']:.2f} ms   ({r['host_vs_device']:.2f}x)", flush=True)
    return r


# -- the run -----------------------------------------------------------------------------------------------------
def build_runner(shape: str, device: torch.device, dtype: torch.dtype, block_size: int, tmp: Path) -> ModelRunner:
    model_dir = write_opt_checkpoint(tmp / shape, opt_config(**OPT_SHAPES[shape]), weight_format="none")
    cfg = OPTConfig.from_model_dir(model_dir)
    model = load_model_stage(model_dir, cfg, TensorParallelGroup(ParallelLayout()), dtype, device, "dummy")
    return ModelRunner(model, device, dtype, block_size)


def fitting_batches(runner: ModelRunner, batches: list[int], context: int, reserve: int) -> list[int]:
    """The batches whose KV (plus `reserve` bytes of headroom) fits the device now."""
    if runner.device.type != "cuda":
        return batches
    free, _ = torch.cuda.mem_get_info(runner.device)
    return [b for b in batches if kv_bytes_read(runner, b, context) + reserve <= free]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--shape", help="model shape (modelmaker/opt_checkpoint.py OPT_SHAPES); default opt-13b on CUDA, "
                    "opt-125m on CPU")
    ap.add_argument("--dtype", help="default float16 on CUDA, float32 on CPU")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,32 on CUDA, 1,8,32 on CPU)")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--prefill", default=None, help="SEQSxTOKENS (default 8x1024 on CUDA, 2x256 on CPU)")
    ap.add_argument("--swap-blocks", default=None, help="JOBSxBLOCKS offloaded and uploaded (default 16x32 on "
                    "CUDA, 8x8 on CPU)")
    ap.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 10 on CUDA, 3 on CPU)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: --device cuda, but torch sees no CUDA device (run without --device for the "
                         "CPU parts)")
    shape = args.shape or (CUDA_SHAPE if cuda else "opt-125m")
    dtype = getattr(torch, args.dtype or ("float16" if cuda else "float32"))
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(CUDA_BATCHES if cuda else (1, 8, 32))
    p_seqs, p_tokens = (int(x) for x in (args.prefill or ("8x1024" if cuda else "2x256")).split("x"))
    s_jobs, s_blocks = (int(x) for x in (args.swap_blocks or ("16x32" if cuda else "8x8")).split("x"))
    repeat = args.repeat or (10 if cuda else 3)
    results: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "shape": shape,
                     "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "notes": []}
    print(f"# bench_gpu: {shape} (dummy weights), {results['device']}, {results['dtype']}", flush=True)
    if not cuda:
        results["notes"].append("CPU run: CUDA graphs, Triton kernels, pinned memory and copy streams need CUDA; run "
                                "`python -m scripts.benchmarks.gpu --device cuda` on a GPU (scripts/device_check.sh)")
        print("# " + results["notes"][-1])

    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(shape, dev, dtype, args.block_size, Path(tmp))
    max_model_len = runner.model.cfg.max_position_embeddings

    bw = copy_bandwidth(dev, (2 << 30) if cuda else (256 << 20), repeat)
    if cuda:
        torch.cuda.empty_cache()  # the copy's buffers: mem_get_info counts cached memory as used
    results["copy_bandwidth_gb_s"] = bw / 1e9
    print(f"\n## device-to-device copy: {bw / 1e9:.1f} GB/s (read + write)", flush=True)

    fit = fitting_batches(runner, batches, args.context, reserve=KV_RESERVE_BYTES)
    if fit != batches:
        results["notes"].append(f"batches {sorted(set(batches) - set(fit))} left out: their KV does not fit")
        print("# " + results["notes"][-1])
    blocks = max(max(fit, default=1) * -(-args.context // args.block_size),
                 p_seqs * -(-p_tokens // args.block_size), 2 * s_jobs * s_blocks)
    runner.allocate_kv_cache(blocks)
    print(f"\n## decode step (context {args.context}) vs (weights + KV read) / copy bandwidth", flush=True)
    results["decode"], notes = bench_decode(runner, fit, args.context, max_model_len, bw, repeat)
    results["notes"] += notes
    for n in notes:
        print("# " + n)

    print("\n## prefill vs bare GEMMs of the same FLOPs", flush=True)
    results["prefill"] = bench_prefill(runner, p_seqs, p_tokens, max(2, repeat // 2))

    print("\n## swaps vs one memcpy of the same bytes" + ("" if cuda else " (CPU: copy threads, unpinned)"),
          flush=True)
    results["swap"] = bench_swap(runner, s_jobs, s_blocks, repeat)

    if cuda:
        print("\n## sampling on the device vs on the host", flush=True)
        results["sampling"] = bench_sampling(runner, max(batches), repeat)

    results["goals"] = goals(results)
    print("\n## goals")
    for line in results["goals"]:
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
