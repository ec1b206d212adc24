"""tests/conftest.py's handling of the `datasets` tests, in a tree where ../shared/datasets is absent: `make test`
leaves them out and its summary says NOT RUN; `make test-datasets` (FASTSERVE_REQUIRE_DATASETS=1) runs them and
they fail, naming the missing folder. Real pytest runs in a copy of the conftest placed away from ../shared."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_pytest(tests_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           str(tests_dir)], cwd=tests_dir.parent, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **env))


def test_datasets_tests_are_left_out_loudly_without_the_folder_and_fail_when_required(tmp_path):
    tests = tmp_path / "clone" / "tests"  # tmp_path/shared does not exist: conftest looks there
    tests.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "test_reader.py").write_text(
        "import pytest\n"
        "from conftest import shared_dataset\n\n"
        "@pytest.mark.datasets\n"
        "def test_reads_shared():\n"
        "    shared_dataset('sharegpt_lengths.csv')\n\n"
        "def test_plain():\n"
        "    pass\n")
    (tmp_path / "clone" / "pytest.ini").write_text("[pytest]\nmarkers =\n    datasets: shared\n    slow: slow\n")
    left_out = run_pytest(tests)
    assert left_out.returncode == 0, left_out.stdout + left_out.stderr
    assert "1 passed, 1 deselected" in left_out.stdout
    assert f"NOT RUN: 1 tests of the workload readers against the project's shared datasets, which are not at " \
           f"{tmp_path / 'shared' / 'datasets'}" in left_out.stdout
    required = run_pytest(tests, FASTSERVE_REQUIRE_DATASETS="1")
    assert required.returncode == 1
    assert "1 failed, 1 passed" in required.stdout and "NOT RUN" not in required.stdout
    assert "the `datasets` tests need the project's shared datasets" in required.stdout
