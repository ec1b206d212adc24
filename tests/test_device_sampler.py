"""The sampler that runs where the logits are, against the host sampler it replaced (kept here, verbatim in
substance, as the reference): on CPU the same tokens for greedy, tempered, top-k/top-p/min_p, seeded and
unseeded rows over several steps (the generators advance the same way), and the same logprobs and prompt
logprobs. On CUDA (device_check.sh): greedy equals the CPU pick and seeded draws depend on the seed alone."""

from __future__ import annotations

import pytest
import torch

from engine.batch import SequenceWork
from engine.logits_processors import apply_logit_bias, apply_min_p, apply_penalties
from engine.sampler import Sampler, greedy_tokens, prompt_logprobs
from engine.sampling_params import SamplingParams

# -- the reference: the host sampler as it was (float32 logits copied to the host, one draw per row) ------------


def _ref_top_logprobs(row: torch.Tensor, token: int, k: int) -> dict[int, float]:
    out = {token: float(row[token])}
    if k > 0:
        vals, ids = row.topk(k)
        for v, i in zip(vals.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out


class ReferenceSampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits, seqs, eos):
        logits = logits.float().cpu()
        masked = logits
        for i, s in enumerate(seqs):
            if s.num_generated < s.params.min_tokens:
                banned = list(s.params.stop_token_ids or []) + ([eos] if eos is not None else [])
                masked = masked.clone()
                masked[i, banned] = float("-inf")
        adjusted = apply_penalties(apply_logit_bias(masked, seqs), seqs)
        tokens = adjusted.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            if s.params.greedy:
                continue
            row = adjusted[i : i + 1] / s.params.temperature
            row = apply_min_p(row, [s.params.min_p])
            if s.params.top_k > 0:
                kth = row.topk(min(s.params.top_k, row.shape[1])).values[0, -1]
                row = row.masked_fill(row < kth, float("-inf"))
            if s.params.top_p < 1.0:
                vals, order = row.sort(dim=-1, descending=True)
                p = vals.softmax(-1)
                drop = (p.cumsum(-1) - p) >= s.params.top_p
                drop[0, 0] = False
                row = torch.full_like(row, float("-inf")).scatter(1, order, vals.masked_fill(drop, float("-inf")))
            probs = row.softmax(-1)[0]
            noise = torch.empty_like(probs).exponential_(generator=s.generator or self.generator)
            tokens[i] = int((probs / noise).argmax())
        out = []
        for i, s in enumerate(seqs):
            lp = None
            if s.params.logprobs is not None:
                lp = _ref_top_logprobs(torch.log_softmax(logits[i], -1), tokens[i], s.params.logprobs)
            out.append((tokens[i], lp))
        return out


def ref_prompt_logprobs(logits, prompt_ids, k):
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [None] + [_ref_top_logprobs(lp[p - 1], prompt_ids[p], k) for p in range(1, len(prompt_ids))]


# -- the comparison --------------------------------------------------------------------------------------------

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, seed=11, logprobs=0),
    SamplingParams(temperature=1.3, top_k=20),
    SamplingParams(temperature=0.7, top_p=0.8, seed=5),
    SamplingParams(temperature=1.0, min_p=0.05, top_k=50, top_p=0.9, logprobs=5),
    SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[7], logit_bias={4: 2.0}, seed=99),
    SamplingParams(temperature=1.0),
]


def _seqs(step: int, gens: list, outputs: list[list[int]]) -> list[SequenceWork]:
    return [SequenceWork(f"j{i}", [0], 5 + step, [0], p, gens[i], num_generated=step, prompt_token_ids=[1, 2, 3],
                         output_token_ids=list(outputs[i])) for i, p in enumerate(PARAMS)]


def _fresh_generators() -> list:
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in PARAMS]


