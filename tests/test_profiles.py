"""The job profiler and profile lookup: the CLI writes a valid profile for the
tiny model, lookup by key picks the matching file and nothing else, bad
--profile files give errors that say what to do, the start-up profile sends
well-formed batches, and lookups on the pinned profile are monotone."""

from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from engine.batch import BatchResult, ModelBatch, SequenceResult
from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.job_profiler import STARTUP_GRID, profile_key
from engine.model.config import OPTConfig
from engine.profiles import (
    PROFILE_CACHE_ENV,
    PROFILE_DIR_ENV,
    engine_profile_key,
    find_profile,
    load_cost_model,
    profile_filename,
)
from scheduler.cost_model import ProfiledCostModel

REPO = Path(__file__).resolve().parents[1]
PINNED = Path(__file__).parent / "data" / "tiny_profile.json"


def pinned_with_key(key: dict) -> dict:
    data = json.loads(PINNED.read_text())
    data["key"] = dict(key)
    return data


class FakeExecutor(Executor):
    """Answers every batch at once and keeps what it was sent: measures nothing."""

    def __init__(self, num_device_blocks: int = 64, block_size: int = 4) -> None:
        self.num_device_blocks, self.block_size = num_device_blocks, block_size
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.batches: list[ModelBatch] = []

    def submit(self, batch: ModelBatch) -> Future[BatchResult]:
        self.batches.append(batch)
        future: Future[BatchResult] = Future()
        future.set_result(BatchResult([SequenceResult(token_id=5) for _ in batch.seqs]))
        return future

    def attach_host_tier(self, num_host_blocks: int):
        raise NotImplementedError("no host tier")


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir) -> OPTConfig:
    return OPTConfig.from_model_dir(tiny_model_dir)


def test_profiler_writes_a_valid_profile_for_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    from fastserve import profile as profiler

    rc = profiler.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                        "--prompt-lens", "1,8,32", "--batch-sizes", "1,2", "--context-lens", "8,32",
                        "--repeats", "1", "--warmup", "1", "--num-gpu-blocks-override", "64", "--quiet"])
    assert rc == 0
    key = profile_key("tiny-opt", torch.float32, torch.device("cpu"))
    written = tmp_path / profile_filename(key)
    assert find_profile(key, tmp_path) == written  # the default output is where lookup looks
    cost = ProfiledCostModel.from_json(written)
    assert cost.key == key and key["hardware"].startswith("cpu: ")
    assert cost.prefill_lens == (1, 8, 32)
    assert (cost.decode_batch_sizes, cost.decode_context_lens) == ((1, 2), (8, 32))
    assert all(t > 0 for t in cost.prefill_seconds)
    assert list(cost.prefill_seconds) == sorted(cost.prefill_seconds)
    for row in cost.decode_seconds:
        assert all(t > 0 for t in row) and list(row) == sorted(row)
    assert all(a <= b for a, b in zip(cost.decode_seconds[0], cost.decode_seconds[1]))


def test_lookup_finds_the_matching_key_and_ignores_the_rest(tmp_path):
    want = {"model": "tiny-opt", "dtype": "float32", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "hardware": "cpu: Test CPU"}
    others = [dict(want, hardware="cuda: NVIDIA H200"), dict(want, dtype="float16"),
              dict(want, model="opt-125m"), dict(want, tensor_parallel_size=2)]
    for i, key in enumerate(others):
        (tmp_path / f"a{i}.json").write_text(json.dumps(pinned_with_key(key)))
    (tmp_path / "b-not-json.json").write_text("{not json")
    (tmp_path / "c-other-schema.json").write_text(json.dumps({"schema": "something/1", "key": want}))
    assert find_profile(want, tmp_path) is None
    (tmp_path / "d-match.json").write_text(json.dumps(pinned_with_key(want)))
    (tmp_path / "d-match.txt").write_text(json.dumps(pinned_with_key(want)))  # not *.json
    assert find_profile(want, tmp_path) == tmp_path / "d-match.json"
    assert find_profile(want, tmp_path / "missing") is None


def test_engine_order_analytic_then_path_then_folder(tiny_config, tmp_path, monkeypatch):
    executor = FakeExecutor()
    key = engine_profile_key(EngineConfig(), tiny_config, executor)
    (tmp_path / "mine.json").write_text(json.dumps(pinned_with_key(key)))
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))

    cost, source = load_cost_model(EngineConfig(), tiny_config, executor)
    assert source == f"profile {tmp_path / 'mine.json'}" and cost.key == key
    cost, source = load_cost_model(EngineConfig(profile=str(PINNED)), tiny_config, executor)
    assert source == f"profile {PINNED}"
    cost, source = load_cost_model(EngineConfig(profile="analytic"), tiny_config, executor)
    assert source.startswith("analytic") and "analytic" in cost.key["hardware"]
    assert executor.batches == []  # none of these measured anything


