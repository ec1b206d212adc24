"""The device check's first step (scripts/device_check.sh): what this machine has, against what the project pins,
and whether torch sees a CUDA device. Prints the versions of Python, torch (and its CUDA), Triton and transformers
beside the pinned torch and Triton (requirements.txt, requirements-test.txt), the C compiler Triton builds its
launchers with, the GPU (name, memory, compute capability, driver via nvidia-smi); writes them to --json; exits 1
at once, saying so, when there is no CUDA device. The check runs with the machine's own versions: nothing is
installed (the device machine has no network, and a CUDA build of the pinned torch is gigabytes).

    python -m scripts.device_env --json results/env.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pinned(package: str) -> str | None:
    """The version requirements*.txt pin for `package` (`name==version`), if any."""
    for name in ("requirements.txt", "requirements-test.txt"):
        path = REPO / name
        if path.exists():
            m = re.search(rf"^{re.escape(package)}==([^\s;#]+)", path.read_text(), re.MULTILINE)
            if m:
                return m.group(1)
    return None


def version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception as e:  # missing or broken: say which
        return f"unavailable ({type(e).__name__}: {e})"


def c_compiler() -> str:
    """The C compiler Triton would build its launchers with ($CC, else cc, gcc or clang on PATH): Triton 3.6
    compiles one per kernel signature (3.7 has one generic launcher, still built once), so without one no Triton
    kernel runs."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return "none found"


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return (run.stdout or run.stderr).strip() or f"nvidia-smi exited {run.returncode}"
    except Exception as e:
        return f"nvidia-smi failed ({type(e).__name__}: {e})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write what was found here")
    args = ap.parse_args(argv)
    import torch

    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": version_of("triton"),
           "transformers": version_of("transformers"), "pinned_torch": pinned("torch"),
           "pinned_triton": pinned("triton"), "c_compiler": c_compiler(), "nvidia_smi": nvidia_smi(),
           "cuda_available": torch.cuda.is_available()}
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_count=torch.cuda.device_count(), memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}")
    for key in ("date", "python", "torch", "torch_cuda", "triton", "transformers", "c_compiler"):
        print(f"{key:>14}: {env[key]}")
    print(f"{'pinned':>14}: torch {env['pinned_torch']}, triton {env['pinned_triton']} (the check runs with this "
          "machine's versions above)")
    print(f"{'nvidia-smi':>14}: {env['nvidia_smi']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(env, indent=1) + "\n")
    if not env["cuda_available"]:
        print(f"no CUDA device: torch {env['torch']} (CUDA {env['torch_cuda']}) sees none; this check needs a GPU",
              file=sys.stderr)
        return 1
    print(f"{'device':>14}: {env['device']} x {env['device_count']}, {env['memory_gib']:.1f} GiB, compute capability "
          f"{env['capability']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
