"""LLM: the offline API, with vLLM's shapes.

    from engine import LLM, SamplingParams
    llm = LLM(model=None)                       # None: the built-in tiny model
    outs = llm.generate(["Hello", [2, 100, 7]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].text

engine_args are the CLI flags in snake_case (engine/config.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine import Engine, Prompt
from engine.errors import ValidationError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        return list(prompts)
    raise ValidationError("prompts must be a string, a list of token ids, or a list of those", param="prompt")


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.engine.emit_running_outputs = False
        self._ids = itertools.count()
        # Worker processes (tensor/pipeline parallelism) end with the LLM: on close(), leaving a `with` block,
        # garbage collection, or exit. The in-process model, KV cache and graphs are freed by close() and `with`
        # (Engine.close); garbage collection of the LLM alone leaves them usable, since code may keep its engine
        # (llm.engine), which then frees them when it is collected itself.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def close(self) -> None:
        """Release the engine now: its device memory comes back at once, even while this object (or its engine)
        is still referenced, so a next LLM in the process sizes its KV cache against all of the device."""
        self.engine.close()
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """priority: vLLM's, one request class per prompt (lower first; default 0 for all)."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValidationError(
                    f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts; pass one, or one per prompt"
                )
        if priority is None:
            priority = [0] * len(prompt_list)
        elif not isinstance(priority, Sequence) or isinstance(priority, str) or len(priority) != len(prompt_list):
            raise ValidationError(f"priority must be a list of one integer per prompt ({len(prompt_list)}), "
                                  f"got {priority!r}"[:200], param="priority")
        # Validate every request before admitting any, so a bad one changes nothing.
        states = [
            self.engine.prepare_request(str(next(self._ids)), p, sp, priority=pr)
            for p, sp, pr in zip(prompt_list, param_list, priority)
        ]
        for st in states:
            self.engine.admit(st)
        finished: dict[str, RequestOutput] = {}
        wanted = {st.request_id for st in states}
        while wanted - finished.keys():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        while self.engine.in_flight and not self.engine.requests:  # (async scheduling: a step past an EOS)
            self.engine.step()
        return [finished[st.request_id] for st in states]
