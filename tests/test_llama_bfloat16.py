"""A tiny Llama (modelmaker's random weights, 2 KV heads under 8 query heads, 3 layers) served by the engine in
bfloat16 on the CPU against the same checkpoint in float32, through prefill and the compiled decode loop
(fastserve_kernels/csrc/cpu_decode_llama_layers.cpp), with the weights packed in bfloat16 where torch's oneDNN runs
it (fastserve_kernels/cpu_packed_linear.py) and the KV cache in bfloat16.

The tolerance: bfloat16 keeps 8 significant bits, so rounding moves a value by up to 2^-8 of itself. The logits
come out of the head rounded to bfloat16, which alone moves a token's logprob (its logit minus the log-sum-exp of
the row) by up to 2 * 2^-8 * max|logit|; the roundings of the weights and of every layer's activations before it
add about as much again: TOL = 4 * 2^-8 * max|logit| (this checkpoint's logits reach ~35: TOL ~0.5 nats). Every
prompt logprob, and every decode step's while both sides' tokens agree, is within TOL of float32's; greedy may
part only where float32's own two best were within 2 * TOL (the comparison of that sequence stops there: the
contexts differ after). And as a whole the engine's bfloat16 is as close to float32 as transformers' own bfloat16
is: the median error over the same positions at most 1.5x transformers' (measured here: 0.93x)."""

from __future__ import annotations

import statistics

import torch
import transformers

from engine import LLM, SamplingParams
from fastserve_kernels import cpu_decode_extension, cpu_packed_linear

NEW = 24
PROMPTS = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (11, 3, 27, 17, 6, 20)]


def run(model_dir, dtype: str):
    """The engine's outputs (greedy, top-2 logprobs, prompt logprobs), the packed qkv weight's dtype, the cache's."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with LLM(model=str(model_dir), dtype=dtype, device="cpu", profile="analytic", num_gpu_blocks_override=256,
             enable_prefix_caching=False) as llm:
        runner = llm.engine.executor.runner
        outs = llm.generate(PROMPTS, params)
        packed = runner.model.layers[0].self_attn.qkv_proj.packed
        return outs, (None if packed is None else packed.dtype), runner.kv_cache.dtype


def transformers_logprobs(model_dir, sequences: list[list[int]]) -> dict[torch.dtype, list[torch.Tensor]]:
    """transformers' LlamaForCausalLM in float32 and bfloat16: each sequence's logprobs [len, V] (float32)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.inference_mode():
            out[dtype] = [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1) for s in sequences]
    return out


def test_bfloat16_serves_the_float32_tokens_and_logprobs_within_its_rounding(llama_checkpoint):
    assert cpu_decode_extension.decode_llama_layers_op() is not None, cpu_decode_extension.unavailable_reason()
    model_dir = llama_checkpoint()
    ref, ref_packed, ref_kv = run(model_dir, "float32")
    got, packed, kv = run(model_dir, "bfloat16")
    assert ref_kv == torch.float32 and kv == torch.bfloat16  # the cache follows the engine's dtype
    if torch.bfloat16 in cpu_packed_linear.dtypes():
        assert ref_packed == torch.float32 and packed == torch.bfloat16
    sequences = [p + r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)]
    hf = transformers_logprobs(model_dir, sequences)
    with torch.inference_mode():
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        max_logit = max(model(torch.tensor([s])).logits.abs().max().item() for s in sequences)
    tol = 4 * 2**-8 * max_logit
    ours, theirs = [], []  # |bfloat16 - float32| of the same token's logprob at the same place

    def check(g_lp: float, r_lp: float, hf_row: int, seq: int, tok: int, where: str):
        assert abs(g_lp - r_lp) < tol, f"{where}: bfloat16 {g_lp:.4f}, float32 {r_lp:.4f}, tolerance {tol:.3f}"
        ours.append(abs(g_lp - r_lp))
        theirs.append(abs(hf[torch.bfloat16][seq][hf_row, tok] - hf[torch.float32][seq][hf_row, tok]).item())

    compared = 0
    for i, (prompt, r, g) in enumerate(zip(PROMPTS, ref, got)):
        for pos in range(1, len(prompt)):  # prefill: the same context on both sides
            tok = prompt[pos]
            check(g.prompt_logprobs[pos][tok], r.prompt_logprobs[pos][tok], pos - 1, i, tok, f"prompt {i} pos {pos}")
        r_out, g_out = r.outputs[0], g.outputs[0]
        for step, (r_tok, g_tok) in enumerate(zip(r_out.token_ids, g_out.token_ids)):
            r_lp, g_lp = r_out.logprobs[step], g_out.logprobs[step]
            if r_tok != g_tok:
                best, second = sorted(r_lp.values(), reverse=True)[:2]
                assert best - second < 2 * tol, f"sequence {i} step {step}: {g_tok} for float32's clear {r_tok}"
                break
            check(g_lp[g_tok], r_lp[r_tok], len(prompt) + step - 1, i, r_tok, f"sequence {i} step {step}")
            compared += 1
    assert compared >= len(PROMPTS) * NEW // 2  # most decode steps were compared, not skipped
    assert statistics.median(ours) <= 1.5 * statistics.median(theirs), (statistics.median(ours),
                                                                        statistics.median(theirs))
