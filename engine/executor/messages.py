"""What the controller and the workers of MultiprocExecutor say to each other.

Every message is a pickled dataclass over an authenticated socket
(multiprocessing.connection). Start-up:

    worker -> Hello(rank)            controller -> WorkerSetup (model, layout, rendezvous)
    worker -> Ready(blocks that fit) controller -> AllocateKV(min over ranks)
    controller -> AttachHost(blocks) (per engine that has a host tier)
    worker -> HostReady(blocks locked) at once, then whenever more are locked

Then one StepMessage per step, sent once and read by every rank. Per-job state
(prompt, sampling params, seed) travels once, in NewJob, and the workers keep
it; a step carries only deltas: which jobs run, their new tokens, the block ids
added to their tables, swap orders and the jobs to forget. The sampling rank
(last pipeline stage, tensor rank 0) answers each step with a StepReply; every
rank reports copies it completed (in a StepReply or a TransfersDone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import SequenceResult
from engine.executor.device_identity import WorkerDevice
from engine.sampling_params import SamplingParams
from memory.transfers import Direction


@dataclass
class Hello:
    rank: int
    pid: int
    host: str


@dataclass
class WorkerSetup:
    model_dir: str
    tp_size: int
    pp_size: int
    dtype: str
    load_format: str  # "auto" | "dummy"
    device: str  # "cpu" | "cuda"
    block_size: int
    seed: int
    master_addr: str
    master_port: int
    measure_kv: bool  # False: --num-gpu-blocks-override, nothing to measure
    max_num_batched_tokens: int
    max_model_len: int
    gpu_memory_utilization: float
    attention_backend: str  # "torch" | "triton", resolved by the controller
    max_num_seqs: int = 256
    enforce_eager: bool = False  # else decode steps replay CUDA graphs where engine/cuda_graphs.py allows


@dataclass
class Ready:
    rank: int
    blocks_that_fit: int
    kv_block_bytes: int  # this rank's slice of one block
    device_name: str
    gpu: WorkerDevice | None = None  # the GPU this rank runs on (None on CPU): the dashboard labels its row


@dataclass
class AllocateKV:
    num_blocks: int


@dataclass
class AttachHost:
    num_blocks: int
    tier_id: int  # counts attachments, so a report about a tier replaced since is told apart


@dataclass
class HostReady:
    """How many leading blocks of its host tier a worker has page-locked (all of them at once on the CPU):
    sent when the tier is attached, then by the worker's main loop each time the count grows."""

    rank: int
    tier_id: int
    blocks_ready: int


@dataclass
class NewJob:
    handle: int  # the job's id in messages (an int: cheaper than its name)
    prompt_len: int
    tokens: list[int]  # every token known so far (the prompt, and outputs after a restart)
    params: SamplingParams
    seed: int | None  # the sequence's seed: the sampling rank keeps its generator


@dataclass
class StepJobs:
    """The jobs of a step, column by column (a decode step of 256 jobs pickles in tens of microseconds; a list
    of per-job objects took a millisecond). Job i computes tokens[start_pos[i] : start_pos[i] + num_tokens[i]]."""

    handles: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)  # tokens the workers have not seen yet, appended
    appended_blocks: dict[int, list[int]] = field(default_factory=dict)  # job index -> block ids added to its table
    replaced_tables: dict[int, list[int]] = field(default_factory=dict)  # job index -> its whole new block table
    prompt_logprobs: list[int] = field(default_factory=list)  # job indices whose prompt logprobs are wanted
    no_sample: list[int] = field(default_factory=list)  # job indices computing a chunk that samples nothing

    def __len__(self) -> int:
        return len(self.handles)


@dataclass
class TransferOrder:
    transfer_id: int
    direction: Direction
    pairs: list[tuple[int, int]]  # (source block, destination block)


@dataclass
class StepMessage:
    step_id: int  # -1: no batch (swap orders or releases only); no reply
    eos_token_ids: tuple[int, ...] = ()
    new_jobs: list[NewJob] = field(default_factory=list)
    jobs: StepJobs = field(default_factory=StepJobs)
    transfers: list[TransferOrder] = field(default_factory=list)  # applied before the step's compute
    released: list[int] = field(default_factory=list)  # handles of jobs that ended


@dataclass
class StepReply:
    rank: int
    step_id: int
    tokens: list[int]  # the sampled token of each job, in the step's order
    extras: dict[int, SequenceResult]  # job index -> its whole result, for jobs that asked for logprobs
    execute_s: float
    transfers_done: list[int]

    @classmethod
    def of(cls, rank: int, step_id: int, results: list[SequenceResult], execute_s: float,
           transfers_done: list[int]) -> StepReply:
        extras = {i: r for i, r in enumerate(results) if r.logprobs is not None or r.prompt_logprobs is not None}
        return cls(rank, step_id, [r.token_id for r in results], extras, execute_s, transfers_done)

    def results(self) -> list[SequenceResult]:
        return [self.extras.get(i) or SequenceResult(t) for i, t in enumerate(self.tokens)]


@dataclass
class TransfersDone:
    rank: int
    transfer_ids: list[int]


@dataclass
class WorkerFailed:
    rank: int
    message: str


@dataclass
class Shutdown:
    pass
