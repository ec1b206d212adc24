"""Writing a Hugging Face model directory: config.json and the weights, in each layout transformers reads.

What it is: the part the random-weight checkpoint writers (opt_checkpoint.py, llama_checkpoint.py) share:
config.json as transformers writes it (sorted, indented), the weights as one model.safetensors, sharded
safetensors with model.safetensors.index.json, or pytorch_model.bin. What it is not: the tensors (each
architecture's writer makes its own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHT_FORMATS = ("safetensors", "sharded", "bin", "none")


def write_checkpoint(out_dir: str | Path, cfg: dict, state_dict: Callable[[dict], dict[str, torch.Tensor]],
                     weight_format: str, dtype: torch.dtype, num_shards: int) -> Path:
    """config.json (torch_dtype set to `dtype`) and, unless weight_format is "none", the weights state_dict(the
    config written) into out_dir; returns it."""
    out = Path(out_dir)
    cfg = write_config(out, cfg, dtype)
    if weight_format != "none":
        write_weights(out, state_dict(cfg), weight_format, num_shards)
    return out


def write_config(out: Path, cfg: dict, dtype: torch.dtype) -> dict:
    """config.json in `out` (made if missing), with torch_dtype set to `dtype`; returns the dict written."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def write_weights(out: Path, sd: dict[str, torch.Tensor], weight_format: str, num_shards: int = 2) -> None:
    """The state dict in `out`. weight_format: safetensors | sharded (num_shards files and the index) | bin."""
    meta = {"format": "pt"}
    if weight_format == "safetensors":
        save_file(sd, str(out / "model.safetensors"), metadata=meta)
    elif weight_format == "sharded":
        names = list(sd)
        weight_map = {}
        for s in range(num_shards):
            fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
            part = names[s::num_shards]
            save_file({k: sd[k].contiguous() for k in part}, str(out / fname), metadata=meta)
            weight_map.update({k: fname for k in part})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    elif weight_format == "bin":
        torch.save({k: t.clone() for k, t in sd.items()}, out / "pytorch_model.bin")
    else:
        raise ValueError(f"weight_format {weight_format!r}: use {', '.join(WEIGHT_FORMATS)}")
