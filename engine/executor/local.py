"""LocalExecutor: the whole model in this process (tp = pp = 1), on CPU or one GPU.

Owns the model, the device KV cache tensors and the sampler. Each execute()
flattens the batch (every sequence's new tokens concatenated; no padding
reaches a linear layer), builds the attention metadata from the block tables,
runs the forward pass and samples one token per sequence.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.batch import BatchResult, ModelBatch
from engine.executor.base import Executor
from engine.kv_cache import allocate_kv_cache, kv_block_bytes, kv_block_shape, num_device_blocks
from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.parallel import ParallelLayout, TensorParallelGroup
from engine.sampler import Sampler, prompt_logprobs
from engine.swapper import Swapper, allocate_host_cache
from kernels.paged_attention import AttentionMetadata, Workspace


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


class LocalExecutor(Executor):
    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: OPTConfig,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_gpu_blocks_override: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.block_size = block_size
        self.layout = ParallelLayout()
        self.model = load_model_stage(model_dir, model_cfg, TensorParallelGroup(self.layout), self.dtype, self.device)
        self.num_device_blocks = num_device_blocks(
            model_cfg, self.layout, block_size, self.dtype, self.device,
            num_gpu_blocks_override, gpu_memory_utilization,
        )
        self.kv_cache = allocate_kv_cache(self.num_device_blocks, model_cfg, self.layout, block_size,
                                          self.dtype, self.device)
        self.sampler = Sampler(seed)
        self.workspace = Workspace()

    @property
    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.model.cfg, self.layout, self.block_size, self.dtype)

    def attach_host_tier(self, num_host_blocks: int, copy_delay_s: float = 0.0) -> Swapper:
        """Allocate the host tier (pinned on CUDA) and the Swapper that moves blocks to and from it."""
        shape = kv_block_shape(self.model.cfg, self.layout, self.block_size)
        host = allocate_host_cache(num_host_blocks, shape, self.dtype, pin=self.device.type == "cuda")
        self.swapper = Swapper(self.kv_cache, host, copy_delay_s)
        return self.swapper

    def shutdown(self) -> None:
        if getattr(self, "swapper", None) is not None:
            self.swapper.shutdown()

    def execute(self, batch: ModelBatch) -> BatchResult:
        start = time.perf_counter()
        ids, positions, meta, sample_rows, prompt_rows = self._prepare(batch)
        with torch.inference_mode():
            hidden = self.model(ids, positions, self.kv_cache, meta)  # [T, E]
            logits = self.model.compute_logits(hidden, sample_rows)  # [S, V]
            results = self.sampler(logits, batch.seqs, batch.eos_token_id)
            for i, rows in prompt_rows.items():
                seq = batch.seqs[i]
                plogits = self.model.compute_logits(hidden, rows)  # [P, V]
                results[i].prompt_logprobs = prompt_logprobs(plogits, seq.prompt_token_ids, seq.params.prompt_logprobs)
        return BatchResult(results, time.perf_counter() - start)

    def _prepare(self, batch: ModelBatch):
        """Flatten the batch: token ids [T], positions [T], attention metadata,
        the row of each sequence's last token [S], and prompt rows for prompt logprobs."""
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
                partial.append((start, start + n, torch.tensor(table, device=self.device), context_len))
            sample_rows.append(start + n - 1)
            if seq.want_prompt_logprobs:
                prompt_rows[i] = torch.arange(start, start + len(seq.prompt_token_ids), device=self.device)
        dev = self.device
        max_blocks = max((len(t) for t in dec_tables), default=0)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, device=dev),
            slot_offsets=torch.tensor(slot_offsets, device=dev),
            fresh_spans=fresh,
            decode_token_index=torch.tensor(dec_index, dtype=torch.long, device=dev),
            decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in dec_tables],
                                             dtype=torch.long, device=dev).reshape(len(dec_tables), max_blocks),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.long, device=dev),
            partial=partial,
            workspace=self.workspace,
        )
        return (
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            torch.tensor(sample_rows, device=dev),
            prompt_rows,
        )
