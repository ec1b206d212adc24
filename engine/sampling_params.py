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


def check_cache_salt(salt) -> None:
    """vLLM's `cache_salt` request field: None or a non-empty string (the engine and the HTTP layer both ask)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValidationError(f"cache_salt must be a non-empty string, got {salt!r}"[:200], param="cache_salt")


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(f"{name} must be a number, got {value!r}", param=name)
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be finite, got {value}", param=name)
    return float(value)


def _parse_logit_bias(value) -> dict[int, float] | None:
    """{token id: bias}; JSON keys are strings of ids ("50256"), as OpenAI's API sends them. Biases lie in
    [-100, 100] (OpenAI's range). An empty map is None (off)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValidationError(f"logit_bias must be a map of token id to bias, got {value!r}"[:200], param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key) if isinstance(key, str) else key
        except ValueError:
            token = None
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValidationError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}",
                                  param="logit_bias")
        bias = _check_float("logit_bias", bias)
        if not -100 <= bias <= 100:
            raise ValidationError(f"logit_bias values must be between -100 and 100, got {bias} for token {token}",
                                  param="logit_bias")
        out[token] = bias
    return out or None


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
    skip_special_tokens: bool = True  # False: special tokens ("</s>") stay in the output text
    # False: a special (added) token right after another gets no space the tokenizer's decoder puts before it
    # (vLLM's rule; byte-level BPE decoders such as OPT's put none, so both settings give the same text there).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # True: the stop string (or stop token's text) ends the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (text: BOS + last N-1)
    detokenize: bool = True  # False: token ids only (no text, no stop strings) - the simulator's setting
    # vLLM's logits adjustments (engine/logits_processors.py), all off by default.
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or output (CTRL's rule)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, before everything else
    min_p: float = 0.0  # drop tokens less probable than min_p x the most probable one
    stop_strings: list[str] = field(init=False, repr=False)
    uses_history: bool = field(init=False, repr=False)  # a penalty needs the prompt and output tokens

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
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(f"{name} must be a boolean, got {getattr(self, name)!r}"[:200], param=name)
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, allow_none=True)
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
        self._check_logits_adjustments()

    def _check_logits_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValidationError(f"{name} must be between -2 and 2, got {value}", param=name)
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValidationError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
                                  param="repetition_penalty")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValidationError(f"min_p must be between 0 and 1, got {self.min_p}", param="min_p")
        self.logit_bias = _parse_logit_bias(self.logit_bias)
        self.uses_history = (self.presence_penalty != 0 or self.frequency_penalty != 0
                             or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def sequence_seed(self, index: int) -> int | None:
        """The seed of output sequence `index` of n (distinct per sequence, fixed per request)."""
        if self.seed is None:
            return None
        return self.seed if index == 0 else hash((self.seed, index)) & (2**63 - 1)
