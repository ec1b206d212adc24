"""Shared fixtures: real checkpoints written to disk in Hugging Face layout."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config, write_opt_checkpoint
from scheduler.cost_model import PROFILE_SCHEMA

DATA = Path(__file__).resolve().parent / "data"  # test data shipped with the repository (each file's source there)
# The project's shared datasets beside the clone. Only tests marked `datasets` read them: they check the workload
# readers against the whole published files, which are not ours to ship (their licences: ../shared/datasets/SOURCES.md).
SHARED_DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"
REQUIRE_DATASETS = "FASTSERVE_REQUIRE_DATASETS"  # set by `make test-datasets`: absent datasets fail, loudly
# Tests neither read nor write the user's start-up profile cache (engine/profiles.py); the servers they start inherit
# this. The test of the cache sets its own folder.
os.environ["FASTSERVE_PROFILE_CACHE"] = "off"

# Small OPT shapes for reference tests: a pre-LN one and an opt-350m-like post-LN one with project_in/out.
SMALL_PRE_LN = dict(vocab_size=512, max_position_embeddings=256, hidden_size=64, num_hidden_layers=3,
                    num_attention_heads=4, ffn_dim=128)
SMALL_POST_LN = dict(SMALL_PRE_LN, word_embed_proj_dim=32, do_layer_norm_before=False)


def shared_dataset(relpath: str) -> Path:
    """A file of the shared datasets, for a test marked `datasets` (not collected when the folder is absent)."""
    path = SHARED_DATASETS / relpath
    if not path.exists():
        pytest.fail(f"{path} is absent: the `datasets` tests need the project's shared datasets at {SHARED_DATASETS}")
    return path


def settle_kv_copies(engine, timeout_s: float = 10.0) -> None:
    """Let every KV copy still in flight land. With prefix caching the cache's own device -> host copies of a
    finished request's blocks may outlive every request, holding host blocks until they land; a test that checks
    that memory ends empty waits for them first. Copy threads (the live engine): poll until they are done; the
    simulator: its virtual clock moved to each copy's end."""
    from engine.clock import VirtualClock

    deadline = time.monotonic() + timeout_s
    engine.kv.poll()  # (a copy that landed after the engine's last poll is reaped here, not waited for)
    while engine.kv.pending_transfers():
        if isinstance(engine.clock, VirtualClock):
            done_at = engine.executor.next_copy_completion()
            assert done_at is not None, "copies pending that the simulated executor does not know"
            engine.clock.advance(max(done_at - engine.clock.now(), 0.0) or 1e-9)
        else:
            assert time.monotonic() < deadline, "KV copies never landed"
            time.sleep(0.002)
        engine.kv.poll()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ../shared/datasets, the `datasets` tests are not run, and the summary says so (see
    pytest_terminal_summary); with FASTSERVE_REQUIRE_DATASETS set they run and fail."""
    if SHARED_DATASETS.is_dir() or os.environ.get(REQUIRE_DATASETS):
        return
    left_out = [item for item in items if item.get_closest_marker("datasets")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("datasets")]
    config.stash[_LEFT_OUT] = len(left_out)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.stash.get(_LEFT_OUT, 0):
        terminalreporter.write_line(
            f"NOT RUN: {config.stash[_LEFT_OUT]} tests of the workload readers against the project's shared datasets, "
            f"which are not at {SHARED_DATASETS}; put them there and run `make test-datasets`",
            yellow=True, bold=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The built-in tiny model (tokenizer + weights), built once per session."""
    from modelmaker.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-opt")


@pytest.fixture(scope="session")
def word_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a word-level tokenizer (its random answers survive decode -> encode), built once."""
    from modelmaker.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-opt-word", "word")


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The tokenizer files of model_dir (all but its config and weights) into out."""
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory, tiny_model_dir):
    """Factory: a small random OPT checkpoint with the tiny tokenizer files, cached per shape."""
    cache: dict[tuple, Path] = {}

    def make(shape: dict, weight_format: str = "safetensors", seed: int = 0, prefix: str = "model.decoder.") -> Path:
        key = (tuple(sorted(shape.items())), weight_format, seed, prefix)
        if key not in cache:
            out = tmp_path_factory.mktemp("ckpt")
            cfg = opt_config(**shape)
            write_opt_checkpoint(out, cfg, seed=seed, weight_format=weight_format, prefix=prefix)
            copy_tokenizer(tiny_model_dir, out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory, tiny_model_dir):
    """Factory: a small random Llama-family checkpoint (modelmaker/llama_checkpoint.py: 8 query heads over 2 KV
    heads, 3 layers, 512 tokens by default; `overrides` are config.json fields) with the tiny tokenizer files,
    cached per arguments."""
    cache: dict[str, Path] = {}

    def make(architecture: str = "LlamaForCausalLM", weight_format: str = "safetensors", seed: int = 0,
             **overrides) -> Path:
        key = json.dumps([architecture, weight_format, seed, overrides], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("llama")
            write_llama_checkpoint(out, llama_config(architecture, **overrides), seed=seed,
                                   weight_format=weight_format)
            copy_tokenizer(tiny_model_dir, out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="module")
def client(server):
    """The official openai client against the module's `server` fixture (a tests.server_fixtures server)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# The simulator's flat test profile: every first iteration costs 1.0 s, every decode step 0.1 s.
FLAT_PREFILL_S, FLAT_DECODE_S = 1.0, 0.1


@pytest.fixture(scope="module")
def flat_sim_model(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """(an OPT-13B config-only directory with the tiny tokenizer, the flat profile), for the simulator."""
    root = tmp_path_factory.mktemp("sim")
    model = write_opt_checkpoint(root / "opt-13b-config", opt_config(**OPT_SHAPES["opt-13b"]), weight_format="none")
    for f in tiny_model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(f, model / f.name)
    profile = root / "flat.json"
    profile.write_text(json.dumps({
        "schema": PROFILE_SCHEMA, "key": {"model": "flat"},
        "prefill": {"prompt_lens": [1, 2048], "seconds": [FLAT_PREFILL_S, FLAT_PREFILL_S]},
        "decode": {"batch_sizes": [1, 256], "context_lens": [1, 2048],
                   "seconds": [[FLAT_DECODE_S, FLAT_DECODE_S], [FLAT_DECODE_S, FLAT_DECODE_S]]},
        "transfer": {"host_to_device_bytes_per_s": 1e12, "device_to_host_bytes_per_s": 1e12},
    }))
    return model, profile
