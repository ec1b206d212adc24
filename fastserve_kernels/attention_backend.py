"""Which attention implementation a model runs: the plain-torch reference
(fastserve_kernels/paged_attention.py) or the Triton kernels (fastserve_kernels/triton_attention.py).

    auto    triton on CUDA when triton imports, else torch
    torch   the reference, on any device
    triton  the Triton kernels: on CUDA, or on CPU under Triton's interpreter
            (TRITON_INTERPRET=1, how the tests run them); anything else is an error

What it is not: the kernels themselves. Both implementations have the signature
of fastserve_kernels.paged_attention.paged_attention.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a backend is chosen (engine/config.py stays torch-free)
    import torch

ATTENTION_BACKENDS = ("auto", "torch", "triton")

AttentionFn = Callable[..., "torch.Tensor"]


class AttentionBackendError(ValueError):
    """The asked-for attention backend cannot run here."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"torch" or "triton" for --attention-backend `name` on `device`; an AttentionBackendError says why
    triton was asked for and cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "torch":
        return "torch"
    if not has_triton:
        raise AttentionBackendError(
            "attention_backend triton: the triton package is not installed (it ships with CUDA builds of torch; "
            "`pip install -r requirements-test.txt` installs the matching version); use --attention-backend torch")
    if device.type == "cpu" and not _interpreting():
        raise AttentionBackendError(
            "attention_backend triton runs on CUDA; on CPU only under Triton's interpreter (set TRITON_INTERPRET=1, "
            "slow, for tests); use --attention-backend torch or auto")
    if device.type not in ("cpu", "cuda"):
        raise AttentionBackendError(f"attention_backend triton does not run on device {device.type!r}")
    return "triton"


def attention_function(backend: str, device: torch.device) -> AttentionFn:
    """The paged_attention function of a resolved backend ("torch" | "triton") for tensors on `device`."""
    if backend == "torch":
        from fastserve_kernels.paged_attention import paged_attention

        return paged_attention
    try:
        module = importlib.import_module("fastserve_kernels.triton_attention")
    except ImportError as e:
        raise AttentionBackendError(f"attention_backend triton: triton does not import ({e})") from e
    if device.type == "cpu" and not module.INTERPRETED:
        # Triton fixes interpreter-or-compiler when a kernel is decorated: rebuild the kernels for the interpreter.
        module = importlib.reload(module)
    if device.type == "cpu" and not module.interpreter_ready():
        raise AttentionBackendError(
            "attention_backend triton on CPU: triton was imported before TRITON_INTERPRET=1 was set; set it in the "
            "environment before the process starts")
    return module.paged_attention
