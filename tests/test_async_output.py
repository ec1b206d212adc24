"""Async output processing (EngineConfig.async_output_processing, Engine.complete_step): step k+1 is launched
between committing step k's tokens and publishing its outputs. Against the synchronous engine on the same
requests: the same batches step by step, the same tokens, logprobs (exactly: the batches are the same), text,
finish reasons and streamed snapshots, with stop strings, stop tokens, EOS, max_tokens, n > 1, prompt logprobs,
preemption under a small KV cache (recompute and swapping), and aborts; and the publishing really runs while the
next step is in flight."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import overlaps_output
from tests.test_engine_outputs import PROMPTS


def make_llm(model_dir, async_output: bool, **kw) -> LLM:
    kw = {"block_size": 4, "num_gpu_blocks_override": 512, "profile": "analytic", **kw}
    llm = LLM(model=str(model_dir), async_output_processing=async_output, **kw)
    llm.engine.emit_running_outputs = True  # as the server: a snapshot of every request that advanced
    assert llm.engine.overlaps_output == async_output
    return llm


def run(llm: LLM, requests, abort_at: dict[str, int] | None = None):
    """Every request in at once; returns (snapshots by request, the job ids of every submitted batch, the step
    count at which each publish ran with a step in flight)."""
    engine = llm.engine
    batches, overlapped = [], []
    submit = engine.executor.submit

    def recording_submit(batch):
        batches.append([s.job_id for s in batch.seqs])
        return submit(batch)

    publish = engine.publish_step

    def recording_publish(committed):
        overlapped.append(bool(engine.in_flight))
        return publish(committed)

    engine.executor.submit, engine.publish_step = recording_submit, recording_publish
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    snapshots: dict[str, list] = {rid: [] for rid, _, _ in requests}
    step = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                snapshots[out.request_id].append(out)
            step += 1
            for rid, at in (abort_at or {}).items():
                if at == step:
                    out = engine.abort(rid)
                    assert out is not None and out.finished
                    snapshots[rid].append(out)
            if engine.kv.pending_transfers() and not engine.in_flight:
                time.sleep(0.002)
            assert step < 5000
    finally:
        engine.executor.submit, engine.publish_step = submit, publish
    assert engine.kv.device.num_free == engine.kv.device.num_blocks
    return snapshots, batches, overlapped


def flatten(snapshots):
    return {rid: [(o.finished, [(c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason)
                                for c in o.outputs], o.prompt_logprobs) for o in outs]
            for rid, outs in snapshots.items()}


def assert_same_runs(sync, asyn, timed_copies: bool = False, aborted: frozenset = frozenset()):
    """timed_copies: swaps run on a copy thread, so which step a job comes back in depends on the wall clock,
    in either mode (two synchronous runs differ too): then the final outputs are compared, logprobs within
    float32 rounding of a differently composed batch, instead of every batch and snapshot. aborted: requests
    aborted between two step() calls, which with async output are in the step launched before the abort (its
    result for them is dropped): their jobs are left out of the batches compared."""
    snaps_s, batches_s, _ = sync
    snaps_a, batches_a, overlapped = asyn
    if aborted:
        batches_s, batches_a = ([b for b in ([j for j in batch if j.split("#")[0] not in aborted] for batch in runs)
                                 if b] for runs in (batches_s, batches_a))
    if timed_copies:
        for rid, outs in snaps_s.items():
            a, s = snaps_a[rid][-1].outputs[0], outs[-1].outputs[0]
            assert (a.token_ids, a.text, a.finish_reason) == (s.token_ids, s.text, s.finish_reason)
            for la, ls in zip(a.logprobs, s.logprobs, strict=True):
                assert la.keys() == ls.keys() and all(abs(la[t] - ls[t]) < 1e-4 for t in la)
    else:
        assert batches_a == batches_s  # the scheduler decided the same batches, step for step
        assert flatten(snaps_a) == flatten(snaps_s)  # tokens, text, logprobs, finish reasons, every snapshot
    for outs in snaps_a.values():  # nothing is streamed after a request's last output
        assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum(overlapped) >= len(overlapped) // 2  # publishing ran while the next step was in flight


def mixed_requests(tokenizer_eos: int, stop: str, stop_token: int):
    g = dict(temperature=0)
    return [
        ("greedy", PROMPTS[0], SamplingParams(**g, max_tokens=12, ignore_eos=True, logprobs=3)),
        ("stop-string", PROMPTS[1], SamplingParams(**g, max_tokens=24, ignore_eos=True, stop=[stop, "\x00no"])),
        ("stop-string-kept", PROMPTS[1], SamplingParams(**g, max_tokens=24, ignore_eos=True, stop=[stop],
                                                        include_stop_str_in_output=True)),
        ("stop-token", PROMPTS[2], SamplingParams(**g, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token])),
        ("eos", PROMPTS[0], SamplingParams(**g, max_tokens=6, logit_bias={tokenizer_eos: 100})),
        ("eos-kept", PROMPTS[0], SamplingParams(**g, max_tokens=3, ignore_eos=True, logit_bias={tokenizer_eos: 100},
                                                skip_special_tokens=False)),
        ("length-1", PROMPTS[3], SamplingParams(**g, max_tokens=1, ignore_eos=True)),
        ("n-seeded", PROMPTS[4], SamplingParams(n=2, temperature=3.0, seed=5, max_tokens=10, ignore_eos=True,
                                                logprobs=2)),
        ("prompt-logprobs", PROMPTS[5], SamplingParams(**g, max_tokens=5, ignore_eos=True, prompt_logprobs=2)),
        ("penalties", PROMPTS[6], SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True,
                                                 presence_penalty=0.5, repetition_penalty=1.3)),
        ("unicode", PROMPTS[7], SamplingParams(**g, max_tokens=16, ignore_eos=True)),
        ("min-tokens-stop", PROMPTS[1], SamplingParams(**g, max_tokens=20, ignore_eos=True, stop=[stop],
                                                       min_tokens=20)),
    ]


@pytest.fixture(scope="module")
def probe(tiny_model_dir):
    """A stop string and a stop token that do occur in the greedy outputs."""
    with make_llm(tiny_model_dir, False) as llm:
        text = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        tokens = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        return llm.tokenizer.eos_token_id, text.outputs[0].text[8:11], tokens.outputs[0].token_ids[3]


@pytest.mark.parametrize("engine_args", [{}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 6},
                                         {"enable_prefix_caching": True}], ids=["plain", "chunked", "prefix-cache"])
def test_async_output_gives_the_synchronous_outputs_and_batches(tiny_model_dir, probe, engine_args):
    requests = mixed_requests(*probe)
    runs = {}
    for mode in (False, True):
        with make_llm(tiny_model_dir, mode, **engine_args) as llm:
            runs[mode] = run(llm, requests)
    assert_same_runs(runs[False], runs[True])
    snaps = runs[True][0]
    finish = {rid: outs[-1].outputs[0].finish_reason for rid, outs in snaps.items()}
    assert finish["stop-string"] == finish["stop-token"] == finish["eos"] == "stop"  # they did finish early
    assert finish["greedy"] == finish["length-1"] == finish["min-tokens-stop"] == "length"
    assert snaps["eos-kept"][-1].outputs[0].text == "</s></s></s>"
    assert len(snaps["stop-string"][-1].outputs[0].token_ids) < 24


@pytest.mark.parametrize("kv_policy", ["recompute", "proactive"])
def test_async_output_under_preemption_gives_the_synchronous_outputs(tiny_model_dir, kv_policy):
    """A KV cache of 40 blocks of 4 tokens for 8 requests of up to 20 + 40 tokens: jobs are preempted (dropped
    and recomputed, or swapped out and back) while the next step is already launched."""
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
                for i, p in enumerate(PROMPTS)]
    runs = {}
    for mode in (False, True):
        with make_llm(tiny_model_dir, mode, num_gpu_blocks_override=40, kv_policy=kv_policy,
                      num_host_blocks_override=128) as llm:
            runs[mode] = run(llm, requests)
    assert_same_runs(runs[False], runs[True], timed_copies=kv_policy != "recompute")
    last = [outs[-1] for outs in runs[True][0].values()]
    assert sum(o.metrics.preemptions for o in last) >= 1
    assert all(len(o.outputs[0].token_ids) == 40 for o in last)


def test_async_output_abort_between_steps_streams_nothing_after(tiny_model_dir):
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:4])]
    runs = {}
    for mode in (False, True):
        with make_llm(tiny_model_dir, mode) as llm:
            runs[mode] = run(llm, requests, abort_at={"r1": 3, "r2": 7})
    assert_same_runs(runs[False], runs[True], aborted=frozenset({"r1", "r2"}))
    aborted = runs[True][0]["r1"][-1].outputs[0]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 20


async def serve_and_disconnect(llm: LLM) -> dict[str, list]:
    """Three streamed requests through AsyncEngine (the server's loop); the client of r1 disconnects after 3
    snapshots. Once the steps in flight are done, nothing is left in the engine and every block is free."""
    aengine = AsyncEngine(llm.engine)
    await aengine.start()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["\x00never"])
    streams = aengine.add_requests([(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:3])])
    got: dict[str, list] = {}

    async def read(stream):
        async for out in stream:
            got.setdefault(out.request_id, []).append(out)
            if out.request_id == "r1" and len(got["r1"]) == 3:
                await stream.abort()
                return

    await asyncio.gather(*(read(s) for s in streams))
    for _ in range(200):  # (async scheduling: the step queued behind the abort completes, then its KV is freed)
        if not llm.engine.in_flight:
            break
        await asyncio.sleep(0.01)
    assert not llm.engine.requests and not llm.engine.in_flight
    assert llm.engine.kv.device.num_free == llm.engine.kv.device.num_blocks
    await aengine.shutdown()
    return got


def assert_disconnect_runs_agree(results: dict[bool, dict[str, list]]) -> None:
    """serve_and_disconnect's results, synchronous (False) and overlapped (True): the others finish the same, the
    disconnected client gets nothing more."""
    for rid in ("r0", "r2"):
        assert results[True][rid][-1].outputs[0].token_ids == results[False][rid][-1].outputs[0].token_ids
        assert results[True][rid][-1].outputs[0].text == results[False][rid][-1].outputs[0].text
    assert len(results[True]["r1"]) == 3 and not results[True]["r1"][-1].finished


def test_async_output_over_the_async_engine_with_a_client_that_disconnects(tiny_model_dir):
    """Through AsyncEngine (the server's loop): a stream closed after 3 snapshots is aborted, gets nothing
    more, and its blocks come back; the others finish as in synchronous mode."""
    results = {}
    for mode in (False, True):
        with make_llm(tiny_model_dir, mode) as llm:
            results[mode] = asyncio.run(serve_and_disconnect(llm))
    assert_disconnect_runs_agree(results)


def test_no_overlap_where_it_would_change_the_result(tiny_model_dir):
    """Off when asked, and never with several steps in flight (pipeline stages) or a simulated clock."""
    with make_llm(tiny_model_dir, False) as llm:
        assert not llm.engine.overlaps_output
    on, off = EngineConfig(async_output_processing=True), EngineConfig(async_output_processing=False)

    class Executor:
        def __init__(self, simulated: bool, max_in_flight: int) -> None:
            self.simulated, self.max_in_flight = simulated, max_in_flight

    assert overlaps_output(on, Executor(False, 1)) and not overlaps_output(off, Executor(False, 1))
    assert not overlaps_output(on, Executor(False, 2)) and not overlaps_output(on, Executor(True, 1))


def test_an_executor_that_dies_at_the_next_launch_still_leaves_complete_text(tiny_model_dir):
    """With async output, the next step's launch comes between commit and publish: if the executor dies there,
    ExecutorDeadError propagates (as in synchronous mode) and the committed step's text is decoded first, so the
    requests the caller then fails carry the text of every token they got."""
    from engine.executor.base import ExecutorDeadError

    with make_llm(tiny_model_dir, True) as llm:
        engine = llm.engine
        engine.add_request("r0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        submit, calls = engine.executor.submit, []

        def dying_submit(batch):
            calls.append(len(calls))
            if len(calls) == 4:
                raise ExecutorDeadError("worker 0 died")
            return submit(batch)

        engine.executor.submit = dying_submit
        engine.step()
        engine.step()
        with pytest.raises(ExecutorDeadError):
            engine.step()  # step 3 commits, then launching step 4 fails
        seq = engine.requests["r0"].seqs[0]
        assert len(seq.output_ids) == 3
        assert seq.text == llm.tokenizer.decode(seq.output_ids) != ""
        out = engine.fail("r0", "worker 0 died")
        assert out.finished and out.outputs[0].text == seq.text and out.outputs[0].token_ids == seq.output_ids
        engine.executor.submit = submit


@pytest.mark.slow  # two engines over worker processes: ~30-60 s here
def test_async_output_over_tensor_parallel_workers(tiny_model_dir, probe):
    """tp 2 (real gloo worker processes, one step in flight): the next step's message goes out before the last
    step's outputs are built; the same batches and outputs as synchronous mode over the same workers."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    def config(async_output: bool) -> EngineConfig:
        return EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, block_size=4,
                            num_gpu_blocks_override=128, profile="analytic", async_output_processing=async_output)

    requests = mixed_requests(*probe)[:6]
    first = Engine(config(False))
    try:
        runs = {}
        for mode in (False, True):
            engine = first if not mode else Engine(config(True), executor=first.executor)
            engine.emit_running_outputs = True
            assert engine.overlaps_output == mode
            runs[mode] = run(SimpleNamespace(engine=engine), requests)
        assert_same_runs(runs[False], runs[True])
    finally:
        first.executor.shutdown()
