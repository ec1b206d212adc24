"""Chunked prefill (docs/scheduling.md, "Chunked prefill").

Prefill over a cached prefix: any number of new tokens attending to any number of cached tokens in the paged KV
cache (causal within the new tokens), in the reference attention path against dense attention, and the model
running a prompt's tokens [k, n) given the KV of [0, k): every chunking of a prompt (chunks of 1, of a block, of
sizes that do not divide it) gives transformers' logprobs and greedy tokens, and the unchunked run's.
(The Triton kernels' chunked prefill: tests/triton_interpreter_cases.py.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.batch import ModelBatch, SequenceWork
from engine.config import UNCHUNKED_BATCHED_TOKENS, EngineConfig
from engine.engine import Engine, resolve_chunking
from engine.executor.local import LocalExecutor
from engine.model.config import OPTConfig
from engine.sampling_params import SamplingParams
from fastserve_kernels.paged_attention import paged_attention
from scheduler.cost_model import (
    BUDGET_DECODE_BATCH,
    BUDGET_DECODE_CONTEXT,
    BUDGET_STALL_RATIO,
    ProfiledCostModel,
    chunk_budget,
    stall_safe_chunk,
)
from tests.conftest import SMALL_POST_LN, SMALL_PRE_LN, settle_kv_copies
from tests.paged_batches import make_batch
from tests.test_model_reference import hf_logprobs, run_staggered

BS = 4


def dense_causal(q, k, v, scale):  # q [n, H, D]: the last n positions of k/v [c, H, D]
    n, c = q.shape[0], k.shape[0]
    mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=scale).transpose(0, 1)


# (cached, new): prefixes of 0, mid-block, on a block boundary, long; chunks of 1, a block, not a divisor
PREFIX_CASES = [(0, 1), (0, 4), (0, 9), (1, 1), (3, 1), (4, 4), (3, 4), (5, 7), (8, 3), (7, 13), (16, 2), (2, 31)]


@pytest.mark.parametrize("seqs", [[c] for c in PREFIX_CASES] + [PREFIX_CASES], ids=[f"{c}+{n}" for c, n in
                                                                                     PREFIX_CASES] + ["all"])
def test_reference_prefill_over_a_cached_prefix_equals_dense_attention(seqs):
    h, d = 3, 8
    q, k, v, kv, meta, tables = make_batch(seqs, h=h, d=d, bs=BS, dtype=torch.float32, seed=7)
    # make_batch's cache holds the prefixes' K/V; rebuild each sequence's full K/V from it and the new tokens
    out = paged_attention(q, k, v, kv, 1, meta, d**-0.5)
    t = 0
    for (cached, new), table in zip(seqs, tables):
        pos = torch.arange(cached + new)
        keys = kv[torch.tensor(table)[pos // BS], 1, 0, :, pos % BS]  # [c + n, H, D], written by this step too
        values = kv[torch.tensor(table)[pos // BS], 1, 1, :, pos % BS]
        torch.testing.assert_close(keys[cached:], k[t : t + new])
        ref = dense_causal(q[t : t + new], keys, values, d**-0.5)
        torch.testing.assert_close(out[t : t + new], ref, atol=1e-5, rtol=1e-5)
        t += new


# -- the model over a cached prefix ------------------------------------------------------------------------------


def chunk_plans(n: int) -> dict[str, list[int]]:
    def cut(size):
        return [size] * (n // size) + ([n % size] if n % size else [])

    return {"whole": [n], "ones": [1] * n, "block": cut(BS), "threes": cut(3), "sevens": cut(7),
            "ragged": [5, 1, 9, n - 15]}


def run_chunks(runner, prompt: list[int], plan: list[int], decode_steps: int, job: str, k: int = 5):
    """The prompt through the runner in chunks (each a step of its own), then greedy decode steps; returns
    (the logprobs dict of each chunk's last row, the generated tokens, their logprobs dicts)."""
    table = list(range(0, -(-(len(prompt) + decode_steps) // BS)))
    params = SamplingParams(temperature=0, logprobs=k, max_tokens=decode_steps + 1)
    chunk_lps, tokens, token_lps = [], [], []

    def step(ids, start):
        work = SequenceWork(job, ids, start, table, params, None, len(tokens))
        batch = ModelBatch([work])
        inputs = runner.prepare(batch)
        return runner.sample(runner.forward(inputs), inputs, batch)[0]

    start = 0
    for size in plan:
        res = step(prompt[start : start + size], start)
        start += size
        chunk_lps.append((start, res.logprobs))
    tokens.append(res.token_id)
    token_lps.append(res.logprobs)
    for _ in range(decode_steps):
        res = step([tokens[-1]], len(prompt) + len(tokens) - 1)
        tokens.append(res.token_id)
        token_lps.append(res.logprobs)
    return chunk_lps, tokens, token_lps


@pytest.mark.parametrize("shape", [SMALL_PRE_LN, SMALL_POST_LN], ids=["pre-ln", "post-ln-project-in-out"])
def test_model_prefill_in_chunks_matches_transformers_and_the_unchunked_run(shape, small_checkpoint):
    model_dir = small_checkpoint(shape)
    ex = LocalExecutor(model_dir, OPTConfig.from_model_dir(model_dir), device="cpu", block_size=BS,
                       num_gpu_blocks_override=64)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, shape["vocab_size"], (23,), generator=g).tolist()
    decode = 5
    runs = {name: run_chunks(ex.runner, prompt, plan, decode, name) for name, plan in chunk_plans(23).items()}
    whole_lps, whole_tokens, whole_token_lps = runs["whole"]
    hf = hf_logprobs(model_dir, prompt + whole_tokens)  # [len, V]
    for name, (chunk_lps, tokens, token_lps) in runs.items():
        assert tokens == whole_tokens, f"{name}: greedy tokens differ from the unchunked run"
        for j, tok in enumerate(tokens):
            assert tok == int(hf[len(prompt) + j - 1].argmax()), f"{name} step {j}: greedy differs from transformers"
            for t, lp in token_lps[j].items():
                assert abs(lp - float(hf[len(prompt) + j - 1, t])) < 1e-4, f"{name} step {j} token {t}"
                assert abs(lp - whole_token_lps[j][t]) < 1e-4, f"{name} step {j} token {t} vs unchunked"
        for end, lps in chunk_lps:  # each chunk's last row predicts the token after it
            assert len(lps) >= 5
            for t, lp in lps.items():
                assert abs(lp - float(hf[end - 1, t])) < 1e-4, f"{name}: chunk ending at {end}, token {t}"


def test_chunks_of_several_prompts_share_a_step_with_decodes(small_checkpoint):
    """One flat step holding a decode, a fresh prompt, a first chunk and a later chunk over a prefix: every row's
    logprobs are transformers'."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    ex = LocalExecutor(model_dir, OPTConfig.from_model_dir(model_dir), device="cpu", block_size=BS,
                       num_gpu_blocks_override=64)
    runner = ex.runner
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (10, 6, 17, 13)]
    params = SamplingParams(temperature=0, logprobs=4)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    # earlier steps: prompt 0 cached up to 9 (it decodes its 10th token now), prompt 3 cached up to 7
    pre = ModelBatch([SequenceWork("p0", prompts[0][:9], 0, tables[0], params, None, 0),
                      SequenceWork("p3", prompts[3][:7], 0, tables[3], params, None, 0)], None)
    inputs = runner.prepare(pre)
    runner.sample(runner.forward(inputs), inputs, pre)
    step = ModelBatch([
        SequenceWork("p0", prompts[0][9:10], 9, tables[0], params, None, 0),  # one token over 9 cached
        SequenceWork("p1", prompts[1], 0, tables[1], params, None, 0),  # a whole fresh prompt
        SequenceWork("p2", prompts[2][:6], 0, tables[2], params, None, 0),  # a first chunk
        SequenceWork("p3", prompts[3][7:13], 7, tables[3], params, None, 0),  # a later chunk, prefix mid-block
    ], None)
    inputs = runner.prepare(step)
    results = runner.sample(runner.forward(inputs), inputs, step)
    for res, prompt, end in zip(results, prompts, (10, 6, 6, 13)):
        hf = hf_logprobs(model_dir, prompt[:end])
        for t, lp in res.logprobs.items():
            assert abs(lp - float(hf[end - 1, t])) < 1e-4


# -- the engine: --enable-chunked-prefill under a token budget -----------------------------------------------------


def small_engine(model_dir, **kw) -> Engine:
    kw.setdefault("profile", "analytic")
    kw.setdefault("num_gpu_blocks_override", 64)
    return Engine(EngineConfig(model=str(model_dir), block_size=BS, seed=0, device="cpu", **kw))


def prompts_of(lens, seed=1, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)


def same_outputs(got: dict, want: dict) -> None:
    """Greedy tokens identical, token and prompt logprobs within 1e-4."""
    assert sorted(got) == sorted(want)
    for rid, out in got.items():
        ref = want[rid]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, rid
        for lps, ref_lps in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert lps.keys() == ref_lps.keys(), rid
            assert all(abs(lps[t] - ref_lps[t]) < 1e-4 for t in lps), rid
        if ref.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(out.prompt_token_ids), rid
            for lps, ref_lps in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert lps.keys() == ref_lps.keys(), rid
                assert all(abs(lps[t] - ref_lps[t]) < 1e-4 for t in lps), rid


@pytest.fixture(scope="module")
def reference_runs(small_checkpoint):
    """Unchunked outputs of the prompts below (the budget never splits them), and they match transformers."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    prompts = prompts_of([23, 5, 17, 1, 9, 30])
    engine = small_engine(model_dir, enable_chunked_prefill=False)
    done = run_staggered(engine, {0: [("a", prompts[0], PARAMS), ("b", prompts[1], PARAMS)],
                                  2: [("c", prompts[2], PARAMS), ("d", prompts[3], PARAMS)],
                                  3: [("e", prompts[4], PARAMS), ("f", prompts[5], PARAMS)]})
    for out in done.values():
        comp = out.outputs[0]
        hf = hf_logprobs(model_dir, out.prompt_token_ids + comp.token_ids)
        p = len(out.prompt_token_ids)
        for j, tok in enumerate(comp.token_ids):
            assert tok == int(hf[p + j - 1].argmax())
            assert all(abs(lp - float(hf[p + j - 1, t])) < 1e-4 for t, lp in comp.logprobs[j].items())
        for pos in range(1, p):
            assert all(abs(lp - float(hf[pos - 1, t])) < 1e-4 for t, lp in out.prompt_logprobs[pos].items())
    return model_dir, prompts, done


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "fcfs"])
@pytest.mark.parametrize("budget,cap", [(1, 0), (BS, 0), (3, 0), (7, 0), (20, 0), (20, 3)])
def test_engine_outputs_with_chunking_equal_outputs_without(reference_runs, budget, cap, policy):
    model_dir, prompts, want = reference_runs
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=cap, scheduling_policy=policy)
    chunks_seen = []
    real_finish = engine.finish_step

    def finish(plan, result):  # record the partial prefills
        chunks_seen.extend(w.start_pos for w in plan.batch.seqs if not w.sample)
        assert plan.batch.num_tokens <= budget
        assert not cap or all(len(w.token_ids) <= cap for w in plan.batch.seqs)
        return real_finish(plan, result)

    engine.finish_step = finish
    got = run_staggered(engine, {0: [("a", prompts[0], PARAMS), ("b", prompts[1], PARAMS)],
                                 2: [("c", prompts[2], PARAMS), ("d", prompts[3], PARAMS)],
                                 3: [("e", prompts[4], PARAMS), ("f", prompts[5], PARAMS)]})
    same_outputs(got, want)
    assert chunks_seen  # prompts were split
    engine.kv.check_invariants()
    assert engine.kv.device.num_free == 64


