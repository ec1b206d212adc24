"""What the engine returns: vLLM's output shape plus per-request metrics.

RequestOutput is cumulative (each snapshot holds all text and tokens so far);
streaming consumers diff successive snapshots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Times on the engine clock (seconds); durations derived from them and the
    per-iteration accounting (paper Fig. 15b's breakdown)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    queued_s: float = 0.0  # waiting while not running (includes preempted time)
    executing_s: float = 0.0  # in iterations that ran this request
    swap_wait_s: float = 0.0  # waiting for KV uploads before running
    preemptions: int = 0
    last_token_time: float | None = None  # when the last step that gave the request a token ended
    # Inter-token latencies (vLLM's ITL): the time between successive steps that gave the request tokens, after
    # the first (a request of n sequences: any of them). Shared by every snapshot of a running request (not
    # copied each step); a finished request's is complete. Not in to_dict (the HTTP metrics keep their keys).
    itl_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    @property
    def max_itl_s(self) -> float | None:
        return max(self.itl_s, default=None)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["itl_s"], d["last_token_time"]
        d["ttft_s"] = self.ttft_s
        d["e2e_s"] = self.e2e_s
        return d


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per token: the sampled token and top alternatives
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # message when finish_reason == "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    extra: dict = field(default_factory=dict)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held at its first step (None: caching off)
