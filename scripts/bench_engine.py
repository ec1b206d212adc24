"""Engine benchmark: the decode step against its bare matmuls, and the engine
against transformers' generate, on an opt-125m-shaped random checkpoint.

    python scripts/bench_engine.py                  # writes/uses models/opt-125m-random
    python scripts/bench_engine.py --quick          # smaller workloads, for a smoke run

Every number is a ratio against a baseline measured in the same run:
1. decode-step time at batch 1, 8, 32 (context ~128) / time of that step's
   bare matrix multiplications (q/k/v, out, fc1, fc2 per layer, lm_head);
2. 32 prompts x 128 tokens, 64 new tokens each: engine vs generate (same prefill work);
3. 64 requests with ShareGPT lengths (capped at 128): generate in static
   batches of 32 run to their longest member vs continuous batching, useful
   tokens per second;
4. batch 1: one 128-token prompt, 64 new tokens.
Results print as a table and, with --json, are written to a file.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

SHAREGPT_LENGTHS = REPO.parent / "shared" / "datasets" / "sharegpt_lengths.csv"


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(4, vocab, (max(1, ln) - 1,), generator=g).tolist() for ln in lengths[:n]]


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


# -- 1. decode step vs bare matmuls -----------------------------------------------------------
def decode_step_vs_matmul(llm: LLM, batch: int, context: int, steps: int) -> dict:
    eng = llm.engine
    prompts = random_prompts(batch, [context] * batch, eng.model_config.vocab_size, seed=batch)
    step_s = statistics.median(decode_step_times(eng, prompts, steps))

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

    matmuls()
    mm_s = statistics.median([timed(matmuls) for _ in range(steps)])
    return {"batch": batch, "context": context, "step_ms": step_s * 1e3, "matmul_ms": mm_s * 1e3,
            "ratio": step_s / mm_s}


# -- 2-4. engine vs transformers generate --------------------------------------------------------
def engine_run(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_run(hf, prompts: list[list[int]], outputs: list[int], batch_size: int) -> tuple[float, int]:
    """Static batches: left-padded to the longest prompt, generated to the longest output."""
    useful = 0
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[1] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        new = max(outs)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=1)
        useful += sum(outs)
    return time.perf_counter() - t, useful


def sharegpt_lengths(n: int, cap: int) -> tuple[list[int], list[int]]:
    if not SHAREGPT_LENGTHS.exists():
        raise SystemExit(f"{SHAREGPT_LENGTHS} not found: the ShareGPT workload needs the shared datasets")
    rows = list(csv.DictReader(SHAREGPT_LENGTHS.open()))
    rows = [r for r in rows if int(r["output_tokens"]) > 0][:n]
    return ([min(cap, max(2, int(r["input_tokens"]))) for r in rows],
            [min(cap, int(r["output_tokens"])) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "opt-125m-random")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").exists():
        from make_tiny_model import main as make_model  # scripts/ is on sys.path as the script's folder

        make_model(["--shape", "opt-125m", "--out", str(args.model)])

    from transformers import OPTForCausalLM

    llm = LLM(model=str(args.model), dtype=args.dtype, device=args.device, num_gpu_blocks_override=4096)
    dev = llm.engine.executor.device
    hf = OPTForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(dev).eval()
    vocab = llm.engine.model_config.vocab_size
    q = args.quick
    results: dict = {"model": args.model.name, "device": str(dev), "dtype": args.dtype,
                     "threads": torch.get_num_threads()}

    print(f"# bench_engine: {args.model.name}, {dev}, {args.dtype}, {torch.get_num_threads()} threads")
    print("\n## decode step vs its bare matmuls (context 128)")
    results["decode"] = []
    for b in (1, 8, 32):
        r = decode_step_vs_matmul(llm, b, 128, steps=4 if q else 10)
        results["decode"].append(r)
        print(f"batch {b:3d}: step {r['step_ms']:8.2f} ms   matmuls {r['matmul_ms']:8.2f} ms   "
              f"ratio {r['ratio']:.2f}x")

    def compare(name: str, prompts, outputs, batch_size: int) -> None:
        hf_s, hf_tok = hf_run(hf, prompts, outputs, batch_size)
        en_s, en_tok = engine_run(llm, prompts, outputs)
        assert hf_tok == en_tok, (hf_tok, en_tok)
        r = {"requests": len(prompts), "useful_tokens": en_tok, "hf_s": hf_s, "engine_s": en_s,
             "hf_tok_s": hf_tok / hf_s, "engine_tok_s": en_tok / en_s, "speedup": hf_s / en_s}
        results[name] = r
        print(f"{name:<28} generate {hf_s:7.2f} s ({r['hf_tok_s']:7.1f} tok/s)   engine {en_s:7.2f} s "
              f"({r['engine_tok_s']:7.1f} tok/s)   speedup {r['speedup']:.2f}x")

    print("\n## engine vs transformers generate (useful output tokens per second)")
    n = 8 if q else 32
    compare("fixed_32x128_new64", random_prompts(n, [128] * n, vocab, 1), [16 if q else 64] * n, 32)
    n = 16 if q else 64
    ins, outs = sharegpt_lengths(n, 128)
    compare("sharegpt_64_capped128", random_prompts(n, ins, vocab, 2), outs, 32)
    compare("batch1_128_new64", random_prompts(1, [128], vocab, 3), [16 if q else 64], 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