# -- preemption between chunks: a property test ---------------------------------------------------------------------

_REFERENCE: dict[tuple, object] = {}


def reference_output(model_dir, prompt: list[int]):
    """The prompt's unchunked output, alone (greedy outputs depend on nothing else), from one engine kept for
    every example."""
    key = (str(model_dir), tuple(prompt))
    if key not in _REFERENCE:
        engine = _REFERENCE.get(str(model_dir))
        if engine is None:
            engine = _REFERENCE[str(model_dir)] = small_engine(model_dir, enable_chunked_prefill=False)
        rid = f"ref{len(_REFERENCE)}"
        _REFERENCE[key] = run_staggered(engine, {0: [(rid, prompt, PARAMS)]})[rid]
    return _REFERENCE[key]


def run_with_preemption(engine, prompts, evict_at=(), urgent=None, seed=0):
    """Run the prompts; before each step in evict_at, evict every partly prefilled job (its partial KV dropped
    under recompute, offloaded under reactive and proactive; copies in flight land first, so what is evicted does
    not depend on how fast the copy threads ran); urgent = (step, prompt length): a request of a more urgent class
    arrives then. Returns (finished outputs, evictions, policy preemptions of partly prefilled
    jobs)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    done, step, evicted, preempted = {}, 0, 0, 0
    real_schedule = engine.schedule_step

    def schedule():
        nonlocal preempted
        plan = real_schedule()
        if plan is not None:
            preempted += sum(1 for job in plan.decision.preempted if job.prefilling)
        return plan

    engine.schedule_step = schedule
    while engine.has_unfinished() or (urgent is not None and step <= urgent[0]):
        if urgent is not None and step == urgent[0]:
            engine.add_request("urgent", prompts_of([urgent[1]], seed + 1)[0], PARAMS, priority=-1)
        if step in evict_at:
            settle_kv_copies(engine)
            for seq in list(engine._seq_of_job.values()):
                job = seq.job
                if job.prefilling and not job.in_flight and job.ready:
                    engine.kv.evict(job)
                    evicted += 1
        outs = engine.step()
        for out in outs:
            if out.finished:
                done[out.request_id] = out
        engine.kv.check_invariants()
        if not outs and engine.kv.pending_transfers():
            time.sleep(0.002)  # nothing could run: a copy thread is moving KV
        step += 1
        assert step < 5000
    settle_kv_copies(engine)  # (the prefix cache's own copies of finished requests' blocks)
    assert engine.kv.device.num_free == engine.kv.device.num_blocks and engine.kv.host.num_used == 0
    return done, evicted, preempted


@pytest.mark.parametrize("kv_policy", ["recompute", "reactive", "proactive"])
def test_partial_prefill_evicted_between_chunks_resumes_or_restarts(small_checkpoint, kv_policy):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    prompts = prompts_of([21, 15, 3], 5)
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=5, kv_policy=kv_policy,
                          num_host_blocks_override=64)
    done, evicted, _ = run_with_preemption(engine, prompts, evict_at={1, 2, 4, 7})
    assert evicted >= 3
    if kv_policy == "recompute":
        assert engine.kv.stats.num_drops >= 3 and engine.kv.stats.num_recomputed_tokens > 0
    else:
        assert engine.kv.stats.num_offloads >= 3 and engine.kv.stats.num_uploads >= 3
    same_outputs(done, {rid: reference_output(model_dir, out.prompt_token_ids) for rid, out in done.items()})


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "fixed-priority"])
def test_an_urgent_request_preempts_a_prompt_between_its_chunks(small_checkpoint, policy):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=4, max_num_seqs=1,
                          scheduling_policy=policy)
    done, _, preempted = run_with_preemption(engine, prompts_of([30], 6), urgent=(2, 6), seed=6)
    assert preempted >= 1
    assert done["r0"].metrics.preemptions >= 1
    assert done["urgent"].metrics.first_token_time < done["r0"].metrics.first_token_time
    same_outputs(done, {rid: reference_output(model_dir, out.prompt_token_ids) for rid, out in done.items()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 1000),
       budget=st.integers(1, 24), cap=st.sampled_from([0, 0, 1, 3, 8]), max_num_seqs=st.sampled_from([1, 2, 8]),
       policy=st.sampled_from(["skip-join-mlfq", "fcfs", "mlfq"]),
       kv_policy=st.sampled_from(["recompute", "reactive", "proactive"]),
       evict_at=st.sets(st.integers(0, 30), max_size=8), urgent=st.none() | st.tuples(st.integers(0, 12),
                                                                                           st.integers(1, 20)),
       device_blocks=st.sampled_from([12, 20, 64]))
def test_chunked_outputs_equal_unchunked_under_preemption_between_chunks(
        small_checkpoint, lens, seed, budget, cap, max_num_seqs, policy, kv_policy, evict_at, urgent, device_blocks):
    """Prompt lengths, budgets, per-prompt caps and preemption points drawn (run_with_preemption), and a device
    cache small enough (12 blocks: 48 tokens) that memory preempts too: every request's greedy tokens and logprobs
    (token and prompt) are its unchunked run's."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=cap,
                          max_num_seqs=max_num_seqs, scheduling_policy=policy, kv_policy=kv_policy,
                          num_host_blocks_override=64, num_gpu_blocks_override=device_blocks)
    done, _, _ = run_with_preemption(engine, prompts_of(lens, seed), evict_at, urgent, seed)
    same_outputs(done, {rid: reference_output(model_dir, out.prompt_token_ids) for rid, out in done.items()})


