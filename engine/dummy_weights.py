"""DummyWeights: `--load-format dummy` (vLLM's name): random weights for a
config-only model directory, made on the target device, so OPT-13B/66B- or
Llama-shaped models can be benchmarked and served without a checkpoint.

It answers the loader exactly as CheckpointFiles does (names, shapes, reads of
one rank's shard), with the tensors of a Hugging Face checkpoint of the
config's architecture (its checkpoint_shapes()), so the same strict mapping
fills the model. Each tensor is drawn whole from a
generator seeded by its name and then sliced: every rank of every layout sees
the same model, so outputs do not depend on tp or pp. Scales keep activations
bounded (weights ~ 1/sqrt(fan-in), norm weights at 1, biases at 0); the text is
gibberish. What it is not: an initialisation for training.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from engine.model.registry import ModelConfig


class DummyWeights:
    def __init__(self, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        self._shapes = cfg.checkpoint_shapes()

    def __enter__(self) -> DummyWeights:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def names(self) -> Iterator[str]:
        return iter(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def nbytes(self) -> int:
        return 0  # nothing is read from disk

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):  # OPT's *_layer_norm, Llama's *_layernorm and final norm
            t = torch.ones(shape, dtype=self.dtype, device=self.device)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=self.dtype, device=self.device)
        else:
            gen = torch.Generator(device=self.device).manual_seed(self.seed ^ zlib.crc32(name.encode()))
            t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
            t = t.mul_(1.0 / math.sqrt(shape[-1])).to(self.dtype)
        return t if dim is None else t.narrow(dim, start, stop - start)
