"""DecodeGraphs: decode-only steps through persistent buffers, replayed as CUDA graphs.

A decode step of a large model is mostly kernel launches: one token per
sequence, dozens of layers, a handful of kernels each. Capturing the step
once per shape and replaying it removes the launch overhead (vLLM does the
same). The shape is the bucket of engine/decode_inputs.py: the batch padded
up to the next captured batch size and the block tables to the next captured
width, from the bounded set of graph_buckets (Triton: every batch size at the
widest table only; torch: powers of two x every width). Every bucket's graph
is captured at start-up, before serving (capture_all, from
ModelRunner.capture_decode_graphs, which logs the count, the time and the
memory), each after one eager warm-up run on a side stream, into a memory pool
all graphs share (they replay one at a time, on one stream, and each graph's
output stays referenced here, so no capture hands out memory another graph's
output lives in). Without that call a bucket is captured on its first step.
If a capture fails (out of memory, or an attention kernel that waits on the
host), that bucket runs eagerly from then on.

Steps with a prefill or a chunk of prompt run eagerly (ModelRunner.prepare);
so does everything when graphs are off: --enforce-eager, on CPU (CUDA graphs
exist only on CUDA), or on a tensor-parallel worker (capturing NCCL
all-reduces is not checked on a GPU here). With capture off the same padded
buffers still run eagerly, which is how the padding is tested on CPU.

What it is not: the buffers and their padding (engine/decode_inputs.py) or
the model (engine/model/opt.py).

Legend: B bucket batch size, E hidden size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.batch import ModelBatch
from engine.decode_inputs import DecodeInputs
from engine.device_memory import free_storage
from engine.model.stage import DecoderStage
from fastserve_kernels.paged_attention import AttentionMetadata, Workspace

log = logging.getLogger("fastserve.cuda_graphs")


def graphs_wanted(enforce_eager: bool, device: torch.device, tensor_parallel_size: int = 1) -> bool:
    """Whether decode steps replay CUDA graphs: on CUDA, unless --enforce-eager, on one tensor-parallel rank."""
    return not enforce_eager and device.type == "cuda" and tensor_parallel_size == 1


def capture_supported(device: torch.device) -> bool:
    """Whether graphs can be captured on this device (CUDA graphs exist only on CUDA)."""
    return device.type == "cuda"


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output  # output [B, E], rewritten by each replay


class DecodeGraphs:
    def __init__(self, model: DecoderStage, kv_cache: Callable[[], torch.Tensor], buffers: DecodeInputs,
                 capture: bool, workspace: Workspace | None = None) -> None:
        self.model, self._kv_cache, self.buffers, self.capture = model, kv_cache, buffers, capture
        self._workspace = None if capture else workspace  # eager runs reuse the runner's gather buffers
        self._graphs: dict[tuple[int, int], _Captured | None] = {}  # bucket -> its graph; None: runs eagerly
        self._pool = None  # the memory pool every graph allocates from
        self._captured_at_start = False  # capture_all ran: no capture in the middle of serving

    @property
    def num_captured(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def accepts(self, batch: ModelBatch) -> bool:
        return self.buffers.accepts(batch)

    def prepare(self, batch: ModelBatch) -> tuple[int, int]:
        """Fill the buffers with the batch; returns its bucket."""
        return self.buffers.fill(batch)

    def forward(self, bucket: tuple[int, int], num_seqs: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers over the filled buffers: [S, E] hidden states of the real rows (a view that the
        next step of the same bucket overwrites)."""
        if hidden is not None:
            self.buffers.fill_hidden(hidden)
        if not self.capture:
            return self._eager(bucket)[:num_seqs]
        if bucket not in self._graphs:  # a bucket outside the start-up set (none: fill pads to the set)
            if self._captured_at_start:
                log.warning("decode bucket %d x %d was not captured at start-up; it runs eagerly", *bucket)
            self._graphs[bucket] = None if self._captured_at_start else self._capture(bucket)
        captured = self._graphs[bucket]
        if captured is None:
            return self._eager(bucket)[:num_seqs]
        captured.graph.replay()
        return captured.output[:num_seqs]

    def metadata(self, bucket: tuple[int, int]) -> AttentionMetadata:
        return self._inputs(bucket)[2]

    def _inputs(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b, width = bucket
        x = self.buffers.token_ids(b) if self.model.is_first else self.buffers.hidden[:b]  # [B] or [B, E]
        return x, self.buffers.positions(b), self.buffers.metadata(b, width, self._workspace)

    def _eager(self, bucket: tuple[int, int]) -> torch.Tensor:  # [B, E]
        x, positions, meta = self._inputs(bucket)
        return self.model(x, positions, self._kv_cache(), meta)

    def _capture(self, bucket: tuple[int, int]) -> _Captured | None:
        x, positions, meta = self._inputs(bucket)
        kv = self._kv_cache()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy initialisation happens outside the capture
                self.model(x, positions, kv, meta)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine thread may queue swap copies on its copy streams meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self.model(x, positions, kv, meta)
        except RuntimeError as e:  # out of memory, or a kernel that cannot be captured (a host sync)
            log.warning("cannot capture the decode graph of batch %d x %d blocks (%s); that bucket runs eagerly",
                        *bucket, str(e).splitlines()[0] if str(e) else type(e).__name__)
            torch.cuda.empty_cache()
            return None
        if self._pool is None:
            self._pool = graph.pool()
        log.debug("captured the decode graph of batch %d x %d blocks", *bucket)
        return _Captured(graph, output)

    def release(self) -> None:
        """Free the graphs' memory now (an engine closing; ModelRunner.release): each graph's output, which lives
        in the shared pool, then the graph itself (reset() gives its pool back to the allocator), the pool, and
        the persistent input buffers. Call with the device idle; nothing may run on this object afterwards."""
        for captured in self._graphs.values():
            if captured is not None:
                free_storage(captured.output)
                captured.graph.reset()
        self._graphs.clear()
        self._pool = None
        for value in vars(self.buffers).values():
            if isinstance(value, torch.Tensor):
                free_storage(value)

    def capture_all(self, batch_sizes: list[int] | None = None, widths: list[int] | None = None) -> int:
        """Capture the graphs of these buckets now (all by default) rather than on first use; returns how many
        exist. The warm-ups run on padding rows only, so they write nothing but the scratch block."""
        if not self.capture:
            return 0
        self._captured_at_start = True
        self.buffers.fill_padding()
        for b in sorted(batch_sizes or self.buffers.batch_sizes, reverse=True):  # largest first, as vLLM
            for w in sorted(widths or self.buffers.widths, reverse=True):
                if (b, w) not in self._graphs:
                    self._graphs[(b, w)] = self._capture((b, w))
        return self.num_captured
