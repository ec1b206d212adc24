"""analytic_profile: a job profile estimated from the model's shape, used
when no measured profile (`fastserve profile`) is given.

Roofline estimate: an iteration costs max(FLOPs / peak FLOP/s, bytes / memory
bandwidth), with conservative per-device-kind numbers. It only needs to rank
costs sensibly (prefill grows with prompt length, decode with batch and
context); measured profiles replace it for real runs.
"""

from __future__ import annotations

from engine.model.registry import ModelConfig
from scheduler.cost_model import PROFILE_SCHEMA, ProfiledCostModel

# (FLOP/s, bytes/s): sustained, not peak.
DEVICE_SPEED = {"cpu": (5e10, 1e10), "cuda": (3e14, 2e12)}
PREFILL_LENS = [1, 16, 64, 128, 256, 512, 1024, 2048]
DECODE_BATCHES = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXTS = [16, 128, 512, 1024, 2048]
FORWARD_TOKENS = [1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192]


def analytic_profile(cfg: ModelConfig, device_kind: str, dtype_bytes: int, dtype: str) -> ProfiledCostModel:
    flops_s, bytes_s = DEVICE_SPEED.get(device_kind, DEVICE_SPEED["cpu"])
    key = {"model": cfg.name, "dtype": dtype, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
           "hardware": f"{device_kind} (analytic estimate)"}
    return ProfiledCostModel.from_dict(roofline_profile(cfg, flops_s, bytes_s, dtype_bytes, key))


def roofline_profile(cfg: ModelConfig, flops_s: float, bytes_s: float, dtype_bytes: int, key: dict,
                     overhead_per_layer_s: float = 2e-4) -> dict:
    """A profile dict: each iteration costs max(FLOPs / flops_s, bytes moved / bytes_s) plus a fixed
    per-layer overhead (launches, Python). The weights multiplied and read are the parameters less an untied input
    embedding (Llama's embed_tokens: a row lookup; a tied one is the lm head, read whole)."""
    weights = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    overhead = overhead_per_layer_s * cfg.num_hidden_layers

    def cost(tokens: int, kv_bytes: float, attn_flops: float) -> float:
        flops = 2 * weights * tokens + attn_flops
        return overhead + max(flops / flops_s, (weights * dtype_bytes + kv_bytes) / bytes_s)

    attn = lambda q, c: 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * q * c  # noqa: E731
    prefill = [cost(s, s * kv_per_token, attn(s, s) / 2) for s in PREFILL_LENS]
    decode = [[cost(b, b * c * kv_per_token, attn(b, c)) for c in DECODE_CONTEXTS] for b in DECODE_BATCHES]
    forward = [cost(n, n * kv_per_token, 0.0) for n in FORWARD_TOKENS]  # n one-token sequences: no attention
    return {
        "schema": PROFILE_SCHEMA,
        "key": key,
        "prefill": {"prompt_lens": PREFILL_LENS, "seconds": prefill},
        "decode": {"batch_sizes": DECODE_BATCHES, "context_lens": DECODE_CONTEXTS, "seconds": decode},
        "forward": {"tokens": FORWARD_TOKENS, "seconds": forward},
    }
