"""Random-weight Llama-family checkpoints (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM) in the real Hugging Face layout.

What it is: config.json as each architecture's published checkpoints write it
(rope_theta and rope_scaling, num_key_value_heads, tie_word_embeddings, Qwen2's
sliding-window fields, Mistral's sliding_window) and every tensor under its
Hugging Face name (model.layers.N.self_attn.q_proj.weight, ..., lm_head.weight
when untied), drawn from a seeded CPU generator, written as one or several
safetensors files or pytorch_model.bin (modelmaker/hf_files.py). The tensor
names and shapes are the engine's own (LlamaConfig.checkpoint_shapes), so the
writer and the loader cannot drift apart.

Weights are scaled as the OPT writer's are (modelmaker/opt_checkpoint.py):
logits peaked (std ~LOGIT_STD), layers writing more into the residual stream
than the embedding, so greedy decoding never hinges on a near-tie that float
rounding could flip. What it is not: a trainer, or a source of real weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.model.llama_config import LlamaConfig
from modelmaker.hf_files import write_checkpoint
from modelmaker.opt_checkpoint import LOGIT_STD

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
# Shapes of published checkpoints: their config.json fields that differ from llama_config's defaults, as
# meta-llama/Meta-Llama-3-8B and Meta-Llama-3-70B write them (config only: the simulator and the profiles).
LLAMA_SHAPES: dict[str, dict] = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
}
RESIDUAL_SCALE = 2.0  # o_proj and down_proj: what the layers add to the residual stream
BIAS_STD = 0.1  # large enough that a bias the model ignored would show in the logprobs


def llama_config(architecture: str = "LlamaForCausalLM", vocab_size: int = 512, **overrides) -> dict:
    """A complete config.json dict of `architecture`, as transformers writes one (small shapes by default)."""
    if architecture not in _MODEL_TYPES:
        raise ValueError(f"architecture {architecture!r}: use one of {', '.join(_MODEL_TYPES)}")
    cfg = dict(
        architectures=[architecture], model_type=_MODEL_TYPES[architecture], vocab_size=vocab_size,
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, hidden_act="silu",
        initializer_range=0.02, tie_word_embeddings=False, attention_dropout=0.0, use_cache=True,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    if architecture == "LlamaForCausalLM":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif architecture == "Qwen2ForCausalLM":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    else:
        cfg.update(sliding_window=None)
    cfg.update(overrides)
    return cfg


def random_llama_state_dict(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint of config.json `cfg`, under Hugging Face's names, seeded."""
    shapes = LlamaConfig.from_dict(cfg, cfg["architectures"][0]).checkpoint_shapes()
    g = torch.Generator().manual_seed(seed)
    tied = bool(cfg.get("tie_word_embeddings", False))
    e = cfg["hidden_size"]
    sd: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():  # in the order of checkpoint_shapes: the same draws on every machine
        if name.endswith("norm.weight"):
            t = 1.0 + torch.randn(shape, generator=g) * 0.05
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=g) * BIAS_STD
        elif name == "model.embed_tokens.weight":
            # Tied: the lm_head rows, of norm ~LOGIT_STD against the unit-RMS final norm; untied: unit entries.
            t = torch.randn(shape, generator=g) * (LOGIT_STD / math.sqrt(e) if tied else 1.0)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=g) * (LOGIT_STD / math.sqrt(e))
        else:
            scale = RESIDUAL_SCALE if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            t = torch.randn(shape, generator=g) * (scale / math.sqrt(shape[-1]))
        sd[name] = t.to(dtype)
    return sd


def write_llama_checkpoint(out_dir: str | Path, cfg: dict, seed: int = 0, weight_format: str = "safetensors",
                           dtype: torch.dtype = torch.float32, num_shards: int = 2) -> Path:
    """Write config.json and weights. weight_format: safetensors | sharded | bin | none (config only)."""
    return write_checkpoint(out_dir, cfg, lambda written: random_llama_state_dict(written, seed, dtype),
                            weight_format, dtype, num_shards)
