"""The job profiler's cost model: profiled iteration times, interpolated.

A profile (written by scripts/profile_model.py, schema "fastserve.profile/1"):

    {
      "schema": "fastserve.profile/1",
      "key": {"model": str, "dtype": str, "tensor_parallel_size": int,
              "pipeline_parallel_size": int, "hardware": str},
      "prefill": {"prompt_lens": [int, ...], "seconds": [float, ...]},
      "decode": {"batch_sizes": [int, ...], "context_lens": [int, ...],
                 "seconds": [[float, ...], ...]}      # [batch_i][context_j]
    }

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
        # Lookups repeat (the same batch sizes and lengths every tick): memoized, as the profile is immutable.
        # Bounded by the distinct (batch size, context) pairs: at most max_num_seqs x max_model_len entries.
        object.__setattr__(self, "_t_init_memo", {})
        object.__setattr__(self, "_t_dec_memo", {})

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> ProfiledCostModel:
        if data.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"profile: schema must be {PROFILE_SCHEMA!r}, got {data.get('schema')!r}")
        try:
            return cls(
                key=dict(data.get("key", {})),
                prefill_lens=tuple(int(x) for x in data["prefill"]["prompt_lens"]),
                prefill_seconds=tuple(float(x) for x in data["prefill"]["seconds"]),
                decode_batch_sizes=tuple(int(x) for x in data["decode"]["batch_sizes"]),
                decode_context_lens=tuple(int(x) for x in data["decode"]["context_lens"]),
                decode_seconds=tuple(tuple(float(x) for x in row) for row in data["decode"]["seconds"]),
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
        return {
            "schema": PROFILE_SCHEMA,
            "key": self.key,
            "prefill": {"prompt_lens": list(self.prefill_lens), "seconds": list(self.prefill_seconds)},
            "decode": {
                "batch_sizes": list(self.decode_batch_sizes),
                "context_lens": list(self.decode_context_lens),
                "seconds": [list(r) for r in self.decode_seconds],
            },
        }

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

    def iteration_cost(self, jobs: Sequence[Job]) -> float:
        """Decode jobs share one step; each first iteration adds its prefill time."""
        prefill: list[int] = []
        decode: list[int] = []
        for j in jobs:  # one pass with plain attributes: this runs every iteration over the whole batch
            context = j.prompt_len + j.num_generated
            if j.num_computed == 0:
                prefill.append(context)  # a first iteration (or a recompute) computes the whole context
            else:
                decode.append(context)
        return self.batch_cost(prefill, decode)

    def batch_cost(self, prefill_lens: Sequence[int], decode_context_lens: Sequence[int]) -> float:
        """Cost of an iteration from its shape: prompts prefilled, and contexts of the decoding jobs."""
        cost = sum(self.t_init(n) for n in prefill_lens)
        if decode_context_lens:
            cost += self.t_dec(len(decode_context_lens), sum(decode_context_lens) // len(decode_context_lens))
        return cost
