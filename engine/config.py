"""EngineConfig: every engine setting, one flat dataclass validated once.

Field names are the CLI flags in snake_case (vLLM's names where vLLM has the
setting), so `LLM(model=..., max_num_seqs=...)`, the server's flags and this
class line up. Server-only settings (host, port, api key, ...) live in
server.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from fastserve_kernels.attention_backend import ATTENTION_BACKENDS
from scheduler.policy import MLFQ_LADDERS, PolicyName

# Where the built-in tiny model is loaded from when no model is given ($FASTSERVE_DEFAULT_MODEL overrides).
# The engine only loads it; server.py, `make model` and scripts/make_tiny_model.py build it (modelmaker/).
DEFAULT_MODEL_DIR = Path(os.environ.get("FASTSERVE_DEFAULT_MODEL", Path(__file__).resolve().parents[1] / "models"
                                        / "tiny-opt"))
KV_POLICIES = ("proactive", "reactive", "reactive-blocking", "recompute")
# max_num_batched_tokens without chunked prefill when none is given (this engine's default before chunked prefill),
# and the most a picked chunk budget may be.
UNCHUNKED_BATCHED_TOKENS = 8192
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face OPT directory; None = the built-in tiny model (DEFAULT_MODEL_DIR)
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto (float16 on CUDA, float32 on CPU) | float32 | float16 | bfloat16
    load_format: str = "auto"  # auto: the model directory's weights | dummy: random weights from config.json
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto (triton on CUDA when it imports, else torch) | torch | triton
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1  # nodes the workers span (the controller runs on the first; see README "Many GPUs")
    master_addr: str = "127.0.0.1"  # the torch.distributed rendezvous (and the controller's worker port)
    master_port: int | None = None  # None: a free port; the workers' control port is master_port + 1
    max_num_seqs: int = 256
    # Most tokens one iteration computes. None: with chunked prefill, the budget the job profile picks
    # (scheduler/cost_model.py, chunk_budget); without it, UNCHUNKED_BATCHED_TOKENS.
    max_num_batched_tokens: int | None = None
    # Chunked prefill (vLLM's flag): a prompt that does not fit the rest of an iteration's max_num_batched_tokens is
    # split, its next chunk in a later iteration, and the decodes of the last batch come first
    # (scheduler/policy.py, SchedulingPolicy.chunk). Off: a prompt runs whole (one longer than the budget, alone).
    # None (the default): on where the model runs on CUDA, off on the CPU and in the simulator, as measured
    # (docs/benchmarks.md, "Chunked prefill: the default"; Engine resolves it).
    enable_chunked_prefill: bool | None = None
    # With chunked prefill, at most this many of one prompt's tokens in an iteration (vLLM's
    # long_prefill_token_threshold); 0 (the default, as vLLM's): only the budget bounds a chunk. Measured on the
    # OPT-13B A100 80GB profile, a cap of the stall-safe chunk (128) under the picked budget (256) changed neither
    # P99 ITL nor throughput (docs/benchmarks.md, "Chunked prefill, session 19"), so none is picked.
    long_prefill_token_threshold: int = 0
    # Automatic prefix caching (vLLM's flag; memory/prefix_cache.py): full KV blocks are named by a hash of their
    # tokens and everything before them, shared between jobs and kept after a job ends; a request computes only
    # what follows its longest cached prefix.
    enable_prefix_caching: bool = True
    # With prefix caching and a host tier (kv_policy reactive or proactive): cached blocks the device evicts live on
    # in the host tier, and hits there are uploaded (memory/kv_manager.py, enable_prefix_caching). Off: the device
    # alone caches (an evicted block is lost).
    prefix_caching_host_tier: bool = True
    max_model_len: int | None = None  # defaults to the model's context
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0  # GiB of host memory for offloaded KV
    num_host_blocks_override: int | None = None  # host-tier blocks, overriding swap_space (tests)
    scheduling_policy: str = "skip-join-mlfq"
    seed: int = 0
    kv_policy: str = "proactive"
    # alpha, seconds: the paper's starvation rule; off by default, since past capacity every waiting job is older
    # than alpha and promoting them all turns the queues into round robin (docs/benchmarks.md, "Skip-join at
    # capacity"); age promotion (starvation_age) bounds waits instead.
    starvation_threshold: float | None = None
    # Overload rules: promotion after max(alpha, f x W), to the arrival place for a job that never ran, and a
    # last queue that keeps its order (scheduler/skip_join_mlfq.py); None = the paper's rules.
    starvation_factor: float | None = 1.0
    quantum_ratio: float = 2.0
    # Age promotion: a job in the system longer than this x the mean time in the system runs to completion,
    # oldest first; None = off (scheduler/skip_join_mlfq.py).
    starvation_age: float | None = 3.0
    # The MLFQ ladder: "service" (quanta cover the whole service a job can need, decode included) or
    # "prefill" (the paper's: the last quantum covers t_init(max_model_len)); scheduler/policy.py.
    mlfq_ladder: str = "service"
    # Skip-join's alike-lengths mode (opt-in): when the output lengths of finished jobs say a started job is the
    # nearer to finishing (alike lengths), no demotion and started jobs run to completion first
    # (scheduler/skip_join_mlfq.py, set_alike_lengths). Off by default: the lengths it learns from are those that
    # finished, and past capacity those are the short ones, so a heavy tail can read as alike (Azure's 2023
    # conversation lengths at 1.5x capacity: one seed of two 2.7x worse; docs/benchmarks.md, "Issue 24, session 25").
    adapt_to_alike_lengths: bool = False
    reserved_blocks: int = 0
    # Overload admission: started jobs' KV (device + host) may total at most this many device caches;
    # a new job waits beyond it (memory/kv_manager.py, may_start). None = no limit (the paper's behaviour, and the
    # default: with least-attained-service order the limit kept new jobs waiting behind started long ones).
    kv_overcommit: float | None = None
    profile: str | None = None  # a job-profile JSON (scripts/profile_model.py)
    # Decode steps replay CUDA graphs captured per batch bucket (engine/cuda_graphs.py) unless this is set;
    # on CPU, and on tensor-parallel workers, they always run eagerly.
    enforce_eager: bool = False
    # Async output processing (as vLLM V0's): step k+1 is scheduled and launched as soon as step k's tokens are
    # committed (appended, stop tokens and lengths checked, finished jobs released), and step k's detokenizing
    # (sequences without stop strings) and output snapshots are done while step k+1 computes. Same batches,
    # tokens and outputs; never in the simulator or with pipeline parallelism (engine.engine.overlaps_output).
    # Off by default: on the 2-core CPU it takes 2/3 of the engine's work off the critical path but no gain in
    # the step's period could be measured (docs/benchmarks.md, "Issue 26, control plane ... async output").
    async_output_processing: bool = False
    # Async scheduling (vLLM V1's --async-scheduling): step k+1 is scheduled and queued while step k computes, so
    # the scheduler, the KV manager and building the batch leave the step's critical path. A job of step k runs in
    # step k+1 with a placeholder for the token step k samples; the executor puts the token in before it computes
    # step k+1. What does not depend on tokens is known when step k is launched (its KV positions, its charge to
    # the scheduler, the jobs that end by length); a job that ends by EOS, a stop token or a stop string at step k
    # runs once more in step k+1, whose token is dropped. Same tokens as the synchronous engine; the schedule may
    # differ (a step is charged when launched). Includes async output processing. tp = pp = 1 only.
    async_scheduling: bool = False
    max_queued_requests: int | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.dtype in ("auto", "float32", "float16", "bfloat16"),
             f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(self.attention_backend in ATTENTION_BACKENDS,
             f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        need(self.load_format in LOAD_FORMATS,
             f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        need(self.pipeline_parallel_size >= 1, "pipeline_parallel_size must be >= 1")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        need(self.nnodes >= 1 and world % self.nnodes == 0,
             f"nnodes ({self.nnodes}) must divide tensor_parallel_size x pipeline_parallel_size ({world})")
        need(self.master_port is None or 1 <= self.master_port <= 65534, "master_port must be in [1, 65534]")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.long_prefill_token_threshold >= 0,
             f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
             f"block_size must be a power of two <= 128, got {self.block_size}")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        need(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
             "num_gpu_blocks_override must be >= 1")
        need(self.swap_space >= 0, "swap_space must be >= 0 GiB")
        need(self.num_host_blocks_override is None or self.num_host_blocks_override >= 0,
             "num_host_blocks_override must be >= 0")
        policies = [p.value for p in PolicyName if p is not PolicyName.SRPT]
        need(self.scheduling_policy in policies + [PolicyName.SRPT.value],
             f"scheduling_policy must be one of {', '.join(policies)}; got {self.scheduling_policy!r}")
        need(self.kv_policy in KV_POLICIES,
             f"kv_policy must be one of {', '.join(KV_POLICIES)}; got {self.kv_policy!r}")
        need(self.starvation_threshold is None or self.starvation_threshold > 0, "starvation_threshold must be > 0")
        need(self.starvation_factor is None or self.starvation_factor > 0,
             "starvation_factor must be > 0 (or none)")
        need(self.quantum_ratio > 1, "quantum_ratio must be > 1")
        need(self.mlfq_ladder in MLFQ_LADDERS, f"mlfq_ladder must be one of {', '.join(MLFQ_LADDERS)}")
        need(self.reserved_blocks >= 0, "reserved_blocks must be >= 0")
        need(self.kv_overcommit is None or self.kv_overcommit >= 1, "kv_overcommit must be >= 1 (or none)")
        need(self.max_queued_requests is None or self.max_queued_requests >= 0, "max_queued_requests must be >= 0")
        need(not self.async_scheduling or world == 1,
             "async_scheduling needs tensor_parallel_size and pipeline_parallel_size 1 (pipeline stages overlap "
             "their steps already)")
        need(not self.async_scheduling or self.kv_policy != "reactive-blocking",
             "async_scheduling does not work with kv_policy reactive-blocking (a step that waits for its copies)")

    @property
    def sizing_batched_tokens(self) -> int:
        """The iteration size the executor sizes activation memory for (its warm-up forward), before the engine
        picks a budget: max_num_batched_tokens, or UNCHUNKED_BATCHED_TOKENS, which no picked budget exceeds."""
        return self.max_num_batched_tokens or UNCHUNKED_BATCHED_TOKENS

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def builtin_model_dir() -> Path:
    """DEFAULT_MODEL_DIR once the tiny model is built there; FileNotFoundError saying how to build it otherwise."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"no model given and the built-in tiny model is not built at {DEFAULT_MODEL_DIR}: run `make model` "
            "(scripts/make_tiny_model.py) or `python server.py` once, which build it, or pass a model directory")
    return DEFAULT_MODEL_DIR
