"""Automatic prefix caching through the engine (docs/kv-cache.md, "Prefix caching"): outputs with the cache equal
outputs without it.

Requests sharing prefixes (a common 'system prompt', staggered so later ones find the earlier ones' blocks while
those run and after they end), a follow-up turn whose whole earlier conversation (prompt + answer) is cached, and
the same under preemption (recompute, reactive and proactive swapping on a small device cache), with greedy
tokens identical and logprobs within 1e-4 of the run with caching off. Every block is accounted for after each
step and all references are back to zero at the end."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_PRE_LN, settle_kv_copies

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def engine_of(model_dir, **kw) -> Engine:
    kw.setdefault("profile", "analytic")
    kw.setdefault("num_gpu_blocks_override", 64)
    return Engine(EngineConfig(model=str(model_dir), block_size=BS, seed=0, device="cpu", **kw))


def tokens(n, seed, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(engine, arrivals, params=PARAMS, check=True):
    """Add requests at given step numbers (a callable entry is asked for its prompt then, given the outputs so
    far: a follow-up turn, which waits for the turn before it to finish, as a user does); run to completion;
    checks the KV bookkeeping after every step."""
    done, step, waiting = {}, 0, []
    while step <= max(arrivals) or waiting or engine.has_unfinished():
        arriving, waiting = waiting + arrivals.get(step, []), []
        for rid, prompt in arriving:
            try:
                engine.add_request(rid, prompt(done) if callable(prompt) else prompt, params)
            except KeyError:  # the turn it follows has not finished yet
                waiting.append((rid, prompt))
        outs = engine.step()
        for out in outs:
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.kv.check_invariants()
        if not outs and engine.kv.pending_transfers():
            time.sleep(0.002)  # a copy thread is moving KV
        step += 1
        assert step < 3000
    settle_kv_copies(engine)  # (the prefix cache's own device -> host copies may outlive the jobs)
    return done


def same_outputs(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for rid, out in got.items():
        ref = want[rid]
        assert out.prompt_token_ids == ref.prompt_token_ids, rid
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, rid
        for lps, ref_lps in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert lps.keys() == ref_lps.keys(), rid
            assert all(abs(lps[t] - ref_lps[t]) < 1e-4 for t in lps), rid


SYSTEM = tokens(13, 1)  # three full blocks and a partial one


def conversation_arrivals():
    """Shared system prompt; a few users; follow-ups that repeat their whole conversation."""
    a, b, c = SYSTEM + tokens(6, 2), SYSTEM + tokens(9, 3), SYSTEM[:8] + tokens(3, 4)

    def follow_up(rid, turn):
        return lambda done: done[rid].prompt_token_ids + done[rid].outputs[0].token_ids + turn

    return {
        0: [("a", a), ("b", b)],  # both compute the system prompt (nothing cached yet)
        3: [("c", c), ("a2", SYSTEM + tokens(5, 5))],  # hits on a's and b's blocks while they run
        30: [("a-turn2", follow_up("a", tokens(4, 6)))],  # after a finished: its whole conversation cached
        31: [("b-turn2", follow_up("b", tokens(7, 7))), ("d", tokens(20, 8))],
        60: [("a-turn3", lambda done: done["a-turn2"].prompt_token_ids + done["a-turn2"].outputs[0].token_ids
              + tokens(2, 9))],
    }


@pytest.fixture(scope="module")
def uncached(small_checkpoint):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    return model_dir, run(engine_of(model_dir, enable_prefix_caching=False), conversation_arrivals())


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "fcfs"])
def test_shared_prefixes_and_follow_up_turns_give_the_uncached_outputs(uncached, policy):
    model_dir, want = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True, scheduling_policy=policy)
    computed = []
    real_finish = engine.finish_step

    def finish(plan, result):  # the positions each step computed
        computed.extend((w.job_id, w.start_pos, len(w.token_ids)) for w in plan.batch.seqs)
        return real_finish(plan, result)

    engine.finish_step = finish
    got = run(engine, conversation_arrivals())
    same_outputs(got, want)
    firsts = {}
    for jid, start, n in computed:
        firsts.setdefault(jid.split("#")[0], (start, n))
    # The follow-up turns computed only what followed their cached conversation: its full blocks of computed KV
    # (the last answer token's KV is never computed), and never the new prompt's last token.
    for rid, prev in (("a-turn2", "a"), ("b-turn2", "b"), ("a-turn3", "a-turn2")):
        start, n = firsts[rid]
        plen = len(got[rid].prompt_token_ids)
        computed_before = len(got[prev].prompt_token_ids) + len(got[prev].outputs[0].token_ids) - 1
        assert start == min(computed_before, plen - 1) // BS * BS > 0 and start + n == plen, (rid, start, n, plen)
    assert firsts["c"][0] == 8 and firsts["a2"][0] == 12  # hits on the running jobs' blocks
    assert firsts["a"][0] == 0 and firsts["d"][0] == 0
    dev = engine.kv.device
    assert dev.num_hits > 0 and dev.num_hits <= dev.num_queries
    assert dev.num_used == 0 and dev.num_refs == 0 and dev.num_free == dev.num_blocks  # references back to zero
    host = engine.kv.host
    cached = dev.num_cached + (host.num_cached if engine.kv.host_caching else 0)
    assert dev.num_cached > 0 and engine.kv.clear_prefix_cache() == cached and dev.num_cached == 0
    assert not engine.kv.host_caching or host.num_cached == 0
    dev.check_invariants()


def test_cached_tokens_are_reported_per_request(uncached):
    model_dir, _ = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True)
    got = run(engine, conversation_arrivals())
    assert engine.kv.cached_tokens is not None
    a = got["a"]
    assert got["a-turn2"].num_cached_tokens == (len(a.prompt_token_ids) + len(a.outputs[0].token_ids) - 1) // BS * BS
    assert got["a"].num_cached_tokens == 0 and got["c"].num_cached_tokens == 8
    off = run(engine_of(model_dir, enable_prefix_caching=False), conversation_arrivals())
    assert off["a-turn2"].num_cached_tokens is None  # caching off: no figure (the HTTP usage leaves it out)


def test_generated_blocks_are_named_when_the_job_leaves_the_device(uncached):
    """A decoding job's blocks are hashed when it ends (or is evicted), not as each fills: no request can hit them
    before, and hashing them as they filled cost every tick (docs/benchmarks.md, "Prefix caching"). The prompt's full
    blocks are named at once (others may share them while it runs), and after the end a follow-up finds the whole
    conversation."""
    model_dir, _ = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True)
    prompt = tokens(10, 11)  # two full blocks of BS 4, and a partial one
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    named, done = [], None
    while engine.has_unfinished():
        for out in engine.step():
            done = out if out.finished else done
        named.append(engine.kv.device.num_cached)
        engine.kv.check_invariants()
    # (named at the allocation after the prefill) only the prompt's blocks while it decoded 12 tokens
    assert named[:-1] == [0] + [2] * (len(named) - 2), named
    assert named[-1] == (10 + 12 - 1) // BS  # every full block of computed KV once it ended
    follow = done.prompt_token_ids + done.outputs[0].token_ids + tokens(3, 12)
    got = run(engine, {0: [("y", follow)]})
    assert got["y"].num_cached_tokens == (10 + 12 - 1) // BS * BS


def test_prompt_logprobs_requests_compute_their_whole_prompt(uncached):
    model_dir, _ = uncached
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    arrivals = {0: [("a", SYSTEM + tokens(3, 2))], 5: [("b", SYSTEM + tokens(4, 3))]}
    want = run(engine_of(model_dir), arrivals, params)
    got = run(engine_of(model_dir, enable_prefix_caching=True), arrivals, params)
    same_outputs(got, want)
    for rid in got:
        assert len(got[rid].prompt_logprobs) == len(want[rid].prompt_logprobs)
        for lps, ref in zip(got[rid].prompt_logprobs[1:], want[rid].prompt_logprobs[1:]):
            assert all(abs(lps[t] - ref[t]) < 1e-4 for t in lps)
        assert got[rid].num_cached_tokens == 0


@pytest.mark.parametrize("kv_policy", ["recompute", "reactive", "proactive"])
def test_outputs_equal_under_preemption_on_a_small_cache(uncached, kv_policy):
    """A device cache too small for every conversation at once: jobs are evicted (dropped or swapped), jobs
    sharing a prefix release it, cached blocks are evicted to make room; outputs stay those without caching."""
    model_dir, want = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True, num_gpu_blocks_override=14, kv_policy=kv_policy,
                       num_host_blocks_override=64, max_num_seqs=4)
    got = run(engine, conversation_arrivals())
    same_outputs(got, want)
    stats, dev = engine.kv.stats, engine.kv.device
    assert stats.num_drops + stats.num_offloads > 0  # preemption happened
    assert dev.num_evictions > 0  # cached blocks were evicted to make room
    assert dev.num_refs == 0 and dev.num_free == dev.num_blocks and engine.kv.host.num_used == 0


@pytest.mark.parametrize("kv_policy", ["recompute", "reactive", "proactive"])
def test_evicting_jobs_that_share_a_prefix_never_copies_or_frees_a_block_in_use(uncached, kv_policy):
    """Every started job is evicted at a few steps (as a policy would), while others hold the same prefix: a job
    sharing its prefix releases its references (its named blocks stay cached) and recomputes only the rest; a job
    holding only its own blocks is swapped as before; no copy ever reads a block another job holds."""
    from memory.transfers import Direction

    model_dir, want = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True, kv_policy=kv_policy, num_host_blocks_override=64)
    kv, dev = engine.kv, engine.kv.device
    real_copy = kv.transfers.copy
    copies = []

    def copy(direction, pairs):
        if direction is Direction.OFFLOAD:  # (a job's offload: its own blocks; the cache's copy: blocks no one holds)
            assert all(dev.ref_count(src) <= 1 for src, _ in pairs), "an offload copied a shared block"
        copies.append(direction)
        return real_copy(direction, pairs)

    kv.transfers.copy = copy
    shared_evictions = 0
    real_step = engine.step

    def step():
        nonlocal shared_evictions
        if engine.num_steps in (4, 5, 33, 34):
            for seq in list(engine._seq_of_job.values()):
                job = seq.job
                entry = kv._jobs.get(job.job_id)
                if job.num_computed and job.ready and not job.in_flight and entry is not None and entry.device:
                    shared_evictions += dev.ref_count(entry.device[0]) > 1
                    kv.evict(job)
                    kv.check_invariants()
        return real_step()

    engine.step = step
    got = run(engine, conversation_arrivals())
    same_outputs(got, want)
    assert shared_evictions >= 2
    if kv_policy != "recompute":
        assert Direction.OFFLOAD in copies  # jobs alone with their blocks were still swapped
    assert dev.num_refs == 0 and dev.num_free == dev.num_blocks and kv.host.num_used == 0


def test_server_flags_turn_prefix_caching_on_and_off():
    import server

    parser = server.build_parser()
    for argv, want in (([], EngineConfig().enable_prefix_caching), (["--enable-prefix-caching"], True),
                       (["--no-enable-prefix-caching"], False)):
        engine_config, _ = server._configs(parser.parse_args(argv))
        assert engine_config.enable_prefix_caching is want


# -- visibility over real HTTP ----------------------------------------------------------------------------------

def test_http_usage_reports_cached_tokens_and_metrics_count_queries_and_hits(request, tiny_model_dir):
    from tests.server_fixtures import DEFAULT_ARGS, metric_samples, post_json, shared_server, wait_idle

    srv = shared_server(request, tiny_model_dir, (*DEFAULT_ARGS, "--enable-prefix-caching"))
    wait_idle(srv.url)

    def counter(samples, name):
        return sum(v for (n, _), v in samples.items() if n == name)

    before = metric_samples(srv.url)
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    messages = [system, {"role": "user", "content": "Say something about the sea."}]
    status, _, first = post_json(srv.url + "/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200, first
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And about the mountains?"}]
    status, _, second = post_json(srv.url + "/v1/chat/completions",
                                  {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200, second
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The whole first prompt is cached, in whole 16-token blocks (at most one block short of it).
    assert first["usage"]["prompt_tokens"] - 16 < cached < second["usage"]["prompt_tokens"]
    wait_idle(srv.url)
    after = metric_samples(srv.url)
    queries = counter(after, "vllm:prefix_cache_queries_total") - counter(before, "vllm:prefix_cache_queries_total")
    hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")
    assert queries == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert hits == cached
    assert counter(after, "fastserve:prefix_cache_blocks") > 0


# -- with chunked prefill, and across tensor / pipeline parallel workers ------------------------------------------

@pytest.mark.parametrize("budget", [3, 7])
def test_cached_prefixes_under_chunked_prefill(uncached, budget):
    model_dir, want = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True, enable_chunked_prefill=True,
                       max_num_batched_tokens=budget)
    got = run(engine, conversation_arrivals())
    same_outputs(got, want)
    assert engine.kv.device.num_hits > 0 and engine.kv.device.num_refs == 0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_cached_prefixes_across_tensor_and_pipeline_parallel_workers(uncached, tp, pp):
    model_dir, want = uncached
    engine = engine_of(model_dir, enable_prefix_caching=True, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        got = run(engine, conversation_arrivals())
    finally:
        engine.shutdown()
    same_outputs(got, want)
    assert engine.kv.device.num_hits > 0 and engine.kv.device.num_refs == 0
