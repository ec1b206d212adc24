"""Executors: where a batch runs (see base.py). make_executor picks one from the engine's config."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.executor.base import Executor, ExecutorDeadError
from engine.model.registry import ModelConfig


def make_executor(config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int) -> Executor:
    """LocalExecutor for one device; MultiprocExecutor (one worker per device) for tp * pp > 1."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1 and config.nnodes == 1:
        from engine.executor.local import LocalExecutor

        return LocalExecutor(
            model_dir, model_cfg, dtype=config.dtype, device=config.device, block_size=config.block_size,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.sizing_batched_tokens, max_model_len=max_model_len, seed=config.seed,
            load_format=config.load_format, max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager,
            attention_backend=config.attention_backend,
        )
    from engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_dir, model_cfg, max_model_len)


__all__ = ["Executor", "ExecutorDeadError", "make_executor"]
