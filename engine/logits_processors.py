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


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy that the host does not wait for: staged through pinned memory on CUDA (PyTorch's
    caching host allocator reuses the pinned block once the copy has run); on the CPU the tensor itself."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[SequenceWork]) -> torch.Tensor:  # [S, V] -> [S, V]
    """Repetition, frequency and presence penalties of every penalised row at once, touching only the logits
    of the tokens that the rows have seen.

    The W penalised rows go to the device as one padded [W, 1 + Lo + Lp] long tensor (the row, the output
    ids, then the prompt ids of rows with a repetition penalty; padding and ids past the vocabulary are V)
    and one [W, 3] tensor of penalties. On the device: each listed token's count among its row's outputs
    (searchsorted in the sorted outputs), the listed logits gathered, penalised, and scattered back; a
    padding entry stands for its row's first token, so it writes that token's own value again. No bincount,
    nothing per row, nothing that waits on the device. The values are those of the per-row arithmetic
    (apply_penalties_reference; tests/test_sampler_penalties.py compares the two); a row with repetition
    penalty 1 is divided and multiplied by 1, which changes no value."""
    wanted = [i for i, s in enumerate(seqs) if s.params.uses_history]
    if not wanted:
        return logits
    vocab, dev, dtype = logits.shape[1], logits.device, logits.dtype
    params = [seqs[i].params for i in wanted]
    outputs = [seqs[i].output_token_ids for i in wanted]
    prompts = [seqs[i].prompt_token_ids if p.repetition_penalty != 1.0 else () for i, p in zip(wanted, params)]
    lo, lp = max(map(len, outputs)), max(map(len, prompts))
    if lo + lp == 0:  # no row has a token yet: nothing to penalise
        return logits.clone()
    packed = _to_device(torch.tensor(  # [W, 1 + Lo + Lp]
        [[i, *o, *[vocab] * (lo - len(o)), *pr, *[vocab] * (lp - len(pr))]
         for i, o, pr in zip(wanted, outputs, prompts)], dtype=torch.long), dev)
    factors = _to_device(torch.tensor(  # [W, 3]: repetition, frequency, presence
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], dtype=dtype), dev)
    rows, tokens = packed[:, :1], packed[:, 1:].clamp(max=vocab)  # [W, 1], [W, L = Lo + Lp]
    valid = tokens < vocab  # [W, L]
    any_valid = valid.any(dim=1, keepdim=True)  # [W, 1]
    first = tokens.gather(1, valid.to(torch.uint8).argmax(dim=1, keepdim=True))  # [W, 1]: V when none
    index = torch.where(valid, tokens, torch.where(any_valid, first, 0))  # [W, L]: each entry a real column
    if lo:
        ranked = tokens[:, :lo].sort(dim=1).values  # [W, Lo], padding (V) last
        counts = (torch.searchsorted(ranked, index, right=True) - torch.searchsorted(ranked, index)).to(dtype)
    else:
        counts = torch.zeros(index.shape, dtype=dtype, device=dev)  # [W, L]
    out = logits.clone()  # [S, V]
    flat = out.view(-1)
    positions = (rows * vocab + index).view(-1)  # [W * L]: in the flattened logits
    old = flat.gather(0, positions).view(index.shape)  # [W, L]
    new = old
    if any(p.repetition_penalty != 1.0 for p in params):  # every listed token is in the prompt or output
        r = factors[:, 0:1]  # [W, 1]
        new = torch.where(old > 0, old / r, old * r)
    new = new - (factors[:, 1:2] * counts + factors[:, 2:3] * (counts > 0).to(dtype))
    flat.scatter_(0, positions, torch.where(any_valid, new, old).view(-1))  # a row with no token: unchanged
    return out


def apply_penalties_reference(logits: torch.Tensor, seqs: list[SequenceWork]) -> torch.Tensor:  # [S, V] -> [S, V]
    """The slow reference of apply_penalties: one row at a time, over the whole vocabulary (a bincount and two
    small tensors per penalised row: each a wait on the device on CUDA). What the sampler ran before the
    batched version; tests compare the two."""
    logits = logits.clone()
    vocab, dev = logits.shape[1], logits.device
    for s, row in zip(seqs, logits):  # row: [V], a view
        p = s.params
        if not p.uses_history:
            continue
        out_ids = torch.tensor([t for t in s.output_token_ids if t < vocab], dtype=torch.long, device=dev)
        counts = torch.bincount(out_ids, minlength=vocab).to(logits.dtype)  # [V]
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
