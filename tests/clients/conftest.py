"""Fixtures for the third-party client tests (`make test-clients`): one live server.py with the built-in tiny
model on loopback, shared by every test here but test_smollm2.py's (which serves the real model), and the
environment that keeps the clients off the network.

The clients (requirements-clients.txt) are not in requirements-test.txt: `make test` leaves this folder out
(`--ignore=tests/clients`) and `make test-clients` installs them first. Run without them, every test here fails
saying what is missing; none is skipped.
"""

from __future__ import annotations

import os

import pytest

from tests.clients.client_helpers import OFFLINE_ENV, REQUIREMENTS, SERVER_ARGS, missing_pins
from tests.server_fixtures import shared_server, wait_idle

os.environ.update(OFFLINE_ENV)  # before litellm or langchain is imported, in this process and its children


@pytest.fixture(scope="session", autouse=True)
def clients_installed() -> None:
    """Every pinned client at its pinned version, or every test here fails naming what is missing."""
    missing = missing_pins()
    if missing:
        pytest.fail(f"the third-party clients are not installed as pinned: {', '.join(missing)}; "
                    f"`make test-clients` installs {REQUIREMENTS.name}", pytrace=False)


@pytest.fixture(scope="session")
def server(request, tiny_model_dir):
    srv = shared_server(request, tiny_model_dir, SERVER_ARGS)
    yield srv
    wait_idle(srv.url)


@pytest.fixture
def idle_server(server):
    """The server, checked idle after the test (nothing running or waiting, every KV block free)."""
    yield server
    wait_idle(server.url)


@pytest.fixture(scope="session")
def client_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a client subprocess: offline, its Hugging Face caches under the session's temp folder."""
    cache = tmp_path_factory.mktemp("hf-cache")
    return {**os.environ, **OFFLINE_ENV, "HF_HOME": str(cache), "HF_DATASETS_CACHE": str(cache / "datasets"),
            "NO_COLOR": "1", "COLUMNS": "200"}
