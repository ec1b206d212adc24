"""vLLM's logits adjustments, applied by the sampler before it picks a token.

In vLLM's order: logit_bias is added first; then repetition, frequency and
presence penalties; the greedy pick, temperature and the draw see the result;
min_p filters the tempered distribution (before top-k and top-p).

  * repetition_penalty r (CTRL, Keskar et al. 2019), over the tokens of the
    prompt and the output: a positive logit is divided by r, a negative one
    multiplied by r;
  * frequency_penalty f and presence_penalty p (OpenAI's definition), over the
    output tokens: logit -= f * count + p * (count > 0);
  * min_p m: tokens whose probability is below m x the top probability are dropped.

Logprobs are not affected: the sampler reports the raw model distribution,
as vLLM does by default (its "raw_logprobs" mode).

Every function runs on the device of the logits it is given.

What this is not: the draw (engine/sampler.py). Every function leaves rows of
sequences that do not use it untouched and returns its input when no row does.

Legend: S sequences, V vocab, R rows being sampled.
"""

from __future__ import annotations

import torch

from engine.batch import SequenceWork


def apply_logit_bias(logits: torch.Tensor, seqs: list[SequenceWork]) -> torch.Tensor:  # [S, V] -> [S, V]
    rows, cols, values = [], [], []
    for i, s in enumerate(seqs):
        for token, bias in (s.params.logit_bias or {}).items():
            if token < logits.shape[1]:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if not rows:
        return logits
    logits = logits.clone()
    dev = logits.device
    logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] += torch.tensor(
        values, dtype=logits.dtype, device=dev)
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[SequenceWork]) -> torch.Tensor:  # [S, V] -> [S, V]
    wanted = [i for i, s in enumerate(seqs) if s.params.uses_history]
    if not wanted:
        return logits
    logits = logits.clone()
    vocab, dev = logits.shape[1], logits.device
    for i in wanted:
        s, row = seqs[i], logits[i]  # row: [V], a view
        out_ids = torch.tensor([t for t in s.output_token_ids if t < vocab], dtype=torch.long, device=dev)
        counts = torch.bincount(out_ids, minlength=vocab).to(logits.dtype)  # [V]
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = counts > 0  # [V]
            seen[torch.tensor([t for t in s.prompt_token_ids if t < vocab], dtype=torch.long, device=dev)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:  # [R, V] tempered -> [R, V]
    """Tokens below min_p[r] x the row's top probability set to -inf (min_p 0 = off)."""
    if not any(min_p):
        return logits
    probs = logits.softmax(dim=-1)  # [R, V]
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]  # [R, 1]
    threshold = scale * probs.max(dim=-1, keepdim=True).values  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))
