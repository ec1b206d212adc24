"""vLLM's logits adjustments: logit_bias, repetition / frequency / presence penalties and min_p, against
values worked out by hand on fixed logits; then on the tiny model, where the greedy choice with frequency and
presence penalties must equal the argmax of the raw logprobs minus the penalties, step by step; and request
priority reaching every job."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams, ValidationError
from engine.batch import SequenceWork
from engine.logits_processors import apply_logit_bias, apply_min_p, apply_penalties, apply_penalties_reference
from engine.sampler import Sampler

LOGITS = [2.0, -1.0, 0.5, 0.0, -3.0, 1.9]  # one row, vocabulary of 6


def work(params: SamplingParams, prompt: list[int] = (), output: list[int] = ()) -> SequenceWork:
    return SequenceWork("j", [0], 0, [0], params, None, len(output), prompt_token_ids=list(prompt),
                        output_token_ids=list(output))


def adjusted(params: SamplingParams, prompt=(), output=()) -> list[float]:
    seqs = [work(params, prompt, output)]
    return apply_penalties(apply_logit_bias(torch.tensor([LOGITS]), seqs), seqs)[0].tolist()


def test_each_adjustment_by_hand():
    # logit_bias adds, and only to the tokens it names.
    assert adjusted(SamplingParams(logit_bias={"4": 3.5, 1: -2})) == pytest.approx([2.0, -3.0, 0.5, 0.0, 0.5, 1.9])
    # repetition 2 over prompt {0, 1} and output {2, 4}: positive logits halved, negative doubled, 0 stays.
    assert adjusted(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2, 4, 3]) == pytest.approx(
        [1.0, -2.0, 0.25, 0.0, -6.0, 1.9])
    # frequency 0.5 per occurrence in the output (token 2 twice, token 5 once); the prompt does not count.
    assert adjusted(SamplingParams(frequency_penalty=0.5), prompt=[0], output=[2, 5, 2]) == pytest.approx(
        [2.0, -1.0, -0.5, 0.0, -3.0, 1.4])
    # presence 0.25 once per distinct output token.
    assert adjusted(SamplingParams(presence_penalty=0.25), prompt=[0], output=[2, 5, 2]) == pytest.approx(
        [2.0, -1.0, 0.25, 0.0, -3.0, 1.65])


def test_all_together_in_vllms_order_changes_the_greedy_pick():
    params = SamplingParams(temperature=0, logit_bias={3: 1.0}, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    # bias: token 3 -> 1.0; repetition over {0, 5, 3} (prompt 0; output 5, 5, 3): 2.0 -> 1.0, 1.9 -> 0.95,
    # 1.0 -> 0.5; frequency: token 5 twice -> 0.95 - 1.0, token 3 once -> 0.5 - 0.5; presence: -0.25 each.
    want = [1.0, -1.0, 0.5, -0.25, -3.0, -0.3]
    got = adjusted(params, prompt=[0], output=[5, 5, 3])
    assert got == pytest.approx(want)
    (res,) = Sampler()(torch.tensor([LOGITS]), [work(params, [0], [5, 5, 3])])
    assert res.token_id == 0  # unadjusted, 0 wins too; now check one where the adjustment decides:
    params = SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=2)
    (res,) = Sampler()(torch.tensor([LOGITS]), [work(params, [], [0])])
    assert res.token_id == 5  # 2.0 - 1.0 < 1.9
    raw = torch.log_softmax(torch.tensor(LOGITS), dim=-1)
    assert res.logprobs == pytest.approx({5: float(raw[5]), 0: float(raw[0])})  # the raw distribution


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    probs = [0.5, 0.3, 0.15, 0.05]
    row = torch.tensor([[math.log(p) for p in probs]])
    kept = apply_min_p(row, [0.2])[0]  # threshold 0.2 * 0.5 = 0.1: token 3 goes
    assert torch.isinf(kept[3]) and kept[:3].tolist() == pytest.approx(row[0, :3].tolist())
    assert torch.isinf(apply_min_p(row, [0.7])[0]).tolist() == [False, True, True, True]
    assert torch.equal(apply_min_p(row, [0.0]), row)
    # Sampled: a token under the threshold is never drawn; without min_p it is, often.
    logits = torch.tensor([[0.0, 0.0, -1.0, -1.0]]).repeat(400, 1)  # p ~ [0.37, 0.37, 0.13, 0.13]
    sampler = Sampler(seed=3)
    with_min_p = [work(SamplingParams(min_p=0.5))] * 400
    without = [work(SamplingParams())] * 400
    assert {r.token_id for r in sampler(logits, with_min_p, None)} == {0, 1}
    assert {r.token_id for r in sampler(logits, without, None)} == {0, 1, 2, 3}


def test_rows_without_adjustments_are_untouched_and_not_copied():
    logits = torch.tensor([LOGITS, LOGITS])
    seqs = [work(SamplingParams()), work(SamplingParams(presence_penalty=1.0), output=[0])]
    out = apply_penalties(apply_logit_bias(logits, seqs), seqs)
    assert torch.equal(out[0], logits[0]) and out[1, 0] == 1.0 and logits[1, 0] == 2.0
    plain = [work(SamplingParams())] * 2
    assert apply_penalties(apply_logit_bias(logits, plain), plain) is logits


@pytest.mark.parametrize("kwargs, words", [
    (dict(presence_penalty=2.5), "between -2 and 2"), (dict(frequency_penalty="x"), "number"),
    (dict(repetition_penalty=0), "> 0"), (dict(min_p=1.5), "between 0 and 1"),
    (dict(logit_bias={"a": 1}), "token ids"), (dict(logit_bias={"5": 101}), "between -100 and 100"),
    (dict(logit_bias=[1, 2]), "map"),
])
def test_bad_values_name_the_field(kwargs, words):
    with pytest.raises(ValidationError, match=words) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs))


# -- on the tiny model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=512, profile="analytic")


def test_greedy_with_penalties_is_the_argmax_of_raw_logprobs_minus_penalties(llm):
    """Frequency and presence penalties shift logits, so argmax over logprobs - penalties is the reference;
    the logprobs returned are the raw model's (unpenalized) ones."""
    f, p = 1.5, 0.5
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20, frequency_penalty=f,
                            presence_penalty=p)
    plain = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    (out,) = llm.generate(["The quick brown fox"], params)
    tokens, lps = out.outputs[0].token_ids, out.outputs[0].logprobs
    assert tokens != plain[0].outputs[0].token_ids  # the penalties changed something
    for step, (token, lp) in enumerate(zip(tokens, lps)):
        before = tokens[:step]
        score = {t: v - f * before.count(t) - p * (t in before) for t, v in lp.items()}
        best = max(score, key=score.get)
        assert score[best] >= min(lp.values())  # so no token outside the top 20 can beat it
        assert token == best, (step, token, best)


