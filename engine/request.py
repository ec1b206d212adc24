"""RequestState and SequenceState: what the engine tracks per request while
it runs — token ids, detokenizer, stop checks — beside the scheduler's Job.

A request with n > 1 has n sequences, each its own Job (no KV is shared).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer
from scheduler.job import Job


@dataclass(eq=False)
class SequenceState:
    request: RequestState
    index: int
    job: Job
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""  # output text so far (cut at a stop string)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_logprobs_so_far: list | None = None  # prompt logprobs of the chunks computed so far (chunked prefill)
    num_pending: int = 0  # tokens sampled by launched steps and not in output_ids yet (async scheduling)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_stop_strings(self, old_len: int) -> bool:
        """Cut the text at the first stop string that newly appeared; True if one did."""
        stops = self.request.params.stop_strings
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        search_from = max(0, old_len - longest + 1)
        hits = [(i, s) for s in stops if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        # include_stop_str_in_output (vLLM): the text ends with the stop string instead of before it.
        self.text = self.text[: idx + len(stop) if self.request.params.include_stop_str_in_output else idx]
        self.finish("stop", stop)
        return True

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
            self.job.finished = True

    def visible_text(self) -> str:
        """Text safe to show now: while running, a tail that may begin a stop string is held back."""
        params = self.request.params
        stops = params.stop_strings
        if self.finished or not stops or params.include_stop_str_in_output:  # (vLLM holds nothing back then)
            return self.text
        hold = max(len(s) for s in stops) - 1
        return self.text[: max(0, len(self.text) - hold)]

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.output_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens its first step found cached (prefix caching)
    cache_salt: str | None = None  # starts its KV blocks' hash chain: only requests with the same salt share them

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # (asked per request in every step: the common case without a generator)
            return seqs[0].finish_reason is not None
        return all(s.finished for s in seqs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[s.to_output() for s in self.seqs],
            finished=self.finished,
            metrics=replace(self.metrics),
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )
