"""Trace-driven simulation: the real Engine (scheduler, KV manager, engine
loop) on a VirtualClock with the SimulatedExecutor.

    engine = simulated_engine(model_dir, profile_path, scheduling_policy="skip-join-mlfq", ...)
    result = run_trace(engine, [(arrival_s, prompt_len, output_len), ...])

A model directory needs only config.json and tokenizer files (scripts/
make_tiny_model.py writes config-only directories for the large shapes). The
profile gives iteration costs and may carry the simulator's extra fields:

    "transfer": {"host_to_device_bytes_per_s": float, "device_to_host_bytes_per_s": float},
    "capacity": {"device_kv_bytes": float, "host_kv_bytes": float}

Explicit block counts override the capacities. What it is not: a model of
anything the profile does not measure (kernel overlap, network, CPU limits).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.engine import Engine
from engine.executor.simulated import SimulatedExecutor, TransferModel
from engine.kv_cache import kv_block_bytes
from engine.model.config import OPTConfig
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

    def per_token_latencies(self) -> list[float]:
        return [o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)) for o in self.outputs]

    def summary(self) -> dict:
        """The paper's metrics (mean and P95 per-token latency), TTFT (mean, P99), ITL (mean, median, P99 over
        every gap between a request's tokens), e2e, the queued / executing /
        swap-wait breakdown (means per request), preemptions, queueing share and executor utilization."""
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
        }


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
    (default: one per stage; 1 runs one batch at a time through the stages)."""
    cfg = OPTConfig.from_model_dir(model_dir)
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
    if num_host_blocks is None:
        num_host_blocks = int(capacity.get("host_kv_bytes", 0) // block_bytes)
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
    engine: Engine, trace: Sequence[tuple[float, int, int]], max_steps: int | None = None
) -> SimulationResult:
    """Feed (arrival_s, prompt_len, output_len) requests at their virtual arrival times; run to the end."""
    clock: VirtualClock = engine.clock
    order = sorted(range(len(trace)), key=lambda i: trace[i][0])
    vocab = engine.model_config.vocab_size
    done: dict[str, RequestOutput] = {}
    nxt, steps = 0, 0
    start = trace[order[0]][0] if order else 0.0
    if clock.now() < start:
        clock.advance(start - clock.now())
    while nxt < len(order) or engine.has_unfinished():
        while nxt < len(order) and trace[order[nxt]][0] <= clock.now():
            i = order[nxt]
            arrival, prompt_len, output_len = trace[i]
            prompt = [2] + [4 + (i + k) % (vocab - 4) for k in range(max(0, prompt_len - 1))]
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
            engine.add_request(str(i), prompt, params, arrival_time=arrival)
            nxt += 1
        before = engine.num_steps
        for out in engine.step() if engine.has_unfinished() else []:
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if max_steps is not None and steps > max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        if engine.num_steps == before:  # nothing ran: jump to the next event
            _advance_to_next_event(engine, clock, trace[order[nxt]][0] if nxt < len(order) else None)
    outputs = [done[str(i)] for i in order]
    end = max((o.metrics.finished_time for o in outputs), default=start)
    return SimulationResult(outputs, end - start, engine.executor.busy_s, engine)


def _advance_to_next_event(engine: Engine, clock: VirtualClock, next_arrival: float | None) -> None:
    now = clock.now()
    executor: SimulatedExecutor = engine.executor
    copy_done = executor.next_copy_completion()
    events = [t for t in (copy_done, next_arrival) if t is not None]
    if not events:
        raise RuntimeError("simulation stalled: jobs wait, but no arrival or copy is pending")
    clock.advance(max(min(events) - now, 0.0) or 1e-9)
