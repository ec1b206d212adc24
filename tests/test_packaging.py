"""FastServe's top-level packages shadow no other installed distribution's modules.

Why: the repository root is on sys.path whenever a command runs from it (pytest, `python server.py`, scripts), and
the installed `fastserve` distribution puts the same packages in site-packages. A package here named like another
distribution's import name wins the import: transformers 5.25 requires Hugging Face's `kernels`, and our former
`kernels/` package (now `fastserve_kernels/`) made `import transformers.models.opt` fail with
"cannot import name 'CUDAProperties' from 'kernels'"."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import tomllib

from tests.server_fixtures import REPO


def our_top_level_names() -> set[str]:
    """The top-level packages and modules pyproject.toml installs (test_deploy: the Dockerfile copies them)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {p.split(".")[0] for p in setuptools["packages"]} | set(setuptools["py-modules"])


def test_no_top_level_package_of_ours_is_another_distributions_module():
    shipped_by = importlib.metadata.packages_distributions()
    ours = our_top_level_names()
    assert "fastserve_kernels" in ours and ours <= {p.name.removesuffix(".py") for p in REPO.iterdir()}
    clashes = {name: sorted(set(shipped_by[name]) - {"fastserve"}) for name in ours
               if set(shipped_by.get(name, ())) - {"fastserve"}}
    assert not clashes, f"these packages of ours are also other distributions' modules: {clashes}"


def test_transformers_opt_imports_from_the_repository_root():
    """The import the reference tests make, in a fresh process whose sys.path starts at the repository root."""
    code = "from transformers import OPTForCausalLM; print(OPTForCausalLM.__name__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "OPTForCausalLM", proc.stderr[-2000:]
