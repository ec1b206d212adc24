"""Rotary position embedding (RoPE) as Hugging Face's Llama computes it.

inverse_frequencies: the D/2 frequencies of a head of D dims, in float32, with
rope_theta and the "linear" or "llama3" scaling of rope_scaling (the formulas
of transformers' modeling_rope_utils). Rotary: per step, the cos and sin of
each token's position (float32 products, then cast to the model's dtype, as
transformers does), applied to q and k with the rotate-half convention
(dims i and i + D/2 form a pair): on the CPU by one compiled kernel, the one
the compiled Llama decode loop runs (cpu_decode_extension.llama_kernel), elsewhere
with torch ops.

Nothing is tabulated per position: a step computes [T, D] angles for its own
tokens (a table for Llama 3's 131,072 positions would be 64 MiB a device).

Legend: T tokens of the step, H heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model.llama_config import RopeConfig
from fastserve_kernels import cpu_decode_extension


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [D/2] float32, on the CPU
    # The device is explicit: stages are built under torch.device("meta"), and these are not loaded weights.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        context = rope.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = context / rope.low_freq_factor, context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long waves (beyond the pre-training context) are stretched by factor, short ones kept, and the ones
        # between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass
class Rotation:
    """The cos and sin of a step's positions, [T, 1, D] each (broadcast over heads)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, H, D], a new tensor
        if (kernel := cpu_decode_extension.llama_kernel("rotary", x)) is not None:  # on the CPU: one kernel
            return kernel(x, self.cos, self.sin)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rotated * self.sin


class Rotary:
    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self._inv_freq = {torch.device("cpu"): inverse_frequencies(rope, head_dim)}  # per device, made on first use

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:  # positions [T] long
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:  # first use on this device (a CUDA graph's warm-up runs before its capture)
            inv_freq = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return Rotation(angles.cos().to(dtype), angles.sin().to(dtype))
