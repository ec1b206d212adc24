"""The model against Hugging Face transformers' OPTForCausalLM on the same
random weights (float32): logprobs agree within 1e-4 at prefill (prompt
logprobs) and at every decode step, in batches that mix prefill and decode
jobs of different lengths across KV block boundaries.

On the CPU in float32 wherever it runs: the engine's default on a GPU machine is CUDA in float16, which 1e-4
does not fit (tests/test_cuda.py compares the engine on CUDA with transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import OPTForCausalLM

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.conftest import SMALL_POST_LN, SMALL_PRE_LN

TOL = 1e-4


def hf_logprobs(model_dir, token_ids: list[int], model_class=OPTForCausalLM) -> torch.Tensor:  # [len, V]
    """transformers' log-probabilities of each next token after each prefix of token_ids, float32. model_dir: a
    Hugging Face model directory, or a GGUF file (transformers dequantizes it to float32)."""
    model_dir = Path(model_dir)
    where = dict(pretrained_model_name_or_path=model_dir.parent, gguf_file=model_dir.name) if model_dir.suffix == (
        ".gguf") else dict(pretrained_model_name_or_path=model_dir)
    model = model_class.from_pretrained(**where, dtype=torch.float32).eval()
    # One thread: these small forwards take milliseconds so, and up to a second each with threads that wait on
    # one another while other processes hold the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
    finally:
        torch.set_num_threads(threads)


def run_staggered(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]):
    """Add requests at given step numbers, run to completion, return finished outputs by id."""
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


@pytest.mark.parametrize("shape", [SMALL_PRE_LN, SMALL_POST_LN], ids=["pre-ln", "post-ln-project-in-out"])
def test_logprobs_match_transformers_in_mixed_batches(shape, small_checkpoint):
    check_mixed_batches_against_transformers(small_checkpoint(shape), shape["vocab_size"], OPTForCausalLM)


def check_mixed_batches_against_transformers(model_dir, vocab_size: int, model_class) -> None:
    """Five greedy requests arriving over four steps (prefills beside decodes, contexts across 4-token blocks):
    every prompt logprob and every generated token's logprob, with their top-5 alternatives, equal those of
    transformers' `model_class` on the same checkpoint within TOL, and each token is its greedy choice."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=4,
                                 num_gpu_blocks_override=64, seed=0, profile="analytic"))
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=7, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    arrivals = {
        0: [("a", prompt(13), params), ("b", prompt(5), params)],
        2: [("c", prompt(9), params)],  # prefill beside a and b decoding
        3: [("d", prompt(1), params), ("e", prompt(4), params)],
    }
    done = run_staggered(engine, arrivals)
    assert sorted(done) == ["a", "b", "c", "d", "e"]
    for rid, out in done.items():
        assert len(out.outputs[0].token_ids) == 7
        check_output_against_transformers(out, model_dir, model_class, rid)


def check_output_against_transformers(out, model_dir, model_class, rid: str, prompt_logprobs: bool = True) -> None:
    """One finished greedy request (logprobs=5, and prompt_logprobs=5 unless prompt_logprobs is False) against
    transformers' `model_class` on the same checkpoint: every prompt token's logprob and every generated token's,
    with their top-5 alternatives, within TOL, and each generated token is transformers' greedy choice."""
    comp = out.outputs[0]
    full = out.prompt_token_ids + comp.token_ids
    ref = hf_logprobs(model_dir, full, model_class)
    p = len(out.prompt_token_ids)
    # Prefill: every prompt token's logprob and top-5 alternatives.
    if prompt_logprobs:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == p, f"{rid}: prompt logprobs missing"
        assert out.prompt_logprobs[0] is None
        for pos in range(1, p):
            check_position(out.prompt_logprobs[pos], ref[pos - 1], full[pos], f"{rid} prompt pos {pos}")
    # Decode: every generated token, which is also HF's greedy choice.
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids), f"{rid}: logprobs missing"
    for j, tok in enumerate(comp.token_ids):
        row = ref[p + j - 1]
        assert tok == int(row.argmax()), f"{rid} step {j}: greedy token differs from transformers"
        check_position(comp.logprobs[j], row, tok, f"{rid} step {j}")


def check_position(got: dict[int, float], ref_row: torch.Tensor, token: int, where: str) -> None:
    top = ref_row.topk(5)
    expected = {int(i): float(v) for v, i in zip(top.values, top.indices)}
    expected.setdefault(token, float(ref_row[token]))
    assert set(got) == set(expected), f"{where}: top tokens differ"
    for tok, lp in got.items():
        assert abs(lp - expected[tok]) < TOL, f"{where}: token {tok} logprob {lp} vs transformers {expected[tok]}"
