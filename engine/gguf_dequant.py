"""Dequantization of GGUF tensors (llama.cpp's ggml block formats) into float32 torch tensors, at load.

What it is: pure functions from a tensor's raw bytes, as the gguf package's reader maps them ([rows, bytes of a
row] for block formats), to its values. Formats, a block being 32 values of a row:

    F32, F16   plain values
    Q8_0       per block: float16 scale d, 32 int8 q           x = d * q
    Q4_0       per block: float16 d, 16 bytes of 4-bit q       x = d * (q - 8)
    Q4_1       per block: float16 d, float16 min m, 16 bytes   x = d * q + m

with a block's low nibbles its first 16 values and its high nibbles the last 16 (ggml's order), in torch; and
the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: super-blocks of 256 values, 16 or 8 sub-blocks with their own
6-bit or 8-bit scales, what a Q4_K_M or Q5_K_M file stores most weights in) and BF16, by the gguf package's
numpy dequantizer (gguf.quants.dequantize). The float32 arithmetic is the gguf package's own (gguf.quants,
checked in tests/test_gguf.py and tests/test_gguf_kquants.py). Any other type (Q5_0, Q5_1, the IQ types,
Q8_K, ...) is a CheckpointError naming it. What it is not: reading the file (engine/gguf_checkpoint.py) or
running quantized matmuls: the model computes in the engine's dtype.
"""

from __future__ import annotations

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import CheckpointError

# The types the gguf package's numpy dequantizer reads here (K-quants, and bfloat16)
BY_GGUF_PACKAGE = (GGMLQuantizationType.BF16, GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K,
                   GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
SUPPORTED = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
             GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, *BY_GGUF_PACKAGE)


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:  # [n blocks, bytes of a block] uint8
    _, type_size = GGML_QUANT_SIZES[qtype]
    return torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1, type_size))


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:  # [n, 1] float32: the float16 at byte `start`
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, 16] uint8 -> [n, 32] float32, low nibbles first
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """The float32 values of tensor `name`, of torch shape `shape`, from its raw data."""
    if qtype not in SUPPORTED:
        kind = qtype.name if isinstance(qtype, GGMLQuantizationType) else str(qtype)
        raise CheckpointError(f"GGUF tensor {name} is quantized as {kind}, which this loader cannot read; it reads "
                              f"{', '.join(t.name for t in SUPPORTED)}")
    if qtype == GGMLQuantizationType.F32:
        values = torch.from_numpy(np.array(raw, dtype=np.float32, copy=True))
    elif qtype == GGMLQuantizationType.F16:
        values = torch.from_numpy(np.array(raw, dtype=np.float16, copy=True)).float()
    elif qtype in BY_GGUF_PACKAGE:
        values = torch.from_numpy(np.asarray(gguf.quants.dequantize(np.asarray(raw), qtype), dtype=np.float32))
    else:
        blocks = _blocks(raw, qtype)
        if qtype == GGMLQuantizationType.Q8_0:
            values = _halves(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()
        elif qtype == GGMLQuantizationType.Q4_0:
            values = _halves(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)
        else:  # Q4_1
            values = _halves(blocks, 0) * _nibbles(blocks[:, 4:]) + _halves(blocks, 2)
    return values.reshape(shape)