# -- tensor and pipeline parallelism: chunks through worker processes --------------------------------------------


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_chunked_prefill_across_tensor_and_pipeline_parallel_workers(reference_runs, tp, pp):
    """The same staggered arrivals as the unchunked reference, chunked under a budget of 5 tokens, through gloo
    workers (prompt logprobs collected across chunks on the last stage, pipelined micro-batches under PP)."""
    model_dir, prompts, want = reference_runs
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=5,
                          tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        got = run_staggered(engine, {0: [("a", prompts[0], PARAMS), ("b", prompts[1], PARAMS)],
                                     2: [("c", prompts[2], PARAMS), ("d", prompts[3], PARAMS)],
                                     3: [("e", prompts[4], PARAMS), ("f", prompts[5], PARAMS)]})
    finally:
        engine.shutdown()
    same_outputs(got, want)


def test_requests_report_inter_token_latencies(reference_runs):
    """RequestMetrics.itl_s: one gap per token after the first, each the time between the steps that gave them;
    the HTTP metrics (to_dict) keep their keys."""
    _, _, done = reference_runs
    for out in done.values():
        m = out.metrics
        assert len(m.itl_s) == len(out.outputs[0].token_ids) - 1 == PARAMS.max_tokens - 1
        assert all(gap > 0 for gap in m.itl_s)
        assert m.last_token_time - m.first_token_time == pytest.approx(sum(m.itl_s))
        assert m.mean_itl_s == pytest.approx(sum(m.itl_s) / len(m.itl_s)) and m.max_itl_s == max(m.itl_s)
        assert "itl_s" not in m.to_dict() and "last_token_time" not in m.to_dict()


