"""Tensor and pipeline parallelism with real worker processes (gloo on CPU): the model against
transformers' OPT, LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM at tp=2, pp=2 and tp=2 x pp=2
(KV heads fewer than query heads, and one KV head replicated over the TP ranks); greedy and seeded
outputs identical to tp=pp=1;
offloads, uploads and recompute under TP and PP; a host tier the workers lock in the background;
the sharded forward of each layer against the unsharded one; a second "node" of workers on
loopback; clear errors for layouts that cannot work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from transformers import OPTForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.executor.base import ExecutorDeadError
from engine.executor.messages import StepJobs, StepMessage
from engine.executor.multiproc import check_layout, free_port, port_free
from engine.host_tier import TEST_LOCK_ENV
from engine.kv_cache import DEFAULT_CPU_KV_BYTES
from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup
from tests.conftest import SMALL_POST_LN, SMALL_PRE_LN, settle_kv_copies
from tests.test_kv_policies_live import PROMPTS, greedy
from tests.test_llama_reference import ARCHITECTURES, TRAITS
from tests.test_model_reference import check_position, hf_logprobs, run_staggered

LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tp, pp)
LAYOUT_IDS = ["tp2", "pp2", "tp2xpp2"]
DEFAULT_LLAMA_LAYOUTS = {("LlamaForCausalLM", "tp2xpp2"), ("Qwen2ForCausalLM", "pp2"), ("MistralForCausalLM", "tp2")}
REPO = Path(__file__).resolve().parents[1]


def parallel_engine(model_dir, tp: int, pp: int, **kw) -> Engine:
    kw.setdefault("profile", "analytic")
    return Engine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw))


def worker_pids(engine: Engine) -> list[int]:
    return list(engine.executor.worker_pids().values())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# -- the model against transformers, and against tp = pp = 1 ------------------------------------------------
@pytest.mark.parametrize("shape", [SMALL_PRE_LN, SMALL_POST_LN], ids=["pre-ln", "post-ln-project-in-out"])
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=LAYOUT_IDS)
def test_parallel_logprobs_match_transformers_and_tp1(shape, tp, pp, small_checkpoint):
    check_parallel_against_transformers_and_tp1(small_checkpoint(shape), shape["vocab_size"], tp, pp)


# The Llama family (each architecture with its TRAITS), 8 query heads over 2 KV heads: one layout per architecture
# in the default run, the rest slow; and 1 KV head under TP 2, which each rank holds (replicated).
LLAMA_CASES = [pytest.param(arch, 2, tp, pp, id=f"{arch}-kv-heads-2-{layout}",
                            marks=[] if (arch, layout) in DEFAULT_LLAMA_LAYOUTS else [pytest.mark.slow])
               for arch in ARCHITECTURES for (tp, pp), layout in zip(LAYOUTS, LAYOUT_IDS)]
LLAMA_CASES.append(pytest.param("LlamaForCausalLM", 1, 2, 1, id="LlamaForCausalLM-kv-heads-1-tp2",
                                marks=pytest.mark.slow))


@pytest.mark.parametrize(("architecture", "kv_heads", "tp", "pp"), LLAMA_CASES)
def test_llama_family_parallel_logprobs_match_transformers_and_tp1(architecture, kv_heads, tp, pp, llama_checkpoint):
    model_dir = llama_checkpoint(architecture, num_key_value_heads=kv_heads, **TRAITS[architecture])
    check_parallel_against_transformers_and_tp1(model_dir, 512, tp, pp, getattr(transformers, architecture))


def check_parallel_against_transformers_and_tp1(model_dir, vocab_size: int, tp: int, pp: int,
                                                model_class=OPTForCausalLM) -> None:
    """Five greedy requests arriving over four steps on tp x pp worker processes: every prompt and output logprob
    (with its top 5) within TOL of transformers' `model_class`, greedy ids equal to tp = pp = 1's; then seeded
    sampling and penalties give tp = pp = 1's tokens; the workers end with the engine."""
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=7, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    arrivals = {
        0: [("a", prompt(13), params), ("b", prompt(5), params)],
        2: [("c", prompt(9), params)],  # prefill beside a and b decoding, across block boundaries (block 4)
        3: [("d", prompt(1), params), ("e", prompt(4), params)],
    }
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=s, ignore_eos=True) for s in (7, 8)]
    seeded.append(SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                                 frequency_penalty=0.3, ignore_eos=True))  # penalties read each job's history
    seeded_prompts = [prompt(6), prompt(11), prompt(7)]
    single = Engine(EngineConfig(model=str(model_dir), block_size=4, num_gpu_blocks_override=64, profile="analytic"))
    engine = parallel_engine(model_dir, tp, pp, block_size=4, num_gpu_blocks_override=64)
    try:
        done = run_staggered(engine, arrivals)
        assert sorted(done) == ["a", "b", "c", "d", "e"]
        expected_greedy = run_staggered(single, arrivals)
        for rid, out in done.items():
            comp = out.outputs[0]
            assert comp.token_ids == expected_greedy[rid].outputs[0].token_ids, f"{rid}: greedy differs from tp=pp=1"
            full = out.prompt_token_ids + comp.token_ids
            ref = hf_logprobs(model_dir, full, model_class)
            p = len(out.prompt_token_ids)
            for pos in range(1, p):
                check_position(out.prompt_logprobs[pos], ref[pos - 1], full[pos], f"{rid} prompt pos {pos}")
            for j, tok in enumerate(comp.token_ids):
                check_position(comp.logprobs[j], ref[p + j - 1], tok, f"{rid} step {j}")
        # Seeded sampling: the sampling rank keeps each sequence's generator, so text depends on the seed alone;
        # penalties: the workers keep each job's tokens.
        for i, (pr, sp) in enumerate(zip(seeded_prompts, seeded)):
            engine.add_request(f"s{i}", pr, sp)
            single.add_request(f"s{i}", pr, sp)
        got = {o.request_id: o.outputs[0].token_ids for o in _drain(engine)}
        want = {o.request_id: o.outputs[0].token_ids for o in _drain(single)}
        assert got == want
    finally:
        pids = worker_pids(engine)
        engine.shutdown()
    assert wait_gone(pids) == []


