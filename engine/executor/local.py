"""LocalExecutor: the whole model in this process (tp = pp = 1), on CPU or one GPU.

Owns one ModelRunner (model, device KV cache, sampler; on CUDA, unless
--enforce-eager, CUDA graphs of decode steps). A step runs on the
executor's own thread, so submit() returns at once and the event loop never
waits on compute (torch releases the GIL; on CUDA the thread waits for the
step's results).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from engine.batch import BatchResult, ModelBatch
from engine.cuda_graphs import graphs_wanted
from engine.decode_inputs import graph_buckets
from engine.executor.base import Executor
from engine.executor.device_identity import WorkerDevice, describe_cuda_device
from engine.kv_cache import blocks_that_fit, kv_reserve
from engine.loader import load_model_stage
from engine.model.registry import ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup
from engine.swapper import Swapper
from fastserve_kernels.attention_backend import resolve_attention_backend


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def fill_pending_tokens(batch: ModelBatch, last_tokens: dict[str, int]) -> None:
    """Async scheduling: put into each placeholder (SequenceWork.fill_last) the token its sequence sampled in the
    step run just before this one (steps run in the order submitted, on one thread). A sequence missing there
    had that step fail: it has ended, and this step's result for it is dropped, so any valid id will do."""
    for work in batch.seqs:
        if work.fill_last:
            token = last_tokens.get(work.job_id, 0)
            work.token_ids[-1] = token
            if work.params.uses_history:
                work.output_token_ids.append(token)


class LocalExecutor(Executor):
    supports_async_scheduling = True

    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: ModelConfig,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_gpu_blocks_override: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        seed: int = 0,
        load_format: str = "auto",
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        attention_backend = resolve_attention_backend(attention_backend, self.device)  # fails before loading weights
        self.block_size = block_size
        model = load_model_stage(model_dir, model_cfg, TensorParallelGroup(ParallelLayout()), self.dtype, self.device,
                                 load_format, seed)
        self.runner = ModelRunner(model, self.device, self.dtype, block_size, seed, attention_backend)
        self.kv_block_bytes = self.runner.kv_block_bytes
        max_model_len = max_model_len or model_cfg.max_position_embeddings
        graphs = graphs_wanted(enforce_eager, self.device)
        # What is allocated after sizing (graphs, logits, the torch backend's gather), kept out of the KV budget
        self.kv_reserve = kv_reserve(
            model_cfg, ParallelLayout(), self.dtype, block_size=block_size, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            attention_backend=self.runner.attention_backend,
            graph_buckets=graph_buckets(max_num_seqs, max_model_len, block_size, self.runner.attention_backend)
            if graphs else None)
        if num_gpu_blocks_override is None:  # two phases: peak of the largest batch, then what fits
            peak = self.runner.measure_peak_memory(max_num_batched_tokens, max_model_len)
            num_gpu_blocks_override = blocks_that_fit(self.kv_block_bytes, self.device, gpu_memory_utilization, peak,
                                                      self.kv_reserve)
        self.num_device_blocks = num_gpu_blocks_override
        self.runner.allocate_kv_cache(self.num_device_blocks)
        if graphs:
            self.runner.use_decode_graphs(max_num_seqs, max_model_len, capture=True)
            self.runner.capture_decode_graphs()  # before serving: no capture in the middle of traffic
        self._thread: ThreadPoolExecutor | None = None  # started on first use, again after shutdown()
        self._closed = False  # close(): the device memory is released, no step can run
        self._last_tokens: dict[str, int] = {}  # job id -> token sampled by the last step (async scheduling)
        self._gpu = describe_cuda_device(0, 0, 0, self.device)  # rank 0 of a 1 x 1 layout; None on CPU

    @property
    def model(self):
        return self.runner.model

    @property
    def swapper(self) -> Swapper | None:
        return self.runner.swapper

    def worker_devices(self) -> list[WorkerDevice]:
        return [self._gpu] if self._gpu is not None else []

    def attach_host_tier(self, num_host_blocks: int) -> Swapper:
        return self.runner.attach_host_tier(num_host_blocks)

    def submit(self, batch: ModelBatch) -> Future[BatchResult]:
        if self._closed:
            raise RuntimeError("this executor was closed (LLM.close): its model and KV cache are released")
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastserve-step")
        return self._thread.submit(self._run, batch)

    def _run(self, batch: ModelBatch) -> BatchResult:
        start = time.perf_counter()
        last, self._last_tokens = self._last_tokens, {}  # (a step that fails leaves none for the next)
        fill_pending_tokens(batch, last)
        inputs = self.runner.prepare(batch)
        hidden = self.runner.forward(inputs)
        results = self.runner.sample(hidden, inputs, batch)
        self._last_tokens = {w.job_id: r.token_id for w, r in zip(batch.seqs, results) if w.sample}
        return BatchResult(results, time.perf_counter() - start)

    def shutdown(self) -> None:
        """Stop the step thread (a later submit starts a new one) and the swapper's copy thread. The memory stays:
        a server's engine is shut down with each AsyncEngine over it (tests reuse one engine across apps)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.runner.shutdown()

    def close(self) -> None:
        """shutdown(), then release every device tensor explicitly (ModelRunner.release: KV cache, graphs and
        their pool, the swapper's buffers, scratch, weights; empty_cache on CUDA), rather than when the executor
        happens to become garbage. Idempotent; no step can run afterwards."""
        self.shutdown()
        if not self._closed:
            self._closed = True
            self.runner.release()