# -- the cost model: mixed iterations with chunks over a prefix ----------------------------------------------------


def test_cost_model_prices_chunks_over_their_prefix():
    from pathlib import Path

    from scheduler import Job, ProfiledCostModel

    cost = ProfiledCostModel.from_json(Path(__file__).resolve().parents[1] / "profiles" / "sim"
                                       / "opt-13b-a100-40gb-x1.json")
    # A prompt's chunks add, over the pass over the weights, the attention of the whole prompt (it telescopes).
    cuts = [0, 256, 512, 900, 1500]
    chunks = sum(cost.chunk_attention(a, b - a) for a, b in zip(cuts, cuts[1:]))
    assert chunks == pytest.approx(cost.t_init(1500) - cost.forward(1500))
    assert cost.chunk_attention(0, 700) == pytest.approx(cost.t_init(700) - cost.forward(700))
    # A chunk alone costs its pass plus its attention; beside decodes, one pass over all the tokens.
    assert cost.batch_cost([], [], [(512, 256)]) == pytest.approx(cost.forward(256) + cost.chunk_attention(512, 256))
    mixed = cost.batch_cost([], [300] * 8, [(512, 256)])
    assert mixed == pytest.approx(cost.forward(264) + cost.chunk_attention(512, 256)
                                  + cost.t_dec(8, 300) - cost.forward(8))
    assert mixed < cost.t_dec(8, 300) + cost.batch_cost([], [], [(512, 256)])
    # iteration_cost reads a job's chunk (num_scheduled) and what is computed of it (num_computed).
    job = Job("j", prompt_len=1500, max_new_tokens=10, arrival_time=0.0)
    job.num_computed, job.num_scheduled = 512, 256
    decoder = Job("d", prompt_len=299, max_new_tokens=10, arrival_time=0.0, num_generated=1, num_computed=299)
    decoder.num_scheduled = 1
    assert cost.iteration_cost([job, decoder]) == pytest.approx(cost.batch_cost([], [300], [(512, 256)]))
    job.num_computed, job.num_scheduled = 0, 256  # a first chunk is a 256-token prompt
    assert cost.iteration_cost([job]) == pytest.approx(cost.t_init(256))
    job.num_scheduled = 1500  # the whole prompt
    assert cost.iteration_cost([job]) == pytest.approx(cost.t_init(1500))


