"""Engine benchmark: the decode step against its bare matmuls, and the engine
against transformers' generate, on an opt-125m-shaped random checkpoint.

    python -m scripts.benchmarks.engine             # writes/uses models/opt-125m-random
    python -m scripts.benchmarks.engine --quick     # smaller workloads, for a smoke run
    python -m scripts.benchmarks.engine --parts decode,fixed --repeats 3 --threads 1   # the two targets only

Every number is a ratio against a baseline measured in the same run:
1. decode-step time at batch 1, 8, 32 (context ~128) / time of that step's
   bare matrix multiplications (q/k/v, out, fc1, fc2 per layer, lm_head), beside
   the floor no step can beat: those matmuls plus one read of the step's K and V
   at the read bandwidth of the memory the KV cache is in (the device's: host DRAM
   on CPU, the GPU's memory on CUDA), measured in the same run;
2. 32 prompts x 128 tokens, 64 new tokens each: engine vs generate (same prefill work);
3. 64 requests with ShareGPT lengths (capped at 128; --lengths says whose): generate in static
   batches of 32 run to their longest member vs continuous batching, useful
   tokens per second;
4. batch 1: one 128-token prompt, 64 new tokens.
Results print as a table and, with --json, are written to a file.

On a shared, noisy machine one timing is a sample of the machine's mood, so
each ratio is measured --repeats times with the engine and its baseline
interleaved (A B, then B A, ...), and reported as the median with its range,
in wall-clock seconds and in CPU seconds (time.process_time, every thread of
the process): CPU time counts the work done, not the time other jobs held
the cores, so its ratio is the steadier one when the machine is loaded.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config, write_opt_checkpoint
from modelmaker.tiny_tokenizer import train_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]

PARTS = {"decode", "fixed", "sharegpt", "batch1"}
SHAREGPT_LENGTHS = REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv"


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(4, vocab, (max(1, ln) - 1,), generator=g).tolist() for ln in lengths[:n]]


class Clock:
    """Wall and CPU seconds of one interval. CPU time is the whole process's (time.process_time: every thread,
    the engine's step thread and torch's worker threads included), so on a shared machine it counts the work
    done rather than the time other jobs held the cores; wall time counts both."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def spread(values: list[float]) -> dict:
    """Median and range of a list of per-repeat ratios."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def timed(fn, repeat: int = 1) -> float:
    best = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return statistics.median(best)


def decode_step_times(eng, prompts: list[list[int]], steps: int) -> list[float]:
    """Wall seconds of each of `steps` decode iterations of these prompts, batched (after their prefill)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"decode-timing-{i}", p, params)
    eng.step()  # the prefill iteration
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    while eng.has_unfinished():
        eng.step()
    return times


def write_model(out: Path) -> Path:
    """An opt-125m-shaped checkpoint of random weights (float32) with the tiny model's tokenizer, unless `out`
    already holds one."""
    if not (out / "config.json").exists():
        train_tiny_tokenizer(out)
        write_opt_checkpoint(out, opt_config(**OPT_SHAPES["opt-125m"]))
    return out


def memory_read_gbps(device: torch.device, gib: float = 1.0, repeats: int = 3) -> float:
    """Read bandwidth of `device`'s memory, GB/s: the median time to sum a `gib` GiB float32 tensor there (host
    DRAM with torch's threads on CPU, the GPU's memory on CUDA; larger than the last-level cache either way). A
    decode step cannot read its KV cache, which lives on that device, faster."""
    buf = torch.ones(int(gib * 2**30) // 4, device=device)
    buf.sum()  # first use: kernels loaded, caches warm
    times = []
    for _ in range(repeats):
        if buf.is_cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        buf.sum()
        if buf.is_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times) / 1e9


