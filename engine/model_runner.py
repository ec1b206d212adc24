"""ModelRunner: one pipeline stage of the model on one tensor-parallel rank, with
its slice of the device KV cache, running the forward pass of a ModelBatch.

Used by LocalExecutor (tp = pp = 1, in process) and by every worker process of
the multi-process executor (engine/executor/worker.py), so both compute a step
the same way:

    inputs = runner.prepare(batch)           # flatten: ids, positions, attention metadata
    hidden = runner.forward(inputs, hidden)  # this stage's layers (hidden=None on the first stage)
    results = runner.sample(hidden, inputs, batch)   # last stage only: logits -> tokens

Decode-only steps go through persistent buffers padded to a bucket and, on
CUDA, replay a captured graph (use_decode_graphs; engine/cuda_graphs.py);
other steps run eagerly on inputs built for them. The KV cache has one
scratch block past the KV manager's ids, where padding rows write.

What it is not: the transport between stages or ranks (the worker's job) or
the choice of jobs (scheduler/).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from engine.batch import NOT_SAMPLED, ModelBatch, SequenceResult, SequenceWork
from engine.cuda_graphs import DecodeGraphs, capture_supported
from engine.decode_inputs import DecodeInputs, exact_buckets, graph_buckets
from engine.device_memory import device_free_bytes, free_storage
from engine.host_tier import HostTier, SlowLockForTests
from engine.kv_cache import allocate_kv_cache, kv_block_bytes, kv_block_shape
from engine.model.stage import DecoderStage
from engine.sampler import Sampler, prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.swapper import Swapper
from fastserve_kernels import cpu_decode_extension
from fastserve_kernels.attention_backend import attention_function, resolve_attention_backend
from fastserve_kernels.cpu_decode_attention import supports_in_place_decode
from fastserve_kernels.paged_attention import AttentionMetadata, Workspace

log = logging.getLogger("fastserve.model_runner")


@dataclass
class StepInputs:
    """A ModelBatch flattened for the model (T tokens, S sequences)."""

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] long: the row of each sequence's last token
    prompt_rows: dict[int, torch.Tensor]  # sequence index -> [P] rows of its prompt (prompt logprobs)
    # A decode-only step in the persistent buffers: its (batch, block-table width) bucket; token_ids, positions
    # and meta are then views padded to the bucket. None: an eager step, no padding.
    decode_bucket: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the batch (without padding): the rows of the hidden states between stages."""
        return self.sample_rows.shape[0] if self.decode_bucket is not None else self.token_ids.shape[0]


@dataclass(frozen=True)
class GraphCapture:
    """What ModelRunner.capture_decode_graphs did at start-up."""
    count: int  # graphs captured (a bucket whose capture failed runs eagerly)
    buckets: int  # buckets tried
    seconds: float
    device_bytes: int  # free device memory before less after (0 off CUDA)