def test_server_flags_turn_chunked_prefill_on_and_off():
    import server

    parser = server.build_parser()
    for argv, want in (([], None), (["--enable-chunked-prefill"], True), (["--no-enable-chunked-prefill"], False)):
        engine_config, _ = server._configs(parser.parse_args(argv + ["--max-num-batched-tokens", "512"]))
        assert engine_config.enable_chunked_prefill is want and engine_config.max_num_batched_tokens == 512
    engine_config, _ = server._configs(parser.parse_args([]))
    assert engine_config.max_num_batched_tokens is None  # picked by the engine
    assert engine_config.long_prefill_token_threshold == 0
    engine_config, _ = server._configs(parser.parse_args(["--long-prefill-token-threshold", "64"]))
    assert engine_config.long_prefill_token_threshold == 64
    assert "default: on on CUDA, off on the CPU" in " ".join(parser.format_help().split())


# -- the default: on CUDA, with the budget the job profile picks ------------------------------------------------------
PROFILES = Path(__file__).resolve().parents[1] / "profiles" / "sim"


def test_the_picked_budget_is_the_one_the_simulator_measured_on_the_opt13b_profile():
    """docs/benchmarks.md, "Chunked prefill" (the budget, simulated): on the OPT-13B A100 40GB profile only budget 256
    kept P99 ITL under twice the median; the rule picks 256 from the profile alone."""
    cost = ProfiledCostModel.from_json(PROFILES / "opt-13b-a100-40gb-x1.json")
    assert chunk_budget(cost, 16, max_num_seqs=1, cap=8192) == 256
    assert chunk_budget(cost, 16, max_num_seqs=256, cap=8192) == 256
    assert chunk_budget(cost, 16, max_num_seqs=1000, cap=8192) == 1000  # every sequence of a full batch decodes
    assert chunk_budget(cost, 16, max_num_seqs=1, cap=100) == 64  # the largest 16 x 2^k within the cap


