"""scripts/device_versions.py (`make device-versions`): what it installs besides the image's versions, and the
stubs that stand in for the CUDA libraries torch 2.11.0's wheel loads, tried on a library made here that needs
one (versioned functions, an unversioned one, one that returns text)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from scripts import device_versions

CUDA_LIB = """
int fakeGetDeviceCount(int *n) { *n = 8; return 0; }
const char *fakeGetErrorString(int e) { return "real"; }
"""
UNVERSIONED_LIB = "int fakeLoose(void) { return 1; }\n"
USER = """
int fakeGetDeviceCount(int *n);
const char *fakeGetErrorString(int e);
int fakeLoose(void);
int devices(void) { int n = 0; int err = fakeGetDeviceCount(&n); return err ? -err : n; }
const char *error_text(void) { return fakeGetErrorString(1); }
int loose(void) { return fakeLoose(); }
"""


def test_the_image_versions_replace_the_pins_and_nothing_else():
    reqs = device_versions.requirements()
    names = {r.split("=")[0].split(">")[0].split(";")[0].strip() for r in reqs}
    assert not names & {"torch", "triton", "transformers"}
    assert {"numpy", "safetensors", "pytest", "hypothesis"} <= names
    assert device_versions.VERSIONS == {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None, reason="needs gcc and readelf")
def test_a_library_that_needs_a_missing_cuda_library_loads_against_its_stub(tmp_path):
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "cuda.c").write_text(CUDA_LIB)
    (tmp_path / "user.c").write_text(USER)
    (tmp_path / "loose.c").write_text(UNVERSIONED_LIB)
    (tmp_path / "cuda.map").write_text("libfakecuda.so.1 { global: fakeGetDeviceCount; fakeGetErrorString; };\n")
    real = tmp_path / "real"
    real.mkdir()
    gcc = ["gcc", "-shared", "-fPIC"]
    subprocess.run([*gcc, "-o", str(real / "libfakecuda.so.1"), str(tmp_path / "cuda.c"),
                    "-Wl,-soname,libfakecuda.so.1", f"-Wl,--version-script={tmp_path / 'cuda.map'}"], check=True)
    subprocess.run([*gcc, "-o", str(real / "libfakeloose.so.0"), str(tmp_path / "loose.c"),
                    "-Wl,-soname,libfakeloose.so.0"], check=True)
    subprocess.run([*gcc, "-o", str(lib / "libuser.so"), str(tmp_path / "user.c"), f"-L{real}", "-l:libfakecuda.so.1",
                    "-l:libfakeloose.so.0", "-Wl,-rpath,$ORIGIN"], check=True)
    # only what is missing (libc is there), each with the version tags it had
    assert device_versions.write_stubs(lib) == ["libfakecuda.so.1", "libfakeloose.so.0"]
    assert "libfakecuda.so.1" in subprocess.run(["readelf", "-V", str(lib / "libfakecuda.so.1")], check=True,
                                                capture_output=True, text=True).stdout
    user = ctypes.CDLL(str(lib / "libuser.so"))
    user.error_text.restype = ctypes.c_char_p
    assert user.devices() == -device_versions.NO_DEVICE  # "no CUDA device"
    assert user.error_text().startswith(b"CUDA library stub")
    assert user.loose() == device_versions.NO_DEVICE
