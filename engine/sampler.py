"""Sampler: next tokens from logits, per sequence.

logit_bias and the repetition/frequency/presence penalties first
(engine/logits_processors.py), then greedy (temperature 0 or top_k 1), or
temperature then min_p, top-k and top-p, then a draw. A request with a seed draws from its own torch.Generator, so its
output depends on the seed alone, not on what else shares the batch; others
draw from the engine's generator (seeded by --seed). min_tokens masks EOS and
stop_token_ids until enough tokens exist. Logprobs are of the model's raw
distribution (log_softmax of the logits), as vLLM reports them.

Legend: S sequences, V vocab.
"""

from __future__ import annotations

import torch

from engine.batch import SequenceResult, SequenceWork
from engine.logits_processors import apply_logit_bias, apply_min_p, apply_penalties


def _top_logprobs(logprobs_row: torch.Tensor, token: int, k: int) -> dict[int, float]:
    out = {token: float(logprobs_row[token])}
    if k > 0:
        vals, ids = logprobs_row.topk(k)
        for v, i in zip(vals.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[SequenceWork], eos_token_id: int | None
    ) -> list[SequenceResult]:  # logits [S, V] float32
        logits = logits.float().cpu()
        masked = self._mask_min_tokens(logits, seqs, eos_token_id)
        adjusted = apply_penalties(apply_logit_bias(masked, seqs), seqs)
        tokens = self._sample(adjusted, seqs)
        results = [SequenceResult(t) for t in tokens]
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if wanted:
            logprobs = torch.log_softmax(logits[wanted], dim=-1)  # [W, V], the raw model distribution
            for row, i in enumerate(wanted):
                results[i].logprobs = _top_logprobs(logprobs[row], tokens[i], seqs[i].params.logprobs)
        return results

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, seqs: list[SequenceWork], eos: int | None) -> torch.Tensor:
        rows, cols = [], []
        for i, s in enumerate(seqs):
            if s.num_generated < s.params.min_tokens:
                banned = list(s.params.stop_token_ids or [])
                if eos is not None and not s.params.ignore_eos:
                    banned.append(eos)
                banned = [b for b in banned if b < logits.shape[1]]
                rows += [i] * len(banned)
                cols += banned
        if rows:
            logits = logits.clone()
            logits[rows, cols] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[SequenceWork]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return greedy
        idx = torch.tensor(random_rows)
        rows = logits[idx]  # [R, V]
        temp = torch.tensor([seqs[i].params.temperature for i in random_rows])[:, None]
        probs = self._filter(rows / temp, [seqs[i].params for i in random_rows]).softmax(dim=-1)
        # Exponential race (Gumbel-max in probability space): argmax(p / q), q ~ Exp(1).
        noise = torch.empty_like(probs)
        for r, i in enumerate(random_rows):
            noise[r].exponential_(generator=seqs[i].generator or self.generator)
        drawn = (probs / noise).argmax(dim=-1).tolist()
        for r, i in enumerate(random_rows):
            greedy[i] = drawn[r]
        return greedy

    @staticmethod
    def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
        """min_p, top-k then top-p per row: [R, V] -> [R, V] with dropped tokens at -inf."""
        logits = apply_min_p(logits, [p.min_p for p in params])
        ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        ps = [p.top_p for p in params]
        if all(k >= logits.shape[1] for k in ks) and all(p >= 1.0 for p in ps):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(logits.shape[1])[None, :]
        drop = rank >= torch.tensor(ks)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= torch.tensor(ps)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], k: int
) -> list[dict[int, float] | None]:  # logits [P, V] at prompt positions 0..P-1
    """Logprob of each prompt token given the tokens before it (None for the first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: list[dict[int, float] | None] = [None]
    for pos in range(1, len(prompt_ids)):
        out.append(_top_logprobs(lp[pos - 1], prompt_ids[pos], k))
    return out