@pytest.mark.parametrize("profile", sorted(p.name for p in PROFILES.glob("*.json")) + ["tiny"])
def test_the_picked_chunk_is_the_largest_whose_iteration_costs_at_most_twice_the_decodes(profile):
    path = Path(__file__).parent / "data" / "tiny_profile.json" if profile == "tiny" else PROFILES / profile
    cost = ProfiledCostModel.from_json(path)
    decodes = [BUDGET_DECODE_CONTEXT] * BUDGET_DECODE_BATCH
    alone = cost.batch_cost([], decodes)

    def stall(chunk):
        return cost.batch_cost([], decodes, [(BUDGET_DECODE_CONTEXT, chunk)]) / alone

    for bs in (4, 16):
        chunk = chunk_budget(cost, bs, max_num_seqs=1, cap=1 << 20)
        assert chunk % bs == 0 and (chunk // bs).bit_count() == 1
        assert chunk == bs or stall(chunk) <= BUDGET_STALL_RATIO
        assert stall(2 * chunk) > BUDGET_STALL_RATIO


def test_chunking_is_on_by_default_on_cuda_only_and_explicit_settings_win():
    cost = ProfiledCostModel.from_json(PROFILES / "opt-13b-a100-40gb-x1.json")
    default = EngineConfig()
    assert resolve_chunking(default, "cuda", cost, 16) == (True, 256)
    assert resolve_chunking(default, "cpu", cost, 16) == (False, UNCHUNKED_BATCHED_TOKENS)
    assert resolve_chunking(default, "meta", cost, 16) == (False, UNCHUNKED_BATCHED_TOKENS)  # the simulator
    assert resolve_chunking(EngineConfig(enable_chunked_prefill=True), "cpu", cost, 16) == (True, 256)
    assert resolve_chunking(EngineConfig(enable_chunked_prefill=False), "cuda", cost, 16) == (
        False, UNCHUNKED_BATCHED_TOKENS)
    assert resolve_chunking(EngineConfig(max_num_batched_tokens=100), "cuda", cost, 16) == (True, 100)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_80gb_profiles_budget_is_max_num_seqs_above_their_stall_safe_chunk():
    """On the 80GB profiles the stall-safe chunk is 128 and max_num_seqs 256 raises the budget to 256 (measured
    in the simulator against a per-prompt cap of 128: no difference, so the cap stays off by default, as vLLM's;
    docs/scheduling.md, "Chunked prefill")."""
    cost = ProfiledCostModel.from_json(PROFILES / "opt-13b-a100-80gb-x1.json")
    assert stall_safe_chunk(cost, 16, UNCHUNKED_BATCHED_TOKENS) == 128
    assert resolve_chunking(EngineConfig(), "cuda", cost, 16) == (True, 256)
    assert resolve_chunking(EngineConfig(max_num_seqs=64), "cuda", cost, 16) == (True, 128)
    assert EngineConfig().long_prefill_token_threshold == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        EngineConfig(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "fcfs"])
