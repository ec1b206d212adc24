"""Async scheduling (EngineConfig.async_scheduling, vLLM V1's --async-scheduling): step k+1 is decided and queued
while step k computes; a job of step k runs in step k+1 from a placeholder that the executor fills with the token
step k sampled. Against the synchronous engine on the same requests: the same tokens, text, finish reasons and
logprobs (within float32 rounding: the batches may be composed differently, because a step is charged to the
scheduler when it is launched and a job that ends by EOS runs one step more), with stop strings, stop tokens, EOS,
max_tokens, n > 1, prompt logprobs, penalties, seeds, chunked prefill, prefix caching, every scheduling policy,
preemption under a small KV cache (recompute and swapping) and aborts; every KV block comes back. And the
mechanism itself: steps really are queued behind a running one, placeholders are really filled, a job whose KV a
launched step writes is never evicted, offloaded or freed."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.batch import PENDING_TOKEN
from engine.config import EngineConfig
from memory.kv_manager import KVManager
from memory.kv_policy import KVPolicy
from scheduler import Job
from tests.scheduler_sim import make_cost
from tests.test_async_output import assert_disconnect_runs_agree, mixed_requests, probe, run, serve_and_disconnect  # noqa: F401 - probe: the module's fixture
from tests.test_engine_outputs import PROMPTS


def make_llm(model_dir, ahead: bool, **kw) -> LLM:
    kw = {"block_size": 4, "num_gpu_blocks_override": 512, "profile": "analytic", **kw}
    llm = LLM(model=str(model_dir), async_scheduling=ahead, **kw)
    llm.engine.emit_running_outputs = True  # as the server: a snapshot of every request that advanced
    assert llm.engine.async_scheduling == ahead and llm.engine.overlaps_output == ahead
    return llm


class Recorder:
    """Wraps the executor: the works of every submitted batch (copied at submit, before the fill), how many
    steps were in flight at each submit, and the placeholders the executor filled."""

    def __init__(self, engine) -> None:
        self.engine, self.batches, self.depths, self.filled = engine, [], [], []
        self._submit, self._run = engine.executor.submit, engine.executor._run
        engine.executor.submit, engine.executor._run = self.submit, self.run_step

    def submit(self, batch):
        self.depths.append(len(self.engine.in_flight))
        self.batches.append([(w.job_id, list(w.token_ids), w.fill_last) for w in batch.seqs])
        return self._submit(batch)

    def run_step(self, batch):
        result = self._run(batch)
        self.filled += [(w.job_id, w.token_ids[-1]) for w in batch.seqs if w.fill_last]
        return result

    def close(self) -> None:
        self.engine.executor.submit, self.engine.executor._run = self._submit, self._run


def final(snapshots) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in outs[-1].outputs]
            for rid, outs in snapshots.items()}


def assert_same_outputs(sync, ahead) -> None:
    """The same final outputs; logprobs (sampled and prompt) within float32 rounding; nothing streamed after a
    request's last output, and every snapshot extends the one before."""
    assert final(ahead) == final(sync)
    for rid, outs in sync.items():
        for s, a in zip(outs[-1].outputs, ahead[rid][-1].outputs, strict=True):
            for ls, la in zip(s.logprobs or [], a.logprobs or [], strict=True):
                assert ls.keys() == la.keys() and all(abs(ls[t] - la[t]) < 1e-4 for t in ls)
        ps, pa = outs[-1].prompt_logprobs, ahead[rid][-1].prompt_logprobs
        assert (ps is None) == (pa is None)
        for ls, la in zip(ps or [], pa or [], strict=True):
            assert (ls is None) == (la is None) and (ls is None or all(abs(ls[t] - la[t]) < 1e-4 for t in ls))
    for outs in ahead.values():
        assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
        for before, after in zip(outs, outs[1:]):
            for b, c in zip(before.outputs, after.outputs, strict=True):
                assert c.token_ids[:len(b.token_ids)] == b.token_ids


def run_both(model_dir, requests, abort_at=None, **engine_args):
    """(sync snapshots, async snapshots, the async run's Recorder)."""
    snaps = {}
    for ahead in (False, True):
        with make_llm(model_dir, ahead, **engine_args) as llm:
            recorder = Recorder(llm.engine)
            try:
                snaps[ahead] = run(llm, requests, abort_at)[0]  # (asserts every device block is free at the end)
            finally:
                recorder.close()
            assert not llm.engine.in_flight and not llm.engine._release_later
    return snaps[False], snaps[True], recorder


