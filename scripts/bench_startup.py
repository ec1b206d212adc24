"""Start-up time: how long `fastserve serve` takes to answer /health with 200, on a warm machine (the CPU decode
kernels built, the files in the page cache), and what two clones of the repository cost each other at start.

    python scripts/bench_startup.py                          # 5 starts of `fastserve serve` (the tiny model)
    python scripts/bench_startup.py --repeats 3 -- --tensor-parallel-size 2      # flags after -- go to the server
    python scripts/bench_startup.py --clones                 # + the kernels loaded from two clones in turn
    python scripts/bench_startup.py --clones --kernel-rev 154b1a2   # the same with an older cpu_decode_extension.py

Starts: each is a fresh process, timed from its spawn to the first 200 from /health (polled every 50 ms); the
log's own timestamps split it into the time to the kernel's load, to the model's load, and to serving.
--clones: fastserve_kernels/ copied into two folders (two clones), then loaded in fresh processes in turn, A B A B,
with an empty TORCH_EXTENSIONS_DIR of their own (so the first load builds, ~20-70 s here); each later load either reuses
that build (well under a second) or rebuilds it. --kernel-rev REV takes fastserve_kernels/cpu_decode_extension.py as it
was at REV (git), to measure the old folder naming. Prints a table; --json FILE writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from server_process import free_port  # noqa: E402  (scripts/ is this script's folder)

FASTSERVE = Path(sys.executable).parent / "fastserve"
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
LOAD = ("import json, time\n"
        "t = time.perf_counter()\n"
        "from fastserve_kernels import cpu_decode_extension as e\n"
        "op = e.decode_attention_op()\n"
        "print(json.dumps({'s': time.perf_counter() - t, 'ok': op is not None, 'reason': e.unavailable_reason()}))\n")


def start_once(server_args: list[str], log_dir: Path) -> dict:
    """One `fastserve serve` from spawn to a 200 from /health; then SIGTERM. Seconds, and phases from its log."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        wall0 = datetime.now()
        proc = subprocess.Popen([str(FASTSERVE), "serve", "--port", str(port), *server_args], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {log_path}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - t0 > 300:
                    raise RuntimeError(f"not healthy within 300 s: {log_path}")
                time.sleep(0.05)
            healthy = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(60)
    phases = {}
    for line in log_path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        at = (datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") - wall0).total_seconds()
        if "CPU decode kernel ready" in line or "could not be built" in line:
            phases.setdefault("kernel_loaded_s", at)
        elif "job profile:" in line:
            phases.setdefault("engine_ready_s", at)
    return {"healthy_s": healthy, **phases}


def old_extension_source(rev: str) -> str:
    """cpu_decode_extension.py as at `rev`: under fastserve_kernels/, or under kernels/ before the package's rename."""
    for folder in ("fastserve_kernels", "kernels"):
        shown = subprocess.run(["git", "show", f"{rev}:{folder}/cpu_decode_extension.py"], cwd=REPO,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            return shown.stdout
    raise SystemExit(f"--kernel-rev {rev}: no cpu_decode_extension.py at that revision")


def clone_loads(kernel_rev: str | None, work: Path) -> list[dict]:
    """fastserve_kernels/ in two folders, loaded A B A B in fresh processes sharing one empty TORCH_EXTENSIONS_DIR."""
    clones = []
    for name in ("clone-a", "clone-b"):
        root = work / name
        shutil.copytree(REPO / "fastserve_kernels", root / "fastserve_kernels",
                        ignore=shutil.ignore_patterns("__pycache__"))
        if kernel_rev:
            old = old_extension_source(kernel_rev)
            (root / "fastserve_kernels" / "cpu_decode_extension.py").write_text(old)
        clones.append(root)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"))
    loads = []
    for root, label in zip([*clones, *clones], ["A", "B", "A", "B"]):
        proc = subprocess.run([sys.executable, "-c", LOAD], cwd=root, capture_output=True, text=True, timeout=900,
                              env=dict(env, PYTHONPATH=os.pathsep.join([str(root), str(REPO)])))
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        if not run["ok"]:
            raise RuntimeError(f"the kernel did not build: {run['reason']}")
        loads.append({"clone": label, "load_s": run["s"]})
        print(f"  clone {label}: kernel loaded in {run['s']:.1f} s", flush=True)
    return loads


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="server starts (default: %(default)s)")
    ap.add_argument("--clones", action="store_true", help="also time the kernels' loads from two clones in turn")
    ap.add_argument("--kernel-rev",
                    help="with --clones: fastserve_kernels/cpu_decode_extension.py as at this git revision")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args(ours)
    if not FASTSERVE.is_file():
        ap.error(f"{FASTSERVE} is missing: install the package first (make install)")
    result: dict = {"server_args": server_args, "cpus": os.cpu_count(), "starts": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        start_once(server_args, Path(tmp))  # warms the page cache and builds what a first start builds
        for i in range(args.repeats):
            run = start_once(server_args, Path(tmp))
            result["starts"].append(run)
            print(f"start {i + 1}: healthy after {run['healthy_s']:.2f} s (kernel loaded at "
                  f"{run.get('kernel_loaded_s', float('nan')):.2f} s, engine ready at "
                  f"{run.get('engine_ready_s', float('nan')):.2f} s)", flush=True)
        healthy = [r["healthy_s"] for r in result["starts"]]
        result["healthy_s"] = {"median": statistics.median(healthy), "min": min(healthy), "max": max(healthy)}
        print(f"`fastserve serve {' '.join(server_args)}` healthy after: median {statistics.median(healthy):.2f} s, "
              f"range {min(healthy):.2f}-{max(healthy):.2f} s over {len(healthy)} warm starts")
        if args.clones:
            print(f"kernels from two clones, loaded in turn ({args.kernel_rev or 'this tree'}'s naming):")
            result["clones"] = {"kernel_rev": args.kernel_rev, "loads": clone_loads(args.kernel_rev, Path(tmp))}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