def test_the_prefill_cap_bounds_one_prompts_chunk_below_the_budget(small_checkpoint, policy):
    """A prompt alone takes the whole budget without the cap, and the cap's worth of it with it; either way the
    outputs are the unchunked run's (test_engine_outputs_with_chunking_equal_outputs_without draws a cap too)."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    prompt = prompts_of([40], 3)[0]
    done = {}
    for cap in (0, 5):
        engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=16,
                              long_prefill_token_threshold=cap, scheduling_policy=policy)
        assert engine.scheduler.config.long_prefill_token_threshold == cap
        engine.add_request("p", prompt, PARAMS)
        engine.step()
        assert engine.requests["p"].seqs[0].job.num_computed == (cap or 16)
        done[cap] = run_staggered(engine, {0: []})["p"]
    assert done[0].outputs[0].token_ids == done[5].outputs[0].token_ids


def test_the_engine_on_the_cpu_runs_unchunked_unless_asked_and_then_takes_its_profiles_budget(small_checkpoint):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    engine = small_engine(model_dir)
    assert (engine.scheduler.config.enable_chunked_prefill, engine.scheduler.config.max_num_batched_tokens) == (
        False, UNCHUNKED_BATCHED_TOKENS)
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_seqs=4)
    want = chunk_budget(engine.cost_model, BS, 4, UNCHUNKED_BATCHED_TOKENS)
    assert engine.scheduler.config.enable_chunked_prefill and engine.scheduler.config.max_num_batched_tokens == want
    prompt_len = min(engine.max_model_len - PARAMS.max_tokens, 64 * BS // 2)
    assert want < prompt_len  # the analytic CPU profile's budget splits a long prompt
    engine.add_request("long", prompts_of([prompt_len], 8)[0], PARAMS)
    assert engine.step() == []
    assert engine.requests["long"].seqs[0].job.num_computed == want


def test_a_chunk_alone_emits_nothing_and_abort_mid_prefill_frees_the_partial_kv(small_checkpoint):
    """A step that only computed a chunk of a request gives no output snapshot (a stream would send an empty
    delta); aborting a partly prefilled request frees its blocks and the scheduler forgets it."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=4)
    engine.add_request("long", prompts_of([30], 8)[0], PARAMS)
    for _ in range(3):
        assert engine.step() == []
    job = engine.requests["long"].seqs[0].job
    assert job.prefilling and job.num_computed == 12 and engine.kv.device.num_free == 64 - 3
    out = engine.abort("long")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.device.num_free == 64 and not engine.scheduler.has_work() and not engine.has_unfinished()
    engine.add_request("next", prompts_of([9], 9)[0], PARAMS)
    done = run_staggered(engine, {0: []})
    same_outputs(done, {"next": reference_output(model_dir, done["next"].prompt_token_ids)})


