"""The CPU decode kernels compiled from fastserve_kernels/csrc/, loaded once per process.

What it is: `decode_attention_op()` returns torch.ops.fastserve_cpu.decode_attention (decode attention
over the paged cache in one pass, optionally writing the step's K/V first; cpu_decode_attention.cpp),
`decode_layers_op()` torch.ops.fastserve_cpu.decode_layers (a decode step's OPT decoder layers in one C++ call;
cpu_decode_layers.cpp) and `decode_llama_layers_op()` its Llama-family counterpart (cpu_decode_llama_layers.cpp,
with the RMSNorm and rotary kernels of `llama_kernel()`), building them with torch's cpp_extension (g++ and
ninja) the first time on a machine and loading the cached build after that; or None when it cannot be built or is
turned off, and the CPU path falls back to the sparse-op kernel (fastserve_kernels/cpu_decode_attention.py), the
model's Python layer loop and torch ops.
`make install` builds them (`python -m fastserve_kernels.cpu_decode_extension`), so the first request does not wait for
g++ (~20 s); later processes load the cached build (well under a second). torch's cpp_extension keeps it under
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR elsewhere).

The build folder is named after everything the build depends on (`build_name()`): the sources' bytes (every
file in fastserve_kernels/csrc), the compiler ($CXX or c++: its path and version), torch's version and install folder,
Python's headers, the C++ ABI, the flags, and the CPU (-march=native: its model and flags). The sources are
copied into the folder (src/) and compiled from there, so its build.ninja names no clone's own paths: every
clone with the same sources and environment shares one build and never rebuilds it (a folder named after the CPU
alone was shared by every clone, and each start rebuilt it with its own paths, 29-73 s); a changed byte or
environment gets a folder of its own. Old folders are not removed (a few hundred KB each).
FASTSERVE_CPU_KERNEL=0 turns both off (the sparse-op path and the Python loop serve; benchmarks compare this way).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE_SUFFIXES = (".cpp", ".h")  # what a build reads from fastserve_kernels/csrc (the .cpp files include the headers)
# -fopenmp: at::parallel_for's pragma (the symbols resolve to torch's own OpenMP runtime)
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
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


def _compiler() -> str:
    """The C++ compiler cpp_extension runs ($CXX, else c++): its name, resolved path and version line."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    try:
        version = subprocess.run([path or cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    first_line = version.strip().splitlines()[0] if version.strip() else "-"
    return f"{cxx} {os.path.realpath(path) if path else '-'} {first_line}"


def _source_files(csrc: Path) -> list[Path]:
    return sorted(f for f in csrc.iterdir() if f.suffix in SOURCE_SUFFIXES and f.is_file())


def build_environment() -> list[str]:
    """What a build depends on besides the sources; build.ninja names the torch and Python folders too."""
    return [f"torch {torch.__version__} at {Path(torch.__file__).resolve().parent}",
            f"python headers {sysconfig.get_paths()['include']}",
            f"cxx11 abi {int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"compiler {_compiler()}",
            f"flags {' '.join(CFLAGS)}", f"cpu {_cpu_fingerprint()}"]


def build_name(csrc: Path = CSRC) -> str:
    """The build folder's (and library's) name: a hash of the sources' names and bytes and of
    build_environment(); not of where the sources are."""
    digest = hashlib.sha256()
    for f in _source_files(csrc):
        data = f.read_bytes()
        digest.update(f"{f.name}\0{len(data)}\0".encode())
        digest.update(data)
    digest.update("\n".join(build_environment()).encode())
    return f"fastserve_cpu_decode_{digest.hexdigest()[:16]}"


def _stage_sources(csrc: Path, src_dir: Path) -> list[str]:
    """Copy the sources into the build folder (once: a file already there with the same bytes is left alone, so
    its time stamp does not make ninja rebuild); the .cpp paths to compile."""
    src_dir.mkdir(parents=True, exist_ok=True)
    for f in _source_files(csrc):
        data, dest = f.read_bytes(), src_dir / f.name
        if dest.is_file() and dest.read_bytes() == data:
            continue
        tmp = src_dir / f".{f.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        try:
            os.link(tmp, dest)  # atomic and never replaces: a process staging the same bytes at once wins
        except FileExistsError:
            if dest.read_bytes() != data:  # a damaged copy
                os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    return [str(src_dir / f.name) for f in _source_files(csrc) if f.suffix == ".cpp"]


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold the build folder for one process at a time, with a lock the kernel drops when its holder dies.

    cpp_extension guards a build with a plain file (`lock` in the folder, torch's FileBaton) that its builder
    deletes when done; a builder killed mid-build (a test's timeout, ^C, a killed server) leaves the file, and
    every later process then waits on it for ever: the server hangs at start-up before it logs a line. Every
    load here takes an flock on `fastserve.flock` first, so while one is held nobody else of ours is building:
    a `lock` file found then is stale, and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "fastserve.flock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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


def decode_llama_layers_op():
    """torch.ops.fastserve_cpu.decode_llama_layers (cpu_decode_llama_layers.cpp: a Llama-family decode step's
    layers in one C++ call; built with decode_attention_op's library), or None likewise."""
    return torch.ops.fastserve_cpu.decode_llama_layers if decode_attention_op() is not None else None


def llama_kernel(name: str, x: torch.Tensor):
    """torch.ops.fastserve_cpu.rms_norm or .rotary (cpu_decode_llama_layers.cpp: the Llama family's element-wise
    kernels, which its compiled decode loop runs too) where they serve `x` (a float32, float64 or bfloat16 CPU
    tensor, the kernels built), else None: the caller computes the formula with torch ops."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64, torch.bfloat16)
            or decode_attention_op() is None):
        return None
    return getattr(torch.ops.fastserve_cpu, name)


def unavailable_reason() -> str | None:
    """Why decode_attention_op() gives None (after it was called), or None when it gives the op."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    return _state.get("error")  # type: ignore[return-value]


def describe() -> str:
    """One line for logs and benchmarks: which CPU decode attention serves."""
    op = decode_attention_op()
    if op is not None:
        return "compiled kernel (fastserve_kernels/csrc)"
    return f"sparse torch ops ({unavailable_reason()})"


def _load():
    try:
        from torch.utils import cpp_extension

        name = build_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # $TORCH_EXTENSIONS_DIR/pyXY_cpu/
        sources = _stage_sources(CSRC, build_dir / "src")

        # cpp_extension runs `ninja`; the ninja wheel puts it beside this interpreter, which may not be on PATH.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        started = time.perf_counter()
        with build_lock(build_dir):
            library = cpp_extension.load(
                name=name,
                sources=sources,
                extra_cflags=CFLAGS,
                build_directory=str(build_dir),
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
    """`python -m fastserve_kernels.cpu_decode_extension`: build (or load) the kernel now; `make install` runs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"CPU decode attention: {describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
