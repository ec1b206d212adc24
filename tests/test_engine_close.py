"""LLM.close() releases the engine's memory explicitly, at once, while references to it remain.

On CUDA a second LLM in the same process sized its KV cache against the first one's leftovers whenever anything
still referenced the first (a graph, a stream, an output, a traceback), and torch's allocator kept freed blocks
cached. No GPU here, so a fake device allocator stands in: every storage made on the main thread is counted
while it lives (the weights, the KV cache, the host tier, the decode buffers), and the engine's KV sizing reads
its free memory from that count, as blocks_that_fit reads cudaMemGetInfo. Three engines are created and closed
in turn, each still referenced after close (and its KV cache too, as a captured graph would hold it); each must
size itself exactly as the first did. The CUDA-only steps (graphs reset, the pool dropped, synchronize, then
empty_cache) are checked with stand-ins for the graphs and torch.cuda's calls."""

from __future__ import annotations

import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import engine.executor.local as local_executor
from engine import LLM, SamplingParams
from engine.cuda_graphs import _Captured

DEVICE_BYTES = 64 << 20  # the fake device
PROMPTS = [[2, 10, 20, 30, 40, 50], [2, 7, 8]]


class FakeDeviceMemory(TorchDispatchMode):
    """The storages that ops on this thread created, and `live`: the bytes they hold now. A storage stops counting
    when its last tensor goes (weak references: a storage lives as long as any tensor or view over it) or when its
    memory is freed in place (resized to nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}  # data pointer at creation -> the storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                known = self._storages.get(key)
                if storage.nbytes() and (known is None or known() is None or known().data_ptr() != key):
                    self._storages[key] = weakref.ref(storage)
        return out

    @property
    def live(self) -> int:
        return sum(s.nbytes() for ref in self._storages.values() if (s := ref()) is not None)


def test_three_engines_closed_in_turn_each_size_against_the_whole_device(tiny_model_dir, monkeypatch):
    fake = FakeDeviceMemory()
    sized: list[int] = []

    def blocks_that_fit(per_block_bytes, device, gpu_memory_utilization, peak_bytes=0, reserve=None):  # as on CUDA
        # (without the reserve for after sizing, more than this fake device: tests/test_kv_reserve.py checks it)
        free = DEVICE_BYTES - fake.live
        used = DEVICE_BYTES - free
        sized.append(used)
        return max(0, int(DEVICE_BYTES * gpu_memory_utilization) - peak_bytes - used) // per_block_bytes

    monkeypatch.setattr(local_executor, "blocks_that_fit", blocks_that_fit)
    held = []  # what a graph, a stream, an output or a traceback would keep alive on CUDA
    blocks, after_close = [], []
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with fake:
        start = fake.live
        for _ in range(3):
            llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_host_blocks_override=64,
                      profile="analytic")
            runner = llm.engine.executor.runner
            runner.use_decode_graphs(max_num_seqs=4, max_model_len=64, capture=False)  # the persistent buffers
            assert runner.swapper is not None  # the host tier is there to be released too
            outs = llm.generate(PROMPTS, params)
            assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
            blocks.append(llm.engine.executor.num_device_blocks)
            held += [llm, runner.kv_cache, runner.swapper.host_cache, runner.decode_graphs.buffers.ints,
                     next(runner.model.parameters())]
            llm.close()
            after_close.append(fake.live)
    assert blocks[0] > 0 and blocks == [blocks[0]] * 3, (blocks, sized)
    assert after_close == [start] * 3, (start, after_close)
    assert all(t.untyped_storage().nbytes() == 0 for t in held if isinstance(t, torch.Tensor))
    with pytest.raises(RuntimeError, match="closed"):
        held[0].generate(PROMPTS, params)


class _FakeGraph:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def reset(self) -> None:
        self.calls.append("graph.reset")


def test_release_resets_the_graphs_and_returns_cached_blocks_to_the_device(tiny_model_dir, monkeypatch):
    """On CUDA: synchronize first, every captured graph reset with its output freed, the pool dropped, and
    empty_cache last, once everything is freed (stand-ins for the graphs and for torch.cuda's calls)."""
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks_override=32, profile="analytic")
    runner = llm.engine.executor.runner
    runner.use_decode_graphs(max_num_seqs=4, max_model_len=64, capture=False)
    graphs = runner.decode_graphs
    calls: list[str] = []
    outputs = [torch.ones(4, 8), torch.ones(2, 8)]
    graphs._graphs.update({(4, 4): _Captured(_FakeGraph(calls), outputs[0]), (2, 4): None,
                           (1, 4): _Captured(_FakeGraph(calls), outputs[1])})
    graphs._pool = object()
    kv = runner.kv_cache
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(
        f"empty_cache kv={kv.untyped_storage().nbytes()} outputs={[o.untyped_storage().nbytes() for o in outputs]}"))
    llm.close()
    assert calls == ["synchronize", "graph.reset", "graph.reset", "empty_cache kv=0 outputs=[0, 0]"]
    assert graphs._graphs == {} and graphs._pool is None and runner.decode_graphs is None
    llm.close()  # idempotent
    assert calls.count("synchronize") == 1


@pytest.mark.parametrize("caching", [False, True])
def test_an_engine_kept_after_its_llm_is_collected_still_serves(tiny_model_dir, caching):
    """Only close() (or leaving a `with` block) frees the model and cache: code that keeps llm.engine and drops the
    LLM (as tests and benchmarks do) keeps a working engine; close() then stops it. With prefix caching every
    finished request starts a copy of its cached blocks to the host tier, which must still be open."""
    import gc

    llm = LLM(str(tiny_model_dir), device="cpu", block_size=4, num_gpu_blocks_override=32, profile="analytic",
              enable_prefix_caching=caching, num_host_blocks_override=64)
    engine = llm.engine
    del llm
    gc.collect()
    engine.add_request("r", [2, 10, 11, 12], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 3
    if caching:  # the finished request's full blocks were copied to the host tier's cache
        assert engine.kv.stats.cache_blocks_backed_up > 0
        deadline = time.monotonic() + 30
        while engine.kv.host.num_cached == 0 and time.monotonic() < deadline:
            engine.kv.poll()  # the copy landed: the blocks are named on the host
            time.sleep(0.01)
        assert engine.kv.host.num_cached > 0
    engine.close()
    engine.add_request("s", [2, 10], SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
