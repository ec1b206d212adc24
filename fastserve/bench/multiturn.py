"""Multi-turn chat replay (docs/kv-cache.md, "Prefix caching"): ShareGPT conversations sent turn by turn to
/v1/chat/completions.

    fastserve bench serve --multi-turn --dataset-name sharegpt \\
        --dataset-path ../shared/datasets/sharegpt/sharegpt_v3_random1000.json --num-prompts 50 \\
        --request-rate 0.5 --think-time 5

What this is: --num-prompts conversations (a seeded sample) arrive by the arrival process (--request-rate
conversations per second, gamma with --burstiness: Poisson by default; inf opens them all at once), so many are
open at once. A conversation's first user turn is sent when it arrives; each later one is sent with the whole
history as chat messages (the earlier user turns and the server's own answers, as a chat client keeps them),
once the previous answer has arrived and a think time has passed (--think-time mean seconds,
--think-time-distribution exponential (the default) or constant; per conversation, seeded). Each turn asks for
as many tokens as the dataset's answer has (max_completion_tokens, at least 1). A conversation ends after its
last turn, after --max-turns, at a failed turn, or before a turn that would not fit the context (estimated
from the token counter plus a template margin per message; a server's context-length 400 ends it the same way
and does not count as a failure).
The report: the load generator's metrics over every turn (TTFT, TPOT, ITL, E2EL, per-token latency), TTFT and
per-token latency by turn number (1, 2, 3, 4+), and the prefix-cache hit rate, the sum of
usage.prompt_tokens_details.cached_tokens over the sum of usage.prompt_tokens (turns that report it; "n/a" on
a server that does not, e.g. caching off).
What this is not: the simulator's multi-turn workload (not built), or a tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from fastserve.bench.arrivals import gamma_arrivals, trace_arrivals
from fastserve.bench.client import RequestResult, send_request
from fastserve.bench.workload import Conversation, DatasetError, read_azure_trace, read_sharegpt_conversations

THINK_TIME_DISTRIBUTIONS = ("exponential", "constant")
MESSAGE_MARGIN = 8  # tokens a chat template may add around each message (the estimate that ends a conversation)
TEMPLATE_MARGIN = 16  # and around the whole prompt
TURN_BUCKETS = ("1", "2", "3", "4+")


@dataclass
class Turn:
    conversation: int  # index into the sampled conversations
    number: int  # 1 = the conversation's first user turn
    result: RequestResult


def sample_conversations(path: str, n: int, seed: int) -> list[Conversation]:
    convs = read_sharegpt_conversations(path)
    if not convs:
        raise DatasetError(f"{path}: no conversation has a human turn answered by a gpt turn")
    rng = random.Random(seed)
    return rng.sample(convs, n) if n <= len(convs) else [rng.choice(convs) for _ in range(n)]


def conversation_arrivals(n: int, rate: float | None, burstiness: float = 1.0, seed: int = 0,
                          trace: str | None = None, trace_speedup: float = 1.0) -> list[float]:
    """When each of n conversations opens: a gamma process at `rate` conversations/s (burstiness 1: Poisson), or
    with `trace` (an Azure 2023 trace CSV, fastserve/bench/workload.py) the trace's first n request times,
    relative to the first; then, with a rate, scaled so that n conversations open at that mean rate (the trace's
    burst shape kept), else divided by trace_speedup."""
    if trace is None:
        if rate is None:
            raise ValueError("conversation arrivals need a rate (conversations/s) or a trace")
        return gamma_arrivals(n, rate, burstiness, seed)
    stamps = [it.arrival_s for it in read_azure_trace(trace)[:n]]
    if len(stamps) < n:
        raise DatasetError(f"{trace}: {len(stamps)} requests, fewer than the {n} conversations to time")
    times = trace_arrivals(stamps, trace_speedup)
    if rate is not None and math.isfinite(rate) and n > 1:
        if not times[-1] > 0:
            raise DatasetError(f"{trace}: its first {n} requests arrive at one instant; no rate to scale")
        scale = (n - 1) / rate / times[-1]  # the mean gap becomes 1 / rate
        times = [t * scale for t in times]
    return times


def think_time(rng: np.random.Generator, mean: float, distribution: str) -> float:
    if mean <= 0:
        return 0.0
    return float(rng.exponential(mean)) if distribution == "exponential" else mean


async def replay(session: aiohttp.ClientSession, url: str, model: str, conversations: list[Conversation],
                 arrivals: list[float], args: argparse.Namespace, count_tokens, max_len: int | None,
                 desc: str) -> tuple[list[Turn], float, Counter]:
    """Play every conversation; (turns in the order they finished, seconds from start to the last reply, how
    conversations ended: completed / context / failed)."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    max_turns = args.max_turns or sys.maxsize
    total = sum(min(len(c.turns), max_turns) for c in conversations)
    bar = tqdm(total=total, desc=desc, disable=args.disable_tqdm, file=sys.stderr)
    turns: list[Turn] = []
    ended: Counter = Counter()
    start = time.perf_counter()

    async def converse(index: int, conv: Conversation, at: float) -> None:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rng = np.random.default_rng([args.seed, index])
        messages: list[dict] = []
        history = 0  # counted tokens of the messages so far
        pairs = conv.turns[:max_turns]
        for number, (user, answer) in enumerate(pairs, 1):
            if number > 1:
                await asyncio.sleep(think_time(rng, args.think_time, args.think_time_distribution))
            user_len, out_len = count_tokens(user), max(1, count_tokens(answer))
            estimate = history + user_len + MESSAGE_MARGIN * (len(messages) + 1) + TEMPLATE_MARGIN
            if max_len and estimate + out_len > max_len:
                ended["context"] += 1
                bar.update(len(pairs) - number + 1)
                return
            messages.append({"role": "user", "content": user})
            body = {"model": model, "messages": list(messages), "max_completion_tokens": out_len,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": bool(args.ignore_eos)}
            if args.cache_salt:
                body["cache_salt"] = args.cache_salt
            result = RequestResult(estimate, out_len)
            if limit:
                await limit.acquire()
            try:
                result.start_s = time.perf_counter() - start
                await send_request(session, url, body, result, args.request_timeout)
            finally:
                if limit:
                    limit.release()
            bar.update(1)
            if result.prompt_tokens is not None:
                result.prompt_len = result.prompt_tokens  # the server's count, template included
            if not result.success and result.error.startswith("HTTP 400") and "context" in result.error:
                ended["context"] += 1  # our estimate was short: the conversation outgrew the context
                bar.update(len(pairs) - number)
                return
            turns.append(Turn(index, number, result))
            if not result.success:
                ended["failed"] += 1
                bar.update(len(pairs) - number)
                return
            messages.append({"role": "assistant", "content": result.generated_text})
            history += user_len + count_tokens(result.generated_text)
        ended["completed"] += 1

    await asyncio.gather(*(converse(i, c, t) for i, (c, t) in enumerate(zip(conversations, arrivals))))
    duration = time.perf_counter() - start
    bar.close()
    return turns, duration, ended


def bucket(number: int) -> str:
    return str(number) if number < 4 else "4+"


def hit_rate(results: list[RequestResult]) -> float | None:
    """Prompt tokens read from the prefix cache / prompt tokens, over the results that report both."""
    told = [r for r in results if r.success and r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in told)
    return sum(r.cached_tokens for r in told) / prompt if prompt else None


def summarize(turns: list[Turn], ended: Counter, num_conversations: int) -> dict:
    """Conversations, turns, the hit rate overall and by turn number, mean TTFT and per-token latency by turn."""
    ok = [t for t in turns if t.result.success]
    by_turn = {}
    for name in TURN_BUCKETS:
        rs = [t.result for t in ok if bucket(t.number) == name]
        by_turn[name] = {
            "turns": len(rs),
            "mean_ttft_ms": float(np.mean([r.ttft for r in rs])) * 1000 if rs else None,
            "mean_per_token_latency_s": float(np.mean([r.latency / r.output_tokens for r in rs if r.output_tokens]))
            if any(r.output_tokens for r in rs) else None,
            "prefix_cache_hit_rate": hit_rate(rs),
        }
    results = [t.result for t in ok]
    return {"conversations": num_conversations, "conversations_completed": ended["completed"],
            "conversations_ended_by_context": ended["context"], "conversations_failed": ended["failed"],
            "turns": len(turns), "turns_ok": len(ok),
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
            "cached_tokens": sum(r.cached_tokens or 0 for r in results),
            "prefix_cache_hit_rate": hit_rate(results), "by_turn": by_turn}


def format_summary(s: dict) -> str:
    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    rows = ["{:-^50}".format("Multi-turn"),
            f"{'Conversations (done/context/failed):':<40}{s['conversations_completed']}/"
            f"{s['conversations_ended_by_context']}/{s['conversations_failed']} of {s['conversations']}",
            f"{'Turns (ok of sent):':<40}{s['turns_ok']} of {s['turns']}",
            f"{'Prefix cache hit rate (cached/prompt):':<40}{num(s['prefix_cache_hit_rate'], '.1%')}",
            f"{'turn':>6} {'n':>6} {'mean TTFT ms':>13} {'mean s/tok':>11} {'hit rate':>9}"]
    for name, b in s["by_turn"].items():
        rows.append(f"{name:>6} {b['turns']:>6} {num(b['mean_ttft_ms'], '13.2f'):>13} "
                    f"{num(b['mean_per_token_latency_s'], '11.4f'):>11} {num(b['prefix_cache_hit_rate'], '.1%'):>9}")
    return "\n".join(rows)


async def run(session: aiohttp.ClientSession, url: str, model: str, args: argparse.Namespace, count_tokens,
              max_len: int | None, rate: float, desc: str) -> tuple[list[RequestResult], float, dict, dict]:
    """One multi-turn run at `rate` conversations/s: (every turn's result, duration, the summary, the run's
    extra JSON fields: the summary and per-turn conversation index, turn number, cached tokens)."""
    conversations = sample_conversations(args.dataset_path, args.num_prompts, args.seed)
    arrivals = conversation_arrivals(len(conversations), rate, args.burstiness, args.seed,
                                     args.conversation_trace, args.trace_speedup)
    turns, duration, ended = await replay(session, url, model, conversations, arrivals, args, count_tokens,
                                          max_len, desc)
    summary = summarize(turns, ended, len(conversations))
    extra = {"multi_turn": summary, "think_time_s": args.think_time, "conversation_trace": args.conversation_trace,
             "think_time_distribution": args.think_time_distribution,
             "conversation_indices": [t.conversation for t in turns], "turn_numbers": [t.number for t in turns],
             "prompt_tokens": [t.result.prompt_tokens for t in turns],
             "cached_tokens": [t.result.cached_tokens for t in turns]}
    return [t.result for t in turns], duration, summary, extra