class ModelRunner:
    def __init__(self, model: DecoderStage, device: torch.device, dtype: torch.dtype, block_size: int,
                 seed: int = 0, attention_backend: str = "auto") -> None:
        self.model, self.device, self.dtype, self.block_size = model, device, dtype, block_size
        self.attention_backend = resolve_attention_backend(attention_backend, device)  # "torch" | "triton"
        model.use_attention(attention_function(self.attention_backend, device))
        self.layout = model.layout
        self.kv_cache: torch.Tensor | None = None
        self.swapper: Swapper | None = None
        self.sampler = Sampler(seed)
        self.workspace = Workspace()
        self.decode_graphs: DecodeGraphs | None = None
        # (max_num_seqs, max_model_len, capture, staged_only): the arguments of use_decode_graphs
        self._decode_settings: tuple | None = None

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of this rank's slice of one KV block."""
        return kv_block_bytes(self.model.cfg, self.layout, self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Blocks 0 .. num_blocks - 1 for the KV manager, and the scratch block num_blocks (padding rows)."""
        self.kv_cache = allocate_kv_cache(num_blocks + 1, self.model.cfg, self.layout, self.block_size, self.dtype,
                                          self.device)
        if supports_in_place_decode(self.kv_cache):  # the CPU decode kernel: built or loaded now, not mid-request
            cpu_decode_extension.decode_attention_op()
        if self._decode_settings is not None:  # graphs captured over the old cache would write into freed memory
            self.use_decode_graphs(*self._decode_settings)

    @property
    def scratch_block(self) -> int:
        return self.kv_cache.shape[0] - 1

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool,
                          staged_only: bool = False, stage: bool | None = None) -> None:
        """Run decode-only steps of up to max_num_seqs sequences through persistent input buffers padded to
        buckets; with capture (CUDA only), as CUDA graphs captured per bucket. Call after allocate_kv_cache.
        staged_only (capture False): eager steps through the buffers without padding, for their staged inputs
        alone: one host buffer (pinned on CUDA) and one non-blocking copy a step, instead of a tensor built from
        a Python list for each input (use_staged_decode_inputs). stage: see DecodeInputs (tests)."""
        if capture and not capture_supported(self.device):
            raise ValueError("CUDA graphs need a CUDA device; on CPU use capture=False (the padded path alone)")
        self._decode_settings = (max_num_seqs, max_model_len, capture, staged_only, stage)
        # Captured: the bounded set of buckets of graph_buckets (capture_decode_graphs takes them all at start-up)
        sizes, widths = (graph_buckets(max_num_seqs, max_model_len, self.block_size, self.attention_backend)
                         if capture else exact_buckets(max_num_seqs, max_model_len, self.block_size)
                         if staged_only else (None, None))
        buffers = DecodeInputs(max_num_seqs, max_model_len, self.block_size, self.scratch_block,
                               self.model.cfg.hidden_size, self.dtype, self.device,
                               hidden_input=not self.model.is_first, batch_sizes=sizes, widths=widths, stage=stage)
        self.decode_graphs = DecodeGraphs(self.model, lambda: self.kv_cache, buffers, capture, self.workspace)

    def use_staged_decode_inputs(self, max_num_seqs: int, max_model_len: int, stage: bool = True) -> None:
        """Decode-only steps run eagerly, unpadded, from the persistent buffers: their inputs are staged in one
        host buffer (pinned on CUDA) and moved with one non-blocking copy (tensor-parallel workers, which do not
        replay graphs; engine/executor/worker.py). On CPU too: writing the host buffer through its numpy view
        and copying it beats building the block tables' tensor from lists (docs/benchmarks.md, "Control plane":
        tensor-parallel decode inputs).
        stage=False: written in place (CPU only; benchmarks)."""
        self.use_decode_graphs(max_num_seqs, max_model_len, capture=False, staged_only=True, stage=stage)

    def capture_decode_graphs(self) -> GraphCapture | None:
        """Capture every bucket's decode graph now, before serving (rather than on a bucket's first step, with a
        synchronize and a cache flush in the middle of the traffic); logs and returns how many, the time taken and
        the device memory they took (free memory before less after; 0 off CUDA). None without graphs."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.capture:
            return None
        buffers = graphs.buffers
        free_before = device_free_bytes(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            count = graphs.capture_all()
        seconds = time.perf_counter() - start
        free_after = device_free_bytes(self.device)
        used = free_before - free_after if free_before is not None and free_after is not None else 0
        result = GraphCapture(count, len(buffers.batch_sizes) * len(buffers.widths), seconds, used)
        log.info("captured %d of %d decode graphs at start-up (%d batch sizes up to %d x %d block-table widths up "
                 "to %d, %s attention) in %.2f s, %.1f MiB of device memory", count, result.buckets,
                 len(buffers.batch_sizes), buffers.batch_sizes[-1], len(buffers.widths), buffers.widths[-1],
                 self.attention_backend, seconds, used / 2**20)
        return result

    def attach_host_tier(self, num_host_blocks: int, copy_delay_s: float = 0.0,
                         test_lock: SlowLockForTests | None = None) -> Swapper:
        """The host tier (page-locked in the background on CUDA, engine/host_tier.py; its blocks_ready says how
        far) and the Swapper that moves this rank's block slices to and from it. test_lock (tests only): lock
        through this fake instead, on any device, so the tier grows as a pinned one does."""
        if self.swapper is not None:  # a new engine over the same workers: a fresh host tier
            self.swapper.close()
        shape = kv_block_shape(self.model.cfg, self.layout, self.block_size)
        if test_lock is None:
            tier = HostTier(num_host_blocks, shape, self.dtype, pin=self.device.type == "cuda")
        else:
            block_bytes = math.prod(shape) * self.dtype.itemsize
            tier = HostTier(num_host_blocks, shape, self.dtype, pin=True,
                            chunk_bytes=test_lock.chunk_blocks * block_bytes, register=test_lock.register,
                            unregister=test_lock.unregister)
        self.swapper = Swapper(self.kv_cache, tier, copy_delay_s)
        return self.swapper

    def shutdown(self) -> None:
        if self.swapper is not None:
            self.swapper.shutdown()

    def release(self) -> None:
        """Free every device tensor this runner holds, for good (LocalExecutor.close): the swapper's copies
        finish, its host tier is unlocked and freed; the captured graphs, their outputs and pool, the decode
        buffers, the KV cache, the attention scratch, the sampler's device generators and the weights are freed
        in place (engine/device_memory.py), so the memory comes back even where something still references them
        (a graph, a stream, an output, a test's traceback); on CUDA the allocator's cached blocks then go back to
        the device (empty_cache), where the next engine's KV sizing (mem_get_info) sees them. Idempotent; the
        runner cannot run afterwards."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # no kernel still reads what is freed below
        if self.swapper is not None:
            self.swapper.release()
            self.swapper = None
        if self.decode_graphs is not None:
            self.decode_graphs.release()
        self.decode_graphs, self._decode_settings = None, None
        free_storage(self.kv_cache)
        self.kv_cache = None
        self.workspace.release()
        self.sampler.release()
        if self.attention_backend == "triton":
            from fastserve_kernels import triton_attention

            triton_attention.forget_last_step()
        self.model.release_weights()
        if cuda:
            torch.cuda.empty_cache()

    # -- KV sizing, phase one --------------------------------------------------------------------
    def measure_peak_memory(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """Warm-up forward of the largest batch (max_num_batched_tokens tokens in prompts of at most
        max_model_len) on a scratch KV cache; returns the peak bytes the device's allocator held. Runs on every
        rank at once: tensor-parallel peers all-reduce inside.

        CUDA only: elsewhere the KV budget is fixed (blocks_that_fit), nothing is measured, and the forward is
        skipped (0). Every rank of a group is on the same kind of device, so all of them skip it together. (On
        CPU it would be pure waste: 8,192 tokens take seconds on the torch backend, and the Triton backend under
        the interpreter does not finish in 25 minutes.)"""
        if self.device.type != "cuda":
            return 0
        bs, lens, left = self.block_size, [], max_num_batched_tokens
        while left > 0:
            lens.append(min(left, max_model_len))
            left -= lens[-1]
        seqs, next_block = [], 0
        for n in lens:
            table = list(range(next_block, next_block + -(-n // bs)))
            next_block += len(table)
            seqs.append(SequenceWork(job_id="warm-up", token_ids=[self.model.cfg.bos_token_id] * n, start_pos=0,
                                     block_table=table, params=SamplingParams(temperature=0), generator=None,
                                     num_generated=0))
        batch = ModelBatch(seqs)
        torch.cuda.reset_peak_memory_stats(self.device)
        saved, self.kv_cache = self.kv_cache, allocate_kv_cache(next_block, self.model.cfg, self.layout, bs,
                                                                 self.dtype, self.device)
        try:
            inputs = self.prepare_eager(batch)
            hidden = None
            if not self.model.is_first:
                hidden = torch.zeros(inputs.num_tokens, self.model.cfg.hidden_size, dtype=self.dtype,
                                     device=self.device)
            hidden = self.forward(inputs, hidden)
            if self.model.is_last:
                with torch.inference_mode():
                    self.model.compute_logits(hidden, inputs.sample_rows)
            scratch_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        finally:
            self.kv_cache = saved
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes  # the scratch cache is not activations
        torch.cuda.empty_cache()
        return peak

    # -- one step ------------------------------------------------------------------------------
    def forward(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers: token ids (first stage) or the previous stage's hidden [T, E] -> [T, E]."""
        with torch.inference_mode():
            if inputs.decode_bucket is not None:
                out = self.decode_graphs.forward(inputs.decode_bucket, inputs.num_tokens, hidden)
                # a view the next replay rewrites: a copy for the next stage, whose send may still be pending
                return out if self.model.is_last else out.clone()
            x = inputs.token_ids if self.model.is_first else hidden
            return self.model(x, inputs.positions, self.kv_cache, inputs.meta)

    def sample(self, hidden: torch.Tensor, inputs: StepInputs, batch: ModelBatch) -> list[SequenceResult]:
        """Last stage: logits of each sequence's last token -> one sampled token each (+ asked-for logprobs)."""
        with torch.inference_mode():
            seqs, rows = batch.seqs, inputs.sample_rows
            sampled = [i for i, seq in enumerate(seqs) if seq.sample]  # a chunk short of its context samples nothing
            if len(sampled) < len(seqs):
                seqs, rows = [seqs[i] for i in sampled], rows[torch.tensor(sampled, dtype=torch.long,
                                                                           device=rows.device)]
            results = [SequenceResult(NOT_SAMPLED) for _ in batch.seqs]
            if sampled:
                logits = self.model.compute_logits(hidden, rows)  # [S, V]
                for i, res in zip(sampled, self.sampler(logits, seqs, batch.eos_token_ids)):
                    results[i] = res
            for i, rows in inputs.prompt_rows.items():
                seq = batch.seqs[i]
                plogits = self.model.compute_logits(hidden, rows)  # [R, V]
                results[i].prompt_logprobs = prompt_logprobs(plogits, seq.prompt_token_ids,
                                                             seq.params.prompt_logprobs, seq.start_pos)
        return results

    def stop_decode_graphs(self) -> None:
        """Every step eager again (benchmarks compare the two on the same batches)."""
        self.decode_graphs, self._decode_settings = None, None

    def prepare(self, batch: ModelBatch) -> StepInputs:
        """The step's inputs: in the persistent decode buffers when it is decode-only and they are in use,
        else built for it (prepare_eager)."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.accepts(batch):
            return self.prepare_eager(batch)
        bucket = graphs.prepare(batch)
        b, buffers = bucket[0], graphs.buffers
        return StepInputs(buffers.token_ids(b), buffers.positions(b), graphs.metadata(bucket),
                          buffers.rows[: len(batch.seqs)], {}, decode_bucket=bucket)

    def prepare_eager(self, batch: ModelBatch) -> StepInputs:
        """Flatten the batch: every sequence's new tokens concatenated (no padding), their positions,
        the attention metadata from the block tables, and the rows to sample from."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        fresh: list[tuple[int, int]] = []
        dec_index: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        partial = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, torch.Tensor] = {}
        dev = self.device
        for i, seq in enumerate(batch.seqs):
            start = len(ids)
            n = len(seq.token_ids)
            context_len = seq.start_pos + n
            pos = range(seq.start_pos, context_len)
            ids += seq.token_ids
            positions += pos
            table = seq.block_table
            slot_blocks += [table[p // bs] for p in pos]
            slot_offsets += [p % bs for p in pos]
            if seq.start_pos == 0:
                fresh.append((start, start + n))
            elif n == 1:
                dec_index.append(start)
                dec_tables.append(table[: -(-context_len // bs)])
                dec_lens.append(context_len)
            else:
                partial.append((start, start + n, torch.tensor(table, device=dev), context_len))
            sample_rows.append(start + n - 1)
            if seq.want_prompt_logprobs:  # the rows at prompt positions (all of a prompt, or a chunk's share)
                prompt_rows[i] = torch.arange(start, start + min(context_len, len(seq.prompt_token_ids))
                                              - seq.start_pos, device=dev)
        max_blocks = max((len(t) for t in dec_tables), default=0)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            fresh_spans=fresh,
            decode_token_index=torch.tensor(dec_index, dtype=torch.long, device=dev),
            decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in dec_tables],
                                             dtype=torch.long, device=dev).reshape(len(dec_tables), max_blocks),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.long, device=dev),
            partial=partial,
            workspace=self.workspace,
        )
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev), meta,
                          torch.tensor(sample_rows, dtype=torch.long, device=dev), prompt_rows)
