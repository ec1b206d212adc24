"""Simulate a serving run: the real engine, scheduler and KV manager on a
virtual clock, with costs from a job profile (engine/simulation.py).

    fastserve simulate --model opt-13b --profile profiles/sim/opt-13b-a100-40gb-x1.json \\
        --dataset-name lengths --dataset-path ../shared/datasets/sharegpt_lengths.csv \\
        --num-prompts 3000 --request-rate 3 --scheduling-policy skip-join-mlfq --kv-policy proactive
    fastserve simulate --model opt-13b --profile profiles/sim/opt-13b-a100-40gb-x1.json \\
        --dataset-name sharegpt --dataset-path ../shared/datasets/sharegpt/sharegpt_v3_random1000.json \\
        --gpt2-bpe ../shared/datasets/gpt2-bpe --num-prompts 200 --request-rate 2
    fastserve simulate --model opt-13b --profile profiles/sim/opt-13b-a100-40gb-x1.json \\
        --dataset-name sharegpt --dataset-path ../shared/datasets/sharegpt/sharegpt_v3_random1000.json \\
        --gpt2-bpe ../shared/datasets/gpt2-bpe --multi-turn --num-prompts 200 --request-rate 0.4 \\
        --enable-prefix-caching      # whole conversations, each turn over its history
    fastserve simulate --model llama-3-8b --profile profiles/sim/llama-3-8b-h100-80gb-x1.json \\
        --dataset-name lengths --dataset-path ../shared/datasets/sharegpt_lengths.csv \\
        --num-prompts 3000 --request-rate 40      # Llama-3-8B on one H100 (grouped-query attention)

The first runs at about FCFS's capacity on that profile (2.97 req/s), where the policies differ: seed 0 read a
mean per-token latency of 0.060 s for skip-join MLFQ and 0.203 s with --scheduling-policy fcfs (P95 0.135 and
0.724); at 2 req/s (0.67x) they are within 4% of each other. The measured comparison, with seeds and intervals,
is docs/experiments.md, "Skip-join at capacity".

--model is a model directory (config.json + tokenizer; weights unused) or a
shape name (opt-125m ... opt-175b, llama-3-8b, llama-3-70b): a shape uses
models/<shape>-config, written on first use. Text datasets (sharegpt, alpaca)
are counted with --tokenizer DIR, --gpt2-bpe DIR (OPT's own BPE), else the
model directory's tokenizer (the line printed first says which). --profile
picks the hardware: profiles/sim/ has roofline profiles of the paper's A100
setups (<model>-a100-<memory>-x<GPUs>.json) and of Llama-3-8B on one H100 or
H200 and Llama-3-70B on eight H100s (docs/benchmarks.md, "Simulator profiles";
scripts/tools/make_sim_profiles.py writes them); `fastserve profile` measures
one on real hardware.

The engine settings are the server's flags (engine/args.py), with the same
defaults, but for the profile's say: dtype auto is float16, and the pipeline
stages and host tier are the profile's unless --pipeline-parallel-size or
--swap-space is given. Settings of the real model and its workers (device,
tensor parallelism, CUDA graphs, ...) are taken and change nothing here.

Every dataset goes through vLLM's length filter (prompt and output >= 4,
prompt <= 1024, total <= 2048 tokens, within the model's context), the same
one the load generator and the experiments apply; the first line says how
many requests it dropped. Prints the paper's metrics (mean and P95 per-token latency), TTFT (mean, P99), ITL
(mean, median, P99 over every gap between a request's tokens), the
queued / executing / swap-wait breakdown, and simulation speed; --json writes
them. Same seed, same result. A bad flag value is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.args import OneLineErrorParser, add_engine_args, config_from_args, engine_args_given
from fastserve.bench.tokens import choose_counter, mismatch_warning
from fastserve.bench.workload import DATASETS, LengthFilter, filter_line, load_workload
from modelmaker.llama_checkpoint import LLAMA_SHAPES
from modelmaker.opt_checkpoint import OPT_SHAPES

REPO = Path(__file__).resolve().parents[1]  # the checkout (profiles/sim/); site-packages when installed

TEXT_DATASETS = ("sharegpt", "alpaca")
SHAPES = (*OPT_SHAPES, *LLAMA_SHAPES)  # fastserve/make_model.py's config-only shapes


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineErrorParser(prog="fastserve simulate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    profiles = ", ".join(sorted(p.name for p in (REPO / "profiles" / "sim").glob("*.json")))
    ap.add_argument("--model", required=True, help=f"a model directory, or a shape: {', '.join(SHAPES)}")
    ap.add_argument("--profile", required=True, help=f"job profile JSON (+ optional transfer/capacity fields), "
                    f"or the name of one in profiles/sim/ (with or without .json): {profiles}")
    ap.add_argument("--dataset-name", default="lengths", choices=sorted(DATASETS), help="default: %(default)s")
    ap.add_argument("--dataset-path", help="dataset file (not needed for synthetic)")
    ap.add_argument("--gpt2-bpe", help="text datasets: dir with GPT-2 encoder.json + vocab.bpe to count tokens "
                    "(if no --tokenizer)")
    ap.add_argument("--num-prompts", type=int, default=1000, help="default: %(default)s")
    ap.add_argument("--random-input-len", type=int, default=128, help="synthetic: prompt tokens (default: 128)")
    ap.add_argument("--random-output-len", type=int, default=128, help="synthetic: output tokens (default: 128)")
    ap.add_argument("--random-range-ratio", type=float, default=0.0, help="synthetic: uniform within +-this fraction")
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson rate (default: trace times / all at 0)")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--multi-turn", action=argparse.BooleanOptionalAction, default=False,
                    help="sharegpt: replay whole conversations (--num-prompts of them, --request-rate conversations/s)"
                         ", each turn sent with the history after the previous answer plus a think time")
    ap.add_argument("--think-time", type=float, default=5.0, help="multi-turn: mean think time, s (default: 5)")
    ap.add_argument("--think-time-distribution", default="exponential", choices=("exponential", "constant"))
    ap.add_argument("--max-turns", type=int, default=None, help="multi-turn: at most this many turns per conversation")
    ap.add_argument("--conversation-trace", metavar="CSV", default=None,
                    help="multi-turn: open conversations at an Azure 2023 trace's request times, scaled to "
                         "--request-rate when given (as the load generator's --conversation-trace)")
    ap.add_argument("--trace-speedup", type=float, default=1.0,
                    help="multi-turn with --conversation-trace and no --request-rate: divide its times by this")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="batches in the pipeline at once (default: one per stage; 1 = no pipelining)")
    ap.add_argument("--num-device-blocks", dest="num_gpu_blocks_override", type=int, default=argparse.SUPPRESS,
                    help="the same as --num-gpu-blocks-override")
    ap.add_argument("--num-host-blocks", dest="num_host_blocks_override", type=int, default=argparse.SUPPRESS,
                    help="the same as --num-host-blocks-override")
    ap.add_argument("--json", type=Path, help="write the summary here")
    add_engine_args(ap, exclude=("model", "profile"))  # the server's flags; --model and --profile are the above
    return ap


def model_dir(name: str) -> Path:
    """A directory as given, or models/<shape>-config for a shape name (written on first use)."""
    if name in SHAPES:
        from fastserve.make_model import config_only_model

        return config_only_model(name)
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name}: no config.json there; give a model directory or a shape name "
                         f"({', '.join(SHAPES)})")
    return path


def profile_path(name: str) -> str:
    """--profile as given when that is a file, else profiles/sim/<name>[.json] of the checkout."""
    if Path(name).is_file():
        return name
    for candidate in (REPO / "profiles" / "sim" / name, REPO / "profiles" / "sim" / f"{name}.json"):
        if "/" not in name and candidate.is_file():
            return str(candidate)
    raise ValueError(f"--profile {name}: no such file; profiles/sim/ holds the paper's A100 setups and "
                     "Llama-3 on H100/H200 (fastserve simulate --help lists them), `fastserve profile` measures one")


def run(args: argparse.Namespace) -> dict:
    args.profile = profile_path(args.profile)
    model = model_dir(args.model)
    count = None
    if args.dataset_name in TEXT_DATASETS:
        counter = choose_counter(args.tokenizer, args.gpt2_bpe, str(model), None)
        print(f"token counting: {counter.source}")
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size")
        if warning := mismatch_warning(counter, vocab, "pass --gpt2-bpe DIR to count as OPT does"):
            print(warning, file=sys.stderr)
        count = counter.count
    from engine.simulation import run_trace

    if args.multi_turn:
        return run_multi_turn(args, model, count)
    if args.conversation_trace is not None:
        raise ValueError("--conversation-trace goes with --multi-turn (single requests: --dataset-name azure-conv)")
    limit = json.loads((model / "config.json").read_text()).get("max_position_embeddings", 2048)
    if args.max_model_len:
        limit = min(limit, args.max_model_len)
    stats: dict = {}
    length_filter = (LengthFilter(max_prompt_len=min(1024, limit - 1), max_total_len=min(2048, limit))
                     if args.dataset_name != "synthetic" else LengthFilter(min_len=1, max_prompt_len=limit - 1,
                                                                           max_total_len=limit))
    items = load_workload(args.dataset_name, args.num_prompts, path=args.dataset_path, count_tokens=count,
                          rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
                          length_filter=length_filter, stats=stats,
                          synthetic=dict(input_len=args.random_input_len, output_len=args.random_output_len,
                                         range_ratio=args.random_range_ratio))
    print(filter_line(stats))

    engine = make_engine(args, model)
    trace = [(it.arrival_s, it.prompt_len, it.output_len) for it in items]
    t = time.perf_counter()
    result = run_trace(engine, trace)
    wall = time.perf_counter() - t
    kv = engine.kv.stats
    return result.summary() | {"offloads": kv.num_offloads, "thrash": kv.num_thrash, "drops": kv.num_drops,
                               "recomputed_tokens": kv.num_recomputed_tokens, "wall_s": wall,
                               "policy": args.scheduling_policy, "kv_policy": args.kv_policy,
                               "rate": args.request_rate}


def conversation_lengths(path: str, n: int, seed: int, count) -> list[list[tuple[int, int]]]:
    """n ShareGPT conversations (the load generator's seeded sample) as (user, answer) token counts per turn."""
    from fastserve.bench.multiturn import sample_conversations

    return [[(count(u), count(a)) for u, a in c.turns] for c in sample_conversations(path, n, seed)]


def run_multi_turn(args: argparse.Namespace, model: Path, count) -> dict:
    from engine.simulation import run_conversations
    from fastserve.bench.multiturn import conversation_arrivals

    if args.dataset_name != "sharegpt" or not args.dataset_path:
        raise ValueError("--multi-turn replays ShareGPT conversations: give --dataset-name sharegpt --dataset-path")
    if args.request_rate is None and args.conversation_trace is None:
        raise ValueError("--multi-turn needs --request-rate (conversations per second) or --conversation-trace")
    convs = conversation_lengths(args.dataset_path, args.num_prompts, args.seed, count)
    arrivals = conversation_arrivals(len(convs), args.request_rate, args.burstiness, args.seed,
                                     args.conversation_trace, args.trace_speedup)
    engine = make_engine(args, model)
    t = time.perf_counter()
    result = run_conversations(engine, convs, arrivals, think_time_s=args.think_time,
                               think_time_distribution=args.think_time_distribution, seed=args.seed,
                               max_turns=args.max_turns)
    wall = time.perf_counter() - t
    kv = engine.kv.stats
    return result.summary() | {"offloads": kv.num_offloads, "drops": kv.num_drops, "wall_s": wall,
                               "policy": args.scheduling_policy, "kv_policy": args.kv_policy,
                               "prefix_caching": args.enable_prefix_caching, "rate": args.request_rate}


def make_engine(args: argparse.Namespace, model: Path):
    """The simulated engine of the engine flags: dtype auto is float16 (the profiled GPUs'); the pipeline stages and
    the host tier are the profile's unless --pipeline-parallel-size or --swap-space is given."""
    import dataclasses

    from engine.simulation import simulated_engine

    cfg = config_from_args(args, model=str(model))  # every flag checked here, before the simulation starts
    given = engine_args_given(args)
    settings = dataclasses.asdict(cfg)
    for name in ("model", "profile", "dtype", "block_size", "num_gpu_blocks_override", "num_host_blocks_override",
                 "pipeline_parallel_size", "swap_space"):
        del settings[name]
    if "swap_space" in given:
        settings["swap_space"] = cfg.swap_space
    return simulated_engine(model, cfg.profile, dtype="float16" if cfg.dtype == "auto" else cfg.dtype,
                            block_size=cfg.block_size, num_device_blocks=cfg.num_gpu_blocks_override,
                            num_host_blocks=cfg.num_host_blocks_override,
                            pipeline_parallel_size=given.get("pipeline_parallel_size"),
                            max_in_flight=args.max_in_flight, **settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        summary = run(args)
    except (ValueError, OSError) as e:  # bad paths and values, malformed datasets and profiles (DatasetError)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    for k, v in summary.items():
        print(f"{k:>20}: {v:.4f}" if isinstance(v, float) else f"{k:>20}: {v}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
