"""The engine and the offline API on the tiny model: batch invariance of
greedy output, sampling controls, stop conditions, the output shape, and
validation that changes nothing."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, ValidationError
from modelmaker.opt_checkpoint import TINY_SHAPE

PROMPTS = [
    "The quick brown fox",
    "Serving large language models",
    "A",
    "Scheduling at token granularity removes head-of-line blocking, which is most of the latency",
    "Caches and queues",
    "Numbers: 1 2 3 4 5 6 7 8 9 10",
    "Paris is",
    "Ünïcödé ✓ 日本語",
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=512, profile="analytic")


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_tiny_model_is_a_few_million_parameters_with_2048_context(llm):
    cfg = llm.engine.model_config
    assert cfg.max_position_embeddings == 2048
    assert cfg.hidden_size == TINY_SHAPE["hidden_size"]
    assert 2_000_000 < cfg.num_params() < 10_000_000


def test_greedy_output_does_not_depend_on_batch(llm):
    alone = {p: llm.generate(p, greedy())[0].outputs[0].token_ids for p in PROMPTS}
    for k in range(1, len(PROMPTS) + 1):
        outs = llm.generate(PROMPTS[:k], greedy())
        for p, out in zip(PROMPTS[:k], outs):
            assert out.outputs[0].token_ids == alone[p], f"batch of {k}: {p!r} changed"
    # And with staggered arrivals that mix prefill and decode in one iteration.
    eng = llm.engine
    eng.add_request("late-0", PROMPTS[3], greedy())
    eng.step()
    eng.step()
    eng.add_request("late-1", PROMPTS[0], greedy())
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"late-0": alone[PROMPTS[3]], "late-1": alone[PROMPTS[0]]}


def test_seed_reproducible_whatever_shares_the_batch(llm):
    params = SamplingParams(temperature=5.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids
    b = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                     [SamplingParams(temperature=1.0, max_tokens=16), params, greedy()])[1].outputs[0].token_ids
    c = llm.generate(PROMPTS[1], SamplingParams(temperature=5.0, top_p=0.9, seed=99, max_tokens=16,
                                                ignore_eos=True))[0].outputs[0].token_ids
    assert a == b
    assert a != c  # a different seed draws differently (16 draws at temperature 5; the model is peaked)


def test_top_k_1_equals_greedy(llm):
    g = llm.generate(PROMPTS[:4], greedy())
    k1 = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in g] == [o.outputs[0].token_ids for o in k1]


def test_n_gives_n_distinct_seeded_outputs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=5.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=5.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_string_cuts_text_before_it(llm):
    full = llm.generate(PROMPTS[1], greedy(max_tokens=24))[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]  # a piece from the middle of the output
    cut = llm.generate(PROMPTS[1], greedy(max_tokens=24, stop=[stop, "\x00never"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) <= len(full.token_ids)
    # No stop string counts before min_tokens tokens exist (vLLM's rule).
    late = llm.generate(PROMPTS[1], greedy(max_tokens=24, stop=[stop], min_tokens=24))[0].outputs[0]
    assert late.finish_reason == "length" and late.text == text


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate(PROMPTS[2], greedy(max_tokens=12))[0].outputs[0].token_ids
    tok = full[3]
    first = full.index(tok)
    out = llm.generate(PROMPTS[2], greedy(max_tokens=12, stop_token_ids=[tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == full[: first + 1]
    # min_tokens forbids the stop token until enough tokens exist.
    later = llm.generate(PROMPTS[2], greedy(max_tokens=12, stop_token_ids=[tok], min_tokens=first + 2))[0]
    assert len(later.outputs[0].token_ids) >= first + 2
    assert tok not in later.outputs[0].token_ids[: first + 1]


def test_eos_ends_a_request_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    # min_tokens bans EOS, so with it the request runs to max_tokens; stop_token_ids=[eos] is the same rule.
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, min_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and eos not in out.token_ids


def test_vllm_detokenization_and_truncation_params(llm):
    """The offline API takes vLLM's skip_special_tokens, include_stop_str_in_output and truncate_prompt_tokens."""
    eos = llm.tokenizer.eos_token_id
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100})
    assert llm.generate(PROMPTS[0], SamplingParams(**forced))[0].outputs[0].text == ""
    kept = llm.generate(PROMPTS[0], SamplingParams(**forced, skip_special_tokens=False))[0].outputs[0]
    assert kept.text == "</s></s></s>" and kept.token_ids == [eos] * 3
    text = llm.generate(PROMPTS[1], greedy(max_tokens=24))[0].outputs[0].text
    stop = text[8:11]
    cut = llm.generate(PROMPTS[1], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.outputs[0].text == text[: text.index(stop) + len(stop)] and cut.outputs[0].stop_reason == stop
    full_ids = llm.tokenizer.encode(PROMPTS[3])
    short = llm.generate(PROMPTS[3], greedy(max_tokens=4, truncate_prompt_tokens=5))[0]
    assert short.prompt_token_ids == [eos, *full_ids[-4:]] and short.prompt == PROMPTS[3]
    alone = llm.generate([short.prompt_token_ids], greedy(max_tokens=4))[0]
    assert short.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.generate([full_ids], greedy(max_tokens=1, truncate_prompt_tokens=2))[0].prompt_token_ids == \
        full_ids[-2:]
    with pytest.raises(ValidationError) as e:
        llm.generate("x", SamplingParams(truncate_prompt_tokens=4096))
    assert e.value.param == "truncate_prompt_tokens" and "2048" in e.value.message


def test_logprobs_hold_the_sampled_token_and_top_k(llm):
    out = llm.generate(PROMPTS[0], greedy(max_tokens=4, logprobs=3, prompt_logprobs=2))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == max(lp.values())  # greedy picks the most likely
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lp and 2 <= len(lp) <= 3


def test_output_shape_and_metrics(llm):
    outs = llm.generate([PROMPTS[0], [2, 100, 200, 300]], greedy(max_tokens=5))
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    o = outs[1]
    assert o.prompt is None and o.prompt_token_ids == [2, 100, 200, 300]
    assert outs[0].prompt_token_ids[0] == llm.tokenizer.bos_token_id  # OPT prepends </s>
    m = o.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.executing_s > 0 and m.queued_s >= 0 and m.preemptions == 0
    assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "must not be empty"),
        ([], SamplingParams(), "must not be empty"),
        ([5, -1], SamplingParams(), "out of range"),
        ([5, 10**6], SamplingParams(), "out of range"),
        ("x " * 3000, SamplingParams(), r"prompt has \d+ tokens; this model's context is 2048"),
        ("hello", SamplingParams(max_tokens=2047), r"exceeds this model's context of 2048"),
    ],
)
def test_bad_requests_raise_and_change_nothing(llm, prompt, params, match):
    free = llm.engine.kv.device.num_free
    with pytest.raises(ValidationError, match=match):
        llm.generate(["fine prompt", prompt], params)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.device.num_free == free


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"), (dict(n=0), "n"), (dict(n=1000), "n"), (dict(logprobs=100), "logprobs"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(stop=[""]), "stop"), (dict(seed=2**70), "seed"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(skip_special_tokens=1), "skip_special_tokens"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, param):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_request_that_can_never_fit_is_refused(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=4, profile="analytic")
    with pytest.raises(ValidationError, match="needs 5 KV blocks.*only 4"):
        llm.generate([[2, 3, 4, 5]], SamplingParams(max_tokens=16))


def test_blocks_return_after_finish_and_abort(llm):
    eng = llm.engine
    free = eng.kv.device.num_free
    eng.add_request("x1", PROMPTS[3], greedy(max_tokens=30))
    eng.add_request("x2", PROMPTS[4], greedy(max_tokens=3))
    eng.step()
    eng.step()
    assert eng.kv.device.num_free < free
    out = eng.abort("x1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while eng.has_unfinished():
        eng.step()
    eng.kv.check_invariants()
    assert eng.kv.device.num_free == free


@pytest.mark.parametrize("policy", ["fcfs", "skip-join-mlfq"])
def test_prompt_longer_than_the_token_budget_runs_alone_rather_than_never(tiny_model_dir, policy):
    llm = LLM(model=str(tiny_model_dir), max_num_batched_tokens=8, scheduling_policy=policy, profile="analytic")
    long_prompt = list(range(10, 40))  # 30 tokens > the 8-token budget
    outs = llm.generate([long_prompt, [2, 5, 6]], greedy(max_tokens=4))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
