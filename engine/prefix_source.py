"""The engine's answers to prefix caching's questions about a job (memory/kv_manager.py, PrefixSource):
its tokens, its cache salt, and whether it may skip a cached prefix."""

from __future__ import annotations

from collections.abc import Sequence


class EnginePrefixSource:
    def __init__(self, seq_of_job: dict) -> None:
        self._seq_of_job = seq_of_job  # Engine._seq_of_job: job id -> SequenceState

    def token_ids(self, job, start: int, end: int) -> Sequence[int]:
        seq = self._seq_of_job[job.job_id]
        prompt = seq.request.prompt_ids
        pl = len(prompt)
        if end <= pl:
            return prompt[start:end]
        return prompt[start:pl] + seq.output_ids[max(0, start - pl):end - pl] if start < pl \
            else seq.output_ids[start - pl:end - pl]

    def cache_salt(self, job) -> str | None:
        return getattr(self._seq_of_job[job.job_id].request, "cache_salt", None)

    def may_reuse(self, job) -> bool:
        # Prompt logprobs need every prompt position computed (vLLM skips the cache for them too).
        return self._seq_of_job[job.job_id].request.params.prompt_logprobs is None
