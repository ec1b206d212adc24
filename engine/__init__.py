"""engine/: requests, sampling, the OPT model, checkpoint loading, the
tokenizer, executors and the engine loop (sync Engine, AsyncEngine, offline LLM)."""

from engine.config import EngineConfig
from engine.errors import CheckpointError, EngineDeadError, ValidationError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # Heavy imports (torch, the model) only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = [
    "AsyncEngine", "CheckpointError", "CompletionOutput", "Engine", "EngineConfig", "EngineDeadError", "LLM",
    "RequestMetrics", "RequestOutput", "SamplingParams", "ValidationError",
]
