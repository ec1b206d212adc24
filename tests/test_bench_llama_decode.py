"""scripts/benchmarks/llama_decode.py: the decode window counts the tokens made after every request has its first
one, on both sides; part opt runs the tiny Llama against the tiny OPT end to end and writes its ratios, in bfloat16
with --dtype bfloat16 (both engines' caches in it); bad flags are one line."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM
from scripts.benchmarks import llama_decode


def test_the_engines_decode_window_leaves_out_the_prefill(tiny_model_dir):
    with LLM(model=str(tiny_model_dir), device="cpu", profile="analytic", num_gpu_blocks_override=64,
             enable_prefix_caching=False) as llm:
        r = llama_decode.engine_decode(llm, llama_decode.random_prompts(3, 9, 500, seed=1), 5, "t")
    assert r["tokens"] == 3 * 4  # the first token of each request is the prefill's
    assert r["steps"] == 5 and len(r["ids"]) == 3 and all(len(ids) == 5 for ids in r["ids"])
    assert r["wall"] > 0 and r["cpu"] > 0 and r["whole_tok_s"] > 0


def test_part_opt_runs_both_tiny_models_and_writes_the_ratios(tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / "r.json"
    try:
        assert llama_decode.main(["--parts", "opt", "--batches", "2", "--prompt-len", "8", "--tiny-new-tokens", "4",
                                  "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert r["threads"] == 1 and r["repeats"] == 2
    b = r["opt"]["batch2"]
    assert len(b["rounds"]) == 2 and all(side["tokens"] == 2 * 3 for pair in b["rounds"] for side in pair)
    assert b["ratio_wall"]["median"] > 0 and len(b["ratio_cpu"]["all"]) == 2


def test_dtype_bfloat16_runs_both_sides_in_bfloat16(tmp_path, monkeypatch, capsys):
    threads = torch.get_num_threads()
    dtypes = []
    made = llama_decode.LLM

    def llm(*args, **kwargs):  # the real engine, noting the dtype of each one's KV cache
        engine = made(*args, **kwargs)
        dtypes.append(engine.engine.executor.runner.kv_cache.dtype)
        return engine

    monkeypatch.setattr(llama_decode, "LLM", llm)
    out = tmp_path / "r.json"
    try:
        assert llama_decode.main(["--parts", "opt", "--batches", "2", "--prompt-len", "8", "--tiny-new-tokens", "3",
                                  "--repeats", "1", "--threads", "1", "--dtype", "bfloat16", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the tiny OPT and the tiny Llama
    r = json.loads(out.read_text())
    assert r["dtype"] == "bfloat16" and r["opt"]["batch2"]["ratio_cpu"]["median"] > 0
    assert "for both sides, bfloat16," in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--parts", "gpu"], "--parts: unknown gpu"),
                                           (["--batches", "1,x"], "--batches: comma-separated integers")])
def test_bad_flags_are_one_line(argv, message):
    with pytest.raises(SystemExit) as err:
        llama_decode.main(argv)
    assert message in str(err.value) and "\n" not in str(err.value)
