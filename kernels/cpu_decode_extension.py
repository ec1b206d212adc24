"""The CPU decode kernels compiled from kernels/csrc/, loaded once per process.

What it is: `decode_attention_op()` returns torch.ops.fastserve_cpu.decode_attention (decode attention
over the paged cache in one pass, optionally writing the step's K/V first; cpu_decode_attention.cpp), and
`decode_layers_op()` torch.ops.fastserve_cpu.decode_layers (a decode step's decoder layers in one C++ call;
cpu_decode_layers.cpp), building both with torch's cpp_extension (g++ and ninja) the first time on a machine
and loading the cached build after that; or None when it cannot be built or is turned off, and the CPU path
falls back to the sparse-op kernel (kernels/cpu_decode_attention.py) and the model's Python layer loop.
`make install` builds them (`python -m kernels.cpu_decode_extension`), so the first request does not wait for
g++ (~20 s); later processes load the cached build (~1 s). torch's cpp_extension keeps it under
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR elsewhere) and rebuilds it when a source changes.

The build is compiled for the CPU it runs on (-march=native), so the build directory's name carries a hash of
the CPU's model and flags: a home directory shared by different machines gets one build each.
FASTSERVE_CPU_KERNEL=0 turns both off (the sparse-op path and the Python loop serve; benchmarks compare this way).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "cpu_decode_attention.cpp", CSRC / "cpu_decode_layers.cpp"]
ENV_SWITCH = "FASTSERVE_CPU_KERNEL"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the op or None once tried; "error": why it is None


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's model name and flags (a -march=native build runs only where it was built)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        import platform

        keep = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:10]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def decode_attention_op():
    """torch.ops.fastserve_cpu.decode_attention, built or loaded on first call; None when off or unbuildable
    (the reason is logged once and kept in `unavailable_reason()`)."""
    if not enabled():
        return None
    if "op" in _state:
        return _state["op"]
    with _lock:
        if "op" not in _state:
            _state["op"] = _load()
    return _state["op"]


def decode_layers_op():
    """torch.ops.fastserve_cpu.decode_layers (built with decode_attention_op's library), or None likewise."""
    return torch.ops.fastserve_cpu.decode_layers if decode_attention_op() is not None else None


def unavailable_reason() -> str | None:
    """Why decode_attention_op() gives None (after it was called), or None when it gives the op."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    return _state.get("error")  # type: ignore[return-value]


def describe() -> str:
    """One line for logs and benchmarks: which CPU decode attention serves."""
    op = decode_attention_op()
    return "compiled kernel (kernels/csrc)" if op is not None else f"sparse torch ops ({unavailable_reason()})"


def _load():
    name = f"fastserve_cpu_decode_{_cpu_fingerprint()}"
    try:
        from torch.utils import cpp_extension

        # cpp_extension runs `ninja`; the ninja wheel puts it beside this interpreter, which may not be on PATH.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        started = time.perf_counter()
        library = cpp_extension.load(
            name=name,
            sources=[str(src) for src in SOURCES],
            # -fopenmp: at::parallel_for's pragma (the symbols resolve to torch's own OpenMP runtime)
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        op = torch.ops.fastserve_cpu.decode_attention
    except Exception as e:  # no compiler, no ninja, a build error: the fallbacks serve
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("the CPU decode kernel could not be built (%s); decode attention uses the sparse-op path and "
                    "decode steps the model's Python layer loop", _state["error"])
        return None
    log.info("CPU decode kernel ready in %.1f s (%s)", time.perf_counter() - started, library or name)
    return op


def main() -> int:
    """`python -m kernels.cpu_decode_extension`: build (or load) the kernel now; `make install` runs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"CPU decode attention: {describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
