"""Which model a checkpoint holds: config.json's `architectures` picks the
config class and the stage class (its `model_type` where it names none); a
GGUF file's metadata stands in for config.json (engine/gguf_checkpoint.py).

    OPTForCausalLM                                     OPTConfig    OPTStage
    LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM  LlamaConfig  LlamaStage

An architecture not in the table is a one-line CheckpointError naming those
that are. What it is not: reading weights (engine/loader.py).
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import CheckpointError
from engine.gguf_checkpoint import GGUFCheckpoint, is_gguf
from engine.model.config import OPTConfig, read_config_json
from engine.model.llama import LlamaStage
from engine.model.llama_config import LLAMA_ARCHITECTURES, LlamaConfig
from engine.model.opt import OPTStage
from engine.model.stage import DecoderStage
from engine.parallel import TensorParallelGroup

ModelConfig = OPTConfig | LlamaConfig

ARCHITECTURES = ("OPTForCausalLM", *LLAMA_ARCHITECTURES)
_BY_MODEL_TYPE = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}


def architecture_of(d: dict) -> str:
    """The supported architecture config.json `d` names, or a one-line CheckpointError."""
    named = d.get("architectures") or []
    if not isinstance(named, list):
        raise CheckpointError(f"config.json: architectures must be a list, got {named!r}")
    for arch in named:
        if arch in ARCHITECTURES:
            return arch
    if not named and d.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[d["model_type"]]
    what = f"architectures {named}" if named else f"no architectures (model_type {d.get('model_type')!r})"
    raise CheckpointError(f"config.json names {what}; supported: {', '.join(ARCHITECTURES)}")


def model_config_from_dict(d: dict, name: str) -> ModelConfig:
    arch = architecture_of(d)
    if arch == "OPTForCausalLM":
        return OPTConfig.from_dict(d, name=name)
    return LlamaConfig.from_dict(d, arch, name=name)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The config of the Hugging Face model directory `model_dir` (its config.json), or of a GGUF file."""
    if is_gguf(model_dir):
        with GGUFCheckpoint(model_dir) as gguf:
            return model_config_from_dict(gguf.config_dict(), Path(model_dir).name)
    return model_config_from_dict(read_config_json(model_dir), Path(model_dir).name)


def build_stage(cfg: ModelConfig, tp: TensorParallelGroup) -> DecoderStage:
    """This rank's stage of the model, its parameters uninitialised (the loader fills them)."""
    return OPTStage(cfg, tp) if isinstance(cfg, OPTConfig) else LlamaStage(cfg, tp)