# -- 1. decode step vs bare matmuls -----------------------------------------------------------
def decode_step_vs_matmul(llm: LLM, batch: int, context: int, steps: int, repeats: int) -> dict:
    """`repeats` rounds, each `steps` decode steps of one batch then `steps` runs of its bare matmuls (the
    order alternating from round to round), timed in wall and CPU seconds; a round's ratio is its median step
    over its median matmul run, and the result is the median round (the context grows by steps * repeats)."""
    eng = llm.engine
    prompts = random_prompts(batch, [context] * batch, eng.model_config.vocab_size, seed=batch)
    params = SamplingParams(temperature=0, max_tokens=steps * repeats + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"decode-timing-{i}", p, params)
    eng.step()  # the prefill iteration
    eng.step()  # one decode step untimed (first-use allocations)

    model = eng.executor.model
    like = dict(device=eng.executor.device, dtype=eng.executor.dtype)
    x = torch.randn(batch, eng.model_config.hidden_size, **like)
    ffn = torch.randn(batch, eng.model_config.ffn_dim, **like)

    def matmuls():
        with torch.inference_mode():
            for layer in model.layers:
                F.linear(x, layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias)
                F.linear(x, layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias)
                F.linear(x, layer.fc1.weight, layer.fc1.bias)
                F.linear(ffn, layer.fc2.weight, layer.fc2.bias)
            F.linear(x, model.embed_tokens.weight)
        if x.is_cuda:
            torch.cuda.synchronize()

    def run(fn) -> tuple[float, float]:  # median (wall, cpu) seconds of `steps` calls
        times = []
        for _ in range(steps):
            clock = Clock()
            fn()
            times.append(clock.stop())
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    matmuls()
    rounds = []  # (step wall, step cpu, matmul wall, matmul cpu)
    for r in range(repeats):
        if r % 2 == 0:
            step, mm = run(eng.step), run(matmuls)
        else:
            mm, step = run(matmuls), run(eng.step)
        rounds.append((*step, *mm))
    while eng.has_unfinished():
        eng.step()
    wall = spread([s / m for s, _, m, _ in rounds])
    cpu = spread([s / m for _, s, _, m in rounds])
    # The floor: the matmuls, then one read of the KV cache at the read bandwidth of the memory it is in (the
    # executor's device, measured now), at the rounds' middle context. No decode step can beat it: the attention
    # must read every cached K and V once.
    # Bytes of K and V the step reads: a KV block's bytes (every layer, every head) per token it holds.
    kv_bytes = eng.executor.kv_block_bytes // eng.executor.block_size * batch * (context + 1 + steps * repeats // 2)
    gbps = memory_read_gbps(eng.executor.device)
    matmul_s = statistics.median(r[2] for r in rounds)
    return {"batch": batch, "context": context, "context_end": context + 1 + steps * repeats,
            "kv_mb_per_step": kv_bytes / 1e6, "memory_read_gbps": gbps,
            "floor_ratio": (matmul_s + kv_bytes / (gbps * 1e9)) / matmul_s,
            "step_ms": statistics.median(r[0] for r in rounds) * 1e3,
            "matmul_ms": statistics.median(r[2] for r in rounds) * 1e3,
            "step_cpu_ms": statistics.median(r[1] for r in rounds) * 1e3,
            "matmul_cpu_ms": statistics.median(r[3] for r in rounds) * 1e3,
            "ratio": wall["median"], "ratio_cpu": cpu["median"], "ratio_wall_spread": wall,
            "ratio_cpu_spread": cpu}


# -- 2-4. engine vs transformers generate --------------------------------------------------------
def engine_run(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, float, int]:
    """(wall s, CPU s, useful tokens) of the engine generating `outputs[i]` tokens for prompt i."""
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    clock = Clock()
    outs = llm.generate(prompts, params)
    wall, cpu = clock.stop()
    return wall, cpu, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_run(hf, prompts: list[list[int]], outputs: list[int], batch_size: int) -> tuple[float, float, int]:
    """Static batches: left-padded to the longest prompt, generated to the longest output.
    (wall s, CPU s, useful tokens)."""
    useful = 0
    clock = Clock()
    for i in range(0, len(prompts), batch_size):
        chunk, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[1] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        new = max(outs)
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=1)
        useful += sum(outs)
    wall, cpu = clock.stop()
    return wall, cpu, useful


