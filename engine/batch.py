"""The step's contract between the engine and an executor: what to compute
(ModelBatch) and what came back (BatchResult). Executors receive only these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)  # (made for every job of every step: slots make that cheaper)
class SequenceWork:
    job_id: str
    token_ids: list[int]  # the tokens this iteration computes (their KV is written)
    start_pos: int  # position of token_ids[0] in the sequence (= tokens already cached)
    block_table: list[int]  # device blocks holding positions 0 .. start_pos + len(token_ids) - 1
    params: SamplingParams
    generator: torch.Generator | None  # per-sequence RNG when the request has a seed (in-process executors)
    num_generated: int  # output tokens before this step (for min_tokens)
    want_prompt_logprobs: bool = False  # first iteration of a request that asked for them
    # The prompt: for prompt logprobs, and for the penalties (with output_token_ids); else empty.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # tokens sampled so far, when a penalty needs them
    seed: int | None = None  # the sequence's seed: worker processes build their own generator from it
    # False for a chunk of a prefill that does not reach the end of the context (chunked prefill): its KV is
    # written, nothing is sampled (a seeded generator is not advanced) and its SequenceResult is a placeholder.
    sample: bool = True
    prompt_len: int | None = None  # the request's prompt length (None: start_pos + len(token_ids) - num_generated)
    # Async scheduling: token_ids' last entry is PENDING_TOKEN, the token this sequence samples in the step launched
    # just before this one; the executor puts it in (and at the end of output_token_ids, when they are sent)
    # before computing this step.
    fill_last: bool = False


@dataclass
class ModelBatch:
    seqs: list[SequenceWork]
    eos_token_ids: tuple[int, ...] = ()  # the ids that end a sequence (min_tokens bans them)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


PENDING_TOKEN = -2  # SequenceWork.token_ids' last entry while the token is in flight (fill_last)
NOT_SAMPLED = -1  # SequenceResult.token_id of a sequence that computed a chunk without sampling


@dataclass
class SequenceResult:
    token_id: int
    logprobs: dict[int, float] | None = None  # the sampled token and the top-`logprobs` alternatives
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class BatchResult:
    results: list[SequenceResult]  # one per ModelBatch.seqs entry, same order
    execute_s: float = 0.0  # wall-clock seconds the executor spent
