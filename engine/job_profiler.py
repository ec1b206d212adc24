"""The job profiler: measured iteration costs of a model on the hardware at hand.

What it is: the measuring functions that `fastserve profile` (the CLI)
and engine/profiles.py (the short start-up profile) share. They drive an
executor with real ModelBatches over hand-built block tables and time
`executor.execute()`: the first iteration t_init(s) of one prompt of s tokens
alone, and one decode step of b sequences of context c, each the median of a
few repeats after a warm-up. The result is a ProfiledCostModel in the schema
"fastserve.profile/1" (scheduler/cost_model.py).

What it is not: a choice of which profile to use (engine/profiles.py) or a
scheduler; it only measures.

Block tables use distinct blocks while the cache has room and wrap around it
when it does not (the KV values are garbage either way; only the time counts).
Measured times are made non-decreasing along each axis (a running maximum),
so noise never makes a longer prompt or a larger batch look cheaper.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

import torch

from engine.batch import ModelBatch, SequenceWork
from engine.executor.base import Executor
from engine.sampling_params import SamplingParams
from scheduler.cost_model import PROFILE_SCHEMA, ProfiledCostModel

log = logging.getLogger(__name__)

KEY_FIELDS = ("model", "dtype", "tensor_parallel_size", "pipeline_parallel_size", "hardware")
_GREEDY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class ProfileGrid:
    prompt_lens: tuple[int, ...]  # t_init(s) for each s, one prompt alone
    batch_sizes: tuple[int, ...]  # t_dec(b, c) for each b x c
    context_lens: tuple[int, ...]
    forward_tokens: tuple[int, ...] = ()  # F(n) for each n: n one-token sequences, no context (empty: not measured)
    repeats: int = 3  # timed runs per point (the median is kept)
    warmup: int = 1  # untimed runs per point first

    def clipped(self, max_len: int) -> ProfileGrid:
        """Drop lengths past the model's context; keep the context itself as the last point."""
        def clip(xs: Sequence[int]) -> tuple[int, ...]:
            kept = [x for x in xs if x < max_len]
            return tuple(kept + [max_len]) if len(kept) < len(xs) else tuple(kept)
        return replace(self, prompt_lens=clip(self.prompt_lens), context_lens=clip(self.context_lens))


FULL_GRID = ProfileGrid((1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), (1, 2, 4, 8, 16, 32, 64, 128, 256),
                        (16, 64, 128, 256, 512, 1024, 2048), (1, 4, 16, 64, 256, 512), repeats=5, warmup=2)
QUICK_GRID = ProfileGrid((1, 16, 64, 256, 1024), (1, 4, 16), (16, 128, 512), (1, 16, 64, 256), repeats=3, warmup=1)
STARTUP_GRID = ProfileGrid((1, 16, 64, 256, 512), (1, 8), (16, 256), (1, 64), repeats=2, warmup=1)  # ~0.5 s, tiny, CPU


# -- the key ------------------------------------------------------------------------------------
def hardware_name(device: torch.device) -> str:
    """'cuda: NVIDIA H200' or 'cpu: AMD EPYC 7763 64-Core Processor'."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    name = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{device.type}: {name or platform.processor() or platform.machine() or 'unknown'}"


def profile_key(model: str, dtype: torch.dtype, device: torch.device, tp: int = 1, pp: int = 1) -> dict:
    return {"model": model, "dtype": str(dtype).removeprefix("torch."), "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp, "hardware": hardware_name(device)}


# -- measuring ----------------------------------------------------------------------------------
class _Blocks:
    """Hand-built block tables over an executor's cache: fresh ids, wrapping when it is full."""

    def __init__(self, executor: Executor) -> None:
        if executor.num_device_blocks < 1:
            raise ValueError("the executor's KV cache has no blocks; nothing can be profiled")
        self.num_blocks, self.block_size, self._next = executor.num_device_blocks, executor.block_size, 0

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        ids = [(self._next + i) % self.num_blocks for i in range(n)]
        self._next = (self._next + n) % self.num_blocks
        return ids


def _median_time(run: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall seconds of `repeats` runs after `warmup` untimed ones, to 0.1 us."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # execute() returns Python ints: the device work has finished
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 7)


def _timed_batch(executor: Executor, batch: ModelBatch, repeats: int, warmup: int) -> float:
    """Median seconds of the batch; its synthetic jobs are released afterwards (worker processes keep per-job
    state)."""
    try:
        return _median_time(lambda: executor.execute(batch), repeats, warmup)
    finally:
        executor.release([s.job_id for s in batch.seqs])


def _work(i: int, token_ids: list[int], start_pos: int, table: list[int]) -> SequenceWork:
    return SequenceWork(f"profile-{i}", token_ids, start_pos, table, _GREEDY, None, num_generated=0)


