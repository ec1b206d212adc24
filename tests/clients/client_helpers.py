"""Shared by the third-party client tests and their conftest: the server's arguments and served name, the offline
environment, the pins of requirements-clients.txt, and where the clients' console scripts are."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

from tests.server_fixtures import QUICK_ARGS

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "requirements-clients.txt"
SERVED_NAME = "tiny-opt"
SERVER_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "1024", "--served-model-name", SERVED_NAME)

# Nothing here may reach a hub: models, tokenizers and datasets are local files, and litellm reads its bundled
# model-cost map instead of fetching one at import.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LANGSMITH_TRACING": "false", "DO_NOT_TRACK": "1"}


def pinned_versions() -> dict[str, str]:
    """{distribution: version} for each `name==version` line of requirements-clients.txt."""
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def missing_pins() -> list[str]:
    """The pins of requirements-clients.txt that are not installed at that version, each as a phrase."""
    out = []
    for name, version in pinned_versions().items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}=={version} (not installed)")
            continue
        if have.split("+")[0] != version:  # torch's CPU build is 2.13.0+cpu
            out.append(f"{name}=={version} (installed: {have})")
    return out


def console_script(name: str) -> str:
    """The virtualenv's console script `name` (guidellm, lm_eval), beside the running interpreter."""
    path = Path(sys.executable).with_name(name)
    assert path.exists(), f"{path} is missing: `make test-clients` installs {REQUIREMENTS.name}"
    return str(path)