def assert_steps_were_queued_ahead(recorder: Recorder) -> None:
    """Steps were submitted while another was in flight, their placeholders named jobs of the step before and
    were filled with real token ids."""
    assert sum(d == 1 for d in recorder.depths) >= len(recorder.depths) // 2
    placeholders = [(job, tokens) for batch in recorder.batches for job, tokens, fill in batch if fill]
    assert placeholders and all(tokens == [PENDING_TOKEN] for _, tokens in placeholders)
    assert len(recorder.filled) == len(placeholders)
    assert all(token >= 0 for _, token in recorder.filled)
    for before, after in zip(recorder.batches, recorder.batches[1:]):
        earlier = {job for job, _, _ in before}
        assert all(job in earlier for job, _, fill in after if fill)


@pytest.mark.parametrize("engine_args", [
    {}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 6}, {"enable_prefix_caching": False},
    {"scheduling_policy": "fcfs"}, {"scheduling_policy": "gittins"}, {"max_num_seqs": 3},
], ids=["plain", "chunked", "no-prefix-cache", "fcfs", "gittins", "few-seqs"])
def test_async_scheduling_gives_the_synchronous_outputs(tiny_model_dir, probe, engine_args):  # noqa: F811
    sync, ahead, recorder = run_both(tiny_model_dir, mixed_requests(*probe), **engine_args)
    assert_same_outputs(sync, ahead)
    assert_steps_were_queued_ahead(recorder)
    finish = {rid: outs[-1].outputs[0].finish_reason for rid, outs in ahead.items()}
    assert finish["stop-string"] == finish["stop-token"] == finish["eos"] == "stop"  # they did finish early
    assert finish["greedy"] == finish["length-1"] == finish["min-tokens-stop"] == "length"
    assert ahead["eos-kept"][-1].outputs[0].text == "</s></s></s>"
    for outs in ahead.values():  # steps that overlapped in time are not counted twice
        m = outs[-1].metrics
        assert 0 < m.executing_s <= m.finished_time - m.first_scheduled_time + 1e-6 and m.queued_s >= 0


def test_a_sequence_that_stops_on_eos_runs_one_step_more_and_its_token_is_dropped(tiny_model_dir, probe):  # noqa: F811
    """The EOS is known only when its step completes, by which time the next step (with the job in it) is queued;
    a job that ends by length is known at launch and is not scheduled again."""
    eos = probe[0]
    requests = [("eos", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100})),
                ("long", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
                ("short", PROMPTS[2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))]
    sync, ahead, recorder = run_both(tiny_model_dir, requests)
    assert_same_outputs(sync, ahead)
    runs = {rid: sum(any(job.startswith(rid + "#") for job, _, _ in b) for b in recorder.batches)
            for rid in ("eos", "long", "short")}
    assert ahead["eos"][-1].outputs[0].token_ids == [eos]
    assert runs == {"eos": 2, "long": 8, "short": 2}  # eos: its step, and the step queued behind it


@pytest.mark.parametrize("kv_policy", ["recompute", "proactive", "reactive"])
def test_async_scheduling_under_preemption_gives_the_synchronous_outputs(tiny_model_dir, kv_policy):
    """40 blocks of 4 tokens for 8 requests of up to 20 + 40 tokens: jobs are preempted (dropped and recomputed,
    or swapped out and back) while a step that holds other jobs' KV is in flight."""
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
                for i, p in enumerate(PROMPTS)]
    sync, ahead, recorder = run_both(tiny_model_dir, requests, num_gpu_blocks_override=40, kv_policy=kv_policy,
                                     num_host_blocks_override=128)
    assert_same_outputs(sync, ahead)
    assert_steps_were_queued_ahead(recorder)
    assert sum(outs[-1].metrics.preemptions for outs in ahead.values()) >= 1
    assert all(len(outs[-1].outputs[0].token_ids) == 40 for outs in ahead.values())


def test_a_launched_step_is_charged_to_each_job_by_its_share(tiny_model_dir):
    """Charged at launch, as the synchronous engine charges at the end: an 8-token and a 3-token prompt prefilled
    in one step are charged 8/11 and 3/11 of it, and each of their decodes half of a step."""
    llm = make_llm(tiny_model_dir, True)
    steps = []
    charge = llm.engine.scheduler.on_step_done

    def record(batch, now, cost, charges=None):
        steps.append([charges[j] / cost for j in batch] if charges is not None else None)
        charge(batch, now, cost, charges)

    llm.engine.scheduler.on_step_done = record
    llm.generate([[2, *range(10, 17)], [2, 20, 21]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert steps == [pytest.approx([8 / 11, 3 / 11]), pytest.approx([0.5, 0.5]), []]  # (the third ends both)


def test_an_abort_with_a_step_in_flight_frees_the_kv_when_the_step_is_done(tiny_model_dir):
    requests = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:4])]
    sync, ahead, _ = run_both(tiny_model_dir, requests, abort_at={"r1": 3, "r2": 7})
    kept = {rid: outs for rid, outs in sync.items() if rid not in ("r1", "r2")}
    assert_same_outputs(kept, {rid: ahead[rid] for rid in kept})
    for rid in ("r1", "r2"):
        out = ahead[rid][-1].outputs[0]
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 20
        assert out.token_ids == sync[rid][-1].outputs[0].token_ids[:len(out.token_ids)]
    with make_llm(tiny_model_dir, True) as llm:  # the moment of the abort: a step holding the job is in flight
        engine = llm.engine
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        engine.step()
        assert engine.in_flight and engine.in_flight[0][0].seqs[0].job.kv_busy
        engine.abort("a")
        assert engine._release_later and engine.kv.device.num_free < engine.kv.device.num_blocks
        while engine.has_unfinished():
            assert engine.step() == []  # nothing more for the aborted request
        assert not engine._release_later and engine.kv.device.num_free == engine.kv.device.num_blocks


