"""The CPU decode kernels' build folder (fastserve_kernels/cpu_decode_extension.py): named after the sources' bytes
and the build environment, never after the clone's folder, so two clones with the same sources share one build and an
unchanged clone never rebuilds; a changed byte or environment gets a build of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastserve_kernels import cpu_decode_extension as ext

REPO = Path(__file__).resolve().parents[1]


def copy_csrc(dest: Path) -> Path:
    shutil.copytree(ext.CSRC, dest)
    return dest


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_name_follows_the_sources_bytes_not_their_folder(tmp_path):
    a, b = copy_csrc(tmp_path / "clone-a" / "csrc"), copy_csrc(tmp_path / "elsewhere" / "clone-b" / "csrc")
    assert ext.build_name(a) == ext.build_name(b) == ext.build_name(ext.CSRC)
    for name in ("cpu_decode_attention.h", "cpu_decode_layers.cpp"):  # a header counts as much as a .cpp
        flip_last_byte(b / name)
        assert ext.build_name(b) != ext.build_name(a)
        flip_last_byte(b / name)
        assert ext.build_name(b) == ext.build_name(a)
    (b / "extra.h").write_text("// a new header\n")
    assert ext.build_name(b) != ext.build_name(a)


@pytest.mark.parametrize("change", ["flags", "compiler", "torch", "cpu"])
def test_the_name_follows_the_build_environment(monkeypatch, change):
    before = ext.build_name()
    if change == "flags":
        monkeypatch.setattr(ext, "CFLAGS", [*ext.CFLAGS, "-DNDEBUG"])
    elif change == "compiler":
        monkeypatch.setattr(ext, "_compiler", lambda: "c++ /usr/bin/g++-13 g++ 13.1")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    else:
        monkeypatch.setattr(ext, "_cpu_fingerprint", lambda: "0123456789")
    assert ext.build_name() != before


def test_the_compiler_is_named_by_its_path_and_version(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    cxx = shutil.which("c++")
    assert cxx is not None, "the tests need a C++ compiler (the kernels are built with it)"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert ext._compiler() == f"c++ {os.path.realpath(cxx)} {version}"
    monkeypatch.setenv("CXX", "/no/such/g++")  # no compiler: the name is still made (the build fails later)
    assert ext._compiler() == "/no/such/g++ - -"


LOAD = (
    "import json, sys, time\n"
    "t = time.perf_counter()\n"
    "from fastserve_kernels import cpu_decode_extension as e\n"
    "op = e.decode_attention_op()\n"
    "print(json.dumps({'file': e.__file__, 'name': e.build_name(), 'ok': op is not None,\n"
    "                  'reason': e.unavailable_reason(), 's': time.perf_counter() - t}))\n"
)


def stamps(build_dir: Path) -> dict[str, int]:
    """Modification times of what a build writes (objects, library) and of the staged sources."""
    files = [*build_dir.glob("*.o"), *build_dir.glob("*.so"), *(build_dir / "src").iterdir()]
    return {str(f.relative_to(build_dir)): f.stat().st_mtime_ns for f in files}


def test_two_clones_and_fresh_processes_load_one_build_without_rebuilding(tmp_path):
    assert ext.decode_attention_op() is not None, ext.unavailable_reason()  # built (or loaded) here once
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(ext.build_name(), verbose=False))
    before = stamps(build_dir)
    assert any(k.endswith(".so") for k in before) and "src/cpu_decode_attention.cpp" in before
    clones = []
    for name in ("clone-a", "clone-b"):  # each a copy of the package in a folder of its own
        root = tmp_path / name
        shutil.copytree(REPO / "fastserve_kernels", root / "fastserve_kernels",
                        ignore=shutil.ignore_patterns("__pycache__"))
        clones.append(root)
    runs = []
    for root in [*clones, clones[0], REPO]:  # a, b, a again, then this clone: each a fresh process
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
        proc = subprocess.run([sys.executable, "-c", LOAD], cwd=root, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        assert run["ok"], run["reason"]
        assert Path(run["file"]).resolve().is_relative_to(root.resolve()), run  # that clone's own sources
        runs.append(run)
    assert {r["name"] for r in runs} == {ext.build_name()}
    assert stamps(build_dir) == before, "a clone's load rebuilt (or re-staged) the kernel"
    assert all(r["s"] < 20 for r in runs), [round(r["s"], 1) for r in runs]  # a rebuild takes 20-70 s here


HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from fastserve_kernels import cpu_decode_extension as e\n"
    "d = Path(sys.argv[1])\n"
    "with e.build_lock(d):\n"
    "    (d / 'lock').touch()  # what cpp_extension's FileBaton leaves when its builder is killed\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)
ENTER = (
    "import sys\n"
    "from pathlib import Path\n"
    "from fastserve_kernels import cpu_decode_extension as e\n"
    "with e.build_lock(Path(sys.argv[1])):\n"
    "    print('entered', flush=True)\n"
)


def test_a_builder_killed_mid_build_does_not_wedge_the_next_one(tmp_path):
    """One process at a time holds the build folder; when the holder is killed (SIGKILL, mid-build, torch's
    `lock` file left behind) the next one gets in at once and removes the stale file."""
    build_dir = tmp_path / "build"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(build_dir)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-c", ENTER, str(build_dir)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(timeout=3)  # kept out while the holder lives
        holder.kill()
        out, _ = waiter.communicate(timeout=60)
        assert out.strip() == "entered" and waiter.returncode == 0
        assert not (build_dir / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_loading_goes_through_a_stale_build_lock():
    """The real load, in a fresh process, with the build folder's `lock` left by a killed build: torch's own
    FileBaton would wait on it for ever (the server hung at start-up this way); the load gets the op."""
    assert ext.decode_attention_op() is not None, ext.unavailable_reason()
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(ext.build_name(), verbose=False))
    with ext.build_lock(build_dir):  # no build of ours is running while the stale file is planted
        (build_dir / "lock").touch()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["ok"], run["reason"]
    assert not (build_dir / "lock").exists()