def test_tp_decode_steps_stage_their_inputs_in_one_copy_and_give_the_tp1_outputs(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """TP workers run decode steps eagerly (no graphs across ranks) from the staged decode inputs: one host
    buffer (pinned on CUDA) and one non-blocking copy a step, on every rank (engine/decode_inputs.py; the workers
    count each step's prepare with engine/host_copies.py). Before, each decode step built 8 tensors from Python
    lists. Greedy tokens equal tp = 1's, logprobs within float32 rounding
    (the sharded matmuls add in another order)."""
    from engine.host_copies import COUNT_ENV

    counts = tmp_path / "copies.txt"
    monkeypatch.setenv(COUNT_ENV, str(counts))
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    arrivals = {0: [("a", PROMPTS[0], params), ("b", PROMPTS[1], params)], 3: [("c", PROMPTS[2], params)]}
    engine = parallel_engine(tiny_model_dir, 2, 1, block_size=4, num_gpu_blocks_override=128)
    single = Engine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=128,
                                 profile="analytic"))
    try:
        got, want = run_staggered(engine, arrivals), run_staggered(single, arrivals)
    finally:
        pids = worker_pids(engine)
        engine.shutdown()
    assert wait_gone(pids) == []
    for rid in "abc":
        g, w = got[rid].outputs[0], want[rid].outputs[0]
        assert g.token_ids == w.token_ids, rid
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            assert lg.keys() == lw.keys() and all(abs(lg[t] - lw[t]) < 1e-4 for t in lg), rid
    rows = [tuple(map(int, line.split())) for line in counts.read_text().splitlines()]
    decode = [r for r in rows if r[1] == r[2]]  # one token a sequence
    assert {r[0] for r in decode} == {0, 1} and len(decode) >= 2 * 9  # both ranks, every decode step
    assert {r[3] for r in decode} == {1}  # one copy a decode step, on every rank
    assert all(r[3] >= 8 for r in rows if r[1] != r[2])  # prefills still run the eager path: it is counted


def _drain(engine: Engine):
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    return outs