def sharegpt_lengths(n: int, cap: int, path: Path = SHAREGPT_LENGTHS) -> tuple[list[int], list[int]]:
    """The first n requests with an output: (input lengths, output lengths), each capped at `cap`. `path`: a CSV
    with input_tokens and output_tokens columns (the shared datasets' sharegpt_lengths.csv), or a trace JSON
    whose "trace" rows are [arrival_s, prompt_len, output_len] (tests/data/sharegpt_fig15_trace.json: 300
    ShareGPT requests, in the repository)."""
    if not path.exists():
        raise SystemExit(f"{path} not found: the ShareGPT workload needs the shared datasets, or --lengths "
                         "tests/data/sharegpt_fig15_trace.json (ShareGPT lengths, in the repository)")
    if path.suffix == ".json":
        rows = [(int(p), int(o)) for _, p, o in json.loads(path.read_text())["trace"]]
    else:
        rows = [(int(r["input_tokens"]), int(r["output_tokens"])) for r in csv.DictReader(path.open())]
    rows = [r for r in rows if r[1] > 0][:n]
    if len(rows) < n:
        raise SystemExit(f"{path}: {len(rows)} requests with an output, {n} wanted")
    return [min(cap, max(2, i)) for i, _ in rows], [min(cap, o) for _, o in rows]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "opt-125m-random")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--lengths", type=Path, default=SHAREGPT_LENGTHS,
                    help="the ShareGPT workload's lengths: a CSV (input_tokens, output_tokens) or a trace JSON "
                    "(default: the shared datasets' CSV; tests/data/sharegpt_fig15_trace.json is in the repository)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--repeats", type=int, help="interleaved engine/baseline repeats per measurement "
                    "(default 5, 1 with --quick)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--parts", default="decode,fixed,sharegpt,batch1",
                    help="comma-separated subset of decode (1), fixed (2), sharegpt (3), batch1 (4); default all")
    ap.add_argument("--model-only", action="store_true", help="write --model's checkpoint if it is missing, then "
                    "exit (the device check's control_plane step runs on it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - PARTS:
        raise SystemExit(f"--parts: unknown {', '.join(sorted(parts - PARTS))}; choose from {', '.join(sorted(PARTS))}")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.threads:
        torch.set_num_threads(args.threads)
    write_model(args.model)
    if args.model_only:
        return 0

    from transformers import OPTForCausalLM

    llm = LLM(model=str(args.model), dtype=args.dtype, device=args.device, num_gpu_blocks_override=4096)
    dev = llm.engine.executor.device
    hf = OPTForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(dev).eval()
    vocab = llm.engine.model_config.vocab_size
    q = args.quick
    results: dict = {"model": args.model.name, "device": str(dev), "dtype": args.dtype,
                     "threads": torch.get_num_threads(), "repeats": args.repeats}

    print(f"# bench_engine: {args.model.name}, {dev}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{args.repeats} interleaved repeats")
    if dev.type == "cpu":
        from fastserve_kernels import cpu_decode_extension

        results["cpu_decode_attention"] = cpu_decode_extension.describe()
        print(f"# CPU decode attention: {results['cpu_decode_attention']} ({cpu_decode_extension.ENV_SWITCH}=0: "
              "the sparse torch ops and the Python layer loop)")
    print("# ratios: median over repeats [min-max]; wall = perf_counter, cpu = process_time (all threads)")
    if "decode" in parts:
        print("\n## decode step vs its bare matmuls (context 128)")
        results["decode"] = []
    for b in (1, 8, 32) if "decode" in parts else ():
        r = decode_step_vs_matmul(llm, b, 128, steps=4 if q else 6, repeats=args.repeats)
        results["decode"].append(r)
        w, c = r["ratio_wall_spread"], r["ratio_cpu_spread"]
        print(f"batch {b:3d}: step {r['step_ms']:8.2f} ms   matmuls {r['matmul_ms']:8.2f} ms   "
              f"ratio wall {w['median']:.2f}x [{w['min']:.2f}-{w['max']:.2f}]   "
              f"cpu {c['median']:.2f}x [{c['min']:.2f}-{c['max']:.2f}]  (cpu: step {r['step_cpu_ms']:.1f} ms, "
              f"matmuls {r['matmul_cpu_ms']:.1f} ms)   floor {r['floor_ratio']:.2f}x (matmuls + "
              f"{r['kv_mb_per_step']:.0f} MB of KV at {r['memory_read_gbps']:.1f} GB/s)")

    def compare(name: str, prompts, outputs, batch_size: int) -> None:
        """generate and the engine alternately (generate first in even repeats), `args.repeats` times each."""
        runs = []  # (hf wall, hf cpu, engine wall, engine cpu)
        for rep in range(args.repeats):
            if rep % 2 == 0:
                hf_w, hf_c, hf_tok = hf_run(hf, prompts, outputs, batch_size)
                en_w, en_c, en_tok = engine_run(llm, prompts, outputs)
            else:
                en_w, en_c, en_tok = engine_run(llm, prompts, outputs)
                hf_w, hf_c, hf_tok = hf_run(hf, prompts, outputs, batch_size)
            assert hf_tok == en_tok, (hf_tok, en_tok)
            runs.append((hf_w, hf_c, en_w, en_c))
        wall = spread([h / e for h, _, e, _ in runs])
        cpu = spread([h / e for _, h, _, e in runs])
        hf_s = statistics.median(r[0] for r in runs)
        en_s = statistics.median(r[2] for r in runs)
        r = {"requests": len(prompts), "useful_tokens": en_tok, "hf_s": hf_s, "engine_s": en_s,
             "hf_cpu_s": statistics.median(r[1] for r in runs), "engine_cpu_s": statistics.median(r[3] for r in runs),
             "hf_tok_s": en_tok / hf_s, "engine_tok_s": en_tok / en_s, "speedup": wall["median"],
             "speedup_cpu": cpu["median"], "speedup_wall_spread": wall, "speedup_cpu_spread": cpu}
        results[name] = r
        print(f"{name:<22} generate {hf_s:7.2f} s ({r['hf_tok_s']:6.1f} tok/s)   engine {en_s:7.2f} s "
              f"({r['engine_tok_s']:6.1f} tok/s)   speedup wall {wall['median']:.2f}x "
              f"[{wall['min']:.2f}-{wall['max']:.2f}]   cpu {cpu['median']:.2f}x [{cpu['min']:.2f}-{cpu['max']:.2f}]")

    if parts - {"decode"}:
        print("\n## engine vs transformers generate (useful output tokens per second; speedup = generate time / "
              "engine time)")
    n = 8 if q else 32
    if "fixed" in parts:
        compare("fixed_32x128_new64", random_prompts(n, [128] * n, vocab, 1), [16 if q else 64] * n, 32)
    n = 16 if q else 64
    if "sharegpt" in parts:
        ins, outs = sharegpt_lengths(n, 128, args.lengths)
        results["sharegpt_lengths_from"] = str(args.lengths)
        print(f"# ShareGPT lengths from {args.lengths}")
        compare("sharegpt_64_capped128", random_prompts(n, ins, vocab, 2), outs, 32)
    if "batch1" in parts:
        compare("batch1_128_new64", random_prompts(1, [128], vocab, 3), [16 if q else 64], 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
