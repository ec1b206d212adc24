"""CheckpointFiles: the weight files of a Hugging Face model directory, read
lazily and memory-mapped.

Accepts model.safetensors, sharded safetensors with
model.safetensors.index.json, and pytorch_model*.bin (read with
torch.load(weights_only=True, mmap=True): never plain pickle). Safetensors is
preferred when both are present. What it is not: the mapping of names onto
the model (engine/loader.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import CheckpointError


def _index_files(model_dir: Path, index_name: str) -> list[Path]:
    index = model_dir / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is malformed: {e}") from None
    files = sorted({model_dir / f for f in weight_map.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index} names shard files that are missing: {', '.join(missing)}")
    return files


def find_weight_files(model_dir: Path) -> tuple[str, list[Path]]:
    """('safetensors' | 'bin', files) for a model directory, or a clear error."""
    if (model_dir / "model.safetensors.index.json").is_file():
        return "safetensors", _index_files(model_dir, "model.safetensors.index.json")
    if (model_dir / "model.safetensors").is_file():
        return "safetensors", [model_dir / "model.safetensors"]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return "safetensors", shards
    if (model_dir / "pytorch_model.bin.index.json").is_file():
        return "bin", _index_files(model_dir, "pytorch_model.bin.index.json")
    if (model_dir / "pytorch_model.bin").is_file():
        return "bin", [model_dir / "pytorch_model.bin"]
    raise CheckpointError(
        f"{model_dir} has no weights: expected model.safetensors, model.safetensors.index.json "
        "with its shards, or pytorch_model.bin"
    )


class CheckpointFiles:
    """Context manager over the weight files: names(), shape(name), read(name, dim, start, stop)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.kind, self.files = find_weight_files(self.model_dir)
        self._stack = ExitStack()
        self._where: dict[str, object] = {}  # name -> safe_open handle or loaded state dict

    def __enter__(self) -> CheckpointFiles:
        for path in self.files:
            if self.kind == "safetensors":
                try:
                    handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                except Exception as e:  # safetensors raises its own error types
                    raise CheckpointError(f"{path.name} is not a readable safetensors file: {e}") from None
                for name in handle.keys():
                    self._where[name] = handle
            else:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:
                    raise CheckpointError(
                        f"{path.name} could not be read as a weights-only torch checkpoint: {e}"
                    ) from None
                if not isinstance(state, dict):
                    raise CheckpointError(f"{path.name} does not hold a state dict")
                for name in state:
                    self._where[name] = state
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._where.clear()

    def names(self) -> Iterator[str]:
        return iter(list(self._where))

    def shape(self, name: str) -> tuple[int, ...]:
        src = self._where[name]
        if isinstance(src, dict):
            return tuple(src[name].shape)
        return tuple(src.get_slice(name).get_shape())

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor, or only [start:stop) along `dim` (read without loading the rest)."""
        src = self._where[name]
        if isinstance(src, dict):
            t = src[name]
            return t if dim is None else t.narrow(dim, start, stop - start)
        if dim is None:
            return src.get_tensor(name)
        index = [slice(None)] * len(self.shape(name))
        index[dim] = slice(start, stop)
        return src.get_slice(name)[tuple(index)]
