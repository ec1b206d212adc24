"""DecodeInputs: persistent input buffers for decode-only steps, padded to a bucketed batch size.

A CUDA graph replays the kernels it captured on the same memory, so a
decode step that runs through a graph must find its inputs at fixed
addresses. These buffers are that memory: token ids, positions, KV slots,
context lengths and block tables (and, on a later pipeline stage, the hidden
states coming in), each sized for the largest batch and the longest context.
Each step fills the first `bucket` rows (the batch padded up to the next
bucket size) and the first `width` columns of the block tables (the longest
table padded up to a power of two). The integer inputs and the block tables
are one flat device tensor; on CUDA a step writes them into one preallocated,
pinned host copy of it (through a numpy view: no tensor is built from a
Python list) and moves the used prefix with one non-blocking copy. On CPU the
padded buffers are host memory and are written in place (from two tensors
built from the lists); the unpadded ones of tensor-parallel workers are
staged there too (a host-to-host copy), which is faster than building the
block tables' tensor from lists. Eager steps that only want
the staging, not the padding (tensor-parallel workers, whose decode steps do
not replay graphs), take buckets of every size (exact_buckets): no padding.

Padding rows are harmless by construction: a padded row's token sits at
position 0 of the scratch block, one block past the KV manager's block ids
(ModelRunner allocates it; no job ever owns it), with a context of that one
token, so it writes its K/V only there and reads only what it wrote. Block
table columns past a sequence's own blocks also point at the scratch block
and lie past its context length, so attention masks them.

What it is not: the capture and replay of graphs (engine/cuda_graphs.py) or
the eager, unpadded inputs of other steps (ModelRunner.prepare).

Legend: B the largest bucket, MB blocks of the longest context, E hidden size.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from engine.batch import ModelBatch
from fastserve_kernels.paged_attention import AttentionMetadata, Workspace

_IDS, _POSITIONS, _SLOT_BLOCKS, _SLOT_OFFSETS, _CONTEXT_LENS = range(5)  # rows of the [5, B] integer inputs


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to the first that holds max_num_seqs."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_num_seqs:
        sizes.append(8 * (sizes[-1] // 8 + 1))
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


def block_table_widths(max_blocks: int) -> list[int]:
    """Powers of two below max_blocks, then max_blocks itself."""
    widths = [1]
    while widths[-1] < max_blocks:
        widths.append(min(2 * widths[-1], max_blocks))
    return widths


def exact_buckets(max_num_seqs: int, max_model_len: int, block_size: int) -> tuple[list[int], list[int]]:
    """Every batch size and every block-table width: a step fills the buffers without padding (an eager step
    that wants the staged inputs alone)."""
    return list(range(1, max_num_seqs + 1)), list(range(1, -(-max_model_len // block_size) + 1))


def graph_buckets(max_num_seqs: int, max_model_len: int, block_size: int,
                  attention_backend: str) -> tuple[list[int], list[int]]:
    """The bounded set of buckets whose CUDA graphs are captured at start-up, as (batch sizes, block-table
    widths); a decode step is padded up to the next of each. Triton: every batch size of decode_batch_sizes
    at the widest table only (its decode kernel skips the context splits past a row's length, so a wide table
    costs a narrow batch almost nothing; 35 graphs for 256 sequences). Torch: the gather copies the whole
    table width, so every width of block_table_widths, with the batch sizes that are powers of two and the
    largest (9 x 8 = 72 graphs for 256 sequences of 2,048 tokens in blocks of 16, against 35 x 8 = 280)."""
    sizes = decode_batch_sizes(max_num_seqs)
    max_blocks = -(-max_model_len // block_size)
    if attention_backend == "triton":
        return sizes, [max_blocks]
    return [s for s in sizes[:-1] if s & (s - 1) == 0] + [sizes[-1]], block_table_widths(max_blocks)


class DecodeInputs:
    """The buffers, and the verbs that fill them from a decode-only ModelBatch. batch_sizes and widths: the
    buckets a step is padded to (graph_buckets), by default every decode_batch_sizes x block_table_widths."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, scratch_block: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, hidden_input: bool,
                 batch_sizes: list[int] | None = None, widths: list[int] | None = None,
                 stage: bool | None = None) -> None:
        """stage: write a host copy (pinned on CUDA) through its numpy view and move it with one non-blocking copy
        a step; by default on CUDA only (on CPU the padded buffers are written in place)."""
        self.batch_sizes = sorted(batch_sizes or decode_batch_sizes(max_num_seqs))
        self.max_blocks = -(-max_model_len // block_size)
        self.widths = sorted(widths or block_table_widths(self.max_blocks))
        if self.batch_sizes[-1] < max_num_seqs or self.widths[-1] < self.max_blocks:
            raise ValueError(f"buckets {self.batch_sizes} x {self.widths} do not reach {max_num_seqs} sequences "
                             f"x {self.max_blocks} blocks")
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        b, mb = self.batch_sizes[-1], self.max_blocks
        # One flat tensor: [5, B] ints (ids, positions, slot blocks, slot offsets, context lengths), then [B, MB]
        # block tables, so that a step's inputs are one contiguous prefix (one copy when staged).
        self.flat = torch.zeros(5 * b + b * mb, dtype=torch.long, device=device)
        self.ints = self.flat[: 5 * b].view(5, b)  # [5, B]
        self.block_tables = self.flat[5 * b:].view(b, mb)  # [B, MB]
        self.rows = torch.arange(b, dtype=torch.long, device=device)  # [B]: decode token i is flat row i
        # [B, E]: a later pipeline stage's incoming hidden states (None on the first stage)
        self.hidden = torch.zeros((b, hidden_size), dtype=dtype, device=device) if hidden_input else None
        cuda = device.type == "cuda"
        self.staged = cuda if stage is None else stage
        # The host copy a staged step writes (pinned on CUDA), through numpy views. (A numpy view makes a storage
        # unresizable, so the device buffers never get one: ModelRunner.release frees them in place.)
        self._host = torch.zeros(self.flat.shape, dtype=torch.long, pin_memory=cuda) if self.staged else None
        host = self._host.numpy() if self.staged else None
        self._host_ints = host[: 5 * b].reshape(5, b) if self.staged else None
        self._host_tables = host[5 * b:].reshape(b, mb) if self.staged else None
        self._copied = torch.cuda.Event() if cuda and self.staged else None  # the last copy of the staging
        self._copy_pending = False
        self.copies = 0  # host-to-device copies made by fill (one a step when staged)
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every row a padding row (what a capture ahead of any step runs its warm-up on)."""
        if self._copy_pending:
            self._copied.synchronize()
        self.ints.zero_()
        self.ints[_SLOT_BLOCKS] = self.scratch_block
        self.ints[_CONTEXT_LENS] = 1
        self.block_tables.fill_(self.scratch_block)
        if self.staged:
            self._host.copy_(self.flat)

    @property
    def max_num_seqs(self) -> int:
        return self.batch_sizes[-1]

    def accepts(self, batch: ModelBatch) -> bool:
        """Decode only: every sequence computes one token after a cached prefix (within max_model_len), asks
        for no prompt logprobs, and the batch fits the largest bucket."""
        limit = self.max_blocks * self.block_size  # positions the block tables can hold
        return (0 < len(batch.seqs) <= self.max_num_seqs and
                all(len(s.token_ids) == 1 and 0 < s.start_pos < limit and not s.want_prompt_logprobs
                    for s in batch.seqs))

    def bucket_of(self, batch: ModelBatch) -> tuple[int, int]:
        """(padded batch size, padded block-table width) of a batch this accepts."""
        n = len(batch.seqs)
        blocks = max(s.start_pos // self.block_size + 1 for s in batch.seqs)
        return self.batch_sizes[bisect_left(self.batch_sizes, n)], self.widths[bisect_left(self.widths, blocks)]

    def fill(self, batch: ModelBatch) -> tuple[int, int]:
        """Write the batch's inputs into the buffers, padded to its bucket; returns the bucket. Staged: into the
        host copy through its numpy view, then one non-blocking copy of the prefix the bucket uses; else (CPU) in
        place."""
        bucket, width = self.bucket_of(batch)
        n, bs, scratch = len(batch.seqs), self.block_size, self.scratch_block
        pad = bucket - n
        starts = [s.start_pos for s in batch.seqs]
        ints = [[s.token_ids[0] for s in batch.seqs] + [0] * pad,
                starts + [0] * pad,
                [s.block_table[p // bs] for s, p in zip(batch.seqs, starts)] + [scratch] * pad,
                [p % bs for p in starts] + [0] * pad,
                [p + 1 for p in starts] + [1] * pad]
        tables = []
        for s, p in zip(batch.seqs, starts):
            own = s.block_table[: p // bs + 1]
            tables.append(own + [scratch] * (width - len(own)))
        tables += [[scratch] * width] * pad
        if not self.staged:  # CPU: the buffers are host memory already
            self.ints[:, :bucket] = torch.tensor(ints, dtype=torch.long)
            self.block_tables[:bucket, :width] = torch.tensor(tables, dtype=torch.long)
            return bucket, width
        if self._copy_pending:
            self._copied.synchronize()  # the previous step's copy has read the staging
        self._host_ints[:, :bucket] = ints  # numpy writes into the (pinned) host buffer: no tensor is built
        self._host_tables[:bucket, :width] = tables
        used = self.ints.numel() + bucket * self.max_blocks  # the ints, then the tables' first `bucket` rows
        self.flat[:used].copy_(self._host[:used], non_blocking=True)
        self.copies += 1
        if self._copied is not None:
            self._copied.record()
            self._copy_pending = True
        return bucket, width

    def fill_hidden(self, hidden: torch.Tensor) -> None:  # [S, E] from the previous stage
        self.hidden[: hidden.shape[0]].copy_(hidden)

    def metadata(self, bucket: int, width: int, workspace: Workspace | None = None) -> AttentionMetadata:
        """Views of the buffers for one bucket: the same addresses every step of that bucket. No workspace
        under capture: a graph allocates its gathers from its own memory pool."""
        return AttentionMetadata(
            slot_blocks=self.ints[_SLOT_BLOCKS, :bucket],
            slot_offsets=self.ints[_SLOT_OFFSETS, :bucket],
            fresh_spans=[],
            decode_token_index=self.rows[:bucket],
            decode_block_tables=self.block_tables[:bucket, :width],
            decode_context_lens=self.ints[_CONTEXT_LENS, :bucket],
            partial=[],
            workspace=workspace,
        )

    def token_ids(self, bucket: int) -> torch.Tensor:  # [bucket] long
        return self.ints[_IDS, :bucket]

    def positions(self, bucket: int) -> torch.Tensor:  # [bucket] long
        return self.ints[_POSITIONS, :bucket]