def test_async_streams_get_a_token_with_every_output_under_chunking(reference_runs):
    """Through AsyncEngine (the server's loop): every streamed snapshot brings new tokens (a chunk-only step sends
    none), and the streams end with the unchunked outputs."""
    import asyncio

    from engine.async_engine import AsyncEngine

    model_dir, prompts, want = reference_runs
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=6)

    async def run():
        aengine = AsyncEngine(engine)
        await aengine.start()
        streams = {rid: aengine.add_request(rid, p, PARAMS) for rid, p in zip("abcdef", prompts)}

        async def collect(stream):
            return [out async for out in stream]

        outs = await asyncio.gather(*(collect(s) for s in streams.values()))
        await aengine.shutdown()
        return dict(zip(streams, outs))

    streamed = asyncio.run(run())
    for rid, outs in streamed.items():
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == list(range(1, PARAMS.max_tokens + 1)), rid
    same_outputs({rid: outs[-1] for rid, outs in streamed.items()}, want)


def test_each_chunk_is_charged_to_the_job(small_checkpoint):
    """Attained service: every chunk's iteration cost is charged to the job (service_total and its queue's
    service), and the profiled cost of a chunk over a prefix is the cost model's."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    engine = small_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=8)
    engine.add_request("long", prompts_of([30], 10)[0], PARAMS)
    job = engine.requests["long"].seqs[0].job
    queue = engine.scheduler.entry_queue(30)
    charged = 0.0
    for k in range(3):
        plan = engine.schedule_step()
        assert [j.num_scheduled for j in plan.decision.batch] == [8]
        assert plan.cost == pytest.approx(engine.cost_model.batch_cost([8], []) if k == 0 else
                                          engine.cost_model.batch_cost([], [], [(8 * k, 8)]))
        engine.finish_step(plan, engine.executor.submit(plan.batch).result())
        job.in_flight = False
        charged += plan.cost
        assert job.num_computed == 8 * (k + 1) and job.num_generated == 0
        assert job.service_total == pytest.approx(charged)
    assert job.queue >= queue  # entered by its whole prompt's t_init; may sink as its chunks are charged


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1)], ids=["local", "tp2-workers"])
def test_seeded_sampling_and_penalties_are_unchanged_by_chunking(small_checkpoint, tp, pp):
    """A chunk samples nothing, so a seeded request's generator draws the same numbers, and penalties read the
    whole prompt (workers get it with the first chunk): the same tokens chunked or not, in process and through
    tensor-parallel workers."""
    model_dir = small_checkpoint(SMALL_PRE_LN)
    prompts = prompts_of([25, 11, 18], 12)
    params = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=8, presence_penalty=0.7, frequency_penalty=0.3,
                             repetition_penalty=1.2, min_tokens=3, ignore_eos=True) for i in range(3)]
    runs = []
    for chunked in (False, True):
        engine = small_engine(model_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=6 if chunked else
                              8192, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            done = run_staggered(engine, {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]})
        finally:
            engine.shutdown()
        runs.append({rid: out.outputs[0].token_ids for rid, out in done.items()})
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0].values()}) == 3


def test_cost_model_prices_a_last_chunk_and_a_cached_prefixs_tail_as_chunks():
    """The step that finishes a prompt over computed tokens (the last chunk, or the tail after a prefix-cache hit)
    is a chunk over its prefix, not a one-token decode of the whole context."""
    from pathlib import Path

    from scheduler import Job, ProfiledCostModel

    cost = ProfiledCostModel.from_json(Path(__file__).resolve().parents[1] / "profiles" / "sim"
                                       / "opt-13b-a100-40gb-x1.json")
    job = Job("j", prompt_len=1500, max_new_tokens=10, arrival_time=0.0)
    job.num_computed, job.num_scheduled = 1024, 476  # the last chunk (or 1,024 tokens cached): 476 to compute
    assert cost.iteration_cost([job]) == pytest.approx(cost.batch_cost([], [], [(1024, 476)]))
    assert cost.iteration_cost([job]) > 2 * cost.t_dec(1, 1500)
    job.num_scheduled = 0  # no chunk recorded: the same, the whole rest of the context
    assert cost.iteration_cost([job]) == pytest.approx(cost.batch_cost([], [], [(1024, 476)]))
    decoder = Job("d", prompt_len=1500, max_new_tokens=10, arrival_time=0.0, num_generated=3, num_computed=1502)
    decoder.num_scheduled = 1  # one new token over a computed context: a decode
    assert cost.iteration_cost([decoder]) == pytest.approx(cost.t_dec(1, 1503))