# -- offloads, uploads and recompute under TP and PP -------------------------------------------------------


@pytest.fixture(scope="module")
def unconstrained(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=1024, kv_policy="recompute",
              profile="analytic")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_small_device_tier_offloads_and_recomputes_under_parallelism(tiny_model_dir, unconstrained, tp, pp):
    """24 device blocks of 4 tokens: six jobs of up to ~45 tokens cannot all stay resident. One executor serves
    the three KV policies in turn (each an Engine of its own over the same workers)."""
    first = parallel_engine(tiny_model_dir, tp, pp, block_size=4, num_gpu_blocks_override=24)
    executor = first.executor
    try:
        for kv_policy in ("proactive", "reactive", "recompute"):
            config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  block_size=4, num_gpu_blocks_override=24, num_host_blocks_override=256,
                                  scheduling_policy="skip-join-mlfq", kv_policy=kv_policy, max_num_seqs=3,
                                  profile="analytic")
            engine = Engine(config, executor=executor)
            if kv_policy != "recompute":  # on the CPU nothing is locked: the whole host tier is there at once
                assert executor.host_blocks_ready() == 256
            for i, p in enumerate(PROMPTS):
                engine.add_request(f"{kv_policy}-{i}", p, greedy())
            outs = sorted(_drain(engine), key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
            assert [o.outputs[0].token_ids for o in outs] == unconstrained, kv_policy
            kv = engine.kv
            if kv_policy == "recompute":
                assert kv.stats.num_drops > 0 and kv.stats.num_offloads == 0
            else:
                assert kv.stats.num_offloads > 0 and kv.stats.num_uploads + kv.stats.num_swap_misses > 0, kv_policy
            settle_kv_copies(engine)  # (the prefix cache's own copies of finished requests' blocks)
            kv.check_invariants()
            assert kv.device.num_free == kv.device.num_blocks and kv.host.num_free == kv.host.num_blocks
    finally:
        pids = worker_pids(first)
        executor.shutdown()
    assert wait_gone(pids) == []


def test_pipeline_keeps_micro_batches_in_flight(small_checkpoint):
    """With pp = 2 the engine submits a second step while the first is still in a later stage; the second
    never holds a job of the first (a job in flight is not schedulable). KV is sized in two phases: the
    3 layers split 2 + 1, each stage reports what fits its budget, and both take the smaller count."""
    engine = parallel_engine(small_checkpoint(SMALL_PRE_LN), 1, 2, max_num_seqs=2)
    try:
        cfg = engine.model_config
        per_layer = 2 * 16 * cfg.num_attention_heads * cfg.head_dim * 4  # K and V, block 16, float32
        assert engine.executor.kv_block_bytes == 2 * per_layer  # the larger stage's slice
        assert engine.executor.num_device_blocks == DEFAULT_CPU_KV_BYTES // (2 * per_layer)
        seen_in_flight = []
        submit = engine.executor.submit

        def recording_submit(batch):
            jobs_in_flight = {s.job_id for plan, _ in engine.in_flight for s in plan.batch.seqs}
            seen_in_flight.append(len(engine.in_flight))
            assert not jobs_in_flight & {s.job_id for s in batch.seqs}, "a job ran in two micro-batches at once"
            return submit(batch)

        engine.executor.submit = recording_submit
        for i in range(4):
            engine.add_request(str(i), [2, 10 + i, 20 + i, 30 + i], SamplingParams(temperature=0, max_tokens=10))
        outs = _drain(engine)
        assert len(outs) == 4 and all(len(o.outputs[0].token_ids) == 10 for o in outs)
        assert max(seen_in_flight) == 1, "the second micro-batch was never launched beside the first"
    finally:
        engine.shutdown()


# -- the sharded forward of each layer, in process --------------------------------------------------------------
class _ThreadAllReduce:
    """All-reduce between threads that each play one tensor-parallel rank (sums in rank order)."""

    def __init__(self, size: int) -> None:
        self.size, self.parts = size, [None] * size
        self.barrier = threading.Barrier(size)

    def group(self, layout: ParallelLayout) -> TensorParallelGroup:
        outer = self

        class Group(TensorParallelGroup):
            def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
                outer.parts[layout.tp_rank] = x.clone()
                outer.barrier.wait()
                total = sum(outer.parts[1:], outer.parts[0].clone())
                outer.barrier.wait()
                x.copy_(total)
                return x

        return Group(layout)


def test_qkv_split_and_sharded_layers_match_the_unsharded_model(small_checkpoint):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    cfg = OPTConfig.from_model_dir(model_dir)
    whole = load_model_stage(model_dir, cfg, TensorParallelGroup(ParallelLayout()), "float32", "cpu")
    tp, heads, d = 2, cfg.num_attention_heads, cfg.head_dim
    reduce = _ThreadAllReduce(tp)
    shards = [load_model_stage(model_dir, cfg, reduce.group(ParallelLayout(tp, 1, r, 0)), "float32", "cpu")
              for r in range(tp)]
    # The fused qkv of rank r holds rows [q | k | v] of its heads only.
    w = whole.layers[0].self_attn.qkv_proj.weight.view(3, heads, d, -1)
    for r, shard in enumerate(shards):
        local = shard.layers[0].self_attn.qkv_proj.weight.view(3, heads // tp, d, -1)
        assert torch.equal(local, w[:, r * heads // tp:(r + 1) * heads // tp])
    # Each decoder layer, sharded over two ranks, computes what the unsharded layer computes.
    from engine.batch import ModelBatch, SequenceWork

    seq = SequenceWork("x", list(range(3, 12)), 0, [0, 1, 2], SamplingParams(), None, 0)
    batch = ModelBatch([seq], None)
    runner = ModelRunner(whole, torch.device("cpu"), torch.float32, 4)
    runner.allocate_kv_cache(4)
    inputs = runner.prepare(batch)
    h = torch.randn(len(seq.token_ids), cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(whole.layers):
        with torch.inference_mode():
            want = layer(h, runner.kv_cache, i, inputs.meta)
        got: list[torch.Tensor | None] = [None] * tp

        def run(r: int, i: int, out: list) -> None:
            sr = ModelRunner(shards[r], torch.device("cpu"), torch.float32, 4)
            sr.allocate_kv_cache(4)
            with torch.inference_mode():
                out[r] = shards[r].layers[i](h, sr.kv_cache, i, sr.prepare(batch).meta)

        threads = [threading.Thread(target=run, args=(r, i, got)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in range(tp):
            torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5, msg=f"layer {i} rank {r}")


# -- more than one node ----------------------------------------------------------------------------------------
def test_a_second_node_of_workers_joins_over_loopback(tiny_model_dir, tmp_path):
    """tp 2 x pp 2 over two "nodes": the controller starts ranks 0-1, engine.executor.node starts ranks 2-3
    from a torchrun-style environment; greedy output equals tp = pp = 1."""
    key = os.urandom(16).hex()
    port = free_port()  # the engine's own pick: p and p + 1 free
    env = dict(os.environ, FASTSERVE_CLUSTER_KEY=key, PYTHONPATH=str(REPO))
    os.environ["FASTSERVE_CLUSTER_KEY"] = key
    built: list = []
    controller = threading.Thread(target=lambda: built.append(
        parallel_engine(tiny_model_dir, 2, 2, nnodes=2, master_port=port, num_gpu_blocks_override=128)))
    controller.start()  # it waits for all four workers; the second node starts once it listens
    deadline = time.monotonic() + 60
    while port_free("127.0.0.1", port + 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    node = subprocess.Popen([sys.executable, "-m", "engine.executor.node", "--nnodes", "2", "--node-rank", "1",
                             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)],
                            env=env, cwd=REPO)
    try:
        controller.join(120)
        engine = built[0]
        single = Engine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=128, profile="analytic"))
        params = SamplingParams(temperature=0, max_tokens=12)
        for e in (engine, single):
            e.add_request("a", "Two nodes, one model", params)
        assert _drain(engine)[0].outputs[0].token_ids == _drain(single)[0].outputs[0].token_ids
        assert len(engine.executor.worker_pids()) == 2  # the other two are the node's
        engine.shutdown()
        assert node.wait(30) == 0, "the second node's launcher should exit cleanly after the shutdown"
    finally:
        del os.environ["FASTSERVE_CLUSTER_KEY"]
        if node.poll() is None:
            node.kill()


# -- layouts that cannot work -----------------------------------------------------------------------------------
def test_layouts_that_cannot_work_are_one_line_errors(small_checkpoint, monkeypatch):
    model_dir = small_checkpoint(SMALL_PRE_LN)  # 4 heads, ffn 128, 3 layers
    cfg = OPTConfig.from_model_dir(model_dir)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size 3"):
        parallel_engine(model_dir, 3, 1)
    with pytest.raises(ValueError, match="3 layers, fewer than pipeline_parallel_size 4"):
        parallel_engine(model_dir, 1, 4)
    with pytest.raises(ValueError, match=r"ffn_dim \(128\) is not divisible by tensor_parallel_size 3"):
        check_layout(OPTConfig(**{**cfg.__dict__, "num_attention_heads": 6, "hidden_size": 96}), 3, 1,
                     torch.device("cpu"), 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"= 8 needs 8 GPUs per node, but 2 are visible"):
        check_layout(cfg, 2, 4, torch.device("cuda"), 1)


def test_a_rendezvous_port_in_use_is_a_clear_error(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"rendezvous port {port} on 127.0.0.1 is already in use"):
            parallel_engine(tiny_model_dir, 2, 1, master_port=port)


def test_a_worker_exception_kills_the_executor_with_its_message(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSERVE_PROFILE_DIR", str(tmp_path))  # no stored profile: one is measured at start-up
    engine = parallel_engine(tiny_model_dir, 2, 1, num_gpu_blocks_override=64, profile=None, max_model_len=256)
    pids = worker_pids(engine)
    try:
        # The start-up profile ran its synthetic steps (decode steps of jobs never seen before) on the workers.
        assert engine.profile_source.startswith("start-up profile")
        engine.add_request("ok", [2, 5, 6], SamplingParams(temperature=0, max_tokens=3))
        assert len(_drain(engine)[0].outputs[0].token_ids) == 3
        # A step naming a job the workers never heard of: every rank raises, reports it and exits.
        engine.executor._broadcast(StepMessage(step_id=0, jobs=StepJobs([999], [0], [1], [[]], {}, {0: [0]})))
        deadline = time.monotonic() + 10
        while engine.executor.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.executor.error is not None and "KeyError: 999" in engine.executor.error
        with pytest.raises(ExecutorDeadError, match="rank"):
            engine.executor.submit(_one_job_batch())
        assert wait_gone(pids) == []
    finally:
        engine.shutdown()


def _one_job_batch():
    from engine.batch import ModelBatch, SequenceWork

    return ModelBatch([SequenceWork("x", [2, 5], 0, [0], SamplingParams(), None, 0)], None)


def test_workers_end_with_the_llm_and_with_a_killed_controller(tiny_model_dir, tmp_path):
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, num_gpu_blocks_override=64, profile="analytic") as llm:
        pids = list(llm.engine.executor.worker_pids().values())
        assert all(alive(p) for p in pids)
        gpus = llm.engine.executor.worker_devices()  # what the dashboard labels NVML's rows with
        on_cuda = llm.engine.executor.device.type == "cuda"
        assert [(d.rank, d.tp_rank, d.pp_stage, d.cuda_device) for d in gpus] == ([(0, 0, 0, 0), (1, 1, 0, 1)]
                                                                                   if on_cuda else [])
    assert wait_gone(pids) == []
    # A controller killed with SIGKILL: its workers notice their parent is gone and exit.
    script = tmp_path / "controller.py"
    script.write_text(
        "import sys, time\n"
        "from engine import LLM\n"
        f"llm = LLM({str(tiny_model_dir)!r}, tensor_parallel_size=2, num_gpu_blocks_override=64, "
        "profile='analytic')\n"
        "print(*llm.engine.executor.worker_pids().values(), flush=True)\n"
        "import os\n"
        "time.sleep(0 if os.environ.get('END_AT_ONCE') else 600)\n")
    for ending in ("SIGKILL", "exit"):  # killed, or a script that ends without closing its LLM (atexit)
        env = dict(os.environ, PYTHONPATH=str(REPO), END_AT_ONCE="1" if ending == "exit" else "")
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
        try:
            pids = [int(p) for p in proc.stdout.readline().split()]
            assert len(pids) == 2, ending
            if ending == "SIGKILL":
                proc.kill()
            assert proc.wait(60) in (0, -9), ending
            assert wait_gone(pids) == [], f"workers outlived their controller ({ending})"
        finally:
            if proc.poll() is None:
                proc.kill()


def test_async_engine_pipelines_under_memory_pressure(tiny_model_dir, unconstrained):
    """The server's path: AsyncEngine over pp = 2 workers with a 24-block device tier (proactive offloading), all
    requests at once; outputs equal the unconstrained single-device run and every block comes back."""
    import asyncio

    from engine.async_engine import AsyncEngine

    engine = parallel_engine(tiny_model_dir, 1, 2, block_size=4, num_gpu_blocks_override=24,
                             num_host_blocks_override=256, max_num_seqs=3)

    async def run():
        aengine = AsyncEngine(engine)
        await aengine.start()
        streams = [aengine.add_request(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]

        async def last(stream):
            outs = [out async for out in stream]
            return outs[-1]

        outs = await asyncio.gather(*(last(s) for s in streams))
        await aengine.shutdown()
        return outs

    pids = worker_pids(engine)
    outs = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in outs] == unconstrained
    assert engine.kv.stats.num_offloads > 0
    engine.kv.poll()
    assert engine.kv.device.num_free == engine.kv.device.num_blocks
    assert wait_gone(pids) == []  # AsyncEngine.shutdown stops the workers


# -- the host tier, locked in the background by every worker ------------------------------------------------
def test_workers_lock_the_host_tier_in_the_background_and_only_blocks_locked_everywhere_are_used(
        tiny_model_dir, unconstrained, monkeypatch):
    """Start-up does not wait for the workers to page-lock their host tiers. A fake locker (FASTSERVE_TEST_SLOW_HOST_
    LOCK) takes 0.02 s per chunk of 4 blocks on rank 0 and 0.1 s on rank 1, so the 48 host blocks arrive over about a
    second, at different rates. The KV manager hands out only the blocks both ranks reported locked (a worker refuses
    a copy through a host block it has not locked, which would fail the executor), the reports keep coming while the
    engine is idle, and the outputs under memory pressure equal the unconstrained run."""
    monkeypatch.setenv(TEST_LOCK_ENV, "4:0.02,0.1")  # inherited by the workers
    engine = parallel_engine(tiny_model_dir, 2, 1, block_size=4, num_gpu_blocks_override=24,
                             num_host_blocks_override=48, scheduling_policy="skip-join-mlfq", kv_policy="proactive",
                             max_num_seqs=3)
    ex, kv = engine.executor, engine.kv
    pids = worker_pids(engine)
    try:
        assert ex.host_blocks_ready() < 48  # not held until every block was locked
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, greedy())
        seen = []  # after each step: (host blocks the KV manager may hand out, each rank's report)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            seen.append((kv.host.num_blocks, ex.host_blocks_locked_by_rank()))
        assert ex.error is None
        assert [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: int(o.request_id))] == unconstrained
        assert kv.stats.num_offloads > 0
        assert all(n <= min(by_rank.values()) for n, by_rank in seen)
        assert any(by_rank[0] > by_rank[1] for _, by_rank in seen)  # the ranks differed: the minimum mattered
        assert len({n for n, _ in seen}) > 2  # the tier grew while serving
        deadline = time.monotonic() + 10
        while ex.host_blocks_ready() < 48:  # idle: no steps, and the reports still come
            assert time.monotonic() < deadline, ex.host_blocks_locked_by_rank()
            time.sleep(0.02)
        settle_kv_copies(engine)  # (the prefix cache's own copies of finished requests' blocks)
        kv.check_invariants()  # (the KV manager takes the new blocks in when it next offloads)
        assert kv.host.num_free == kv.host.num_blocks and kv.device.num_free == kv.device.num_blocks
    finally:
        engine.shutdown()
    assert wait_gone(pids) == []