def test_cpu_sampler_matches_the_host_reference_over_steps():
    torch.manual_seed(0)
    new, ref = Sampler(seed=3), ReferenceSampler(seed=3)
    gens_new, gens_ref = _fresh_generators(), _fresh_generators()
    out_new = [[] for _ in PARAMS]
    out_ref = [[] for _ in PARAMS]
    saw_random_difference = False
    for step in range(6):
        logits = torch.randn(len(PARAMS), VOCAB) * 3
        got = new(logits, _seqs(step, gens_new, out_new), eos_token_ids=(2,))
        want = ref(logits, _seqs(step, gens_ref, out_ref), 2)
        assert [r.token_id for r in got] == [t for t, _ in want]
        for r, (_, lp) in zip(got, want):
            assert (r.logprobs is None) == (lp is None)
            if lp is not None:
                assert list(r.logprobs) == list(lp)  # same ids, sampled first, then the top-k in order
                assert list(r.logprobs.values()) == pytest.approx(list(lp.values()), abs=1e-6)
        for i, r in enumerate(got):
            out_new[i].append(r.token_id)
            out_ref[i].append(want[i][0])
        saw_random_difference |= got[1].token_id != int(logits[1].argmax())
    assert saw_random_difference  # the tempered rows really drew, not argmax
    assert all(7 not in out[:3] and 2 not in out[:3] for out in out_new[7:8])  # min_tokens masked stop and eos


def test_cpu_prompt_logprobs_match_the_reference():
    torch.manual_seed(1)
    logits = torch.randn(9, VOCAB)
    prompt = [2, 50, 7, 299, 0, 13, 13, 8, 100]
    for k in (0, 1, 4):
        got, want = prompt_logprobs(logits, prompt, k), ref_prompt_logprobs(logits, prompt, k)
        assert got[0] is None and want[0] is None
        for g, w in zip(got[1:], want[1:]):
            assert list(g) == list(w) and list(g.values()) == pytest.approx(list(w.values()), abs=1e-6)
    assert prompt_logprobs(logits[:1], [2], 3) == [None]


def test_a_seeded_row_depends_on_its_seed_not_on_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    p = SamplingParams(temperature=1.0, seed=42)

    def draw(rows: int) -> int:  # the seeded row first, then rows - 1 unseeded ones drawing from the engine's RNG
        seqs = [SequenceWork("s", [0], 1, [0], p, torch.Generator().manual_seed(42), 0)]
        seqs += [SequenceWork(f"u{i}", [0], 1, [0], SamplingParams(), None, 0) for i in range(1, rows)]
        return Sampler(seed=rows)(logits[:rows], seqs, None)[0].token_id

    assert draw(1) == draw(4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_cuda_sampler_greedy_and_logprobs_equal_the_cpu_sampler():
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), VOCAB) * 3
    params = [SamplingParams(temperature=0, logprobs=3)] * len(PARAMS)
    seqs = [SequenceWork("j", [0], 1, [0], p, None, 0) for p in params]
    cpu = Sampler()(logits, seqs, None)
    gpu = Sampler()(logits.cuda(), seqs, None)
    assert [r.token_id for r in cpu] == [r.token_id for r in gpu]
    for a, b in zip(cpu, gpu):
        assert list(a.logprobs) == list(b.logprobs)
        assert list(a.logprobs.values()) == pytest.approx(list(b.logprobs.values()), abs=1e-4)


@pytest.mark.cuda
@cuda
def test_cuda_seeded_draws_repeat_with_the_seed():
    torch.manual_seed(0)
    logits = (torch.randn(len(PARAMS), VOCAB) * 3).cuda()

    def run():
        sampler, gens, outs = Sampler(seed=1), _fresh_generators(), [[] for _ in PARAMS]
        for step in range(4):
            for i, r in enumerate(sampler(logits, _seqs(step, gens, outs), 2)):
                outs[i].append(r.token_id)
        return outs

    a, b = run(), run()
    assert a == b
    assert len({tuple(o) for o in a}) > 1


@pytest.mark.parametrize("vocab", [50272, 4096, 1000, 70])  # chunks of 32, of 64, none (plain argmax)
def test_greedy_tokens_is_argmax_with_ties_nan_and_inf(vocab):
    """The chunked CPU argmax picks what argmax picks: ties across and inside chunks go to the first index, a NaN
    wins (the first one), an all -inf row gives 0, and ordinary rows their maximum."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, vocab, generator=g)
    logits[1, [vocab - 1, 3, vocab // 2]] = 50.0  # a tie across chunks: 3 first
    logits[2, [5, 6]] = 50.0  # a tie inside one chunk
    logits[3, [vocab - 2, 4]] = float("nan")  # NaN beats any number: the first NaN
    logits[4] = float("-inf")
    logits[5, vocab - 1] = 60.0  # the last element
    logits[6, :] = 1.0  # every element tied: index 0
    torch.testing.assert_close(greedy_tokens(logits), logits.argmax(dim=-1), rtol=0, atol=0)
    assert greedy_tokens(logits[:0]).shape == (0,)