def test_logit_bias_forces_or_forbids_a_token(llm):
    forced = llm.generate(["Hello"], SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True,
                                                     logit_bias={"77": 100}))
    assert forced[0].outputs[0].token_ids == [77] * 8
    first = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    banned = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}))
    assert banned[0].outputs[0].token_ids[0] != first
    with pytest.raises(ValidationError, match=r"logit_bias names token id 999999; ids must be in \[0, 4096\)"):
        llm.generate(["Hello"], SamplingParams(logit_bias={999999: 1}))


def test_priority_reaches_every_job_and_is_validated(llm):
    req = llm.engine.prepare_request("p", "Hello", SamplingParams(n=3), priority=-2)
    assert [s.job.priority for s in req.seqs] == [-2, -2, -2]
    assert llm.engine.prepare_request("q", "Hello").seqs[0].job.priority == 0
    with pytest.raises(ValidationError, match="priority must be an integer") as e:
        llm.engine.prepare_request("r", "Hello", priority=1.5)
    assert e.value.param == "priority"
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(ValidationError, match="one integer per prompt") as e:
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1])
    assert e.value.param == "priority"
    assert not llm.engine.has_unfinished()


# -- one batched operation for the whole batch -------------------------------------------------------------
def random_batch(g: torch.Generator, rows: int, vocab: int, penalised: float = 0.6) -> list[SequenceWork]:
    """Rows with any mix of repetition, frequency and presence penalties (negative ones too) or none; outputs
    from empty to long with repeats; prompts; a few ids past the logits' vocabulary (a tokenizer's extras)."""
    def ints(n: int, high: int) -> list[int]:
        return torch.randint(0, high, (n,), generator=g).tolist()

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (), generator=g))]

    seqs = []
    for _ in range(rows):
        if float(torch.rand((), generator=g)) < penalised:
            params = SamplingParams(repetition_penalty=pick(1.0, 1.3, 0.7, 2.0),
                                    frequency_penalty=pick(0.0, 0.5, -1.25), presence_penalty=pick(0.0, 0.75, -0.3))
        else:
            params = SamplingParams()
        output = ints(pick(0, 1, 5, 40), vocab + 3)  # up to 3 ids past the vocabulary
        seqs.append(work(params, prompt=ints(pick(0, 3, 30), vocab + 3), output=output + output[: len(output) // 2]))
    return seqs


def test_batched_penalties_equal_the_per_row_ones_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    seen = set()
    for case in range(60):
        vocab = int(torch.randint(8, 300, (), generator=g))
        seqs = random_batch(g, rows=int(torch.randint(1, 9, (), generator=g)), vocab=vocab,
                            penalised=(0.6, 1.0)[case % 2])  # every other batch: all rows penalised
        logits = torch.randn(len(seqs), vocab, generator=g) * 4
        logits[:, :3] = torch.tensor([0.0, -0.0, float("-inf")])
        got, want = apply_penalties(logits, seqs), apply_penalties_reference(logits, seqs)
        assert torch.equal(got, want), case
        seen |= {(p.repetition_penalty != 1, p.frequency_penalty != 0, p.presence_penalty != 0)
                 for p in (s.params for s in seqs)}
    assert len(seen) == 8  # every combination of the three penalties (and none) came up


def test_penalties_are_one_batched_operation_with_nothing_per_row_and_no_wait_on_the_device():
    """The ops apply_penalties runs (torch's dispatcher sees each) are the same for 2 penalised rows as for 24,
    and none of them waits on the device on CUDA: no bincount, nonzero, item or masked indexing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def ops(rows: int) -> list[str]:
        g = torch.Generator().manual_seed(rows)
        seqs = [work(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.25),
                     prompt=torch.randint(0, 50, (7,), generator=g).tolist(),
                     output=torch.randint(0, 50, (rows,), generator=g).tolist()) for _ in range(rows)]
        seqs.append(work(SamplingParams()))  # and one row without penalties
        logits = torch.randn(len(seqs), 50, generator=g)
        with Ops() as mode:
            apply_penalties(logits, seqs)
        return mode.names

    few, many = ops(2), ops(24)
    assert few == many
    assert not {"bincount", "nonzero", "_local_scalar_dense", "item", "masked_select", "index_put_",
                "index_put"} & set(many), many
    assert {"searchsorted", "gather", "scatter_"} <= set(many)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_penalties_on_cuda_never_wait_on_the_device_and_equal_the_per_row_ones():
    g = torch.Generator().manual_seed(1)
    seqs = random_batch(g, rows=32, vocab=50272)
    logits = torch.randn(len(seqs), 50272, generator=g)
    want = apply_penalties_reference(logits, seqs)
    gpu = logits.cuda()
    apply_penalties(gpu, seqs)  # the first call allocates the pinned staging blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        got = apply_penalties(gpu, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the repetition division may round differently on CUDA (torch divides by a CPU scalar as a product with its
    # reciprocal there), by at most one unit in the last place
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=2e-6)
