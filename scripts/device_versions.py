"""`make device-versions`: the CPU side of the tests with the GPU image's versions, here, before a GPU run.

    python3 -m scripts.device_versions [--venv .venv-device] [--rebuild]

The GPU machines carry torch 2.11.0 (+cu130), triton 3.6.0 and transformers 5.17.0, while the project pins torch
2.13.0 and triton 3.7.1. This builds a second virtual environment with the image's versions and runs in it the
kernel tests under Triton's interpreter (tests/test_triton_kernels.py without the `cuda` and `slow` ones: the
interpreter cases, the interpreted engine end to end against transformers, and the kernels compiled for sm_90
with that Triton's ptxas) and the reference tests (tests/test_model_reference.py, tests/test_paged_attention.py).
NumPy is held below 2.4 there (INTERPRETER_PINS: Triton 3.6.0's interpreter needs it).

torch 2.11.0 on PyPI is the CUDA 13 build (a 531 MB wheel; no CPU build of it is on PyPI, and no other index is
reachable from here), and it names multi-GB CUDA libraries as dependencies (cuDNN, cuBLAS, NCCL, cuSPARSELt, ...).
Its CPU code is in libtorch_cpu.so, which needs none of them; only libtorch_cuda.so and its kin do, and they are
loaded when torch is imported. So the wheel is installed without its dependencies, and each CUDA library it would
load is replaced by a stub (`write_stubs`): a small shared library with that library's file name, version tags
and every function torch imports from it, each returning cudaErrorNoDevice (100), made with gcc from the symbol
tables readelf shows. torch then imports, sees no CUDA device, and runs its CPU code exactly as on the GPU
machine; nothing calls a stub but the CUDA runtime's start-up registrations and its device count.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
# torch 2.11.0's own requirements, less the CUDA ones (its METADATA's Requires-Dist)
TORCH_DEPS = ["filelock", "typing-extensions>=4.10.0", "setuptools<82", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2",
              "fsspec>=0.8.5"]
# Triton 3.6.0's interpreter turns a loaded scalar (a one-element array) into an int with int(), which NumPy 2.4
# refuses (3.7 squeezes it first): under it every kernel with a loop bound from memory fails. Compiled kernels (the
# GPU machine) never take that path.
INTERPRETER_PINS = ["numpy<2.4"]
TESTS = [
    ("kernels under the interpreter, the interpreted engine end to end, sm_90 compiles",
     ["-m", "not cuda and not slow", "tests/test_triton_kernels.py"]),
    ("the reference tests", ["tests/test_model_reference.py", "tests/test_paged_attention.py"]),
]
ERROR_STRINGS = re.compile(r"Get(Error|Status)(String|Name)|ErrorString")  # return text, not a status
NO_DEVICE = 100  # cudaErrorNoDevice


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def requirements() -> list[str]:
    """The project's requirements (requirements.txt, requirements-test.txt) but torch, triton and transformers."""
    out = []
    for name in ("requirements.txt", "requirements-test.txt"):
        for line in (REPO / name).read_text().splitlines():
            spec = line.split("#")[0].strip()
            if spec and not spec.startswith("-r") and re.split(r"[<>=!~;\s\[]", spec)[0] not in VERSIONS:
                out.append(spec)
    return out


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def needed(lib: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", str(lib)))


def dynamic_symbols(lib: Path) -> list[tuple[str, str, str, str]]:
    """(name, version, type, binding) of every dynamic symbol, defined or not: version '' when unversioned;
    type 'UND' for the undefined ones, else the symbol's type."""
    out = []
    for line in readelf("--dyn-syms", str(lib)).splitlines():
        cols = line.split()
        if len(cols) < 8 or not cols[0].rstrip(":").isdigit():
            continue
        name, _, version = cols[7].partition("@")
        version = version.lstrip("@").split(" ")[0]
        out.append((name, version, "UND" if cols[6] == "UND" else cols[3], cols[4]))
    return out


def version_files(lib: Path) -> dict[str, str]:
    """Version tag -> the library file that must define it (the library's version needs)."""
    out, current = {}, None
    for line in readelf("-V", str(lib)).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current:
            out[m.group(1)] = current
    return out


def system_libraries() -> dict[str, Path]:
    """soname -> path of the libraries the dynamic loader finds (ldconfig's cache)."""
    listing = subprocess.run(["ldconfig", "-p"], check=True, capture_output=True, text=True).stdout
    found = {}
    for m in re.finditer(r"^\s+(\S+) \(libc6,x86-64[^)]*\) => (\S+)$", listing, re.MULTILINE):
        found.setdefault(m.group(1), Path(m.group(2)))
    return found


def stub_symbols(lib_dir: Path) -> dict[str, dict[str, set[str]]]:
    """For each library torch's own libraries need that is neither beside them nor on the system: {version tag
    ('' for none): the functions they import from it}. Unversioned imports that nothing defines go to every
    such library that has no version tags (the loader takes the first definition)."""
    libs = [p for p in sorted(lib_dir.glob("*.so*")) if p.is_file()] + sorted(lib_dir.parent.glob("_C*.so"))
    system = system_libraries()
    present = {p.name for p in libs}
    missing = sorted({n for lib in libs for n in needed(lib)} - present - set(system))
    defined: set[str] = set()
    for path in [*libs, *(system[n] for lib in libs for n in needed(lib) if n in system)]:
        defined |= {name for name, _, kind, _ in dynamic_symbols(path) if kind != "UND"}
    stubs: dict[str, dict[str, set[str]]] = {name: defaultdict(set) for name in missing}
    loose: set[str] = set()
    for lib in libs:
        files = version_files(lib)
        for name, version, kind, binding in dynamic_symbols(lib):
            if kind != "UND" or not name:
                continue
            if version and files.get(version) in stubs:
                stubs[files[version]][version].add(name)
            elif not version and name not in defined and binding != "WEAK":
                loose.add(name)
    for tags in stubs.values():
        if not tags or set(tags) == {""}:
            tags[""] |= loose
    return stubs


def write_stubs(lib_dir: Path) -> list[str]:
    """Stub libraries for every CUDA library torch's libraries need and this machine lacks, into lib_dir (on
    their RPATH, $ORIGIN). Returns their file names."""
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for soname, tags in stub_symbols(lib_dir).items():
            src, script = Path(tmp) / f"{soname}.c", Path(tmp) / f"{soname}.map"
            lines = ['static const char stub_text[] = "CUDA library stub (scripts/device_versions.py)";']
            blocks = []
            for i, (version, names) in enumerate(sorted(tags.items())):
                for j, name in enumerate(sorted(names)):
                    returns = ("const char *", "stub_text") if ERROR_STRINGS.search(name) else ("long", NO_DEVICE)
                    lines.append(f'{returns[0]} stub_{i}_{j}(void) __asm__("{name}");')
                    lines.append(f"{returns[0]} stub_{i}_{j}(void) {{ return {returns[1]}; }}")
                listed = "".join(f" {n};" for n in sorted(names))
                blocks.append(f"{version} {{ global:{listed} }};" if version else f"{{ global:{listed} }};")
            src.write_text("\n".join(lines) + "\n")
            named = [b for b in blocks if not b.startswith("{")]
            script.write_text("\n".join(named) if named else blocks[0] if blocks else "{ local: *; };")
            run(["gcc", "-shared", "-fPIC", "-O0", "-o", str(lib_dir / soname), str(src), f"-Wl,-soname,{soname}",
                 f"-Wl,--version-script={script}"], stdout=subprocess.DEVNULL)
            written.append(soname)
    return written


def build(venv: Path, rebuild: bool) -> Path:
    """The virtual environment with the image's versions (kept: rebuilt when asked or when its stamp differs)."""
    python = venv / "bin" / "python"
    stamp = venv / ".device-versions.json"
    want = dict(VERSIONS, requirements=requirements() + INTERPRETER_PINS)
    if not rebuild and stamp.exists() and json.loads(stamp.read_text()) == want:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    run([*pip, *requirements(), *INTERPRETER_PINS, *TORCH_DEPS, f"triton=={VERSIONS['triton']}",
         f"transformers=={VERSIONS['transformers']}"])
    run([*pip, "--no-deps", f"torch=={VERSIONS['torch']}"])  # its CUDA libraries: stubs, below
    lib_dir = Path(subprocess.run([str(python), "-c", "import importlib.util as u; "
                                   "print(u.find_spec('torch').submodule_search_locations[0])"],
                                  check=True, capture_output=True, text=True).stdout.strip()) / "lib"
    print(f"stubs in {lib_dir}: {', '.join(write_stubs(lib_dir))}")
    stamp.write_text(json.dumps(want))
    return python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-device")
    ap.add_argument("--rebuild", action="store_true", help="build the environment again")
    args = ap.parse_args(argv)
    python = build(args.venv, args.rebuild)
    got = subprocess.run([str(python), "-c", "import json, torch, triton, transformers; print(json.dumps({"
                          "'torch': torch.__version__, 'triton': triton.__version__, "
                          "'transformers': transformers.__version__, 'cuda': torch.cuda.is_available()}))"],
                         check=True, capture_output=True, text=True, cwd=REPO).stdout
    versions = json.loads(got)
    print(f"versions: {versions}")
    if any(versions[k].split("+")[0] != v for k, v in VERSIONS.items()) or versions["cuda"]:  # torch: 2.11.0+cu130
        print(f"expected {VERSIONS} and no CUDA device", file=sys.stderr)
        return 1
    failed = []
    for what, selection in TESTS:
        print(f"\n## {what}", flush=True)
        tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection], cwd=REPO)
        if tests.returncode:
            failed.append(what)
    print(f"\ndevice-versions ({', '.join(f'{k} {v}' for k, v in VERSIONS.items())}): "
          + (f"FAILED: {'; '.join(failed)}" if failed else "every test passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
