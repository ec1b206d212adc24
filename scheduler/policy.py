"""The interface every scheduling policy implements, and the two narrow
protocols it talks through: the cost model (profiled iteration times) and the
KV admission verbs that memory/ provides.

A policy decides *which jobs run* each iteration. It never touches tensors or
block ids: it asks `kv.can_fit(job, n)` / `kv.allocate(job, n)` for room and
`kv.evict(job)` to give a job's device blocks back (memory/ chooses whether
that is a drop for recompute or an offload), and reads `job.ready`.

Nothing waits on a copy. A job whose KV is moving is not ready; a job picked
while its KV is on the host starts its upload in allocate() and is not ready
afterwards; a job whose room is being freed by an offload in flight waits
(`kv.wait_for_room`). In each case the job stays where it is in the policy's
order and is simply left out of this tick's batch.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.job import Job


class PolicyName(str, enum.Enum):
    FCFS = "fcfs"
    SKIP_JOIN_MLFQ = "skip-join-mlfq"
    MLFQ = "mlfq"
    FIXED_PRIORITY = "fixed-priority"
    SRPT = "srpt"  # oracle: simulation and tests only, with the starvation bound of the other policies
    SRPT_UNBOUNDED = "srpt-unbounded"  # the same oracle without it
    GITTINS = "gittins"


ORACLES = frozenset({PolicyName.SRPT, PolicyName.SRPT_UNBOUNDED})  # they read true output lengths: no server runs them


class CostModel(Protocol):
    """Profiled iteration costs in seconds (see scheduler/cost_model.py)."""

    def t_init(self, prompt_len: int) -> float:
        """Time of a first iteration (prefill) of a prompt of this length, alone."""
        ...

    def t_dec(self, batch_size: int, context_len: int) -> float:
        """Time of one decode iteration of `batch_size` jobs of this mean context."""
        ...

    def iteration_cost(self, jobs: Sequence[Job]) -> float:
        """Profiled time of one iteration that runs exactly these jobs."""
        ...

    def batch_cost(self, prefill_lens: Sequence[int], decode_context_lens: Sequence[int],
                   chunks: Sequence[tuple[int, int]] = ()) -> float:
        """Profiled time of an iteration of this shape (chunks: (computed prefix, tokens) of prompts)."""
        ...


class Allocation(Protocol):
    """What KVAdmission.allocate did (memory/residency.py's Allocation)."""

    @property
    def new_blocks(self) -> Sequence[int]:
        """Device blocks the call put in the job's table."""
        ...

    @property
    def in_place(self) -> bool:
        """The job's KV was on the device with no copy in flight and only grew: the KV that may_start counts did
        not shrink, so a may_start refusal stays valid past this call (otherwise ask again)."""
        ...

    @property
    def upload(self) -> bool:
        """Its KV was on the host: its upload started, and the job runs once it lands (job.ready)."""
        ...


class KVAdmission(Protocol):
    """The verbs a policy may use on memory/ (implemented by memory.KVManager)."""

    # Which started job an eviction takes first. True (recompute: an evicted job loses its whole context,
    # so vLLM's rule): the job of lowest priority in the policy's order. False (swapping: the job comes
    # back when it is due): the job with the largest estimated wait (ENST), lowest priority on ties.
    victims_by_priority: bool

    def can_fit(self, job: Job, num_new_tokens: int) -> bool:
        """Whether the job's KV can grow by num_new_tokens on the device now
        (counting the allocations already made this tick)."""
        ...

    def allocate(self, job: Job, num_new_tokens: int) -> Allocation | None:
        """Reserve device room for the job's next num_new_tokens (after can_fit); None, with nothing changed, when
        there is no room (can_fit would say no: the caller makes room first, or passes the job over). If its KV
        was on the host this starts the upload and leaves job.ready False: the job does not run this tick."""
        ...

    def wait_for_room(self, job: Job, num_new_tokens: int) -> bool:
        """True if the room the job lacks is being freed by copies in flight (it is promised to the job
        this tick, and the job waits for it); False if more must be evicted (or it cannot run)."""
        ...

    def note_blocked(self, job: Job) -> None:
        """The policy would run this job now but it is not ready (its KV may be moving: swap wait)."""
        ...

    def may_evict_for(self, job: Job) -> bool:
        """Whether other jobs may be evicted to make room for this one (False: it waits for room)."""
        ...

    def may_start(self, job: Job, num_new_tokens: int) -> bool:
        """Overload admission, for a job with no KV (new, or dropped): whether it may start now. The policy asks
        it with num_new_tokens = the job's whole context, even when only a chunk of it runs this iteration
        (chunked prefill: the rest follows within a few iterations). For such a job the answer depends only on
        num_computed + num_new_tokens and does not rise with it, and it changes only through allocate and evict:
        the walk reuses a refusal until an evict, or an allocate that was not in place. A job with nothing
        computed that is not in flight holds no KV."""
        ...

    def parked(self) -> Container[Job]:
        """Jobs whose KV is on the host alone: they hold no device blocks, so evicting one frees nothing."""
        ...

    def room_for(self, num_tokens: int) -> bool:
        """Whether a job with no KV that needs num_tokens could still get its device blocks this tick without
        an eviction: free now, or being freed by copies in flight and not promised to another job."""
        ...

    def parked_unfit(self) -> Container[Job]:
        """Jobs the walk may pass over without asking: can_fit and may_evict_for are both False for each
        (their KV waits on the host for free room that is not there). Holds until the next allocate or
        evict; empty when memory/ cannot say."""
        ...

    def evict(self, job: Job) -> None:
        """Give back the job's device blocks: dropped now, or offloaded (they free when the copy
        completes; see wait_for_room). Afterwards job.num_computed says what survived (0: dropped,
        to be recomputed) and job.ready whether it can run without a transfer."""
        ...


MLFQ_LADDERS = ("service", "prefill")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: PolicyName = PolicyName.SKIP_JOIN_MLFQ
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    starvation_threshold: float | None = 0.3  # alpha, seconds on the engine clock; None = off
    # Overload: a job is promoted only once it has waited max(alpha, this x the recent wait of jobs at
    # their first run) (an EMA); below capacity that wait is under alpha, so this is alpha. None = alpha
    # (the paper's rule, this unit's default; the engine's default is 1, engine/config.py). See
    # scheduler/skip_join_mlfq.py and docs/experiments.md, "Past capacity".
    starvation_factor: float | None = None
    # Age promotion (skip-join MLFQ and naive MLFQ): a job in the system longer than this x the current mean time
    # in the system (Little's law: jobs held / recent completion rate) moves to a band above every queue and
    # runs to completion there, oldest first, so no job waits without bound however much service it has had.
    # None = off.
    starvation_age: float | None = None
    # Skip-join's alike-lengths mode (scheduler/skip_join_mlfq.py, set_alike_lengths): learned from the output
    # lengths of finished jobs; False = the service ladder always (the paper's, and the engine's default).
    adapt_to_alike_lengths: bool = False
    quantum_ratio: float = 2.0
    demotion_step: int = 1  # eta: queues dropped per demotion
    max_prompt_len: int = 2048  # the longest prompt (max_model_len): the last MLFQ quantum covers its t_init
    # The MLFQ ladder: "service" (the engine's default, engine/config.py), the last quantum covers the whole
    # service a job can need (its prefill and max_prompt_len decode steps alone), so jobs keep sinking
    # as they decode and the queues order them by attained service; "prefill" (the paper's, this unit's
    # default), the last covers t_init(max_prompt_len).
    mlfq_ladder: str = "prefill"
    # Chunked prefill: a prompt that does not fit the rest of the iteration's max_num_batched_tokens is split, and
    # its next chunk runs in a later iteration (each chunk charged to the job like any iteration); the decodes of
    # the jobs that ran last iteration keep one token each of the budget ahead of a chunk (SchedulingPolicy.chunk).
    # False: a prompt runs whole or not at all (one too large for the budget runs alone).
    enable_chunked_prefill: bool = False
    # Chunked prefill: at most this many of one prompt's tokens in an iteration (vLLM's long_prefill_token_threshold),
    # however much of the budget is left. 0: no cap but the budget.
    long_prefill_token_threshold: int = 0
    # Pipeline parallelism: with several batches in flight at once, one batch's jobs may hold at most this many
    # tokens of KV (the device's tokens / batches in flight, set by the engine), so the batch the next stage
    # frees is not the only one that can run: without it the most urgent jobs fill the whole device in one
    # batch and the other slot of the pipe stays empty (vLLM's virtual engines split the cache the same way).
    # None = no limit (one batch in flight). The preemptive policies apply it; FCFS's running set alternates
    # between the batches by itself.
    max_batch_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.starvation_threshold is not None and not self.starvation_threshold > 0:
            raise ValueError(f"starvation_threshold must be > 0 seconds, got {self.starvation_threshold}")
        if self.starvation_factor is not None and not self.starvation_factor > 0:
            raise ValueError(f"starvation_factor must be > 0, got {self.starvation_factor}")
        if self.starvation_age is not None and not self.starvation_age > 0:
            raise ValueError(f"starvation_age must be > 0, got {self.starvation_age}")
        if not self.quantum_ratio > 1:
            raise ValueError(f"quantum_ratio must be > 1, got {self.quantum_ratio}")
        if self.demotion_step < 1:
            raise ValueError(f"demotion_step must be >= 1, got {self.demotion_step}")
        if self.max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1 token, got {self.max_prompt_len}")
        if self.max_batch_kv_tokens is not None and self.max_batch_kv_tokens < 1:
            raise ValueError(f"max_batch_kv_tokens must be >= 1 or None, got {self.max_batch_kv_tokens}")
        if self.mlfq_ladder not in MLFQ_LADDERS:
            raise ValueError(f"mlfq_ladder must be one of {', '.join(MLFQ_LADDERS)}, got {self.mlfq_ladder!r}")


@dataclass
class ScheduleDecision:
    # The jobs that run this iteration, each computing job.num_new_tokens tokens.
    batch: list[Job] = field(default_factory=list)
    # Jobs that ran last iteration but not in this one (by policy or for memory).
    preempted: list[Job] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(j.num_scheduled for j in self.batch)


def step_tokens(job: Job) -> int:
    """Tokens the job computes in the iteration the policy put it in (as the cost model's iteration_cost and the
    engine read them): its chunk (num_scheduled) when that is short of the rest of its context (chunked prefill),
    else the rest: the whole context on a first iteration or a recompute, what follows a cached prefix, one token
    for a decode."""
    rest = job.prompt_len + job.num_generated - job.num_computed
    n = job.num_scheduled
    return n if 0 < n < rest else max(1, rest)


def step_charges(jobs: Sequence[Job], cost: float) -> list[float]:
    """The service each job of an iteration is charged (in the order of `jobs`, formed and not yet run): the
    iteration's profiled cost split by the tokens each job computes in it (step_tokens), cost x mine / all.

    Why a share, and a share by tokens. The engine runs an iteration as one pass over the weights for all its
    tokens, plus each part's attention (scheduler/cost_model.py). Charging every job the whole iteration (the
    paper's rule) charges a decode token beside a 1,000-token prompt what the prompt costs: 169 ms on the OPT-13B
    A100 40GB profile, 7 x q1 (24.4 ms), so a job decoding next to new prompts uses up each quantum in a token or
    two, sinks below the queue where new prompts enter (skip-join, by t_init), and is preempted by every new prompt
    until the host tier fills and its KV is dropped. The charges here sum to the iteration's cost, so attained
    service stays in server seconds, the units of the quanta (q1 = a decode step alone, which a job running alone
    is still charged per token) and of t_init: a long prompt's first iteration is charged about its t_init
    whatever runs beside it (1,000 tokens beside 32 decodes at context 512: 180 ms, t_init 168 ms; a little more
    than alone: it takes its tokens' part of the decodes' attention), and a decode token beside it 0.17 ms, about
    a token's share of a large decode step (0.48 ms at batch 256), not the prompt's cost.

    Not the marginal cost (the iteration's cost less that of the iteration without the job): it leaves the pass
    over the weights, most of a decode step, to no one. A decode's charge then jumps from 24.8 ms alone to 0.39 ms
    beside one other decode, charges sum to a third of a 32-decode step's time, and a 20-token prompt beside 200
    decodes at context 300 is charged 2.9 ms of its 24.4 ms t_init: service would measure who ran beside a job,
    not the server time it had."""
    tokens = [step_tokens(job) for job in jobs]
    per_token = cost / sum(tokens) if tokens else 0.0
    return [per_token * n for n in tokens]


def charged(batch: Sequence[Job], cost: float, charges: Mapping[Job, float] | None) -> Iterator[tuple[Job, float]]:
    """(job, its charge) for each job of the batch (on_step_done's arguments): charges[job], or the whole cost
    where no charges are given."""
    return zip(batch, itertools.repeat(cost) if charges is None else map(charges.__getitem__, batch))


class SchedulingPolicy(ABC):
    """Owns the set of unfinished jobs and orders them.

    The engine calls, per iteration: schedule(now, kv) -> run the batch ->
    on_step_done(batch, now, cost, charges); and add/remove as jobs arrive and end.
    """

    name: PolicyName

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost

    @abstractmethod
    def add(self, job: Job, now: float) -> None: ...

    @abstractmethod
    def remove(self, job: Job) -> None:
        """Forget a job that finished or was aborted (its KV is freed by the engine)."""

    @abstractmethod
    def schedule(self, now: float, kv: KVAdmission) -> ScheduleDecision: ...

    @abstractmethod
    def on_step_done(self, batch: Sequence[Job], now: float, cost: float,
                     charges: Mapping[Job, float] | None = None) -> None:
        """The iteration ended at `now`: charge each job of the batch its share of the iteration's profiled cost,
        charges[job] (step_charges; the engine passes them), or, where none are given, the whole cost (a caller that
        drives the policy by hand)."""

    @abstractmethod
    def estimated_wait(self, job: Job, now: float) -> float:
        """Estimated time until the job is next scheduled (ENST for MLFQ policies)."""

    @property
    @abstractmethod
    def jobs(self) -> Sequence[Job]:
        """Every unfinished job the policy holds."""

    def has_work(self) -> bool:
        return bool(self.jobs)

    def _fits_token_budget(self, tokens_so_far: int, job: Job, batch_len: int) -> bool:
        """The batched-token limit; a job too large for it runs alone rather than never."""
        return batch_len == 0 or tokens_so_far + job.num_new_tokens <= self.config.max_num_batched_tokens

    def chunk(self, n: int, tokens_so_far: int, batch_len: int, reserve: int = 0) -> int:
        """Tokens a job with n tokens to compute may compute in this iteration, after tokens_so_far of the
        batch's: n, or 0 when it must wait. Without chunked prefill: n if it fits the budget (or the batch is
        empty: a job too large runs alone). With it, a job of several tokens (a prompt, or the rest of one)
        takes what the budget has left after `reserve` tokens kept for decodes that come later in the walk (the
        jobs that ran last iteration: they are not stalled behind a prompt), at least one token when the batch
        is empty (so the budget is never spent on nothing), and at most long_prefill_token_threshold when set."""
        config = self.config
        budget = config.max_num_batched_tokens
        if n == 1 or not config.enable_chunked_prefill:
            return n if batch_len == 0 or tokens_so_far + n <= budget else 0
        room = budget - tokens_so_far - reserve
        if room < 1:
            room = 0 if batch_len else 1
        cap = config.long_prefill_token_threshold
        return min(n, room, cap) if cap else min(n, room)