def test_a_start_up_profile_is_cached_for_the_next_start_of_the_same_shape(tiny_model_dir, tiny_config, tmp_path,
                                                                           monkeypatch, caplog):
    """A model given by path (not the built-in tiny one) is measured once: the next start of the same key and shape
    reads the cache and measures nothing; another shape, or a broken cache file, is measured again; off keeps none."""
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "stored"))  # no stored profile matches
    monkeypatch.setenv(PROFILE_CACHE_ENV, str(tmp_path / "cache"))
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=300)
    first = FakeExecutor()
    with caplog.at_level(logging.INFO, logger="engine.profiles"):
        cost, source = load_cost_model(config, tiny_config, first)
    assert source == "start-up profile (short grid)" and first.batches
    (cached,) = (tmp_path / "cache").glob("startup__*.json")
    assert f"cached in {cached} for the next start" in caplog.text

    again = FakeExecutor()
    cost2, source2 = load_cost_model(config, tiny_config, again)
    assert again.batches == [] and source2 == f"start-up profile (short grid) cached in {cached}"
    assert cost2.to_dict() == cost.to_dict()

    wider = FakeExecutor()
    load_cost_model(config, dataclasses.replace(tiny_config, ffn_dim=2 * tiny_config.ffn_dim), wider)
    assert wider.batches and len(list((tmp_path / "cache").glob("startup__*.json"))) == 2

    cached.write_text("{ not json")
    broken = FakeExecutor()
    _, source3 = load_cost_model(config, tiny_config, broken)
    assert broken.batches and source3 == "start-up profile (short grid)" and "ignoring the cached" in caplog.text
    assert json.loads(cached.read_text())["schema"]  # measured again and written over the broken file

    monkeypatch.setenv(PROFILE_CACHE_ENV, "off")
    off = FakeExecutor()
    load_cost_model(EngineConfig(model=str(tiny_model_dir), max_model_len=200), tiny_config, off)
    assert off.batches and len(list((tmp_path / "cache").glob("startup__*.json"))) == 2


def test_startup_profile_runs_the_short_grid_and_says_so(tiny_config, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))  # empty: nothing matches
    executor = FakeExecutor(num_device_blocks=50, block_size=4)
    with caplog.at_level(logging.INFO, logger="engine.profiles"):
        cost, source = load_cost_model(EngineConfig(max_model_len=300), tiny_config, executor)
    assert source.startswith("start-up profile")
    # The built-in tiny model (no --model) is always measured at start-up: said at INFO, not warned about.
    assert [r.levelno for r in caplog.records if "start-up" in r.getMessage()] == [logging.INFO]
    assert cost.prefill_lens == tuple(n for n in STARTUP_GRID.prompt_lens if n < 300) + (300,)
    assert cost.decode_batch_sizes == STARTUP_GRID.batch_sizes
    runs = STARTUP_GRID.repeats + STARTUP_GRID.warmup
    prefills = executor.batches[: len(cost.prefill_lens) * runs : runs]
    for n, batch in zip(cost.prefill_lens, prefills):
        (seq,) = batch.seqs
        assert seq.start_pos == 0 and len(seq.token_ids) == n and len(seq.block_table) == -(-n // 4)
        assert all(0 <= b < 50 for b in seq.block_table)
    decodes = executor.batches[len(cost.prefill_lens) * runs :: runs]
    for batch, (b, c) in zip(decodes, [(b, c) for b in cost.decode_batch_sizes for c in cost.decode_context_lens]):
        assert len(batch.seqs) == b
        assert all(s.start_pos == c - 1 and len(s.token_ids) == 1 and len(s.block_table) == -(-c // 4)
                   for s in batch.seqs)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.profiles"):  # a named model without a profile: a warning
        load_cost_model(EngineConfig(model="some/opt", max_model_len=300), tiny_config, FakeExecutor(50, 4))
    assert [r.levelno for r in caplog.records if "start-up" in r.getMessage()] == [logging.WARNING]


@pytest.mark.parametrize("content, problem", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "does not hold a JSON object"),
    (json.dumps({"schema": "fastserve.profile/0"}), "schema must be"),
    (json.dumps({"schema": "fastserve.profile/1", "key": {}, "prefill": {"prompt_lens": [1], "seconds": [1.0]}}),
     "missing or malformed field"),
    (json.dumps({"schema": "fastserve.profile/1", "prefill": {"prompt_lens": [16, 1], "seconds": [1.0, 2.0]},
                 "decode": {"batch_sizes": [1], "context_lens": [16], "seconds": [[1.0]]}}), "strictly increasing"),
])
def test_bad_profile_file_is_a_clear_error(tiny_config, tmp_path, content, problem):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_cost_model(EngineConfig(profile=str(path)), tiny_config, FakeExecutor())
    message = str(e.value)
    assert str(path) in message and problem in message
    assert "`fastserve profile`" in message and "--profile analytic" in message


def test_engine_refuses_a_missing_profile(tiny_model_dir, tmp_path):
    from engine import LLM

    with pytest.raises(ValueError, match="nope.json: it does not exist"):
        LLM(model=str(tiny_model_dir), profile=str(tmp_path / "nope.json"), num_gpu_blocks_override=16,
            kv_policy="recompute")


def test_pinned_profile_lookups_are_monotone():
    cost = ProfiledCostModel.from_json(PINNED)
    assert cost.key["model"] == "tiny-opt"
    t_init = [cost.t_init(n) for n in range(1, 2049)]
    assert all(t > 0 for t in t_init)
    assert all(a <= b for a, b in zip(t_init, t_init[1:]))
    for c in (1, 16, 100, 512, 2048):
        t_dec = [cost.t_dec(b, c) for b in range(1, 65)]
        assert all(a <= b for a, b in zip(t_dec, t_dec[1:]))
    for b in (1, 3, 16, 64):
        t_dec = [cost.t_dec(b, c) for c in range(1, 2049, 7)]
        assert all(x <= y for x, y in zip(t_dec, t_dec[1:]))
