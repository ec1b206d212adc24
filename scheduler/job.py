"""Job: the per-sequence state that scheduling policies read and update.

What it is: one schedulable sequence (a request with n > 1 has n jobs), its
lengths, its place in the MLFQ, and the service it has been charged on the
engine's clock. What it is not: a holder of tokens, tensors or KV blocks; the
engine keeps token ids, memory/ keeps block ids.

Pure Python: scheduler/ never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Job:
    job_id: str
    prompt_len: int
    max_new_tokens: int
    arrival_time: float
    # The true output length: given only to the SRPT oracle (simulation, tests).
    true_output_len: int | None = None
    priority: int = 0  # request class (vLLM's priority): lower runs first
    # Prompt tokens found cached when the job was added (prefix caching; the engine looks it up at admission):
    # skip-join prices its entry by the rest. An estimate for the entry rule only: the job's real hit is taken
    # at its first allocation (num_computed), which computes more if those blocks were evicted meanwhile.
    num_cached_prompt_tokens: int = 0

    num_generated: int = 0  # output tokens sampled so far
    num_computed: int = 0  # tokens whose KV is in the cache (reset to 0 when KV is dropped)
    # Tokens the job's current iteration computes, set by the policy when it puts the job in a batch:
    # num_new_tokens, or less for a chunk of a prefill (chunked prefill: the rest runs in later iterations).
    num_scheduled: int = 0

    queue: int = 0  # MLFQ level, 0 = Q1 (the highest priority)
    service_in_queue: float = 0.0  # profiled seconds charged while in the current queue
    last_scheduled_time: float = field(default=-1.0)  # engine clock; arrival_time until first run

    kv_ready: bool = True  # all KV on the device and no copy pending (memory/ sets it, through `ready`)
    # Its KV was brought back because the policy picked it (a reactive upload on demand) and it has not run since:
    # memory/ sets it; only another such job may evict it (Victims), so every upload on demand ends in a step.
    kv_pinned: bool = False
    in_flight: bool = False  # in a step that has not completed (the engine sets it; pipeline parallelism)
    # Async scheduling (the engine's async_scheduling): steps launched and not completed that write this job's KV.
    # The job stays schedulable (the next step may take it), but its KV may not be moved or dropped: no eviction,
    # no offload, no free until it is 0 again.
    kv_busy: int = 0
    finished: bool = False

    # Telemetry.
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    num_promotions: int = 0
    num_demotions: int = 0
    service_total: float = 0.0  # profiled seconds charged over the job's life

    def __post_init__(self) -> None:
        if self.last_scheduled_time < 0:
            self.last_scheduled_time = self.arrival_time

    @property
    def ready(self) -> bool:
        """Schedulable now: all KV on the device, no copy pending, not in flight in a pipeline stage."""
        return self.kv_ready and not self.in_flight

    @ready.setter
    def ready(self, value: bool) -> None:  # memory/'s verb: whether the job's KV is in place
        self.kv_ready = value

    @property
    def context_len(self) -> int:
        """Tokens in the sequence: the prompt plus every sampled output token."""
        return self.prompt_len + self.num_generated

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to compute before the next output token: the whole prompt (or, after a drop,
        prompt + output so far) on a first iteration, the rest of it after a chunk of it (chunked prefill),
        else the one new token."""
        return self.context_len - self.num_computed

    @property
    def prefilling(self) -> bool:
        """Partly prefilled: some of its context is computed, more than one token of it is not (chunked
        prefill, or a recompute in chunks)."""
        return 0 < self.num_computed < self.context_len - 1

    def starve_time(self, now: float) -> float:
        """Seconds since the job last ran (or arrived), on the engine clock."""
        return now - self.last_scheduled_time

    def remaining_tokens(self) -> int:
        """Output tokens still to generate, as far as the scheduler may know."""
        target = self.true_output_len if self.true_output_len is not None else self.max_new_tokens
        return max(0, target - self.num_generated)
