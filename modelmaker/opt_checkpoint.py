"""Random-weight OPT checkpoints in the real Hugging Face layout.

What it is: the writer behind `fastserve make-model` (fastserve/make_model.py), the built-in tiny
model (modelmaker/tiny_model.py) and the tests' checkpoints — config.json plus weights (single or sharded
safetensors, or pytorch_model.bin), named exactly as facebook/opt-* name them,
from a seeded CPU generator so every machine writes identical bytes.

Weights are scaled so logits are peaked (std ~8): greedy decoding then never
hinges on a near-tie that float rounding between code paths could flip
(DESIGN.md, invariants). What it is not: a trainer, or a source of real weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.model.config import POSITION_OFFSET
from modelmaker.hf_files import write_checkpoint

# Shapes of the published checkpoints (their config.json fields that matter).
OPT_SHAPES: dict[str, dict] = {
    "opt-125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072),
    "opt-350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
                     word_embed_proj_dim=512, do_layer_norm_before=False),
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192),
    "opt-2.7b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, ffn_dim=10240),
    "opt-6.7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384),
    "opt-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480),
    "opt-30b": dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56, ffn_dim=28672),
    "opt-66b": dict(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72, ffn_dim=36864),
    "opt-175b": dict(hidden_size=12288, num_hidden_layers=96, num_attention_heads=96, ffn_dim=49152),
}
TINY_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, ffn_dim=1024)
LOGIT_STD = 8.0


def opt_config(vocab_size: int = 50272, max_position_embeddings: int = 2048, **overrides) -> dict:
    """A complete OPT config.json dict, as transformers writes one."""
    cfg = dict(
        architectures=["OPTForCausalLM"], model_type="opt", vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, hidden_size=768, num_hidden_layers=12,
        num_attention_heads=12, ffn_dim=3072, do_layer_norm_before=True, _remove_final_layer_norm=False,
        word_embed_proj_dim=None, activation_function="relu", dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, init_std=0.02, enable_bias=True,
        layer_norm_elementwise_affine=True, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        tie_word_embeddings=True, use_cache=True, torch_dtype="float32",
    )
    cfg.update(overrides)
    if cfg["word_embed_proj_dim"] is None:
        cfg["word_embed_proj_dim"] = cfg["hidden_size"]
    return cfg


def random_opt_state_dict(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of an OPT checkpoint, under the `model.decoder.` names, seeded."""
    g = torch.Generator().manual_seed(seed)
    e, f, p, v = cfg["hidden_size"], cfg["ffn_dim"], cfg["word_embed_proj_dim"], cfg["vocab_size"]
    n_layers = cfg["num_hidden_layers"]
    bias = cfg.get("enable_bias", True)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def linear(prefix: str, out_f: int, in_f: int, scale: float = 1.0) -> None:
        sd[prefix + ".weight"] = normal(out_f, in_f, std=scale / math.sqrt(in_f))
        if bias:
            sd[prefix + ".bias"] = normal(out_f, std=0.02)

    def layer_norm(prefix: str, dim: int) -> None:
        sd[prefix + ".weight"] = (1.0 + torch.randn(dim, generator=g) * 0.05).to(dtype)
        sd[prefix + ".bias"] = normal(dim, std=0.02)

    sd: dict[str, torch.Tensor] = {}
    d = "model.decoder."
    # Peaked logits: lm_head rows (the tied embeddings) of norm ~LOGIT_STD against unit-variance hidden states.
    sd[d + "embed_tokens.weight"] = normal(v, p, std=LOGIT_STD / math.sqrt(p))
    sd[d + "embed_positions.weight"] = normal(cfg["max_position_embeddings"] + POSITION_OFFSET, e, std=2.0)
    if p != e:
        sd[d + "project_in.weight"] = normal(e, p, std=1 / math.sqrt(p))
        sd[d + "project_out.weight"] = normal(p, e, std=1 / math.sqrt(e))
    # Layers write more into the residual stream than the (tied, large) token embedding does, so the
    # next token is not simply the current one again.
    residual_scale = 2.0
    for i in range(n_layers):
        lp = f"{d}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            linear(lp + "self_attn." + proj, e, e)
        linear(lp + "self_attn.out_proj", e, e, residual_scale)
        layer_norm(lp + "self_attn_layer_norm", e)
        linear(lp + "fc1", f, e)
        linear(lp + "fc2", e, f, residual_scale)
        layer_norm(lp + "final_layer_norm", e)
    if cfg.get("do_layer_norm_before", True) and not cfg.get("_remove_final_layer_norm", False):
        layer_norm(d + "final_layer_norm", e)
    sd["lm_head.weight"] = sd[d + "embed_tokens.weight"]
    return sd


def write_opt_checkpoint(
    out_dir: str | Path,
    cfg: dict,
    seed: int = 0,
    weight_format: str = "safetensors",
    dtype: torch.dtype = torch.float32,
    num_shards: int = 2,
    prefix: str = "model.decoder.",
) -> Path:
    """Write config.json and weights. weight_format: safetensors | sharded | bin | none (config only)."""

    def state_dict(written: dict) -> dict[str, torch.Tensor]:
        sd = random_opt_state_dict(written, seed, dtype)
        del sd["lm_head.weight"]  # tied: HF's save_pretrained leaves it out too
        return {prefix + k.removeprefix("model.decoder."): t for k, t in sd.items()}

    return write_checkpoint(out_dir, cfg, state_dict, weight_format, dtype, num_shards)
