"""SamplingParams: how to pick each output token and when to stop, with
vLLM's field names and defaults. Validated at construction: a bad value raises
ValidationError naming the field and the allowed range (the server's 400)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ValidationError

MAX_N = 32
MAX_LOGPROBS = 20


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an integer, got {value!r}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ValidationError(f"{name} must be {rng}, got {value}", param=name)


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(f"{name} must be a number, got {value!r}", param=name)
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be finite, got {value}", param=name)
    return float(value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no stop strings) - the simulator's setting
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValidationError(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValidationError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValidationError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}", param="top_k")
        _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValidationError(f"seed must fit in 64 bits (between {-(2**63)} and {2**63 - 1})", param="seed")
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True)
        if not isinstance(self.ignore_eos, bool):
            raise ValidationError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", param="ignore_eos")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValidationError("stop must be a non-empty string or a list of non-empty strings", param="stop")
        self.stop_strings = stop
        if stop and not self.detokenize:
            raise ValidationError("stop strings need detokenize=True", param="stop")
        ids = self.stop_token_ids or []
        if not isinstance(ids, list):
            raise ValidationError("stop_token_ids must be a list of integers", param="stop_token_ids")
        for i in ids:
            _check_int("stop_token_ids", i, 0)
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def sequence_seed(self, index: int) -> int | None:
        """The seed of output sequence `index` of n (distinct per sequence, fixed per request)."""
        if self.seed is None:
            return None
        return self.seed if index == 0 else hash((self.seed, index)) & (2**63 - 1)
