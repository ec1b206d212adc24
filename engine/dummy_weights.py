"""DummyWeights: `--load-format dummy` (vLLM's name): random weights for a
config-only model directory, made on the target device, so OPT-13B/66B-shaped
models can be benchmarked and served without a checkpoint.

It answers the loader exactly as CheckpointFiles does (names, shapes, reads of
one rank's shard), with the tensors of a Hugging Face OPT checkpoint, so the
same strict mapping fills the model. Each tensor is drawn whole from a
generator seeded by its name and then sliced: every rank of every layout sees
the same model, so outputs do not depend on tp or pp. Scales keep activations
bounded (weights ~ 1/sqrt(fan-in), layer norms at 1 and 0); the text is
gibberish. What it is not: an initialisation for training.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from engine.model.config import POSITION_OFFSET, OPTConfig

_PREFIX = "model.decoder."


class DummyWeights:
    def __init__(self, cfg: OPTConfig, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        e, f, p, v = cfg.hidden_size, cfg.ffn_dim, cfg.word_embed_proj_dim, cfg.vocab_size
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (v, p),
            "embed_positions.weight": (cfg.max_position_embeddings + POSITION_OFFSET, e),
        }
        if cfg.has_projections:
            shapes["project_in.weight"] = (e, p)
            shapes["project_out.weight"] = (p, e)
        if cfg.has_final_layer_norm:
            shapes["final_layer_norm.weight"] = shapes["final_layer_norm.bias"] = (e,)
        for i in range(cfg.num_hidden_layers):
            layer = f"layers.{i}."
            linears = {"self_attn.q_proj": (e, e), "self_attn.k_proj": (e, e), "self_attn.v_proj": (e, e),
                       "self_attn.out_proj": (e, e), "fc1": (f, e), "fc2": (e, f)}
            for name, shape in linears.items():
                shapes[layer + name + ".weight"] = shape
                if cfg.enable_bias:
                    shapes[layer + name + ".bias"] = shape[:1]
            if cfg.layer_norm_elementwise_affine:
                for norm in ("self_attn_layer_norm", "final_layer_norm"):
                    shapes[layer + norm + ".weight"] = shapes[layer + norm + ".bias"] = (e,)
        self._shapes = {_PREFIX + k: s for k, s in shapes.items()}

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
        if name.endswith("_norm.weight"):
            t = torch.ones(shape, dtype=self.dtype, device=self.device)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=self.dtype, device=self.device)
        else:
            gen = torch.Generator(device=self.device).manual_seed(self.seed ^ zlib.crc32(name.encode()))
            t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
            t = t.mul_(1.0 / math.sqrt(shape[-1])).to(self.dtype)
        return t if dim is None else t.narrow(dim, start, stop - start)
