"""`fastserve profile` (fastserve/profile.py) on the models the server serves besides OPT, run for real as a user
types it (the console script, a small grid): a random-weight Llama checkpoint (modelmaker/llama_checkpoint.py),
whose profile the engine then finds by key at start-up; a config-only Llama directory with --load-format dummy
(and without it, a one-line error); and the real SmolLM2-135M-Instruct GGUF file by its name. Each profile must be
sane: every time positive, and the measured first iteration (the progress lines, before the profile makes times
non-decreasing) clearly longer for a long prompt than for one token."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.profiles import PROFILE_DIR_ENV
from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from tests.conftest import copy_tokenizer

FASTSERVE = Path(sys.executable).parent / "fastserve"
# Large enough that a 512-token prefill costs well over a one-token one on any CPU (~4 GFLOP against ~8 MFLOP).
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024)
GRID = ("--device", "cpu", "--batch-sizes", "1,2", "--context-lens", "16,64", "--forward-tokens", "1,4",
        "--repeats", "3", "--warmup", "1", "--num-gpu-blocks-override", "128")


def profile(*args: str, cwd: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict[int, float]]:
    """`fastserve profile ARGS`: the process, and {prompt length: t_init in seconds} as it measured them."""
    r = subprocess.run([str(FASTSERVE), "profile", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **(env or {})})
    measured = {int(n): float(ms) / 1e3 for n, ms in re.findall(r"t_init\((\d+)\) = ([\d.]+) ms", r.stderr)}
    return r, measured


def check_sane(path: Path, measured: dict[int, float], model: str, short: int, long: int) -> dict:
    data = json.loads(path.read_text())
    assert data["key"]["model"] == model and data["key"]["hardware"].startswith("cpu")
    assert data["prefill"]["prompt_lens"] == [short, long] == sorted(measured)
    times = [*data["prefill"]["seconds"], *data["forward"]["seconds"], *(t for row in data["decode"]["seconds"]
                                                                         for t in row)]
    assert all(0 < t < 60 for t in times), times
    assert measured[long] > 2 * measured[short], f"t_init does not grow with the prompt: {measured}"
    return data


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """(a Llama checkpoint, the same shape's config.json alone), each with the tiny model's tokenizer."""
    root = tmp_path_factory.mktemp("llama-profile")
    cfg = llama_config(**SHAPE)
    full = write_llama_checkpoint(root / "llama-small", cfg)
    config_only = write_llama_checkpoint(root / "llama-small-config", cfg, weight_format="none")
    for d in (full, config_only):
        copy_tokenizer(tiny_model_dir, d)
    return full, config_only


def test_profile_measures_a_llama_checkpoint_and_the_engine_finds_it(llama_dirs, tmp_path, monkeypatch):
    full, _ = llama_dirs
    folder = tmp_path / "profiles"  # no --out: the profile folder, under a name made from the key
    r, measured = profile("--model", str(full), "--prompt-lens", "1,512", *GRID, cwd=tmp_path,
                          env={PROFILE_DIR_ENV: str(folder)})
    assert r.returncode == 0, r.stderr
    (written,) = folder.glob("*.json")
    data = check_sane(written, measured, "llama-small", 1, 512)
    monkeypatch.setenv(PROFILE_DIR_ENV, str(folder))  # the engine looks its profile up there by key
    engine = Engine(EngineConfig(model=str(full), num_gpu_blocks_override=64))
    try:
        assert engine.cost_model.key == data["key"]
        assert list(engine.cost_model.prefill_seconds) == data["prefill"]["seconds"]
    finally:
        engine.close()


def test_profile_runs_dummy_weights_on_a_llama_config_only_directory(llama_dirs, tmp_path):
    _, config_only = llama_dirs
    r, _ = profile("--model", str(config_only), "--prompt-lens", "1,512", *GRID, "--out", "p.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "has no weights" in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()
    r, measured = profile("--model", str(config_only), "--load-format", "dummy", "--prompt-lens", "1,512", *GRID,
                          "--out", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    check_sane(tmp_path / "p.json", measured, "llama-small-config", 1, 512)


@pytest.mark.slow  # 45 s: the real model, loaded and profiled
def test_profile_measures_the_smollm2_gguf_by_name(tmp_path):
    """The model `fastserve serve` serves with no model, named as it is served; the key is the file's name, which is
    what the engine looks it up by."""
    r, measured = profile("--model", "SmolLM2-135M-Instruct", "--prompt-lens", "1,128", "--device", "cpu",
                          "--batch-sizes", "1", "--context-lens", "16", "--forward-tokens", "1", "--repeats", "1",
                          "--warmup", "1", "--num-gpu-blocks-override", "64", "--out", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    check_sane(tmp_path / "p.json", measured, "SmolLM2-135M-Instruct.Q4_1.gguf", 1, 128)