def test_async_scheduling_over_the_async_engine_with_a_client_that_disconnects(tiny_model_dir):
    results = {}
    for ahead in (False, True):
        with make_llm(tiny_model_dir, ahead) as llm:
            results[ahead] = asyncio.run(serve_and_disconnect(llm))
    assert_disconnect_runs_agree(results)


def test_async_scheduling_is_refused_where_it_cannot_run(flat_sim_model):
    with pytest.raises(ValueError, match="tensor_parallel_size and pipeline_parallel_size 1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size and pipeline_parallel_size 1"):
        EngineConfig(async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="reactive-blocking"):
        EngineConfig(async_scheduling=True, kv_policy="reactive-blocking")
    from engine.simulation import simulated_engine
    with pytest.raises(ValueError, match="in-process executor"):
        simulated_engine(*flat_sim_model, num_device_blocks=64, async_scheduling=True)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_async_scheduling_property_same_tokens_as_synchronous(tiny_model_dir, data):
    """Drawn: the requests (prompt lengths, max_tokens, an EOS bias that ends some early, n), the KV cache's
    size (small enough to preempt), the scheduling policy, the KV policy and chunked prefill. Greedy and seeded
    tokens equal the synchronous engine's; every block comes back."""
    eos = 2
    requests = []
    for i in range(data.draw(st.integers(2, 7), label="requests")):
        prompt = list(range(10 + i, 10 + i + data.draw(st.integers(1, 30), label="prompt")))
        early = data.draw(st.booleans(), label="eos")
        params = SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=data.draw(st.integers(1, 24)),
                                ignore_eos=not early, logit_bias={eos: 8.0} if early else None,
                                n=data.draw(st.sampled_from([1, 1, 2]), label="n"))
        requests.append((f"r{i}", prompt, params))
    engine_args = dict(
        num_gpu_blocks_override=data.draw(st.sampled_from([24, 40, 512]), label="blocks"),
        scheduling_policy=data.draw(st.sampled_from(["skip-join-mlfq", "fcfs", "gittins", "mlfq"]), label="policy"),
        kv_policy=data.draw(st.sampled_from(["proactive", "reactive", "recompute"]), label="kv_policy"),
        num_host_blocks_override=128,
        enable_chunked_prefill=data.draw(st.booleans(), label="chunked"),
        max_num_batched_tokens=data.draw(st.sampled_from([5, 16, 64]), label="budget"),
    )
    sync, ahead, _ = run_both(tiny_model_dir, requests, **engine_args)
    assert final(ahead) == final(sync)


# -- the rule that keeps a launched step's KV in place --------------------------------------------------------

def busy_manager() -> tuple[KVManager, Job, Job]:
    kv = KVManager(num_device_blocks=8, block_size=4, num_host_blocks=8, policy=KVPolicy.PROACTIVE)
    busy, idle = Job("busy", 4, 4, 0.0), Job("idle", 4, 4, 0.0)
    for job in (busy, idle):
        kv.allocate(job, 4)
        job.num_computed = 4
    busy.kv_busy = 1
    return kv, busy, idle


def test_a_job_whose_kv_a_launched_step_writes_is_no_offload_candidate_and_cannot_be_evicted():
    kv, busy, idle = busy_manager()
    assert [e.job for e in kv.offload_candidates(set())] == [idle]
    with pytest.raises(RuntimeError, match="still writes its KV"):
        kv.evict(busy)
    busy.kv_busy = 0
    assert [e.job for e in kv.offload_candidates(set())] == [busy, idle]


def test_fcfs_gives_no_busy_job_as_victim():
    from scheduler import SchedulerConfig, make_policy

    policy = make_policy(SchedulerConfig(policy="fcfs"), make_cost())
    jobs = [Job(f"j{i}", 4, 4, float(i)) for i in range(3)]
    for job in jobs:
        policy.add(job, job.arrival_time)
    policy._running[:] = jobs
    jobs[2].kv_busy = 1
    assert policy._victim(0) is jobs[1]
    jobs[1].kv_busy = jobs[0].kv_busy = 1
    assert policy._victim(0) is None
