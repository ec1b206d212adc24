"""Engine: the synchronous core. One step() = schedule -> memory -> execute
-> update jobs -> outputs.

    engine = Engine(EngineConfig(model=path))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

The engine owns tokens, the model (through an executor) and the clock; it asks
scheduler/ which jobs run and memory/ where their KV lives. Requests are
validated and tokenized by prepare_request() (no state changes, so a bad
request leaves the engine untouched) and admitted by admit(); add_request()
does both. AsyncEngine drives the same object from asyncio.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.batch import PENDING_TOKEN, BatchResult, ModelBatch, SequenceWork
from engine.clock import WallClock
from engine.config import UNCHUNKED_BATCHED_TOKENS, EngineConfig
from engine.errors import ValidationError
from engine.executor import make_executor
from engine.executor.base import Executor, ExecutorDeadError
from engine.model.registry import load_model_config
from engine.model_names import model_path
from engine.outputs import RequestMetrics, RequestOutput
from engine.prefix_source import EnginePrefixSource
from engine.profiles import load_cost_model
from engine.request import RequestState, SequenceState
from engine.sampling_params import SamplingParams, check_cache_salt
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, sequence_end_ids
from memory.admission import admission_limit
from memory.kv_manager import KVManager, blocks_needed
from memory.kv_policy import KVPolicy
from scheduler import Job, ProfiledCostModel, SchedulerConfig, make_policy, step_charges
from scheduler.cost_model import chunk_budget
from scheduler.policy import ScheduleDecision

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class StepPlan:
    """What one iteration runs: the scheduler's decision and the executor's input."""

    decision: ScheduleDecision
    batch: ModelBatch
    seqs: list[SequenceState]
    start_time: float
    cost: float  # profiled seconds of the iteration
    charges: dict[Job, float]  # each job's share of it (scheduler.step_charges), charged to the job


@dataclass
class CommittedStep:
    """A step whose tokens are in (Engine.commit_step) but whose outputs are not built yet (publish_step)."""

    end: float  # when its results came in
    advanced: dict[str, RequestState]  # requests that got a token
    # (sequence, token, ending) whose text is still to be decoded: sequences without stop strings, whose finish
    # does not depend on their text (async output processing; empty otherwise)
    untexted: list[tuple[SequenceState, int, tuple[str, int | None] | None]]
    deferred: bool  # published after the next step's launch: a finished request's finished_time is `end`


@dataclass(frozen=True)
class SchedulerStats:
    """A read-only snapshot of the policy's counters (for the server's /metrics)."""

    policy: str
    num_jobs: int  # unfinished jobs the policy holds
    queue_lengths: list[int]  # jobs per MLFQ level, Q1 first; [] for policies without queues (fcfs)
    quanta: list[float]  # profiled seconds per MLFQ level; [] without queues
    num_promotions: int  # starvation promotions to Q1 (MLFQ policies)
    num_demotions: int
    num_policy_preemptions: int  # jobs that ran one iteration and not the next (priority policies)
    jobs_by_priority: dict[int, int]  # unfinished jobs per request class (Job.priority), most urgent first
    started_by_priority: dict[int, int]  # jobs started (first run) per request class, over the engine's life


def overlaps_output(config: EngineConfig, executor: Executor) -> bool:
    """Whether complete_step publishes a step's outputs after launching the next (async output processing, which
    async scheduling includes): as configured, but not in the simulator (its virtual clock would move between a
    step's end and its outputs) nor with several steps in flight (pipeline stages overlap their steps already)."""
    return ((config.async_output_processing or config.async_scheduling) and not executor.simulated
            and executor.max_in_flight == 1)


def check_async_scheduling(config: EngineConfig, executor: Executor) -> bool:
    """Whether steps are scheduled ahead (EngineConfig.async_scheduling); ValueError where it was asked for and
    the executor cannot fill a step's placeholders from the step before (worker processes, the simulator)."""
    if config.async_scheduling and not executor.supports_async_scheduling:
        raise ValueError(f"async_scheduling needs the in-process executor (tp = pp = 1, a real model); "
                         f"{type(executor).__name__} cannot run it")
    return config.async_scheduling


def resolve_chunking(config: EngineConfig, device_type: str, cost: ProfiledCostModel,
                     block_size: int) -> tuple[bool, int]:
    """(chunked prefill on, max_num_batched_tokens) as the engine runs them. Chunked prefill: as configured, else
    on where the model runs on CUDA and off elsewhere: on this CPU chunking raised the tiny model's P99 ITL and
    the simulator ("meta") keeps the unchunked runs its experiments were measured with (docs/scheduling.md,
    "Chunked prefill"). The budget: as configured, else with chunking the one the job profile picks
    (scheduler/cost_model.py chunk_budget), without it UNCHUNKED_BATCHED_TOKENS."""
    chunked = config.enable_chunked_prefill
    if chunked is None:
        chunked = device_type == "cuda"
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = (chunk_budget(cost, block_size, config.max_num_seqs, UNCHUNKED_BATCHED_TOKENS) if chunked
                  else UNCHUNKED_BATCHED_TOKENS)
    return chunked, budget


class Engine:
    def __init__(self, config: EngineConfig | None = None, clock=None, executor: Executor | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_dir = model_path(config.model)  # a directory, a GGUF file, or a name (engine/model_names.py)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_dir)
        self.eos_token_ids = sequence_end_ids(self.tokenizer, self.model_dir)
        self.max_model_len = self._resolve_max_model_len()
        self.executor = executor or make_executor(config, self.model_dir, self.model_config, self.max_model_len)
        self.clock = clock or WallClock()
        self.kv = self._make_kv_manager()
        self._seq_of_job: dict[str, SequenceState] = {}
        if config.enable_prefix_caching:
            self.kv.enable_prefix_caching(EnginePrefixSource(self._seq_of_job), config.prefix_caching_host_tier)
        self.cost_model = self._load_cost_model()
        chunked, budget = resolve_chunking(config, self.executor.device.type, self.cost_model,
                                           self.executor.block_size)
        prefill_limit = config.long_prefill_token_threshold
        log.info("chunked prefill: %s; at most %d tokens per iteration%s", "on" if chunked else "off", budget,
                 f", {prefill_limit} of one prompt" if chunked and prefill_limit else "")
        self.scheduler = make_policy(
            SchedulerConfig(
                policy=config.scheduling_policy, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=chunked, long_prefill_token_threshold=prefill_limit,
                starvation_threshold=config.starvation_threshold, quantum_ratio=config.quantum_ratio,
                starvation_factor=config.starvation_factor, mlfq_ladder=config.mlfq_ladder,
                starvation_age=config.starvation_age, adapt_to_alike_lengths=config.adapt_to_alike_lengths,
                max_prompt_len=self.max_model_len,
                max_batch_kv_tokens=self._batch_kv_share(),
            ),
            self.cost_model,
        )
        self.requests: dict[str, RequestState] = {}
        self.num_steps = 0
        self.in_flight: deque[tuple[StepPlan, Future[BatchResult]]] = deque()  # submitted, oldest first
        # Async scheduling: one step computes while the next is decided and queued behind it (steps in flight: 2)
        self.async_scheduling = check_async_scheduling(config, self.executor)
        self._depth = 2 if self.async_scheduling else self.executor.max_in_flight
        self._release_later: list[SequenceState] = []  # ended while a launched step still writes their KV
        self._last_step_end = 0.0  # when the last committed step's results came in (clock)
        # reactive-blocking: the decision that waits for the copies it started (its jobs keep their num_scheduled:
        # nothing schedules or reads them until it runs)
        self._held: ScheduleDecision | None = None
        self.last_batch_size = 0  # sequences in the last finished iteration (telemetry: the dashboard)
        # False: step() returns only finished requests (offline use, simulation) instead of a
        # snapshot of every request that advanced, which costs a copy of its tokens each step.
        self.emit_running_outputs = True
        # Async output processing: complete_step launches the next step before it decodes text and builds outputs
        self.overlaps_output = overlaps_output(config, self.executor)

    # -- set-up --------------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds this model's context of {limit}")
        max_model_len = self.config.max_model_len or limit
        self.model_config.check_max_model_len(max_model_len)  # e.g. a sliding window shorter than that
        return max_model_len

    def _batch_kv_share(self) -> int | None:
        """With batches in flight in several pipeline stages, one batch's share of the device's KV (tokens)."""
        ex = self.executor
        if ex.max_in_flight <= 1:
            return None
        return max(1, ex.num_device_blocks * ex.block_size // ex.max_in_flight)

    def _make_kv_manager(self) -> KVManager:
        """Two tiers: the executor's device blocks and a host tier of --swap-space GiB."""
        cfg, ex = self.config, self.executor
        policy = KVPolicy(cfg.kv_policy)
        num_host, transfers = 0, None
        if policy is not KVPolicy.RECOMPUTE:
            num_host = cfg.num_host_blocks_override
            if num_host is None:
                num_host = int(cfg.swap_space * (1 << 30)) // ex.kv_block_bytes
            transfers = ex.attach_host_tier(num_host)
        limit = None
        if cfg.kv_overcommit is not None:
            limit = min(int(cfg.kv_overcommit * ex.num_device_blocks), ex.num_device_blocks + num_host)
        elif num_host:
            limit = admission_limit(ex.num_device_blocks, num_host)
        return KVManager(ex.num_device_blocks, ex.block_size, num_host, policy, cfg.reserved_blocks, transfers,
                         now=self.clock.now, max_started_blocks=limit)

    def _load_cost_model(self) -> ProfiledCostModel:
        """--profile analytic | PATH, else a matching file in the profile folder, else a short
        profile measured now (engine/profiles.py)."""
        cost, self.profile_source = load_cost_model(self.config, self.model_config, self.executor)
        log.info("job profile: %s", self.profile_source)
        return cost

    # -- requests ------------------------------------------------------------------------------
    def prepare_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
    ) -> RequestState:
        """Validate and tokenize; raises ValidationError and changes nothing. `priority` is vLLM's request
        class (lower first), given to every job of the request; policies that know classes honour it.
        `cache_salt` (vLLM's; a non-empty string) starts the hash chain of the request's KV blocks: with prefix
        caching, only requests with the same salt (or none) share cached blocks."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValidationError("params must be a SamplingParams")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValidationError(f"priority must be an integer, got {priority!r}", param="priority")
        check_cache_salt(cache_salt)
        if request_id in self.requests:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_text, prompt_ids = self._tokenize(prompt, params.truncate_prompt_tokens)
        self._check_lengths(len(prompt_ids), params)
        bad_bias = [t for t in params.logit_bias or () if t >= self.model_config.vocab_size]
        if bad_bias:
            raise ValidationError(f"logit_bias names token id {bad_bias[0]}; ids must be in "
                                  f"[0, {self.model_config.vocab_size})", param="logit_bias")
        now = self.clock.now() if arrival_time is None else arrival_time
        req = RequestState(request_id, prompt_text, prompt_ids, params, RequestMetrics(arrival_time=now),
                           cache_salt=cache_salt)
        for k in range(params.n):
            job = Job(f"{request_id}#{k}", len(prompt_ids), params.max_tokens, now, priority=priority)
            seed = params.sequence_seed(k)
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
            logprobs = [] if params.logprobs is not None else None
            req.seqs.append(SequenceState(req, k, job, detok, gen, logprobs=logprobs))
        return req

    def admit(self, req: RequestState) -> None:
        if req.request_id in self.requests:
            raise ValidationError(f"request id {req.request_id!r} is already in use", param="request_id")
        self.requests[req.request_id] = req
        kv = self.kv
        for seq in req.seqs:
            self._seq_of_job[seq.job.job_id] = seq
            if kv.prefix_caching:  # skip-join enters it by the work it really needs (the uncached rest)
                seq.job.num_cached_prompt_tokens = kv.expected_hit(seq.job)
            self.scheduler.add(seq.job, req.metrics.arrival_time)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> RequestState:
        req = self.prepare_request(request_id, prompt, params, arrival_time, priority, cache_salt)
        self.admit(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now (finish_reason "abort"), freeing its KV; None if unknown."""
        return self._end_request(request_id, "abort")

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        return self._end_request(request_id, "error", message)

    def _end_request(self, request_id: str, reason: str, message: str | None = None) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish(reason, error=message)
                self._release(seq)
        return self._finish_request(req)

    def _tokenize(self, prompt: Prompt, truncate: int | None = None) -> tuple[str | None, list[int]]:
        """(text, ids); `truncate` N keeps the last N ids (a text prompt keeps its BOS: BOS + the last N-1, as
        vLLM's left-truncating tokenizer does). The text stays the prompt as given, as in vLLM."""
        if truncate is not None and truncate > self.max_model_len:
            raise ValidationError(f"truncate_prompt_tokens ({truncate}) is greater than this model's context "
                                  f"(max_model_len {self.max_model_len}); pick a smaller value",
                                  param="truncate_prompt_tokens")
        if isinstance(prompt, str):
            if not prompt:
                raise ValidationError("prompt must not be empty", param="prompt")
            return prompt, self.tokenizer.encode(prompt, truncate_to=truncate)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValidationError(
                    f"prompt token id {bad[0]} is out of range; ids must be in [0, {vocab})", param="prompt"
                )
            return None, list(prompt[-truncate:] if truncate is not None else prompt)
        if isinstance(prompt, list) and not prompt:
            raise ValidationError("prompt must not be empty", param="prompt")
        raise ValidationError("prompt must be a string or a list of token ids", param="prompt")

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        ctx = self.max_model_len
        if prompt_len > ctx:
            raise ValidationError(
                f"prompt has {prompt_len} tokens; this model's context is {ctx} tokens", param="prompt",
                code="context_length_exceeded",
            )
        if prompt_len + params.max_tokens > ctx:
            raise ValidationError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                f"{prompt_len + params.max_tokens} exceeds this model's context of {ctx} tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        need = blocks_needed(prompt_len + params.max_tokens, self.kv.block_size)
        if need > self.kv.device.num_blocks:
            raise ValidationError(
                f"the request needs {need} KV blocks ({prompt_len} + {params.max_tokens} tokens) but the device "
                f"cache has only {self.kv.device.num_blocks}; shorten it or raise --num-gpu-blocks-override",
                param="max_tokens",
            )

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent)."""
        self.executor.shutdown()

    def close(self) -> None:
        """Stop the executor for good and release its device memory now (LLM.close; idempotent)."""
        self.executor.close()

    # -- telemetry --------------------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        """Counters read from the policy; changes nothing."""
        sched = self.scheduler
        queue_lengths = getattr(sched, "queue_lengths", None)
        return SchedulerStats(
            policy=sched.name.value,
            num_jobs=len(sched.jobs),
            queue_lengths=list(queue_lengths()) if queue_lengths is not None else [],
            quanta=list(getattr(sched, "quanta", [])),
            num_promotions=getattr(sched, "num_promotions", 0),
            num_demotions=getattr(sched, "num_demotions", 0),
            num_policy_preemptions=getattr(sched, "num_policy_preemptions", 0),
            jobs_by_priority=sched.jobs_by_priority(),
            started_by_priority=dict(sorted(sched.started_by_priority.items())),
        )

    # -- the step ---------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Requests not finished, or steps still in flight (async scheduling runs one more step of a request
        that ended by EOS; its KV is freed when that step completes)."""
        return bool(self.requests) or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Launch steps while the executor has room (one, or up to pp with pipeline parallelism), then wait for
        the oldest and finish it."""
        self.launch_steps()
        return self.complete_step() if self.in_flight else []

    def launch_steps(self) -> None:
        """Schedule and submit steps while fewer than executor.max_in_flight are running (pipeline parallelism: a
        job in a step that has not completed is not schedulable, job.in_flight, so the next step takes other
        pending jobs), or, with async scheduling, while fewer than two are: the next step is decided from the
        launched one's known effects (_advance_launched) and queued behind it."""
        while len(self.in_flight) < self._depth:
            plan = self.schedule_step()
            if plan is None:
                return
            try:
                future = self.executor.submit(plan.batch)
            except ExecutorDeadError:
                self._end_in_flight(plan)
                raise
            self.in_flight.append((plan, future))
            if self.async_scheduling:
                self._advance_launched(plan)

    def _advance_launched(self, plan: StepPlan) -> None:
        """Async scheduling: what a launched step does to its jobs that needs none of its tokens, done at launch
        so that the next step can be decided while this one computes. The KV positions it computes; one more
        token for each sequence it samples (seq.num_pending until commit_step appends the token; the next step
        computes it from a placeholder the executor fills); the jobs that end at this step by length leave the
        scheduler now (their KV is freed when the step completes); the step's profiled cost is charged to the
        others (each its share), at its launch time (the synchronous engine charges at its end)."""
        charged = []
        max_len = self.max_model_len
        for seq, work in zip(plan.seqs, plan.batch.seqs):
            job = seq.job
            job.num_scheduled = 0
            job.num_computed = work.start_pos + len(work.token_ids)
            if work.sample:
                job.num_generated += 1
                seq.num_pending += 1
                if job.num_generated >= seq.request.params.max_tokens or job.prompt_len + job.num_generated >= max_len:
                    self.scheduler.remove(job)  # (its last token: it ends at this step whatever the token)
                    continue
            charged.append(job)
        self.scheduler.on_step_done(charged, plan.start_time, plan.cost, plan.charges)

    def complete_step(self) -> list[RequestOutput]:
        """Wait for the oldest step in flight and finish it. ExecutorDeadError (a worker died) propagates: no
        step can run again; the caller ends every request.

        With overlaps_output, finishing is split around the next step's launch: commit_step (tokens appended,
        stop tokens, EOS and lengths checked, finished jobs released, the scheduler told), then launch_steps
        (step k+1 scheduled and submitted: it computes from here on), then publish_step (text decoded for
        sequences without stop strings, output snapshots), which so overlaps step k+1's compute. Step k+1 is
        decided from the same state as in synchronous mode: a job that finished at step k is not in it."""
        plan, future = self.in_flight.popleft()
        try:
            result = future.result()
        except ExecutorDeadError:
            self._end_in_flight(plan)
            raise
        except Exception as e:  # a failed forward pass fails its batch; the engine goes on
            log.exception("forward step failed; failing the %d requests of its batch", len(plan.seqs))
            self._end_in_flight(plan)
            return self.fail_step(plan, f"internal error in the forward pass: {type(e).__name__}")
        self._end_in_flight(plan)
        if not self.overlaps_output:
            return self.finish_step(plan, result)
        committed = self.commit_step(plan, result, defer_text=True)
        try:
            self.launch_steps()
        finally:  # (an executor that died at the launch: the text is complete for the errors that follow)
            outputs = self.publish_step(committed)
        return outputs

    def _end_in_flight(self, plan: StepPlan) -> None:
        if not self.async_scheduling:
            for seq in plan.seqs:
                seq.job.in_flight = False
            return
        for seq in plan.seqs:
            seq.job.kv_busy -= 1
        if self._release_later:
            self._free_released()

    def schedule_step(self) -> StepPlan | None:
        now = self.clock.now()
        self.kv.poll()  # finished copies: free their source blocks, mark uploaded jobs ready
        # The paper's reactive baseline (--kv-policy reactive-blocking): no iteration runs while a swap is in
        # flight. A decision that starts one is held, and runs as it was decided once the copies have landed (as
        # with synchronous copies: the batch waited for them); its jobs keep the room they got meanwhile, and a job
        # it swapped in joins a later decision. (Forming the batch anew instead let the next decision evict the
        # held one's jobs for the jobs just swapped in, and the decision after that evict those again: with prefix
        # caching and a full host, no step ran for thousands of ticks. tests/test_simulation.py)
        blocking = self.kv.policy is KVPolicy.REACTIVE_BLOCKING
        decision = None
        if blocking:
            if self.kv.pending_transfers():
                return None
            decision = self._take_held_decision()
        if decision is None:
            decision = self.scheduler.schedule(now, self.kv)
            self.kv.plan(decision.batch, self.scheduler.estimated_wait, now)  # proactive offload/upload
            if blocking and self.kv.pending_transfers():
                self._held = decision
                return None
        if not decision.batch:
            return None
        seqs = [self._seq_of_job[j.job_id] for j in decision.batch]
        cost = self.cost_model.iteration_cost(decision.batch)
        charges = dict(zip(decision.batch, step_charges(decision.batch, cost)))
        batch = ModelBatch([self._work(s) for s in seqs], self.eos_token_ids)
        kv, caching = self.kv, self.kv.prefix_caching
        for s in seqs:
            metrics = s.request.metrics
            if metrics.first_scheduled_time is None:  # the request's first step: its cached prefix is known now
                metrics.first_scheduled_time = now
                if caching:
                    s.request.num_cached_tokens = kv.cached_tokens(s.job.job_id)
            metrics.swap_wait_s += kv.note_scheduled(s.job, now)  # the wait on a copy after the pick (memory/)
            if self.async_scheduling:
                s.job.kv_busy += 1
            else:
                s.job.in_flight = True
        return StepPlan(decision, batch, seqs, now, cost, charges)

    def _take_held_decision(self) -> ScheduleDecision | None:
        """The decision held while its copies ran (reactive-blocking), less the jobs that ended meanwhile (an
        abort frees their KV); None if there is none or nothing of it is left."""
        decision, self._held = self._held, None
        if decision is None:
            return None
        decision.batch = [job for job in decision.batch if job.job_id in self._seq_of_job]
        return decision if decision.batch else None

    def _work(self, seq: SequenceState) -> SequenceWork:
        # Once per job in the batch, every step: attributes read once, SequenceWork's fields by position.
        job, req = seq.job, seq.request
        prompt, params, generated = req.prompt_ids, req.params, job.num_generated
        pl = len(prompt)
        a, b = job.num_computed, job.prompt_len + generated  # compute positions a .. b-1 (b: job.context_len)
        if 0 < job.num_scheduled < b - a:  # a chunk of a prefill (or of a recompute): no token sampled after it
            b = a + job.num_scheduled
        pending = seq.num_pending  # async scheduling: its last token is sampled by the step in flight
        if pending:
            if b - a != 1:
                raise RuntimeError(f"job {job.job_id}: a token in flight but {b - a} positions to compute")
            tokens = [PENDING_TOKEN]  # the executor puts the step before's token in (SequenceWork.fill_last)
        else:
            tokens = seq.output_ids[a - pl : b - pl] if a >= pl else prompt[a:b] + seq.output_ids[: max(0, b - pl)]
        want_plp = params.prompt_logprobs is not None and generated == 0 and a < pl
        history = params.uses_history
        return SequenceWork(
            job.job_id,  # job_id
            tokens,  # token_ids
            a,  # start_pos
            self.kv.block_table(job.job_id),  # block_table
            params,
            seq.generator,
            generated,  # num_generated
            want_plp and req.prompt_logprobs is None,  # want_prompt_logprobs
            prompt if want_plp or history else [],  # prompt_token_ids
            list(seq.output_ids) if history else [],  # output_token_ids
            None if params.seed is None else params.sequence_seed(seq.index),  # seed
            b == job.context_len,  # sample
            pl,  # prompt_len
            bool(pending),  # fill_last
        )

    def finish_step(self, plan: StepPlan, result: BatchResult) -> list[RequestOutput]:
        """A step's results into its requests; the outputs of the requests that advanced."""
        return self.publish_step(self.commit_step(plan, result))

    def commit_step(self, plan: StepPlan, result: BatchResult, defer_text: bool = False) -> CommittedStep:
        """Everything of a step's results the next decision depends on: tokens appended, stop tokens, EOS,
        lengths and stop strings checked, finished jobs released, the step charged to the scheduler. defer_text:
        the text of sequences without stop strings is decoded later, by publish_step."""
        end = self.clock.now()
        untexted: list[tuple[SequenceState, int, tuple[str, int | None] | None]] | None = [] if defer_text else None
        touched: dict[str, RequestState] = {}
        advanced: dict[str, RequestState] = {}  # requests that got a token (a chunk alone gives the client nothing)
        ahead = self.async_scheduling
        # With async scheduling the step was launched while the one before it computed: it ran from that one's end
        begin = max(plan.start_time, self._last_step_end) if ahead else plan.start_time
        for seq, work, res in zip(plan.seqs, plan.batch.seqs, result.results):
            req = seq.request
            if seq.finish_reason is not None:  # aborted while the step ran (seq.finished)
                continue
            if req.request_id not in touched:
                req.metrics.executing_s += end - begin
                touched[req.request_id] = req
            if res.prompt_logprobs is not None and req.prompt_logprobs is None:
                self._add_prompt_logprobs(seq, res.prompt_logprobs, work.start_pos)
            job = seq.job
            if ahead:  # positions, counts and charge advanced at launch (_advance_launched)
                if work.sample:
                    self._append_token(seq, res, end, untexted, counted=True)
                    advanced[req.request_id] = req
                continue
            if job.num_scheduled and job.num_computed + job.num_scheduled < job.prompt_len + job.num_generated:
                job.num_computed += job.num_scheduled  # a chunk of a prefill: its KV is cached, nothing sampled
            else:
                self._append_token(seq, res, end, untexted)
                advanced[req.request_id] = req
            job.num_scheduled = 0
        # Finished and aborted jobs have left the scheduler already: charge the rest.
        if not ahead:
            self.scheduler.on_step_done([s.job for s in plan.seqs if s.finish_reason is None], end, plan.cost,
                                        plan.charges)
        self.num_steps += 1
        self.last_batch_size = len(plan.seqs)
        self._last_step_end = end
        return CommittedStep(end, advanced, untexted or [], defer_text)

    def publish_step(self, committed: CommittedStep) -> list[RequestOutput]:
        """The text commit_step left to decode, then the output snapshots of the requests that advanced (a
        finished request's last, which removes it from the engine)."""
        for seq, token, ending in committed.untexted:
            self._decode_text(seq, token, ending)
        outputs = []
        for req in committed.advanced.values():
            if req.finished:
                outputs.append(self._finish_request(req, committed.end if committed.deferred else None))
            elif self.emit_running_outputs:
                outputs.append(req.to_output())
        return outputs

    def fail_step(self, plan: StepPlan, message: str) -> list[RequestOutput]:
        ids = dict.fromkeys(s.request.request_id for s in plan.seqs)
        return [out for rid in ids if (out := self.fail(rid, message)) is not None]

    def _append_token(self, seq: SequenceState, res, now: float,
                      untexted: list[tuple[SequenceState, int, tuple[str, int | None] | None]] | None = None,
                      counted: bool = False) -> None:
        """counted: the job's positions and token count were advanced when the step was launched (async
        scheduling): the token only joins the sequence."""
        job, req, params = seq.job, seq.request, seq.request.params
        token = res.token_id
        if counted:
            seq.num_pending -= 1
            seq.output_ids.append(token)
            generated = len(seq.output_ids)
            context = job.prompt_len + generated
        else:
            context = job.prompt_len + job.num_generated  # (job.context_len, inlined: once per job every step)
            job.num_computed = context
            seq.output_ids.append(token)
            generated = job.num_generated = job.num_generated + 1
            context += 1
        if seq.logprobs is not None and res.logprobs is not None:
            seq.logprobs.append(res.logprobs)
        metrics = req.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        elif now > metrics.last_token_time:  # (a request's other sequences in the same step: one gap)
            metrics.itl_s.append(now - metrics.last_token_time)
        metrics.last_token_time = now
        ending: tuple[str, int | None] | None = None
        if token in params.stop_token_ids:
            ending = ("stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            ending = ("stop", None)
        elif generated >= params.max_tokens or context >= self.max_model_len:
            ending = ("length", None)
        old_len = len(seq.text)
        if params.detokenize:
            if untexted is not None and not params.stop_strings:  # no finish depends on this text: decoded later
                untexted.append((seq, token, ending))
            else:
                self._decode_text(seq, token, ending)
        # As vLLM: no stop string counts before min_tokens tokens exist.
        stopped = (bool(params.stop_strings) and generated >= params.min_tokens
                   and seq.check_stop_strings(old_len))
        if not stopped and ending is not None:
            seq.finish(*ending)
        if seq.finish_reason is not None:  # (seq.finished)
            self._release(seq)

    @staticmethod
    def _decode_text(seq: SequenceState, token: int, ending: tuple[str, int | None] | None) -> None:
        params = seq.request.params
        # As vLLM: the text of a stop token (EOS or stop_token_ids) is left out unless include_stop_str_in_output.
        if ending is None or ending[0] != "stop" or params.include_stop_str_in_output:
            seq.text += seq.detokenizer.step([token])
        if ending is not None:
            seq.text += seq.detokenizer.flush()

    @staticmethod
    def _add_prompt_logprobs(seq: SequenceState, chunk: list, start: int) -> None:
        """Prompt logprobs of a step that computed prompt positions from `start` on (the whole prompt, or a
        chunk of it): collected per sequence until they cover the prompt, then the request's. A chunk at 0
        (a first chunk, or a prefill restarted after a drop) starts the collection anew."""
        if start == 0:
            seq.prompt_logprobs_so_far = []
        elif seq.prompt_logprobs_so_far is None or len(seq.prompt_logprobs_so_far) != start + 1:
            return  # (cannot happen: chunks come in order)
        seq.prompt_logprobs_so_far += chunk
        if len(seq.prompt_logprobs_so_far) >= len(seq.request.prompt_ids):
            seq.request.prompt_logprobs = seq.prompt_logprobs_so_far
            seq.prompt_logprobs_so_far = None

    def _release(self, seq: SequenceState) -> None:
        if seq.job.kv_busy:  # async scheduling: a launched step still writes its KV; freed once none does
            self.scheduler.remove(seq.job)
            self._release_later.append(seq)
            return
        self.kv.free(seq.job.job_id)
        self.executor.release([seq.job.job_id])
        self.scheduler.remove(seq.job)
        self._seq_of_job.pop(seq.job.job_id, None)

    def _free_released(self) -> None:
        """Free the KV of the ended sequences no launched step writes any more. Positions computed from a token
        the engine never took in (the step before failed, or the request was aborted first) are not named for
        the prefix cache."""
        waiting = []
        for seq in self._release_later:
            job = seq.job
            if job.kv_busy:
                waiting.append(seq)
                continue
            job.num_computed = min(job.num_computed, job.prompt_len + len(seq.output_ids))
            self._release(seq)
        self._release_later = waiting

    def _finish_request(self, req: RequestState, now: float | None = None) -> RequestOutput:
        m = req.metrics
        m.finished_time = self.clock.now() if now is None else now
        m.preemptions = sum(s.job.num_preemptions for s in req.seqs)
        m.queued_s = max(0.0, (m.finished_time - m.arrival_time) - m.executing_s - m.swap_wait_s)
        self.requests.pop(req.request_id, None)
        return req.to_output()