def measure_prefill(executor: Executor, vocab_size: int, prompt_len: int, repeats: int = 3, warmup: int = 1,
                    seed: int = 0) -> float:
    """Seconds of the first iteration of one prompt of prompt_len tokens, alone."""
    gen = torch.Generator().manual_seed(seed + prompt_len)
    ids = torch.randint(4, vocab_size, (prompt_len,), generator=gen).tolist()
    table = _Blocks(executor).table(prompt_len)
    batch = ModelBatch([_work(0, ids, 0, table)])
    return _timed_batch(executor, batch, repeats, warmup)


def measure_decode(executor: Executor, vocab_size: int, batch_size: int, context_len: int, repeats: int = 3,
                   warmup: int = 1, seed: int = 0) -> float:
    """Seconds of one decode step of batch_size sequences, each attending to context_len tokens."""
    gen = torch.Generator().manual_seed(seed + batch_size * 100_003 + context_len)
    tokens = torch.randint(4, vocab_size, (batch_size,), generator=gen).tolist()
    blocks = _Blocks(executor)
    seqs = [_work(i, [t], context_len - 1, blocks.table(context_len)) for i, t in enumerate(tokens)]
    batch = ModelBatch(seqs)
    return _timed_batch(executor, batch, repeats, warmup)


def measure_forward(executor: Executor, vocab_size: int, num_tokens: int, repeats: int = 3, warmup: int = 1,
                    seed: int = 0) -> float:
    """Seconds of one iteration of num_tokens sequences of one token each (one-token prompts): F(n) of
    scheduler/cost_model.py, the forward pass and a logit row per sequence with next to no attention."""
    gen = torch.Generator().manual_seed(seed + 7 * num_tokens + 1)
    tokens = torch.randint(4, vocab_size, (num_tokens,), generator=gen).tolist()
    blocks = _Blocks(executor)
    batch = ModelBatch([_work(i, [t], 0, blocks.table(1)) for i, t in enumerate(tokens)])
    return _timed_batch(executor, batch, repeats, warmup)


def measure_mixed(executor: Executor, vocab_size: int, prompt_lens: Sequence[int], decode_context_lens: Sequence[int],
                  repeats: int = 3, warmup: int = 1, seed: int = 0) -> float:
    """Seconds of one iteration that prefills these prompts and decodes one token for sequences of these
    contexts, all in one batch (as the engine runs a mixed step)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = _Blocks(executor)
    seqs = []
    for p in prompt_lens:
        seqs.append(_work(len(seqs), torch.randint(4, vocab_size, (p,), generator=gen).tolist(), 0, blocks.table(p)))
    for c in decode_context_lens:
        seqs.append(_work(len(seqs), [int(torch.randint(4, vocab_size, (1,), generator=gen))], c - 1,
                          blocks.table(c)))
    return _timed_batch(executor, ModelBatch(seqs), repeats, warmup)


def profile_executor(executor: Executor, vocab_size: int, key: dict, grid: ProfileGrid,
                     progress: Callable[[str], None] | None = None) -> ProfiledCostModel:
    """Measure the grid and return the profile (times monotone along each axis)."""
    say = progress or (lambda _msg: None)
    prefill = []
    for s in grid.prompt_lens:
        prefill.append(measure_prefill(executor, vocab_size, s, grid.repeats, grid.warmup))
        say(f"t_init({s}) = {prefill[-1] * 1e3:.3f} ms")
    decode = []
    for b in grid.batch_sizes:
        row = []
        for c in grid.context_lens:
            row.append(measure_decode(executor, vocab_size, b, c, grid.repeats, grid.warmup))
            say(f"t_dec(batch {b}, context {c}) = {row[-1] * 1e3:.3f} ms")
        decode.append(list(accumulate(row, max)))
    for j in range(len(grid.context_lens)):  # non-decreasing in batch size too
        for i in range(1, len(decode)):
            decode[i][j] = max(decode[i][j], decode[i - 1][j])
    profile = {
        "schema": PROFILE_SCHEMA,
        "key": key,
        "prefill": {"prompt_lens": list(grid.prompt_lens), "seconds": list(accumulate(prefill, max))},
        "decode": {"batch_sizes": list(grid.batch_sizes), "context_lens": list(grid.context_lens),
                   "seconds": decode},
    }
    if grid.forward_tokens:
        forward = []
        for n in grid.forward_tokens:
            forward.append(measure_forward(executor, vocab_size, n, grid.repeats, grid.warmup))
            say(f"F({n} tokens) = {forward[-1] * 1e3:.3f} ms")
        profile["forward"] = {"tokens": list(grid.forward_tokens), "seconds": list(accumulate(forward, max))}
    return ProfiledCostModel.from_dict(profile)
