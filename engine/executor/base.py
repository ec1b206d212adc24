"""Executor: runs one ModelBatch and returns the sampled tokens.

Implementations: LocalExecutor (world size 1, in this process), and later a
multi-process TP/PP executor and a SimulatedExecutor for the simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.batch import BatchResult, ModelBatch


class Executor(ABC):
    num_device_blocks: int
    block_size: int

    @abstractmethod
    def execute(self, batch: ModelBatch) -> BatchResult: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and device memory (nothing to do in process)."""
