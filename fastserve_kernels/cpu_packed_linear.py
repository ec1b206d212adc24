"""Linear weights packed for oneDNN, the CPU's faster float32 and bfloat16 matmul.

What it is: `pack(weight)` gives a copy of a [out, in] float32 CPU weight, or of a bfloat16 one where torch's oneDNN
runs bfloat16 on this CPU (torch.ops.mkldnn._is_mkldnn_bf16_supported: AVX-512; avx512_bf16 or AMX do the products
in hardware), reordered into oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight; the copy keeps the
weight's dtype), or None where that does not apply (another device or dtype, bfloat16 where oneDNN does not run
it, a torch without oneDNN, FASTSERVE_CPU_PACKED_WEIGHTS=0); `linear(x, packed, bias)` is F.linear against it
(torch.ops.mkldnn._linear_pointwise), and the compiled Llama decode loop
(fastserve_kernels/csrc/cpu_decode_llama_layers.cpp) calls the same op for a packed weight.

Why: F.linear on the CPU runs MKL's sgemm on plain weights. On the project's 2-core AMD EPYC, a SmolLM2-135M
decode step's matmuls on packed weights took 0.64-0.72x MKL's CPU time at 32 rows and 0.87-0.94x at one row, one
thread (`python -m scripts.benchmarks.llama_decode --parts matmul --threads 1`, two runs; docs/benchmarks.md). The
packed result is not MKL's bit for bit (another order of sums: the same values within float32 rounding), so a
model uses it in every path or in none (engine/model/llama.py). In bfloat16 (products in bfloat16, sums in float32,
one rounding to bfloat16) the same step's packed matmuls took 50.5 ms of CPU at 32 rows against float32's 97.3 ms
(`python -m scripts.benchmarks.llama_decode --threads 1 --repeats 3 --dtype bfloat16`, then without --dtype; on
avx512_bf16 without AMX), 0.74x the plain bfloat16 weights' time (oneDNN's unpacked matmul).
What it costs: the packed copy sits beside the plain weight (which the loader fills and the rest of the engine
reads), so a model's matmul weights are held twice (SmolLM2-135M: about 0.54 GB more in float32, 0.27 GB in
bfloat16); a model whose copies would take more than half the host's available memory is not packed (fits).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
ENV_SWITCH = "FASTSERVE_CPU_PACKED_WEIGHTS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and torch.backends.mkldnn.is_available()


def dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes pack() packs on this machine: float32, and bfloat16 where torch's oneDNN runs it on this CPU (the
    check torch makes before it gives a bfloat16 F.linear to oneDNN)."""
    bf16 = enabled() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def applies(weight: torch.Tensor) -> bool:
    """Whether pack() packs this weight: a 2-d CPU tensor of one of dtypes(), with packing on."""
    return weight.device.type == "cpu" and weight.dim() == 2 and enabled() and weight.dtype in dtypes()


def fits(nbytes: int) -> bool:
    """Whether packed copies of `nbytes` take at most half the memory the host has available now (Linux's
    MemAvailable; True where /proc/meminfo cannot be read); logs a warning when not."""
    try:
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return True
    available = int(line.split()[1]) * 1024
    if nbytes <= available // 2:
        return True
    log.warning("weights not packed for oneDNN: the copies would take %.1f GB of the %.1f GB available; the plain "
                "weights serve (slower matmuls on the CPU)", nbytes / 1e9, available / 1e9)
    return False


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` [out, in], or None where it does not apply (see applies)."""
    if not applies(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) against pack(weight): [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
