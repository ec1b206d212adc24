"""Sampler: next tokens from logits, per sequence, on the device the logits are on.

logit_bias and the repetition/frequency/presence penalties first
(engine/logits_processors.py), then greedy (temperature 0 or top_k 1), or
temperature then min_p, top-k and top-p, then a draw. A request with a seed draws from its own torch.Generator, so its
output depends on the seed alone, not on what else shares the batch; others
draw from the engine's generator (seeded by --seed). min_tokens masks EOS and
stop_token_ids until enough tokens exist. Logprobs are of the model's raw
distribution (log_softmax of the logits), as vLLM reports them.

Everything runs where the logits are (CPU, or the GPU that computed them):
only the sampled ids, and the logprobs a request asked for (the sampled
token's and the top-k alternatives'), cross to the host. A seeded sequence's
generator is a host torch.Generator (the engine or a worker makes it from the
seed); on another device the sampler keeps a twin on that device, seeded from
the same seed, for as long as the host generator lives. On CPU the draws are
the very ones the host sampler made before (tests/test_device_sampler.py
keeps that sampler as the reference).

Legend: S sequences, V vocab, R rows being sampled, W rows asking for logprobs.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import SequenceResult, SequenceWork
from engine.logits_processors import apply_logit_bias, apply_min_p, apply_penalties


@dataclass
class _HostLogprobs:
    """Per-row logprobs moved to the host: of one chosen token and of the row's top k (k = the most any row
    asked for; each row keeps its own first k)."""

    chosen: list[float]  # [W]
    top_values: list[list[float]]  # [W][k]
    top_ids: list[list[int]]  # [W][k]

    def as_dict(self, row: int, token: int, k: int) -> dict[int, float]:
        """{token: its logprob, then the top-k ids: theirs}, the sampled (or prompt) token first."""
        out = {token: self.chosen[row]}
        for v, i in zip(self.top_values[row][:k], self.top_ids[row][:k]):
            out.setdefault(i, v)
        return out


def _logprobs_to_host(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> _HostLogprobs:
    """logprobs [W, V] and chosen [W] long (on the device) -> the chosen tokens' values and the top k per row."""
    chosen_values = logprobs.gather(1, chosen[:, None])[:, 0]  # [W]
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)  # [W, k] each, largest first
        return _HostLogprobs(chosen_values.tolist(), values.tolist(), ids.tolist())
    return _HostLogprobs(chosen_values.tolist(), [[] for _ in range(chosen.shape[0])], [[] for _ in range(
        chosen.shape[0])])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S] long
    """logits.argmax(dim=-1), the same ids (ties and NaN included: the first index of the row's maximum).

    On the CPU, argmax walks each row one element at a time (about 3 ms for 32 rows of OPT's 50,272 at one
    thread), while amax is vectorised; so the row is cut into chunks of 64 or 32, the first chunk holding the
    maximum is found from the chunk maxima (amax, then argmax over V / chunk values), and argmax runs inside
    that chunk only (about 0.6 ms). The first chunk holding the maximum holds its first index. Elsewhere, or
    when no chunk size divides V, plain argmax."""
    s, v = logits.shape
    chunk = next((c for c in (64, 32) if v % c == 0), 0)
    if logits.device.type != "cpu" or not chunk or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(s, v // chunk, chunk)
    first = chunks.amax(dim=-1).argmax(dim=-1)  # [S]: the first chunk holding each row's maximum
    return first * chunk + chunks[torch.arange(s), first].argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)  # the engine's, on CPU
        self._engine_generators: dict[torch.device, torch.Generator] = {}  # the engine's, on other devices
        # host generator of a seeded sequence -> its twin on a device; dropped with the sequence's generator
        self._twins: weakref.WeakKeyDictionary[torch.Generator, torch.Generator] = weakref.WeakKeyDictionary()

    def release(self) -> None:
        """Drop the generators kept on devices (the engine's and the seeded sequences' twins): an engine closing."""
        self._engine_generators.clear()
        self._twins.clear()

    def _generator(self, seq: SequenceWork, device: torch.device) -> torch.Generator:
        """The generator a row draws from, on `device`."""
        if device.type == "cpu":
            return seq.generator or self.generator
        if seq.generator is None:
            gen = self._engine_generators.get(device)
            if gen is None:
                gen = self._engine_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
            return gen
        twin = self._twins.get(seq.generator)
        if twin is None:
            twin = self._twins[seq.generator] = torch.Generator(device=device).manual_seed(
                seq.generator.initial_seed())
        return twin

    def __call__(
        self, logits: torch.Tensor, seqs: list[SequenceWork], eos_token_ids: Sequence[int] = ()
    ) -> list[SequenceResult]:  # logits [S, V], on any device
        logits = logits.float()
        masked = self._mask_min_tokens(logits, seqs, eos_token_ids)
        adjusted = apply_penalties(apply_logit_bias(masked, seqs), seqs)
        tokens = self._sample(adjusted, seqs)  # [S] long, on the device
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        host_lp = None
        if wanted:
            rows = torch.tensor(wanted, dtype=torch.long, device=logits.device)
            logprobs = torch.log_softmax(logits[rows], dim=-1)  # [W, V], the raw model distribution
            host_lp = _logprobs_to_host(logprobs, tokens[rows], max(seqs[i].params.logprobs for i in wanted))
        token_ids = tokens.tolist()  # [S]: the step's one wait on the device
        results = [SequenceResult(t) for t in token_ids]
        for row, i in enumerate(wanted):
            results[i].logprobs = host_lp.as_dict(row, token_ids[i], seqs[i].params.logprobs)
        return results

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, seqs: list[SequenceWork], eos: Sequence[int]) -> torch.Tensor:
        rows, cols = [], []
        for i, s in enumerate(seqs):
            if s.num_generated < s.params.min_tokens:
                banned = list(s.params.stop_token_ids or [])
                if not s.params.ignore_eos:
                    banned += eos
                banned = [b for b in banned if b < logits.shape[1]]
                rows += [i] * len(banned)
                cols += banned
        if rows:
            logits = logits.clone()
            dev = logits.device
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[SequenceWork]) -> torch.Tensor:  # [S, V] -> [S] long
        greedy = greedy_tokens(logits)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return greedy
        dev = logits.device
        idx = torch.tensor(random_rows, dtype=torch.long, device=dev)
        rows = logits[idx]  # [R, V]
        temp = torch.tensor([seqs[i].params.temperature for i in random_rows], dtype=rows.dtype, device=dev)[:, None]
        probs = self._filter(rows / temp, [seqs[i].params for i in random_rows]).softmax(dim=-1)
        noise = self._exponential_noise(probs, [seqs[i] for i in random_rows])
        # Exponential race (Gumbel-max in probability space): argmax(p / q), q ~ Exp(1).
        drawn = (probs / noise).argmax(dim=-1)  # [R]
        return greedy.index_copy(0, idx, drawn)

    def _exponential_noise(self, probs: torch.Tensor, seqs: list[SequenceWork]) -> torch.Tensor:
        """Exp(1) noise [R, V]: a seeded row from its own generator; the other rows in one draw, in row order,
        from the engine's generator (on CPU the same numbers as one draw per row)."""
        noise = torch.empty_like(probs)
        shared = [r for r, s in enumerate(seqs) if s.generator is None]
        for r, s in enumerate(seqs):
            if s.generator is not None:
                noise[r].exponential_(generator=self._generator(s, probs.device))
        if len(shared) == len(seqs):
            return noise.exponential_(generator=self._generator(seqs[0], probs.device))
        if shared:
            draw = torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype, device=probs.device)
            draw.exponential_(generator=self._generator(seqs[shared[0]], probs.device))
            noise[torch.tensor(shared, dtype=torch.long, device=probs.device)] = draw
        return noise

    @staticmethod
    def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
        """min_p, top-k then top-p per row: [R, V] -> [R, V] with dropped tokens at -inf."""
        logits = apply_min_p(logits, [p.min_p for p in params])
        vocab, dev = logits.shape[1], logits.device
        ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        ps = [p.top_p for p in params]
        if all(k >= vocab for k in ks) and all(p >= 1.0 for p in ps):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= torch.tensor(ks, device=dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= torch.tensor(ps, dtype=probs.dtype, device=dev)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], k: int, start: int = 0
) -> list[dict[int, float] | None]:  # logits [R, V] at prompt positions start..start+R-1, on any device
    """Logprob of each prompt token given the tokens before it (None for the first): of tokens start+1 ..
    start+R (those in the prompt), and the None of token 0 when start is 0. The whole prompt (start 0, R = P)
    gives all P; a chunk of it (chunked prefill) its share, the chunks' lists concatenated giving the same.
    Computed where the logits are, only the values asked for moved to the host."""
    out: list[dict[int, float] | None] = [None] if start == 0 else []
    last = min(start + logits.shape[0], len(prompt_ids) - 1)  # rows start..last-1 predict tokens start+1..last
    if last <= start:
        return out
    lp = torch.log_softmax(logits[: last - start].float(), dim=-1)  # row r predicts token start+r+1
    targets = prompt_ids[start + 1 : last + 1]
    host = _logprobs_to_host(lp, torch.tensor(targets, dtype=torch.long, device=lp.device), k)
    for row, token in enumerate(targets):
        out.append(host.as_dict(row, token, k))
    return out
