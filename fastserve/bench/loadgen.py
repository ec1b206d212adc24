"""Load generator: replays a workload against any OpenAI-compatible server (ours or vLLM), streaming, and
reports vLLM benchmark_serving's metrics plus the paper's (per-token latency, throughput at SLO, breakdown).

    fastserve bench serve --base-url http://127.0.0.1:8000 --dataset-name sharegpt \\
        --dataset-path ../shared/datasets/sharegpt/sharegpt_v3_random1000.json --num-prompts 20 --request-rate 4
    fastserve bench serve --backend openai-chat --port 8000 --dataset-name sharegpt --dataset-path ...
    fastserve bench serve ... --sweep 1,2,4,8 --label skip-join --save-result --plot fig11.png
    python -m fastserve.bench.loadgen ...       (the same, without the console script)
    fastserve bench serve --multi-turn --dataset-name sharegpt --dataset-path ... --num-prompts 50 \
        --request-rate 0.5 --think-time 5     (whole conversations, turn by turn: multiturn.py)

Flags follow benchmark_serving's names (--backend openai|openai-chat|vllm, --base-url or --host/--port,
--endpoint, --model, --served-model-name, --tokenizer, --dataset-name, --dataset-path, --num-prompts,
--request-rate, --burstiness, --seed, --ignore-eos, --goodput, --save-result, --result-dir, --result-filename,
--percentile-metrics, --metric-percentiles, --max-concurrency, --disable-tqdm); ours are --slo-per-token,
--sweep, --token-id-prompts, --plot, --compare, --label, --gpt2-bpe, --vocab-size, --max-model-len,
--trace-speedup, --request-timeout, the synthetic lengths, and the multi-turn replay's --multi-turn,
--think-time, --think-time-distribution, --max-turns, --cache-salt, --conversation-trace (with --multi-turn,
--num-prompts counts conversations and --request-rate is conversations per second; the backend defaults to
openai-chat).
Prompts: datasets with text (sharegpt, alpaca) send their text, as vLLM does (--token-id-prompts sends random
ids of the same counted length instead); the others (lengths, azure-*, synthetic) have no text and send random
token ids in [4, vocab) from --seed, exactly the dataset's prompt length, with ignore_eos. The chat backend
(openai-chat) sends `messages` with the text as a content part, as vLLM's does; it needs text. Text is counted
with the served model's tokenizer when it can be found (fastserve/bench/tokens.py says which one it chose).
Trace datasets (azure-*) keep their own arrival times unless --request-rate or --sweep is given. Items that
cannot fit the context (--max-model-len, else what /v1/models says) are dropped.
Each request has a timeout, so a run always ends. Exit status: 0, 1 on an error (unreachable server, bad
dataset), 2 on bad flags, 3 when some requests failed. What this is not: a server, or a simulator (fastserve simulate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from datetime import datetime
from pathlib import Path

try:
    import aiohttp
    import numpy as np
except ImportError as e:  # the system Python: say how to run it instead of a traceback
    raise SystemExit(f"fastserve bench serve: the module {e.name} is missing; run it with the project's "
                     "virtualenv: .venv/bin/fastserve bench serve ..., or `source .venv/bin/activate` first "
                     "(`make test` or `make serve` creates it)") from None
from tqdm import tqdm

from engine.args import OneLineErrorParser
from fastserve.bench.client import RequestResult, ServerInfo, send_request, server_info
from fastserve.bench.metrics import (
    LATENCY_METRICS,
    compute_metrics,
    format_report,
    format_sweep,
    parse_goodput,
    rate_at_slo,
    run_json,
    slo_points,
)
from fastserve.bench.multiturn import THINK_TIME_DISTRIBUTIONS
from fastserve.bench.multiturn import format_summary as format_multi_turn
from fastserve.bench.multiturn import run as run_multi_turn
from fastserve.bench.tokens import TokenCounter, choose_counter, mismatch_warning
from fastserve.bench.workload import DATASETS, TRACE_DATASETS, LengthFilter, WorkItem, filter_line, load_workload

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
TEXT_DATASETS = ("sharegpt", "alpaca")
PROG = "fastserve bench serve"
CHAT_TEMPLATE_MARGIN = 16  # tokens a server's chat template may add around a message


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--backend", choices=sorted(BACKENDS), default=None,
        help="openai and vllm: /v1/completions; openai-chat: /v1/chat/completions with messages "
        "(default: openai; openai-chat with --multi-turn)")
    add("--base-url", help="server root (default: http://HOST:PORT)")
    add("--host", default="127.0.0.1", help="server host when no --base-url (default: %(default)s)")
    add("--port", type=int, default=8000, help="server port when no --base-url (default: %(default)s)")
    add("--endpoint", help="route (default: the backend's, /v1/completions or /v1/chat/completions)")
    add("--model", help="model name to send, and its tokenizer when it is a local directory "
        "(default: the first that /v1/models lists)")
    add("--served-model-name", help="model name to send when it differs from --model")
    add("--dataset-name", choices=(*DATASETS, "random"), default="sharegpt",
        help="random is synthetic (vLLM's name for it) (default: %(default)s)")
    add("--dataset-path", help="the dataset file (not needed for synthetic)")
    add("--num-prompts", type=int, default=100, help="requests per run (default: %(default)s)")
    add("--request-rate", type=float, default=None,
        help="requests/s, 'inf' sends all at once (default: inf; trace datasets: the trace's own times)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson (default: 1)")
    add("--seed", type=int, default=0, help="seeds sampling, arrivals and prompt ids (default: 0)")
    add("--ignore-eos", action="store_true", help="text prompts: generate all max_tokens (token-id prompts always do)")
    add("--goodput", nargs="+", help='SLOs in ms, vLLM format: "ttft:500 tpot:50 e2el:2000"')
    add("--save-result", action="store_true", help="write the result JSON")
    add("--result-dir", default=".", help="where --save-result writes (default: .)")
    add("--result-filename", help="file name for --save-result (default: LABEL-RATEqps-MODEL-DATE.json)")
    add("--percentile-metrics", default=",".join(LATENCY_METRICS),
        help="which of ttft,tpot,itl,e2el to print (default: %(default)s)")
    add("--metric-percentiles", default="99", help="percentiles to print, e.g. 25,50,99 (default: 99)")
    add("--max-concurrency", type=int, default=None, help="most requests in flight (default: unlimited)")
    add("--disable-tqdm", action="store_true", help="no progress bar")
    add("--slo-per-token", type=float, default=0.3, help="per-token latency SLO, seconds (default: 0.3)")
    add("--sweep", help="comma-separated request rates to run in turn, e.g. 1,2,4,8; reports throughput at SLO")
    add("--token-id-prompts", action="store_true",
        help="sharegpt, alpaca: send random token ids of the counted length instead of the text")
    add("--text-prompts", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    add("--plot", help="write a PNG: per-token latency vs rate (Fig. 11) and the breakdown (Fig. 15b)")
    add("--compare", nargs="+", default=[], help="result JSON files of other runs to draw in --plot")
    add("--label", default="", help="name of this run/policy in the report, JSON and plot")
    add("--tokenizer", help="model dir whose tokenizer counts text tokens (sharegpt, alpaca) (default: --model's, "
        "else the served model's when it is a local dir, GGUF file or known name, else the built-in tiny model's)")
    add("--gpt2-bpe", help="dir with GPT-2 encoder.json + vocab.bpe to count text tokens (if no --tokenizer)")
    add("--vocab-size", type=int, help="token-id prompts draw from [4, this) (default: the server's, else 4000)")
    add("--max-model-len", type=int, help="drop items longer than this (default: what /v1/models says)")
    add("--trace-speedup", type=float, default=1.0, help="trace datasets: divide arrival times by this")
    add("--random-input-len", type=int, default=128, help="synthetic: prompt tokens (default: 128)")
    add("--random-output-len", type=int, default=128, help="synthetic: output tokens (default: 128)")
    add("--random-range-ratio", type=float, default=0.0, help="synthetic: uniform within +-this fraction")
    add("--input-output-ratio", type=float, help="synthetic: keep input+output, split it RATIO:1 (Fig. 14)")
    add("--request-timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    add("--multi-turn", action="store_true",
        help="sharegpt: replay whole conversations over chat, each user turn with the history so far, after the "
        "previous answer and a think time; --num-prompts counts conversations, --request-rate is conversations/s")
    add("--think-time", type=float, default=5.0, help="--multi-turn: mean seconds between an answer and the next "
        "user turn (default: %(default)s)")
    add("--think-time-distribution", choices=THINK_TIME_DISTRIBUTIONS, default="exponential",
        help="--multi-turn: how think times are drawn around their mean (default: %(default)s)")
    add("--max-turns", type=int, help="--multi-turn: user turns per conversation at most (default: all)")
    add("--cache-salt", help="--multi-turn: send this cache_salt with every request (vLLM's field)")
    add("--conversation-trace", metavar="CSV",
        help="--multi-turn: open conversations at an Azure 2023 trace's request times (its first --num-prompts), "
        "scaled to --request-rate conversations/s when given (the burst shape kept), else divided by "
        "--trace-speedup (default: a gamma process at --request-rate, --burstiness)")
    return p


class FlagError(SystemExit):
    """A bad flag value: `fastserve bench serve: error: MESSAGE` on stderr, exit status 2 (as argparse's own errors)."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FlagError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def _validate(args: argparse.Namespace) -> None:
    if args.dataset_name == "random":  # `vllm bench serve --dataset-name random`
        args.dataset_name = "synthetic"
    args.backend = args.backend or ("openai-chat" if args.multi_turn else "openai")
    if args.multi_turn:
        if args.dataset_name != "sharegpt" or args.backend != "openai-chat" or args.token_id_prompts:
            raise FlagError("--multi-turn replays ShareGPT conversations as chat: it needs --dataset-name sharegpt, "
                            "the openai-chat backend and text prompts")
        if not (args.think_time >= 0 and math.isfinite(args.think_time)):
            raise FlagError(f"--think-time must be a finite number >= 0, got {args.think_time}")
        if args.max_turns is not None and args.max_turns < 1:
            raise FlagError(f"--max-turns must be >= 1, got {args.max_turns}")
    elif args.max_turns is not None or args.cache_salt is not None or args.conversation_trace is not None:
        raise FlagError("--max-turns, --cache-salt and --conversation-trace go with --multi-turn")
    if args.cache_salt == "":
        raise FlagError("--cache-salt must be a non-empty string")
    if args.dataset_name != "synthetic" and not args.dataset_path:
        raise FlagError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    has_text = args.dataset_name in TEXT_DATASETS
    if args.text_prompts and not has_text:
        raise FlagError("--text-prompts needs a dataset with text (sharegpt, alpaca)")
    if args.text_prompts and args.token_id_prompts:
        raise FlagError("--text-prompts and --token-id-prompts exclude each other")
    args.text_prompts = has_text and not args.token_id_prompts
    if args.backend == "openai-chat" and not args.text_prompts:
        raise FlagError(f"--backend openai-chat sends text: use a dataset with text ({', '.join(TEXT_DATASETS)}) "
                         "without --token-id-prompts")
    if not 0 < args.port < 65536:
        raise FlagError(f"--port must be in 1..65535, got {args.port}")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.endpoint = args.endpoint or BACKENDS[args.backend]
    if args.num_prompts < 1 or args.request_timeout <= 0:
        raise FlagError("--num-prompts must be >= 1 and --request-timeout > 0")
    bad = set(args.percentile_metrics.split(",")) - set(LATENCY_METRICS)
    if bad:
        raise FlagError(f"--percentile-metrics: unknown {', '.join(sorted(bad))}; choose from ttft,tpot,itl,e2el")
    if any(not 0 < p < 100 for p in _floats(args.metric_percentiles, "--metric-percentiles")):
        raise FlagError("--metric-percentiles must lie strictly between 0 and 100")


def token_counter(args: argparse.Namespace, info: ServerInfo | None) -> TokenCounter | None:
    """The text datasets' token counter (tokens.py's choice, printed with a warning when it cannot be
    the server's); None for datasets that give counts."""
    if args.dataset_name not in TEXT_DATASETS:
        return None
    counter = choose_counter(args.tokenizer, args.gpt2_bpe, args.model, info.model if info else None)
    print(f"token counting: {counter.source}")
    warning = mismatch_warning(counter, info.vocab_size if info else None)
    if warning:
        print(warning, file=sys.stderr)
    return counter


def workload_for(args: argparse.Namespace, rate: float | None, max_len: int | None) -> list[WorkItem]:
    limit = max_len
    if max_len and args.text_prompts:  # the server adds BOS to text, and a chat template its own words
        limit = max_len - 1 - (CHAT_TEMPLATE_MARGIN if args.backend == "openai-chat" else 0)
    if args.dataset_name != "synthetic":  # one filter everywhere (vLLM's), within the context
        lf = LengthFilter(max_prompt_len=min(1024, limit), max_total_len=min(2048, limit)) if limit else LengthFilter()
    else:  # generated to the flags' lengths: only what cannot fit is left out
        lf = LengthFilter(min_len=1, max_prompt_len=limit or sys.maxsize, max_total_len=limit or sys.maxsize)
    synthetic = dict(input_len=args.random_input_len, output_len=args.random_output_len,
                     range_ratio=args.random_range_ratio, io_ratio=args.input_output_ratio)
    stats: dict = {}
    items = load_workload(args.dataset_name, args.num_prompts, path=args.dataset_path,
                          count_tokens=args.count_tokens, rate=rate, burstiness=args.burstiness,
                          trace_speedup=args.trace_speedup, length_filter=lf, synthetic=synthetic, seed=args.seed,
                          stats=stats)
    if stats["dropped"]:
        print(filter_line(stats))
    return items


def payloads(args: argparse.Namespace, items: list[WorkItem], model: str, vocab: int) -> list[dict]:
    """One streaming body per item: completions (prompt, max_tokens) or, for openai-chat, chat (messages with a
    text content part, max_completion_tokens), as vLLM's request functions send them."""
    rng = np.random.default_rng(args.seed)
    out = []
    for it in items:
        prompt = it.prompt_text if args.text_prompts else rng.integers(4, vocab, size=it.prompt_len).tolist()
        body: dict = {"model": model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                      "ignore_eos": bool(args.ignore_eos or not args.text_prompts)}
        if args.backend == "openai-chat":
            body.update(messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                        max_completion_tokens=it.output_len)
        else:
            body.update(prompt=prompt, max_tokens=it.output_len)
        out.append(body)
    return out


async def run_once(session: aiohttp.ClientSession, url: str, items: list[WorkItem], bodies: list[dict],
                   args: argparse.Namespace, desc: str) -> tuple[list[RequestResult], float]:
    """Send each body at its item's arrival time; (results in item order, seconds from start to last reply)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(items), desc=desc, disable=args.disable_tqdm, file=sys.stderr)
    start = time.perf_counter()

    async def one(item: WorkItem, body: dict) -> RequestResult:
        result = RequestResult(item.prompt_len, item.output_len)
        if limit:
            await limit.acquire()
        try:
            result.start_s = time.perf_counter() - start
            return await send_request(session, url, body, result, args.request_timeout)
        finally:
            if limit:
                limit.release()
            bar.update(1)

    tasks = []
    for item, body in zip(items, bodies):
        delay = start + item.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(item, body)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def benchmark(args: argparse.Namespace) -> dict:
    """Every run of the invocation; prints reports and returns the result JSON."""
    percentiles = _floats(args.metric_percentiles, "--metric-percentiles")
    goodput = parse_goodput(args.goodput) if args.goodput else None
    shown = [m for m in LATENCY_METRICS if m in args.percentile_metrics.split(",")]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        name = args.served_model_name or args.model
        told = name and args.vocab_size and args.max_model_len
        info = None if told else await server_info(session, args.base_url)
        model = name or info.model
        counter = token_counter(args, info)
        args.count_tokens = counter.count if counter else None
        vocab = args.vocab_size or (info and info.vocab_size) or 4000
        max_len = args.max_model_len or (info and info.max_model_len)
        if args.sweep:
            rates: list[float | None] = _floats(args.sweep, "--sweep")
        else:
            default = None if args.dataset_name in TRACE_DATASETS else math.inf
            rates = [args.request_rate if args.request_rate is not None else default]
        if any(r is not None and not r > 0 for r in rates):
            raise FlagError("request rates must be > 0 (or inf)")
        url = args.base_url + args.endpoint
        runs, rows = [], []
        for rate in rates:
            extra = None
            if args.multi_turn:  # (rate: conversations/s; a sharegpt dataset, so never None)
                offered, label = rate, f"{rate:g} conv/s"
                if args.conversation_trace and not math.isfinite(rate):  # the trace's own times
                    offered, label = None, "conversation trace"
                results, duration, summary, extra = await run_multi_turn(session, url, model, args,
                                                                         args.count_tokens, max_len, rate, label)
            else:
                items = workload_for(args, rate, max_len)
                if len(items) < args.num_prompts:
                    print(f"note: {len(items)} of {args.num_prompts} requests fit (max_model_len {max_len})")
                offered = rate if rate is not None else _offered_rate(items)
                label = "trace" if rate is None else f"{rate:g} req/s"
                results, duration = await run_once(session, url, items, payloads(args, items, model, vocab), args,
                                                   label)
            m = compute_metrics(results, duration, percentiles, goodput)
            print(format_report(m, label, shown, percentiles, goodput))
            if extra is not None:
                print(format_multi_turn(summary))
            for err in sorted({r.error for r in results if r.error})[:5]:
                print(f"  error: {err}")
            run = run_json(offered, args.burstiness, m, results)
            run["trace_speedup"] = args.trace_speedup if rate is None else None
            if extra is not None:
                run.update(extra)
            runs.append((offered, m, run))
            rows.append((label, m))
    # vLLM's top-level fields (mean_ttft_ms, request_throughput, input_lens, ...) are the last run's (the only
    # one without --sweep); `runs` holds every run's, each with our per-token and breakdown fields beside them.
    result = {**runs[-1][2], "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
              "label": args.label, "model_id": model, "tokenizer_id": counter.source if counter else None,
              "base_url": args.base_url, "endpoint": args.endpoint, "dataset_name": args.dataset_name,
              "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency, "seed": args.seed,
              "text_prompts": args.text_prompts, "goodput_config": goodput, "slo_per_token_s": args.slo_per_token,
              "rates": [r for r, _, _ in runs], "runs": [run for _, _, run in runs]}
    if len(runs) > 1:
        print(format_sweep(rows, args.slo_per_token))
        pairs = [(r, m) for r, m, _ in runs]
        failed = [f"{m.failed} at {r:g} req/s" for r, m in pairs if m.failed]
        note = (f" (failed requests: {', '.join(failed)}; a rate with failed requests never counts as meeting "
                "the SLO, whatever its latency)") if failed else ""
        for which in ("mean", "p95"):
            best = rate_at_slo(slo_points(pairs, which), args.slo_per_token)
            result[f"throughput_at_slo_{which}"] = best
            print(f"Throughput at SLO ({which} per-token latency <= {args.slo_per_token:g} s): "
                  + (f"{best:g} req/s" if best is not None else "none of the swept rates") + note)
    return result


def _offered_rate(items: list[WorkItem]) -> float:
    span = items[-1].arrival_s - items[0].arrival_s if items else 0.0
    return (len(items) - 1) / span if span > 0 else math.inf


def jsonable(obj: object) -> object:
    """obj with every non-finite float written as a string ("inf"), so the JSON is strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def result_path(args: argparse.Namespace, result: dict) -> Path:
    if args.result_filename:
        return Path(args.result_dir) / args.result_filename
    rates = "-".join(f"{r:g}" for r in result["rates"])  # "inf" for inf
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(result["model_id"]).name)
    return Path(args.result_dir) / f"{args.label or args.backend}-{rates}qps-{model}-{result['date']}.json"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _validate(args)
        result = asyncio.run(benchmark(args))
    except FlagError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise
    except (RuntimeError, ValueError) as e:  # unreachable server, bad dataset, bad --goodput
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.save_result:
        path = result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(result), allow_nan=False))
        print(f"result saved to {path}")
    if args.plot:
        from fastserve.bench.plot import plot_results

        others = []
        for f in args.compare:  # a run without a label is named after its file in the legend
            other = json.loads(Path(f).read_text())
            other["label"] = other.get("label") or Path(f).stem
            others.append(other)
        plot_results([result, *others], args.plot, args.slo_per_token)
        print(f"plot saved to {args.plot}")
    failed = sum(run["failed"] for run in result["runs"])
    return 0 if failed == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
