"""load_model_stage: build an OPTStage for one (tp, pp) rank and fill it,
strictly, from a Hugging Face checkpoint.

The model is built on the meta device, materialised on the target device in the
target dtype (never as float32 first) and filled tensor by tensor from
memory-mapped files, reading only this rank's shard of each split tensor.
Strict: every parameter of the stage must be filled with a tensor of the shape
config.json implies; keys the model does not know are reported. Both
`model.decoder.*` and `decoder.*` prefixes load.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.checkpoint_files import CheckpointFiles
from engine.dummy_weights import DummyWeights
from engine.errors import CheckpointError
from engine.model.config import OPTConfig
from engine.model.opt import OPTStage
from engine.parallel import TensorParallelGroup

log = logging.getLogger(__name__)

_PREFIXES = ("model.decoder.", "decoder.")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
# Tensor-parallel split of each per-layer tensor: the dim split across ranks, or None (replicated).
_SPLIT_DIM = {
    "self_attn.out_proj.weight": 1,
    "fc1.weight": 0,
    "fc1.bias": 0,
    "fc2.weight": 1,
}
PROGRESS_BAR_MIN_BYTES = 1 << 30


@dataclass(frozen=True)
class _Target:
    param: str  # local parameter name in the OPTStage
    split_dim: int | None  # dim split across TP ranks
    part: int | None = None  # for fused qkv: which third (q=0, k=1, v=2)


def _target(name: str, stage: OPTStage) -> _Target | None | str:
    """Where a checkpoint tensor goes: a _Target, None (another stage's), or "unexpected"."""
    if name == "lm_head.weight":
        return None  # tied to embed_tokens (OPT always ties); the tied copy is loaded from there
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    else:
        return "unexpected"
    m = _LAYER.fullmatch(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if layer not in stage.layer_range:
            return None if 0 <= layer < stage.cfg.num_hidden_layers else "unexpected"
        local = f"layers.{layer - stage.layer_range.start}."
        proj = rest.split(".")
        if len(proj) == 3 and proj[0] == "self_attn" and proj[1] in _QKV:
            return _Target(local + f"self_attn.qkv_proj.{proj[2]}", 0, _QKV[proj[1]])
        return _Target(local + rest, _SPLIT_DIM.get(rest))
    first = {"embed_positions.weight", "project_in.weight"}
    last = {"final_layer_norm.weight", "final_layer_norm.bias", "project_out.weight"}
    if name == "embed_tokens.weight":
        return _Target(name, None) if (stage.is_first or stage.is_last) else None
    if name in first:
        return _Target(name, None) if stage.is_first else None
    if name in last:
        return _Target(name, None) if stage.is_last else None
    return "unexpected"


def _dtype_from_str(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, float16 or bfloat16")
    return table[dtype]


def load_model_stage(
    model_dir: str | Path,
    cfg: OPTConfig,
    tp: TensorParallelGroup,
    dtype: str | torch.dtype,
    device: str | torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> OPTStage:
    """load_format: "auto" (the directory's checkpoint files) or "dummy" (random weights made on the device from
    config.json alone; engine/dummy_weights.py)."""
    dtype = _dtype_from_str(dtype)
    with torch.device("meta"):
        stage = OPTStage(cfg, tp)
    # The dtype on the meta device (free), then the storage: each parameter is created once, in the target dtype
    # (materialising float32 and casting after would peak at twice the model: ~52 GB for OPT-13B in float16).
    stage = stage.to(dtype).to_empty(device=device)
    params = dict(stage.named_parameters())
    filled: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    layout = tp.layout
    source = DummyWeights(cfg, device, dtype, seed) if load_format == "dummy" else CheckpointFiles(model_dir)
    with source as files:
        names = sorted(files.names())
        bar = tqdm(names, desc=f"loading {Path(model_dir).name}", unit="tensor",
                   disable=files.nbytes() < PROGRESS_BAR_MIN_BYTES)
        for name in bar:
            target = _target(name, stage)
            if target == "unexpected":
                unexpected.append(name)
                continue
            if target is None:
                continue
            param = params.get(target.param)
            if param is None:  # e.g. a bias in a checkpoint whose config says enable_bias=False
                unexpected.append(name)
                continue
            _fill(files, name, param, target, layout.tp_rank, layout.tp_size)
            filled.add((target.param, target.part))
    missing = []
    for pname in params:
        parts = (0, 1, 2) if ".qkv_proj." in pname else (None,)
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


def _fill(files: CheckpointFiles | DummyWeights, name: str, param: torch.Tensor, target: _Target, rank: int,
          size: int) -> None:
    """Copy this rank's shard of checkpoint tensor `name` into `param` (or its qkv third)."""
    dest = param
    if target.part is not None:
        third = param.shape[0] // 3
        dest = param.narrow(0, target.part * third, third)
    expected = list(dest.shape)
    if target.split_dim is not None:
        expected[target.split_dim] *= size
    shape = list(files.shape(name))
    if shape != expected:
        raise CheckpointError(f"tensor {name} has shape {shape}, but config.json implies {expected}")
    if target.split_dim is None:
        tensor = files.read(name)
    else:
        n = dest.shape[target.split_dim]
        tensor = files.read(name, target.split_dim, rank * n, (rank + 1) * n)
    dest.copy_(tensor)
