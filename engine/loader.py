"""load_model_stage: build the stage of the config's architecture for one
(tp, pp) rank (engine/model/registry.py) and fill it, strictly, from a Hugging
Face checkpoint.

The model is built on the meta device, materialised on the target device in the
target dtype (never as float32 first) and filled tensor by tensor from
memory-mapped files, reading only this rank's shard of each split tensor.
Where each checkpoint tensor goes is the stage's to say (checkpoint_target:
its parameter, the piece this rank reads, the part of a fused parameter).
Strict: every parameter of the stage, every part of a fused one, must be
filled with a tensor of the shape config.json implies; keys the model does not
know are reported.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from engine.checkpoint_files import CheckpointFiles
from engine.dummy_weights import DummyWeights
from engine.errors import CheckpointError
from engine.gguf_checkpoint import GGUFCheckpoint, is_gguf
from engine.model.registry import ModelConfig, build_stage
from engine.model.stage import UNEXPECTED, DecoderStage, WeightTarget
from engine.parallel import TensorParallelGroup

log = logging.getLogger(__name__)

PROGRESS_BAR_MIN_BYTES = 1 << 30


def _dtype_from_str(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, float16 or bfloat16")
    return table[dtype]


def load_model_stage(
    model_dir: str | Path,
    cfg: ModelConfig,
    tp: TensorParallelGroup,
    dtype: str | torch.dtype,
    device: str | torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> DecoderStage:
    """model_dir: a Hugging Face model directory, or a GGUF file (engine/gguf_checkpoint.py). load_format: "auto"
    (the checkpoint's files) or "dummy" (random weights made on the device from config.json alone;
    engine/dummy_weights.py)."""
    dtype = _dtype_from_str(dtype)
    with torch.device("meta"):
        stage = build_stage(cfg, tp)
    # The dtype on the meta device (free), then the storage: each parameter is created once, in the target dtype
    # (materialising float32 and casting after would peak at twice the model: ~52 GB for OPT-13B in float16).
    stage = stage.to(dtype).to_empty(device=device)
    params = dict(stage.named_parameters())
    filled: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    if load_format == "dummy":
        source = DummyWeights(cfg, device, dtype, seed)
    else:
        source = GGUFCheckpoint(model_dir) if is_gguf(model_dir) else CheckpointFiles(model_dir)
    with source as files:
        names = sorted(files.names())
        bar = tqdm(names, desc=f"loading {Path(model_dir).name}", unit="tensor",
                   disable=files.nbytes() < PROGRESS_BAR_MIN_BYTES)
        for name in bar:
            target = stage.checkpoint_target(name)
            if target == UNEXPECTED:
                unexpected.append(name)
                continue
            if target is None:
                continue
            param = params.get(target.param)
            if param is None:  # e.g. a bias in a checkpoint whose config says enable_bias=False
                unexpected.append(name)
                continue
            _fill(files, name, param, target, stage.fused_parts(target.param))
            filled.add((target.param, target.part))
    missing = []
    for pname in params:
        parts = stage.fused_parts(pname) or (None,)
        missing += [pname for p in parts if (pname, p) not in filled]
    if missing:
        raise CheckpointError(
            f"{model_dir}: checkpoint is missing {len(set(missing))} tensor(s) the config needs, e.g. "
            + ", ".join(sorted(set(missing))[:5])
        )
    if unexpected:
        log.warning("%s: %d checkpoint tensor(s) not used by the model: %s", model_dir, len(unexpected),
                    ", ".join(unexpected[:10]))
    return stage.eval()


def _fill(files: CheckpointFiles | DummyWeights, name: str, param: torch.Tensor, target: WeightTarget,
          parts: dict[str, tuple[int, int]]) -> None:
    """Copy this rank's piece of checkpoint tensor `name` into `param` (or into its rows of target.part)."""
    if target.part is not None and target.part not in parts:
        raise CheckpointError(f"tensor {name}: the model has no part {target.part!r} in {target.param}")
    dest = param if target.part is None else param.narrow(0, *parts[target.part])
    index, count = target.piece
    expected = list(dest.shape)
    if target.split_dim is not None:
        expected[target.split_dim] *= count
    shape = list(files.shape(name))
    if shape != expected:
        raise CheckpointError(f"tensor {name} has shape {shape}, but config.json implies {expected}")
    if target.split_dim is None or count == 1:
        tensor = files.read(name)
    else:
        n = dest.shape[target.split_dim]
        tensor = files.read(name, target.split_dim, index * n, (index + 1) * n)
    dest.copy_(tensor)
