"""The job profiler's cost model: profiled iteration times, interpolated.

A profile (written by `fastserve profile`, fastserve/profile.py; schema "fastserve.profile/1"):

    {
      "schema": "fastserve.profile/1",
      "key": {"model": str, "dtype": str, "tensor_parallel_size": int,
              "pipeline_parallel_size": int, "hardware": str},
      "prefill": {"prompt_lens": [int, ...], "seconds": [float, ...]},
      "decode": {"batch_sizes": [int, ...], "context_lens": [int, ...],
                 "seconds": [[float, ...], ...]},     # [batch_i][context_j]
      "forward": {"tokens": [int, ...], "seconds": [float, ...]}   # optional
    }

- t_init(s) = prefill.seconds: the first iteration of one prompt of s tokens, alone.
- t_dec(b, c) = decode.seconds: one decode step of b sequences of context c.
- F(n) = forward.seconds: one iteration of n sequences of one token each and no context (n one-token
  prompts): the pass over the weights, the per-token work and one logit row per sequence. Without a
  "forward" table, F(n) = t_dec(n, the shortest profiled context), which is that plus a short attention.

An iteration is priced as the engine runs it (one flattened forward over all its tokens): with prompts
p_1..p_k prefilled and b decoding sequences of mean context c, T = sum(p_i) + b tokens in all,

    cost = F(T) + sum_i (t_init(p_i) - F(p_i)) + (t_dec(b, c) - F(b))

one pass over the weights for all T tokens, plus what each part adds beyond that pass: a prompt's
attention over itself, the decoders' attention over their contexts. Where F is linear in n the sum is
exact for the per-token work and counts one logit row per sequence. The cost of a part alone is its
profiled time (a single prompt costs t_init(p), a pure decode step t_dec(b, c)), and an iteration never
costs less than its most expensive part alone.

Lookups interpolate linearly (bilinearly for decode) and extrapolate linearly
past the last grid point, so every length has a cost. Pure Python.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scheduler.job import Job

PROFILE_SCHEMA = "fastserve.profile/1"


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x), extended linearly beyond both ends."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class ProfiledCostModel:
    key: dict
    prefill_lens: tuple[int, ...]
    prefill_seconds: tuple[float, ...]
    decode_batch_sizes: tuple[int, ...]
    decode_context_lens: tuple[int, ...]
    decode_seconds: tuple[tuple[float, ...], ...]  # [batch_i][context_j]
    forward_tokens: tuple[int, ...] = ()  # F(n): empty = t_dec(n, decode_context_lens[0])
    forward_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.prefill_lens or len(self.prefill_lens) != len(self.prefill_seconds):
            raise ValueError("profile: prefill.prompt_lens and .seconds must be non-empty and equal in length")
        for name, xs in (
            ("prefill.prompt_lens", self.prefill_lens),
            ("decode.batch_sizes", self.decode_batch_sizes),
            ("decode.context_lens", self.decode_context_lens),
        ):
            if list(xs) != sorted(set(xs)):
                raise ValueError(f"profile: {name} must be strictly increasing, got {list(xs)}")
        if not self.decode_batch_sizes or not self.decode_context_lens:
            raise ValueError("profile: decode.batch_sizes and decode.context_lens must be non-empty")
        if len(self.decode_seconds) != len(self.decode_batch_sizes) or any(
            len(row) != len(self.decode_context_lens) for row in self.decode_seconds
        ):
            raise ValueError("profile: decode.seconds must be a [batch_sizes x context_lens] table")
        if len(self.forward_tokens) != len(self.forward_seconds):
            raise ValueError("profile: forward.tokens and .seconds must be equal in length")
        if list(self.forward_tokens) != sorted(set(self.forward_tokens)):
            raise ValueError(f"profile: forward.tokens must be strictly increasing, got {list(self.forward_tokens)}")
        # Lookups repeat (the same batch sizes and lengths every tick): memoized, as the profile is immutable.
        # Bounded by the distinct (batch size, context) pairs: at most max_num_seqs x max_model_len entries.
        object.__setattr__(self, "_t_init_memo", {})
        object.__setattr__(self, "_t_dec_memo", {})
        object.__setattr__(self, "_forward_memo", {})

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> ProfiledCostModel:
        if data.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"profile: schema must be {PROFILE_SCHEMA!r}, got {data.get('schema')!r}")
        forward = data.get("forward") or {}
        try:
            return cls(
                key=dict(data.get("key", {})),
                prefill_lens=tuple(int(x) for x in data["prefill"]["prompt_lens"]),
                prefill_seconds=tuple(float(x) for x in data["prefill"]["seconds"]),
                decode_batch_sizes=tuple(int(x) for x in data["decode"]["batch_sizes"]),
                decode_context_lens=tuple(int(x) for x in data["decode"]["context_lens"]),
                decode_seconds=tuple(tuple(float(x) for x in row) for row in data["decode"]["seconds"]),
                forward_tokens=tuple(int(x) for x in forward.get("tokens", ())),
                forward_seconds=tuple(float(x) for x in forward.get("seconds", ())),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile: missing or malformed field {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> ProfiledCostModel:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"profile {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        out = {
            "schema": PROFILE_SCHEMA,
            "key": self.key,
            "prefill": {"prompt_lens": list(self.prefill_lens), "seconds": list(self.prefill_seconds)},
            "decode": {
                "batch_sizes": list(self.decode_batch_sizes),
                "context_lens": list(self.decode_context_lens),
                "seconds": [list(r) for r in self.decode_seconds],
            },
        }
        if self.forward_tokens:
            out["forward"] = {"tokens": list(self.forward_tokens), "seconds": list(self.forward_seconds)}
        return out

    # -- the CostModel protocol -----------------------------------------------------------
    def t_init(self, prompt_len: int) -> float:
        memo = self._t_init_memo
        t = memo.get(prompt_len)
        if t is None:
            t = memo[prompt_len] = _interp(self.prefill_lens, self.prefill_seconds, prompt_len)
        return t

    def t_dec(self, batch_size: int, context_len: int) -> float:
        memo = self._t_dec_memo
        t = memo.get((batch_size, context_len))
        if t is None:
            per_batch = [_interp(self.decode_context_lens, row, context_len) for row in self.decode_seconds]
            t = memo[(batch_size, context_len)] = _interp(self.decode_batch_sizes, per_batch, batch_size)
        return t

    def forward(self, num_tokens: int) -> float:
        """F(n): one iteration of n one-token sequences with no context (see the module docstring)."""
        memo = self._forward_memo
        t = memo.get(num_tokens)
        if t is None:
            if self.forward_tokens:
                t = _interp(self.forward_tokens, self.forward_seconds, num_tokens)
            else:
                t = _interp(self.decode_batch_sizes, [row[0] for row in self.decode_seconds], num_tokens)
            memo[num_tokens] = t
        return t

    def iteration_cost(self, jobs: Sequence[Job]) -> float:
        """The iteration's cost from its shape: first iterations (or recomputes) prefill their whole context,
        the other jobs decode one token; a job the policy gave a chunk (job.num_scheduled short of the rest of
        its context: chunked prefill) computes that chunk over the part already computed."""
        prefill: list[int] = []
        chunks: list[tuple[int, int]] = []
        decoded = 0  # the sum of the decoding sequences' contexts (with their number, all batch_cost reads of them)
        for j in jobs:  # one pass with plain attributes: this runs every iteration over the whole batch
            context = j.prompt_len + j.num_generated
            done, n = j.num_computed, j.num_scheduled
            if n == 1 and done and done + 1 == context:  # a decode step (the rules below say so too; most jobs)
                decoded += context
            elif not n or done + n >= context:  # the whole rest of the context
                if done == 0:
                    prefill.append(context)  # a first iteration (or a recompute) computes the whole context
                elif context - done > 1:
                    chunks.append((done, context - done))  # a last chunk, or the tail after a cached prefix
                else:
                    decoded += context
            elif done == 0:
                prefill.append(n)  # a first chunk: a prompt of n tokens
            elif n == 1:
                decoded += done + 1  # a one-token chunk: a decode step's shape
            else:
                chunks.append((done, n))
        b = len(jobs) - len(prefill) - len(chunks)  # every other job decodes
        if not prefill and not chunks:
            return self.t_dec(b, decoded // b) if b else 0.0
        return self._cost(prefill, b, decoded, chunks)

    def chunk_attention(self, prefix: int, n: int) -> float:
        """What a chunk of n prompt tokens after `prefix` computed ones adds beyond the pass over the weights:
        the attention the prompt's first prefix + n tokens have beyond its first prefix tokens',
        (t_init(prefix + n) - F(prefix + n)) - (t_init(prefix) - F(prefix)), at least 0."""
        def beyond(p: int) -> float:
            return self.t_init(p) - self.forward(p) if p else 0.0

        return max(0.0, beyond(prefix + n) - beyond(prefix))

    def batch_cost(self, prefill_lens: Sequence[int], decode_context_lens: Sequence[int],
                   chunks: Sequence[tuple[int, int]] = ()) -> float:
        """Cost of an iteration from its shape (prompts prefilled, contexts of the decoding jobs, and chunks
        (prefix, n) of prompts over their computed prefix): one forward pass over all its tokens plus each part's
        attention (the module docstring's formula; a chunk's part is chunk_attention, and alone it costs
        F(n) plus that)."""
        return self._cost(prefill_lens, len(decode_context_lens), sum(decode_context_lens), chunks)

    def _cost(self, prefill_lens: Sequence[int], b: int, decoded: int, chunks: Sequence[tuple[int, int]]) -> float:
        """batch_cost from b decoding sequences whose contexts sum to `decoded` (the mean is all it reads)."""
        if not prefill_lens and not chunks:
            return self.t_dec(b, decoded // b) if b else 0.0
        if len(prefill_lens) == 1 and not b and not chunks:
            return self.t_init(prefill_lens[0])
        forward, t_init = self.forward, self.t_init
        tokens = b
        cost = 0.0
        floor = 0.0  # the most expensive part alone
        for p in prefill_lens:
            alone = t_init(p)
            cost += alone - forward(p)
            tokens += p
            floor = max(floor, alone)
        for prefix, n in chunks:
            extra = self.chunk_attention(prefix, n)
            cost += extra
            tokens += n
            floor = max(floor, forward(n) + extra)
        if b:
            alone = self.t_dec(b, decoded // b)
            cost += alone - forward(b)
            floor = max(floor, alone)
        return max(floor, cost + forward(tokens))


# The chunk budget's reference iteration: a decode batch of this many sequences at this context.
BUDGET_DECODE_BATCH = 16
BUDGET_DECODE_CONTEXT = 512
# How much longer a streamed token's gap may get while a long prompt is prefilled in chunks (chunked prefill's
# aim, docs/scheduling.md, "Chunked prefill": P99 inter-token latency at most twice the median).
BUDGET_STALL_RATIO = 2.0


def stall_safe_chunk(cost: ProfiledCostModel, block_size: int, cap: int) -> int:
    """The largest chunk of block_size x 2^k prompt tokens (at most cap, at least block_size) whose iteration
    (BUDGET_DECODE_BATCH decodes at BUDGET_DECODE_CONTEXT, plus the chunk over a prefix of that length) the job
    profile prices at most BUDGET_STALL_RATIO x the decodes alone: while a long prompt is prefilled in chunks of
    this size, a streamed token's gap grows at most that much."""
    decodes = [BUDGET_DECODE_CONTEXT] * BUDGET_DECODE_BATCH
    limit = BUDGET_STALL_RATIO * cost.batch_cost([], decodes)
    chunk = block_size
    while chunk * 2 <= cap and cost.batch_cost([], decodes, [(BUDGET_DECODE_CONTEXT, chunk * 2)]) <= limit:
        chunk *= 2
    return chunk


def chunk_budget(cost: ProfiledCostModel, block_size: int, max_num_seqs: int, cap: int) -> int:
    """The default token budget per iteration with chunked prefill (max_num_batched_tokens), from the job profile:
    the stall-safe chunk (stall_safe_chunk), then at least max_num_seqs (vLLM's rule: every sequence of a full
    batch can decode) and at most cap (but never below block_size). On the OPT-13B A100 40GB profile this is 256,
    the budget the simulator measured as the only one keeping P99 ITL under twice the median (docs/benchmarks.md,
    "Chunked prefill")."""
    return max(block_size, min(cap, max(stall_safe_chunk(cost, block_size, cap), max_num_seqs)))
