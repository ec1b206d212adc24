"""Trace-driven simulation: the real Engine (scheduler, KV manager, engine
loop) on a VirtualClock with the SimulatedExecutor.

    engine = simulated_engine(model_dir, profile_path, scheduling_policy="skip-join-mlfq", ...)
    result = run_trace(engine, [(arrival_s, prompt_len, output_len), ...])

A model directory needs only config.json and tokenizer files (`fastserve
make-model` writes config-only directories for the large shapes). The
profile gives iteration costs and may carry the simulator's extra fields:

    "transfer": {"host_to_device_bytes_per_s": float, "device_to_host_bytes_per_s": float},
    "capacity": {"device_kv_bytes": float, "host_kv_bytes": float}

Explicit block counts override the capacities. What it is not: a model of
anything the profile does not measure (kernel overlap, network, CPU limits).
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.engine import Engine
from engine.executor.simulated import SimulatedExecutor, TransferModel
from engine.kv_cache import kv_block_bytes
from engine.model.registry import load_model_config
from engine.outputs import RequestOutput
from engine.parallel import ParallelLayout
from engine.sampling_params import SamplingParams
from scheduler.cost_model import ProfiledCostModel

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class SimulationResult:
    outputs: list[RequestOutput]  # finished, in arrival order
    duration_s: float  # virtual seconds from the first arrival to the last finish
    busy_s: float  # virtual seconds the executor computed
    engine: Engine
    sent: int = 0  # requests sent (run_trace: all of the trace unless its stop hook ended the arrivals)
    unfinished: list[RequestOutput] = field(default_factory=list)  # still in the engine when run_trace's `until` cut it

    @property
    def upload_wait_s(self) -> float:
        """Virtual seconds the steps waited for KV uploads: no step ran while requests were pending and an
        upload was in flight (SimulatedExecutor.note_idle)."""
        return self.engine.executor.upload_wait_s

    def per_token_latencies(self) -> list[float]:
        return [o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)) for o in self.outputs]

    def summary(self) -> dict:
        """The paper's metrics (mean and P95 per-token latency), TTFT (mean, P99), ITL (mean, median, P99 over
        every gap between a request's tokens), e2e, the queued / executing /
        swap-wait breakdown (means per request), preemptions, queueing share, executor utilization, and the upload
        stall: the seconds steps waited for KV uploads, and their share of the executor's time (computing or so
        waiting)."""
        outs = self.outputs
        per_token = self.per_token_latencies()
        mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
        e2e = sum(o.metrics.e2e_s for o in outs)
        itl = [gap for o in outs for gap in o.metrics.itl_s]  # every gap between a request's tokens
        return {
            "requests": len(outs),
            "duration_s": self.duration_s,
            "mean_per_token_s": mean(per_token),
            "p95_per_token_s": p95(per_token),
            "mean_ttft_s": mean([o.metrics.ttft_s for o in outs]),
            "p99_ttft_s": quantile([o.metrics.ttft_s for o in outs], 0.99),
            "mean_itl_s": mean(itl),
            "median_itl_s": quantile(itl, 0.5),
            "p99_itl_s": quantile(itl, 0.99),
            "mean_e2e_s": mean([o.metrics.e2e_s for o in outs]),
            "mean_queued_s": mean([o.metrics.queued_s for o in outs]),
            "mean_executing_s": mean([o.metrics.executing_s for o in outs]),
            "mean_swap_wait_s": mean([o.metrics.swap_wait_s for o in outs]),
            "preemptions": sum(o.metrics.preemptions for o in outs),
            "queueing_share": sum(o.metrics.queued_s for o in outs) / e2e if e2e else 0.0,
            "utilization": self.busy_s / self.duration_s if self.duration_s else 0.0,
            "upload_stall_s": self.upload_wait_s,
            "upload_stall_share": stall_share(self.upload_wait_s, self.busy_s),
        }


def stall_share(wait_s: float, busy_s: float) -> float:
    """Seconds steps waited on copies as a share of the executor's time: computing, or so waiting."""
    return wait_s / (busy_s + wait_s) if busy_s + wait_s > 0 else 0.0


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by the project's one rule, numpy.percentile's default and so vLLM's benchmark's
    (and the load generator's, fastserve/bench/metrics.py): linear interpolation between the sorted values at
    positions floor(q * (n - 1)) and the next. 0.0 if empty."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p95(xs: Sequence[float]) -> float:
    """The 95th percentile as the simulator reports it (quantile 0.95)."""
    return quantile(xs, 0.95)


def simulated_engine(
    model_dir: str | Path,
    profile: str | Path,
    *,
    dtype: str = "float16",
    block_size: int = 16,
    num_device_blocks: int | None = None,
    num_host_blocks: int | None = None,
    pipeline_parallel_size: int | None = None,
    max_in_flight: int | None = None,
    **engine_args,
) -> Engine:
    """pipeline_parallel_size: stages (default: the profile key's); max_in_flight: batches in the pipe at once
    (default: one per stage; 1 runs one batch at a time through the stages). The host tier: num_host_blocks, else
    engine_args' swap_space GiB when given, else the profile's capacity."""
    cfg = load_model_config(model_dir)
    data = json.loads(Path(profile).read_text())
    if pipeline_parallel_size is None:
        pipeline_parallel_size = int(data.get("key", {}).get("pipeline_parallel_size", 1))
    cost = ProfiledCostModel.from_dict(data)
    layout = ParallelLayout()
    block_bytes = kv_block_bytes(cfg, layout, block_size, _torch_dtype(dtype))
    capacity = data.get("capacity", {})
    if num_device_blocks is None:
        if "device_kv_bytes" not in capacity:
            raise ValueError(f"{profile}: give num_device_blocks or a capacity.device_kv_bytes field")
        num_device_blocks = int(capacity["device_kv_bytes"] // block_bytes)
    if num_host_blocks is None:  # swap_space GiB when given, else the profile's host tier, else the engine's default
        host_bytes = (engine_args["swap_space"] * (1 << 30) if "swap_space" in engine_args
                      else capacity.get("host_kv_bytes", EngineConfig.swap_space * (1 << 30)))
        num_host_blocks = int(host_bytes // block_bytes)
    transfer = TransferModel(**data.get("transfer", {}))
    clock = VirtualClock()
    executor = SimulatedExecutor(cost, clock, num_device_blocks, block_size, block_bytes, transfer,
                                 dtype=_torch_dtype(dtype), pipeline_parallel_size=pipeline_parallel_size,
                                 max_in_flight=max_in_flight)
    config = EngineConfig(model=str(model_dir), profile=str(profile), dtype=dtype, block_size=block_size,
                          num_gpu_blocks_override=num_device_blocks, num_host_blocks_override=num_host_blocks,
                          **engine_args)
    engine = Engine(config, clock=clock, executor=executor)
    engine.emit_running_outputs = False
    return engine


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def run_trace(
    engine: Engine, trace: Sequence[tuple[float, int, int]], max_steps: int | None = None,
    stop: Callable[[Engine], bool] | None = None, until: float | None = None,
) -> SimulationResult:
    """Feed (arrival_s, prompt_len, output_len) requests at their virtual arrival times; run to the end.

    stop: asked before each round of arrivals (the engine loop's turn); once it answers True, no more requests are
    sent, and the run goes on until those sent have finished. until: the run is cut at this virtual time, the
    requests still in the engine then left unfinished. The result's `sent` counts the requests sent, `unfinished`
    holds those cut (their RequestOutputs as they stood), `outputs` those that finished."""
    clock: VirtualClock = engine.clock
    order = sorted(range(len(trace)), key=lambda i: trace[i][0])
    done: dict[str, RequestOutput] = {}
    nxt, steps, stopped = 0, 0, False
    start = trace[order[0]][0] if order else 0.0
    if clock.now() < start:
        clock.advance(start - clock.now())
    while until is None or clock.now() < until:
        stopped = stopped or (stop is not None and stop(engine))
        while not stopped and nxt < len(order) and trace[order[nxt]][0] <= clock.now():
            add_trace_request(engine, order[nxt], *trace[order[nxt]])
            nxt += 1
        sending = not stopped and nxt < len(order)
        if not sending and not engine.has_unfinished():
            break
        before = engine.num_steps
        for out in engine.step() if engine.has_unfinished() else []:
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if max_steps is not None and steps > max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        if engine.num_steps == before:  # nothing ran: jump to the next event
            advance_to_next_event(engine, clock, trace[order[nxt]][0] if sending else None)
    outputs = [done[str(i)] for i in order[:nxt] if str(i) in done]
    end = max((o.metrics.finished_time for o in outputs), default=start)
    return SimulationResult(outputs, end - start, engine.executor.busy_s, engine, nxt,
                            [req.to_output() for req in engine.requests.values()])


def add_trace_request(engine: Engine, index: int, arrival: float, prompt_len: int, output_len: int) -> None:
    """Request `index` of a trace (its id str(index)): a prompt of prompt_len distinct-ish token ids that asks
    for exactly output_len tokens (greedy, ignore_eos)."""
    vocab = engine.model_config.vocab_size
    prompt = [2] + [4 + (index + k) % (vocab - 4) for k in range(max(0, prompt_len - 1))]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    engine.add_request(str(index), prompt, params, arrival_time=arrival)


def advance_to_next_event(engine: Engine, clock: VirtualClock, next_arrival: float | None) -> None:
    """Nothing ran: move the clock to the next copy's completion or `next_arrival`, whichever comes first (the
    time passed is a copy stall when requests wait: SimulatedExecutor.note_idle)."""
    now = clock.now()
    executor: SimulatedExecutor = engine.executor
    copy_done = executor.next_copy_completion()
    events = [t for t in (copy_done, next_arrival) if t is not None]
    if not events:
        raise RuntimeError("simulation stalled: jobs wait, but no arrival or copy is pending")
    seconds = max(min(events) - now, 0.0) or 1e-9
    executor.note_idle(seconds, engine.has_unfinished())
    clock.advance(seconds)


# -- multi-turn chat --------------------------------------------------------------------------------------------
THINK_TIME_DISTRIBUTIONS = ("exponential", "constant")


@dataclass
class ChatTurn:
    conversation: int  # index into the conversations given
    number: int  # 1 = the conversation's first user turn
    output: RequestOutput

    @property
    def prompt_len(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def cached_tokens(self) -> int:
        return self.output.num_cached_tokens or 0


@dataclass
class ConversationResult:
    turns: list[ChatTurn]  # every finished turn, in the order they were sent
    duration_s: float  # virtual seconds from the first arrival to the last finish
    busy_s: float
    ended: dict[str, int]  # how conversations ended: completed (every turn) / context (the next did not fit)
    engine: Engine

    def summary(self) -> dict:
        """The simulator's summary over every turn (SimulationResult.summary), plus the prompt tokens sent, those
        the prefix cache held at each turn's first step, and the hit rate (cached / sent)."""
        outs = [t.output for t in self.turns]
        prompt = sum(t.prompt_len for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        base = SimulationResult(outs, self.duration_s, self.busy_s, self.engine).summary()
        return base | {"conversations": sum(self.ended.values()), "completed": self.ended.get("completed", 0),
                       "ended_by_context": self.ended.get("context", 0), "turns": len(self.turns),
                       "prompt_tokens": prompt, "cached_tokens": cached,
                       "hit_rate": cached / prompt if prompt else 0.0}


def run_conversations(
    engine: Engine,
    conversations: Sequence[Sequence[tuple[int, int]]],
    arrivals: Sequence[float],
    *,
    think_time_s: float = 5.0,
    think_time_distribution: str = "exponential",
    seed: int = 0,
    max_turns: int | None = None,
    max_steps: int | None = None,
) -> ConversationResult:
    """Replay chats as the load generator does (fastserve/bench/multiturn.py): conversation i opens at
    arrivals[i]; its turns are (user tokens, answer tokens) pairs. Each turn's prompt is the whole history, the
    earlier user turns and the engine's own answers, token for token, then the new user turn (its ids drawn per
    conversation, so conversations share nothing); it asks for the answer's length (at least 1, ignore_eos). A
    turn is sent once the previous answer has finished plus a think time (mean think_time_s, exponential or
    constant; drawn per conversation from the seed). A conversation ends after its last turn (or max_turns), or
    before a turn whose prompt and answer would not fit the engine's context."""
    if think_time_distribution not in THINK_TIME_DISTRIBUTIONS:
        raise ValueError(f"think_time_distribution must be one of {', '.join(THINK_TIME_DISTRIBUTIONS)}")
    if len(arrivals) != len(conversations):
        raise ValueError(f"{len(arrivals)} arrival times for {len(conversations)} conversations")
    clock: VirtualClock = engine.clock
    vocab, limit = engine.model_config.vocab_size, engine.max_model_len
    rngs = [random.Random(seed * 1_000_003 + i) for i in range(len(conversations))]
    history: list[list[int]] = [[2] for _ in conversations]  # BOS, then the conversation so far
    pending: list[tuple[float, int, int]] = [(at, i, 0) for i, at in enumerate(arrivals)]  # (send time, conv, turn)
    heapq.heapify(pending)
    sent: dict[str, tuple[int, int]] = {}
    turns: list[ChatTurn] = []
    order: dict[str, int] = {}
    ended = {"completed": 0, "context": 0}
    start = min(arrivals, default=0.0)
    if clock.now() < start:
        clock.advance(start - clock.now())
    steps = 0

    def send(at: float, i: int, k: int) -> None:
        turns_of = conversations[i][:max_turns] if max_turns else conversations[i]
        if k >= len(turns_of):
            ended["completed"] += 1
            return
        user_len, answer_len = max(1, turns_of[k][0]), max(1, turns_of[k][1])
        prompt = history[i] + [rngs[i].randrange(4, vocab) for _ in range(user_len)]
        if len(prompt) + answer_len > limit:
            ended["context"] += 1
            return
        rid = f"{i}-{k + 1}"
        params = SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True, detokenize=False)
        engine.add_request(rid, prompt, params, arrival_time=at)
        sent[rid] = (i, k)
        order[rid] = len(order)

    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= clock.now():
            send(*heapq.heappop(pending))
        before = engine.num_steps
        for out in engine.step() if engine.has_unfinished() else []:
            if not out.finished:
                continue
            i, k = sent.pop(out.request_id)
            turns.append(ChatTurn(i, k + 1, out))
            history[i] = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            rng = rngs[i]
            think = (rng.expovariate(1.0 / think_time_s) if think_time_distribution == "exponential"
                     else think_time_s) if think_time_s > 0 else 0.0
            heapq.heappush(pending, (out.metrics.finished_time + think, i, k + 1))
        steps += 1
        if max_steps is not None and steps > max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        if engine.num_steps == before and (pending or engine.has_unfinished()):
            advance_to_next_event(engine, clock, pending[0][0] if pending else None)
    turns.sort(key=lambda t: order[t.output.request_id])
    end = max((t.output.metrics.finished_time for t in turns), default=start)
    return ConversationResult(turns, end - start, engine.executor.busy_s, ended, engine)
