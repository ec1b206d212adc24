"""What the controller and the workers of MultiprocExecutor say to each other.

Every message is a pickled dataclass over an authenticated socket
(multiprocessing.connection). Start-up:

    worker -> Hello(rank)            controller -> WorkerSetup (model, layout, rendezvous)
    worker -> Ready(blocks that fit) controller -> AllocateKV(min over ranks)
    controller -> AttachHost(blocks) (once, when the engine has a host tier)

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
    device: str  # "cpu" | "cuda"
    block_size: int
    seed: int
    master_addr: str
    master_port: int
    measure_kv: bool  # False: --num-gpu-blocks-override, nothing to measure
    max_num_batched_tokens: int
    max_model_len: int
    gpu_memory_utilization: float


@dataclass
class Ready:
    rank: int
    blocks_that_fit: int
    kv_block_bytes: int  # this rank's slice of one block
    device_name: str


@dataclass
class AllocateKV:
    num_blocks: int


@dataclass
class AttachHost:
    num_blocks: int
    copy_delay_s: float = 0.0  # slows each copy (tests of the ordering rules)


@dataclass
class NewJob:
    handle: int  # the job's id in messages (an int: cheaper than its name)
    prompt_len: int
    tokens: list[int]  # every token known so far (the prompt, and outputs after a restart)
    params: SamplingParams
    seed: int | None  # the sequence's seed: the sampling rank keeps its generator


@dataclass
class JobStep:
    """One job of a step: compute tokens[start_pos : start_pos + num_tokens]."""

    handle: int
    start_pos: int
    num_tokens: int
    new_tokens: list[int]  # tokens the workers have not seen yet (appended to the job's tokens)
    replace_table: bool  # True: `blocks` is the whole block table; False: blocks appended to it
    blocks: list[int]
    want_prompt_logprobs: bool = False


@dataclass
class TransferOrder:
    transfer_id: int
    direction: Direction
    pairs: list[tuple[int, int]]  # (source block, destination block)


@dataclass
class StepMessage:
    step_id: int  # -1: no batch (swap orders or releases only); no reply
    eos_token_id: int | None = None
    new_jobs: list[NewJob] = field(default_factory=list)
    jobs: list[JobStep] = field(default_factory=list)
    transfers: list[TransferOrder] = field(default_factory=list)  # applied before the step's compute
    released: list[int] = field(default_factory=list)  # handles of jobs that ended


@dataclass
class StepReply:
    rank: int
    step_id: int
    results: list[SequenceResult]
    execute_s: float
    transfers_done: list[int]


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
