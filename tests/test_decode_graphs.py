"""Decode steps through the persistent, padded input buffers (engine/decode_inputs.py, engine/cuda_graphs.py).

On CPU the padded path runs eagerly (no capture): greedy outputs equal the ordinary path's, the padding
rows write only the scratch block past the KV manager's ids, and the buckets are vLLM's. On CUDA
(device_check.sh): greedy outputs agree with graphs on and off (logprobs within a tolerance: a graph's padded
matmuls round differently from the eager ones; assert_logprobs_close), and graphs really are replayed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.batch import ModelBatch, SequenceWork
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, _Captured, graphs_wanted
from engine.decode_inputs import DecodeInputs, block_table_widths, decode_batch_sizes, graph_buckets
from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup

PROMPTS = [[2, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], [2, 7], [2] + list(range(100, 140)), [2, 5, 9],
           [2, 300, 301, 302, 303]]
MAX_TOKENS = [14, 9, 12, 5, 3]  # sequences finish at different steps: the batch shrinks through several buckets


def params(logprobs: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in MAX_TOKENS]


TOP_K = 5  # logprobs asked for where runs are compared within a tolerance
# How far a chosen token's logprob may move between two runs of the same model that round differently (CUDA: a
# graph's padded matmuls and the eager ones pick different kernels): fp16 keeps ~3 decimal digits of logits of
# magnitude ~10.
LOGPROB_ATOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}


def assert_logprobs_close(want, got, atol: float) -> None:
    """Two greedy runs of the same prompts (RequestOutputs with logprobs=TOP_K) are the same model's up to
    rounding: at each step while the tokens agree, the chosen token's logprob within `atol`. Tokens may part
    ways only at a near tie: each run's token is among the other's top TOP_K and the two tokens are within
    2 x atol of each other in both runs (rounding flips the argmax); the sequences are then different texts and
    nothing after is compared. Where the logits are peaked a different token is a real difference."""
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        w, g = w.outputs[0], g.outputs[0]
        assert len(w.token_ids) == len(g.token_ids), (i, w.token_ids, g.token_ids)
        for j, (a, b, la, lb) in enumerate(zip(w.token_ids, g.token_ids, w.logprobs, g.logprobs)):
            if a == b:
                assert abs(la[a] - lb[a]) <= atol, f"sequence {i} step {j}: token {a} logprob {la[a]} vs {lb[a]}"
                continue
            near_tie = b in la and a in lb and la[a] - la[b] <= 2 * atol and lb[b] - lb[a] <= 2 * atol
            assert near_tie, (f"sequence {i} step {j}: token {a} vs {b} where the logits are not a near tie "
                              f"({la} vs {lb})")
            break


def _run(tokens: list[int], logprobs: list[dict[int, float]]):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)])


def test_runs_compare_by_logprobs_and_may_part_ways_only_at_a_near_tie():
    """The comparison the CUDA graphs-vs-eager test makes (it once demanded token-exact float16 equality
    between differently padded matmuls)."""
    peaked = {5: -0.01, 6: -5.0}
    tie_a, tie_b = {7: -0.690, 8: -0.700}, {8: -0.693, 7: -0.697}  # argmax flipped by rounding
    base = _run([5, 7, 9], [peaked, tie_a, {9: -0.1}])
    assert_logprobs_close([base], [_run([5, 7, 9], [{5: -0.02, 6: -5.0}, tie_a, {9: -0.1}])], atol=0.05)
    # the tie flips: accepted, and what follows (another text) is not compared
    assert_logprobs_close([base], [_run([5, 8, 3], [peaked, tie_b, {3: -4.0}])], atol=0.05)
    with pytest.raises(AssertionError, match="logprob"):  # the same tokens, a logprob moved too far
        assert_logprobs_close([base], [_run([5, 7, 9], [{5: -0.2, 6: -5.0}, tie_a, {9: -0.1}])], atol=0.05)
    with pytest.raises(AssertionError, match="near tie"):  # another token where the logits are peaked
        assert_logprobs_close([base], [_run([6, 7, 9], [{6: -0.01, 5: -5.0}, tie_a, {9: -0.1}])], atol=0.05)


def test_padded_decode_on_cpu_gives_logprobs_close_to_the_eager_ones(tiny_model_dir):
    """The comparison on real runs: the padded path on CPU against the ordinary one, with logprobs."""
    kw = dict(model=str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks_override=128, profile="analytic")
    eager, padded = LLM(**kw), LLM(**kw)
    padded.engine.executor.runner.use_decode_graphs(max_num_seqs=8, max_model_len=padded.engine.max_model_len,
                                                    capture=False)
    want, got = eager.generate(PROMPTS, params(TOP_K)), padded.generate(PROMPTS, params(TOP_K))
    assert_logprobs_close(want, got, LOGPROB_ATOL["float32"])
    eager.close()
    padded.close()


def test_buckets_are_vllms_and_cover_the_limits():
    assert decode_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and decode_batch_sizes(256)[-1] == 256
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert decode_batch_sizes(1) == [1]
    assert block_table_widths(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert block_table_widths(20) == [1, 2, 4, 8, 16, 20]


def test_padding_rows_point_only_at_the_scratch_block():
    buffers = DecodeInputs(max_num_seqs=8, max_model_len=64, block_size=4, scratch_block=99, hidden_size=8,
                           dtype=torch.float32, device=torch.device("cpu"), hidden_input=False)
    seqs = [SequenceWork("a", [5], 9, [3, 4, 7], None, None, 1), SequenceWork("b", [6], 4, [1, 2], None, None, 1),
            SequenceWork("c", [7], 1, [0], None, None, 1)]
    batch = ModelBatch(seqs, None)
    assert buffers.accepts(batch)
    assert buffers.fill(batch) == (4, 4)  # 3 rows -> bucket 4; 3 blocks -> width 4
    meta = buffers.metadata(4, 4)
    assert buffers.token_ids(4).tolist() == [5, 6, 7, 0]
    assert buffers.positions(4).tolist() == [9, 4, 1, 0]
    assert meta.slot_blocks.tolist() == [7, 2, 0, 99] and meta.slot_offsets.tolist() == [1, 0, 1, 0]
    assert meta.decode_context_lens.tolist() == [10, 5, 2, 1]
    assert meta.decode_block_tables.tolist() == [[3, 4, 7, 99], [1, 2, 99, 99], [0, 99, 99, 99], [99] * 4]
    prefill = ModelBatch([SequenceWork("d", [1, 2], 0, [5], None, None, 0)], None)
    assert not buffers.accepts(prefill)


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params())]


def test_padded_decode_on_cpu_gives_the_eager_outputs_and_writes_padding_to_scratch(tiny_model_dir, monkeypatch):
    kw = dict(model=str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks_override=128, profile="analytic")
    eager, padded = LLM(**kw), LLM(**kw)
    runner = padded.engine.executor.runner
    runner.use_decode_graphs(max_num_seqs=8, max_model_len=padded.engine.max_model_len, capture=False)
    buckets = []
    forward = DecodeGraphs.forward
    monkeypatch.setattr(DecodeGraphs, "forward", lambda self, bucket, n, h: buckets.append((bucket, n))
                        or forward(self, bucket, n, h))
    assert _generate(padded) == _generate(eager)
    assert {(b, n) for (b, _), n in buckets} >= {(8, 5), (4, 4), (4, 3), (2, 2), (1, 1)}  # padded and exact
    # Every block the KV manager hands out holds the same K/V either way; only the scratch block differs.
    a, b = eager.engine.executor.runner.kv_cache, runner.kv_cache
    assert runner.scratch_block == 128 and b.shape[0] == 129
    torch.testing.assert_close(a[:128], b[:128], rtol=1e-5, atol=1e-5)
    assert b[128].abs().sum() > 0 and a[128].abs().sum() == 0  # the padding rows wrote there, and only there


def _two_stages(model_dir, padded: bool) -> list[ModelRunner]:
    cfg = OPTConfig.from_model_dir(model_dir)
    runners = []
    for rank in (0, 1):
        stage = load_model_stage(model_dir, cfg, TensorParallelGroup(ParallelLayout(1, 2, 0, rank)), "float32", "cpu")
        runner = ModelRunner(stage, torch.device("cpu"), torch.float32, block_size=4)
        runner.allocate_kv_cache(32)
        if padded:
            runner.use_decode_graphs(max_num_seqs=8, max_model_len=64, capture=False)
        runners.append(runner)
    return runners


def _pipeline_step(runners: list[ModelRunner], batch: ModelBatch) -> tuple[list[int], torch.Tensor]:
    first, last = runners
    inputs = first.prepare(batch)
    hidden = first.forward(inputs)
    assert hidden.shape[0] == inputs.num_tokens == batch.num_tokens  # what goes to the next stage: no padding
    inputs = last.prepare(batch)
    hidden = last.forward(inputs, hidden)
    return [r.token_id for r in last.sample(hidden, inputs, batch)], hidden


def test_padded_decode_on_a_later_pipeline_stage_takes_the_hidden_states_in(tiny_model_dir):
    eager, padded = _two_stages(tiny_model_dir, False), _two_stages(tiny_model_dir, True)
    prompts = [[2, 10, 20, 30, 40], [2, 7], [2, 50, 60]]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    greedy = SamplingParams(temperature=0)
    seqs = [SequenceWork(f"j{i}", p, 0, tables[i], greedy, None, 0) for i, p in enumerate(prompts)]
    want, _ = _pipeline_step(eager, ModelBatch(seqs, None))
    got, _ = _pipeline_step(padded, ModelBatch(seqs, None))
    assert got == want
    contexts = [len(p) for p in prompts]
    for _ in range(4):  # decode: 3 sequences padded to 4 rows on both stages
        seqs = [SequenceWork(f"j{i}", [want[i]], contexts[i], tables[i], greedy, None, 1) for i in range(3)]
        want, h_eager = _pipeline_step(eager, ModelBatch(seqs, None))
        got, h_padded = _pipeline_step(padded, ModelBatch(seqs, None))
        assert got == want
        torch.testing.assert_close(h_padded, h_eager, rtol=1e-5, atol=1e-5)
        contexts = [c + 1 for c in contexts]
    assert padded[1].prepare(ModelBatch(seqs, None)).decode_bucket == (4, 4)


def test_graphs_are_off_on_cpu_and_with_enforce_eager(tiny_model_dir):
    assert not graphs_wanted(False, torch.device("cpu"))
    assert not graphs_wanted(True, torch.device("cuda"))
    assert not graphs_wanted(False, torch.device("cuda"), tensor_parallel_size=2)
    assert graphs_wanted(False, torch.device("cuda"))
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=64, profile="analytic")
    assert llm.engine.executor.runner.decode_graphs is None
    assert LLM(model=str(tiny_model_dir), device="cpu", num_gpu_blocks_override=64, profile="analytic",
               enforce_eager=True).engine.config.enforce_eager
    # The server's switch (vLLM's flag): off by default, on when given.
    import server

    assert server.build_parser().parse_args([]).enforce_eager is False
    args = server.build_parser().parse_args(["--enforce-eager"])
    assert server._configs(args)[0].enforce_eager is True


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# The attention backends of this tree (--attention-backend arrives with the Triton kernels; until then, the one).
BACKENDS = ["torch", "triton"] if "attention_backend" in EngineConfig.field_names() else [None]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graphs_give_the_eager_greedy_outputs_with_every_backend(tiny_model_dir, dtype):
    kw = dict(model=str(tiny_model_dir), device="cuda", dtype=dtype, block_size=4, num_gpu_blocks_override=256,
              profile="analytic", max_num_seqs=16)
    reference = None
    for backend in BACKENDS:
        extra = {} if backend is None else {"attention_backend": backend}
        graphs = LLM(**kw, **extra)
        eager = LLM(**kw, **extra, enforce_eager=True)
        assert eager.engine.executor.runner.decode_graphs is None
        with_graphs = graphs.generate(PROMPTS, params(TOP_K))
        # Not token-exact: the graph's padded matmuls and the eager ones round differently (float16 above all).
        assert_logprobs_close(eager.generate(PROMPTS, params(TOP_K)), with_graphs, LOGPROB_ATOL[dtype])
        assert graphs.engine.executor.runner.decode_graphs.num_captured >= 3  # 8, 4, 2, 1 rows at least
        reference = reference or with_graphs
        assert_logprobs_close(reference, with_graphs, LOGPROB_ATOL[dtype])  # and the backends agree
        graphs.close()
        eager.close()


@pytest.mark.cuda
@cuda
def test_cuda_capture_all_writes_only_the_scratch_block(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), device="cuda", dtype="float32", block_size=4, num_gpu_blocks_override=64,
              profile="analytic", max_num_seqs=8)
    runner = llm.engine.executor.runner
    buffers = runner.decode_graphs.buffers
    assert runner.decode_graphs.num_captured == len(buffers.batch_sizes) * len(buffers.widths)  # at start-up
    runner.allocate_kv_cache(64)  # a zeroed cache, and graphs not captured yet (they would write the old one)
    assert runner.decode_graphs.num_captured == 0
    capture = runner.capture_decode_graphs()
    assert capture.count == capture.buckets == len(buffers.batch_sizes) * len(buffers.widths)
    assert capture.device_bytes >= 0 and capture.seconds > 0
    assert runner.kv_cache[:64].abs().sum() == 0
    outs = llm.generate(PROMPTS, params())
    assert [len(o.outputs[0].token_ids) for o in outs] == MAX_TOKENS


def test_graph_buckets_are_a_bounded_set():
    """Up to 280 graphs (35 batch sizes x 8 widths) were once captured lazily while serving; the start-up set
    is every batch size at the widest table for Triton, powers of two x every width for the torch gather."""
    sizes, widths = graph_buckets(256, 2048, 16, "triton")
    assert sizes == decode_batch_sizes(256) and widths == [128] and len(sizes) * len(widths) == 35
    sizes, widths = graph_buckets(256, 2048, 16, "torch")
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256] and widths == block_table_widths(128)
    assert len(sizes) * len(widths) == 72
    assert graph_buckets(20, 64, 4, "torch") == ([1, 2, 4, 8, 16, 24], [1, 2, 4, 8, 16])
    assert graph_buckets(20, 64, 4, "triton") == ([1, 2, 4, 8, 16, 24], [16])
    # A step is padded up to the set: 3 rows of 3 blocks -> batch 4 at the only width, 16.
    buffers = DecodeInputs(max_num_seqs=20, max_model_len=64, block_size=4, scratch_block=99, hidden_size=8,
                           dtype=torch.float32, device=torch.device("cpu"), hidden_input=False,
                           batch_sizes=[1, 2, 4, 8, 16, 24], widths=[16])
    seqs = [SequenceWork("a", [5], 9, [3, 4, 7], None, None, 1), SequenceWork("b", [6], 4, [1, 2], None, None, 1),
            SequenceWork("c", [7], 1, [0], None, None, 1)]
    assert buffers.fill(ModelBatch(seqs, None)) == (4, 16)
    assert buffers.metadata(4, 16).decode_block_tables[0].tolist() == [3, 4, 7] + [99] * 13
    with pytest.raises(ValueError, match="do not reach"):
        DecodeInputs(max_num_seqs=20, max_model_len=64, block_size=4, scratch_block=99, hidden_size=8,
                     dtype=torch.float32, device=torch.device("cpu"), hidden_input=False, batch_sizes=[1, 8])


class _FakeGraph:
    def reset(self) -> None:
        pass


def test_start_up_captures_the_bounded_set_before_serving_and_logs_it(tiny_model_dir, monkeypatch, caplog):
    """LLM(...) with graphs wanted captures every bucket of graph_buckets while it starts (stand-ins for the
    capture and for the device's free memory, as CUDA is needed for both), logs the count, the time and the
    memory, and a step afterwards captures nothing."""
    import engine.executor.local as local_executor
    import engine.model_runner as model_runner

    captured = []

    def fake_capture(self, bucket):
        captured.append(bucket)
        return _Captured(_FakeGraph(), torch.zeros(bucket[0], 8))

    free = iter([10 << 30, (10 << 30) - (300 << 20)])  # 300 MiB taken by the capture
    monkeypatch.setattr(DecodeGraphs, "_capture", fake_capture)
    monkeypatch.setattr(local_executor, "graphs_wanted", lambda *a, **kw: True)
    monkeypatch.setattr(model_runner, "capture_supported", lambda device: True)
    monkeypatch.setattr(model_runner, "device_free_bytes", lambda device: next(free))
    caplog.set_level("INFO", logger="fastserve.model_runner")
    llm = LLM(model=str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks_override=64, profile="analytic",
              max_num_seqs=20, max_model_len=64)
    try:
        runner = llm.engine.executor.runner
        sizes, widths = graph_buckets(20, 64, 4, runner.attention_backend)
        assert runner.attention_backend == "torch"
        assert sorted(captured) == sorted((b, w) for b in sizes for w in widths)  # 6 x 5, each once
        assert captured[0] == (24, 16)  # largest first, as vLLM
        assert runner.decode_graphs.num_captured == 30
        message = next(r.getMessage() for r in caplog.records if "decode graphs at start-up" in r.getMessage())
        assert "captured 30 of 30 decode graphs" in message and "300.0 MiB" in message, message
        # A bucket outside the set is never captured while serving (fill pads to the set; this is a safeguard).
        runner.decode_graphs._graphs.pop((1, 1))
        runner.decode_graphs.capture = True
        monkeypatch.setattr(DecodeGraphs, "_eager", lambda self, bucket: torch.zeros(bucket[0], 8))
        runner.decode_graphs.forward((1, 1), 1, None)
        assert len(captured) == 30 and runner.decode_graphs._graphs[(1, 1)] is None
    finally:
        llm.close()


# -- staged decode inputs without graphs (tensor-parallel workers; docs/parallel.md, "How it runs") -------------
def _decode_batch(n: int, contexts: list[int], bs: int = 4) -> ModelBatch:
    greedy = SamplingParams(temperature=0)
    return ModelBatch([SequenceWork(f"j{i}", [10 + i], c, list(range(i * 20, i * 20 + c // bs + 1)), greedy, None, 1)
                       for i, c in zip(range(n), contexts)], None)


@pytest.mark.parametrize("stage", [True, False])
def test_staged_decode_inputs_make_one_copy_a_step_and_equal_the_eager_ones(tiny_model_dir, stage):
    """use_staged_decode_inputs (what a tensor-parallel worker uses): a decode step's inputs, unpadded, in the
    persistent buffers, written through a numpy view of one host buffer and moved by one copy (stage=True, the
    default; stage=False, CPU only: in place); the eager path builds a tensor from a Python list for every input.
    The metadata and the hidden states equal the eager step's."""
    from engine.host_copies import HostCopyCounter

    cfg = OPTConfig.from_model_dir(tiny_model_dir)
    runners = []
    for staged in (False, True):
        stage_model = load_model_stage(tiny_model_dir, cfg, TensorParallelGroup(ParallelLayout()), "float32", "cpu")
        runner = ModelRunner(stage_model, torch.device("cpu"), torch.float32, block_size=4)
        runner.allocate_kv_cache(160)
        if staged:
            runner.use_staged_decode_inputs(max_num_seqs=8, max_model_len=64, stage=stage)
        runners.append(runner)
    eager, staged = runners
    for n, contexts in ((3, [9, 4, 1]), (7, [17, 3, 8, 30, 1, 12, 5]), (1, [33])):
        batch = _decode_batch(n, contexts)
        with HostCopyCounter() as before:
            want = eager.prepare(batch)
        with HostCopyCounter() as after:
            got = staged.prepare(batch)
        assert before.count >= 8 and before.calls["tensor"] >= 8  # ids, positions, slots x 2, rows, table, lens
        # (in place on CPU: two tensors from the lists, in host memory, where the "device" buffers are)
        assert dict(after.calls) == ({"copy_": 1} if stage else {"tensor": 2, "__setitem__": 2})
        assert got.decode_bucket == (n, max(c // 4 + 1 for c in contexts))  # every size: no padding
        assert got.num_tokens == n and got.sample_rows.tolist() == want.sample_rows.tolist()
        assert got.token_ids.tolist() == want.token_ids.tolist() and got.positions.tolist() == want.positions.tolist()
        for name in ("slot_blocks", "slot_offsets", "decode_context_lens"):
            assert getattr(got.meta, name).tolist() == getattr(want.meta, name).tolist(), name
        width = want.meta.decode_block_tables.shape[1]
        real = [[b if j < c // 4 + 1 else 0 for j, b in enumerate(row[:width])]
                for row, c in zip(got.meta.decode_block_tables.tolist(), contexts)]
        assert real == want.meta.decode_block_tables.tolist()  # past a row's blocks: scratch (masked) against 0
        torch.testing.assert_close(staged.forward(got), eager.forward(want), rtol=1e-5, atol=1e-5)
    assert staged.decode_graphs.buffers.copies == (3 if stage else 0)
