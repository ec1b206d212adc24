"""Skip-join enters a request by the work it really needs (docs/kv-cache.md, "Prefix caching"): with prefix caching the
engine looks up a request's cached prefix when it is admitted (Job.num_cached_prompt_tokens) and the entry rule prices
only the uncached rest; the real hit is still taken at the job's first allocation, so a job whose cached blocks were
evicted in between computes its whole prompt and gives the same outputs."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_PRE_LN
from tests.test_prefix_caching import BS, engine_of, tokens

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def run_all(engine):
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.kv.check_invariants()
    return done


def follow_up_prompt(first) -> list[int]:
    return first.prompt_token_ids + first.outputs[0].token_ids + tokens(3, 99)


def test_a_follow_up_turn_enters_by_its_uncached_rest_and_stays_exact_if_its_blocks_go(small_checkpoint):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    history = tokens(200, 5)  # a long first turn: its follow-up is mostly cached
    want = {}
    for cache in (False, True):
        engine = engine_of(model_dir, enable_prefix_caching=cache, num_gpu_blocks_override=256)
        engine.add_request("t1", history, PARAMS)
        first = run_all(engine)["t1"]
        prompt = follow_up_prompt(first)
        req = engine.add_request("t2", prompt, PARAMS)
        job, policy = req.seqs[0].job, engine.scheduler
        if not cache:
            assert job.num_cached_prompt_tokens == 0 and job.queue == policy.entry_queue(len(prompt))
            want = run_all(engine)
            continue
        cached = (len(history) + len(first.outputs[0].token_ids) - 1) // BS * BS
        assert job.num_cached_prompt_tokens == cached
        assert job.queue == policy.entry_queue(len(prompt), cached) < policy.entry_queue(len(prompt))
        assert engine.kv.device.num_queries == len(history)  # admission's look-up counts no query
        # Its cached blocks go before it starts (nothing holds them): it keeps its entry, computes everything.
        assert engine.kv.clear_prefix_cache() > 0
        got = run_all(engine)
        assert got["t2"].num_cached_tokens == 0
        assert got["t2"].outputs[0].token_ids == want["t2"].outputs[0].token_ids
        # And with the blocks there, the hit is taken: the same tokens, only the rest computed.
        engine.add_request("t3", prompt, PARAMS)
        again = run_all(engine)["t3"]
        assert again.num_cached_tokens == (len(prompt) - 1) // BS * BS
        assert again.outputs[0].token_ids == want["t2"].outputs[0].token_ids
        dev = engine.kv.device
        assert dev.num_refs == 0 and dev.num_free == dev.num_blocks


def test_prompt_logprobs_requests_enter_by_their_whole_prompt(small_checkpoint):
    engine = engine_of(small_checkpoint(SMALL_PRE_LN), enable_prefix_caching=True)
    prompt = tokens(40, 7)
    engine.add_request("a", prompt, PARAMS)
    run_all(engine)
    req = engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert req.seqs[0].job.num_cached_prompt_tokens == 0
    run_all(engine)
