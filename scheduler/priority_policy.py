"""The shared machinery of the preemptive priority policies (skip-join MLFQ,
naive MLFQ, fixed priority, SRPT): one batch-formation loop, one eviction
rule, one preempted list. A subclass says only how jobs are ordered.

Rule (FastServe section 4.1, Algorithm 1: "the batch is the highest-priority
ready jobs"), applied every iteration, so any job may be preempted after any
output token:
- walk the jobs from the highest priority down and take each *ready* job
  while the batch has a slot (max_num_seqs) and the batched-token budget
  allows it (a job too large for the budget runs alone when it comes first);
- each job must get device KV room (`kv.can_fit` then `kv.allocate`); when it
  does not fit, jobs of *lower* priority that are not in the batch and hold
  device KV are evicted, largest estimated wait first, until it fits or the
  room is being freed by offloads in flight (then the job waits for them,
  `kv.wait_for_room`); a job that still does not fit is skipped (and a job
  evicted this tick does not run this tick);
- once a job has been refused room this tick (none could be made, or it
  waits for room that copies in flight are freeing), a lower-priority job
  whose KV is parked on the host (`kv.parked()`) is not brought back on
  demand, under any KV policy: its upload would take the room the more
  urgent job waits for (the proactive planner still brings parked jobs back
  ahead of need, within its watermark). Without this, reactive swapping
  livelocks past capacity: each finished copy's blocks go to the next small
  host job, whose room evicts another. A resident job that fits still runs
  (no copy);
- a job with no KV (new, or dropped) starts only if `kv.may_start` admits it
  (overload admission: the started jobs' KV must fit within what memory/
  allows), asked for its whole context even when only a chunk of it runs now
  (chunked prefill): the chunks that follow hold the rest within a few
  iterations, and a prompt admitted by its first chunk's room overfilled
  both tiers past capacity (drops: docs/benchmarks.md, "Chunked prefill");
- fresh jobs (never run yet) are looked at only while it can matter: once
  admission refuses one, no other fresh job starts this tick; once nothing is
  left to evict, none starts either if the smallest fresh prompt does not
  fit the room left (`kv.room_for`: it only shrinks for the rest of the
  tick), nor, for fixed priority, if every later fresh job of the class needs
  as much as a refused one; after the token
  budget has refused max_num_seqs fresh jobs, no further fresh job is tried
  (a smaller one among those may still slip in). Past capacity thousands of
  jobs wait fresh, so this is what keeps a tick's walk proportional to the
  started jobs and the batch, not to the queue;
- once nothing is left to evict (every ready resident job below the refused
  one is evicted), a later job is refused without asking when its whole KV
  does not fit the room left (free, or freeing and unpromised: `kv.room_for`),
  and the walk ends when not one block is left: past capacity thousands of
  started jobs wait on the host, and each refusal went through the eviction
  machinery;
- a job whose KV waits on the host for free room it may not evict for is
  passed over without asking once memory/ says none of those fit
  (`kv.parked_unfit()`, asked when one is refused): past capacity most
  started jobs are parked there, and each then costs one membership test;
- a job that is not ready (its KV moving), or that allocate() left not ready
  (its upload just started), waits: it keeps its place and skips this tick;
- jobs that ran last iteration but not in this one are the preempted ones.

Request classes (Job.priority, lower first) come before everything else in
each subclass's order.

The walk of one tick is _Walk below: each job's checks, its room, and taking
it, as named steps over the state the walk has learned so far; its eviction
candidates are scheduler/victims.py's.

What it is not: a ranking of its own. Subclasses give the walk (`_walk`: every
job in order, fresh ones only while the gate is open), `_rank` (a job's sort
key in that order), `_started_jobs`, `_on_started` and `_wait_estimate`;
KeyedPriorityPolicy below is the variant for a per-job sort key (fixed
priority, SRPT).
"""

from __future__ import annotations

import bisect
import itertools
from abc import abstractmethod
from collections import Counter, deque
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from itertools import filterfalse
from operator import itemgetter
from typing import ClassVar

from scheduler.job import Job
from scheduler.policy import CostModel, KVAdmission, ScheduleDecision, SchedulerConfig, SchedulingPolicy, charged
from scheduler.victims import Victims

START_WAIT_WEIGHT = 0.05  # of each started job in the running average W of waits to first run


NEVER = 1 << 62  # Gate.no_kv_from when no job is refused that way
AGE_WINDOW = 256  # completions whose rate estimates the mean time in the system (age promotion)
AGE_MIN_COMPLETIONS = 32  # no age promotion before this many completions


class Gate:
    """Whether the walk still yields fresh jobs (closed once one is refused), and the started jobs it may leave
    out, each of which schedule() would pass over without a side effect: those in `skip` (() = none), and those
    with nothing computed (no KV: dropped) whose context is at least `no_kv_from` tokens (NEVER = none)."""

    __slots__ = ("fresh", "skip", "no_kv_from")

    def __init__(self) -> None:
        self.fresh = True
        self.skip: Container[Job] = ()
        self.no_kv_from = NEVER


class PriorityPolicy(SchedulingPolicy):
    # A fresh job waits while a started job ahead of it in the order waits for KV (its KV on the host, moving,
    # dropped, or no room for it): the started job's room comes first, as vLLM starts no prompt while a
    # preempted sequence waits. Off: a fresh job that fits starts (it may take the room a started one needs).
    fresh_waits_for_started: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._running: dict[Job, None] = {}  # the batch of the last schedule(), in order
        self.num_policy_preemptions = 0  # jobs that ran and then did not, over the policy's life
        self._classes: Counter[int] = Counter()  # request class -> unfinished jobs
        self.started_by_priority: Counter[int] = Counter()  # request class -> jobs started (first run)
        self.start_wait_ema = 0.0  # W: recent wait from arrival to first run (engine clock), an EMA
        self._completions: deque[float] = deque(maxlen=AGE_WINDOW)  # engine times of the last completions (age)
        self._fresh_lens: list[int] = []  # prompt lengths of the jobs that never ran, sorted (the smallest first)
        # Started jobs whose KV an eviction of schedule() dropped (num_computed 0), kept by their context then (it
        # cannot grow before they run again), until they are given room (allocate) or leave: only allocate or the
        # step after it gives a started job KV again. The walk leaves out in C those the gate's no_kv_from covers
        # (past capacity hundreds of dropped jobs wait, each tested in the interpreter every tick), found as a
        # slice of the list sorted by (context, sequence). Every job kept has no KV; a dropped job not kept
        # (none, as far as schedule() can see) is tested as before.
        self._dropped: dict[Job, tuple[int, int]] = {}  # job -> (context, sequence): its key in _dropped_order
        self._dropped_order: list[tuple[int, int, Job]] = []  # sorted
        self._drop_seq = itertools.count()

    # -- what a subclass defines ---------------------------------------------------------
    @abstractmethod
    def _walk(self, gate: Gate) -> Iterator[Job]:
        """Every job the policy holds, highest priority first; fresh jobs only while gate.fresh. A started job
        that gate says may be left out (as it says when the walk comes to the job) may be: only an economy."""

    @abstractmethod
    def _rank(self, job: Job) -> tuple:
        """The job's sort key in the walk's order (smaller comes first)."""

    @abstractmethod
    def _started_jobs(self) -> Iterable[Job]:
        """Jobs that have run at least once (only they can hold KV), in any order (ranks are unique: the eviction
        order sorts them)."""

    @abstractmethod
    def _on_started(self, jobs: list[Job]) -> None:
        """These fresh jobs are in the batch for the first time."""

    @abstractmethod
    def _wait_estimate(self, job: Job, now: float) -> float:
        """Estimated time until the job runs, as if it were not running now."""

    def _before_schedule(self, now: float) -> None:
        """Reorder before the batch is formed (promotion, re-sorting)."""

    def _later_fresh_need_at_least(self, job: Job, n: int) -> bool:
        """Whether every fresh job after this fresh one in the walk needs at least n new tokens (then, once
        nothing is left to evict, none of them can start this tick and the walk may stop yielding them)."""
        return False

    def _on_preempted(self, jobs: list[Job]) -> None:
        """These jobs ran last iteration and not in this one."""

    # -- classes -----------------------------------------------------------------------------
    def _count_in(self, job: Job) -> None:
        self._classes[job.priority] += 1
        if job.first_scheduled_time is None:
            bisect.insort(self._fresh_lens, job.prompt_len)

    def _not_fresh(self, job: Job) -> None:
        lens = self._fresh_lens
        del lens[bisect.bisect_left(lens, job.prompt_len)]

    def _count_out(self, job: Job) -> None:
        if job.first_scheduled_time is None:
            self._not_fresh(job)
        elif self._dropped:
            self._forget_dropped(job)
        c = self._classes
        c[job.priority] -= 1
        if not c[job.priority]:
            del c[job.priority]

    def _forget_dropped(self, job: Job) -> None:
        key = self._dropped.pop(job, None)
        if key is not None:
            order = self._dropped_order
            del order[bisect.bisect_left(order, key)]  # ((context, sequence) is a prefix of its entry: unique)

    def _dropped_in(self, lo: int, hi: int = NEVER) -> Iterator[Job]:
        """The kept dropped jobs whose context is at least lo and below hi (NEVER: no bound), by context."""
        order = self._dropped_order
        end = len(order) if hi == NEVER else bisect.bisect_left(order, (hi,))
        return map(itemgetter(2), order[bisect.bisect_left(order, (lo,)):end])

    def jobs_by_priority(self) -> dict[int, int]:
        """Unfinished jobs per request class (Job.priority), most urgent first."""
        return dict(sorted(self._classes.items()))

    # -- the SchedulingPolicy verbs --------------------------------------------------------
    def _priority_order(self) -> Iterator[Job]:
        return self._walk(Gate())

    @property
    def jobs(self) -> Sequence[Job]:
        return list(self._priority_order())

    def has_work(self) -> bool:
        return bool(self._classes)

    def age_limit(self, now: float) -> float | None:
        """Age promotion's threshold: starvation_age x the mean time in the system (jobs held / completion rate
        over the last AGE_WINDOW completions, which a subclass records); None while there are too few completions
        to say."""
        done = self._completions
        if len(done) < AGE_MIN_COMPLETIONS or now <= done[0]:
            return None
        rate = len(done) / (now - done[0])
        return self.config.starvation_age * sum(self._classes.values()) / rate

    def estimated_wait(self, job: Job, now: float) -> float:
        return 0.0 if job in self._running else self._wait_estimate(job, now)

    def schedule(self, now: float, kv: KVAdmission) -> ScheduleDecision:
        self._before_schedule(now)
        walk = _Walk(self, now, kv)
        walk.run()
        chosen = walk.chosen
        decision = ScheduleDecision(batch=list(chosen))
        left = list(filterfalse(chosen.__contains__, self._running))  # ran last iteration, not in this one
        for job in left:
            if job.in_flight:  # still running in a later pipeline stage: not preempted
                chosen[job] = None
                continue
            job.num_preemptions += 1
            decision.preempted.append(job)
        self._keep_dropped(walk.victims.evicted)
        if decision.preempted:
            self.num_policy_preemptions += len(decision.preempted)
            self._on_preempted(decision.preempted)
        self._running = chosen  # the batch, then the jobs still in flight (the tick's own dict)
        if walk.started:
            self._note_started(walk.started, now)
        return decision

    def _keep_dropped(self, evicted: Iterable[Job]) -> None:
        """Keep the jobs this tick's evictions dropped (no KV left) by their context (the walk's no_kv_from)."""
        for job in evicted:
            if not job.num_computed:  # dropped
                self._forget_dropped(job)
                key = self._dropped[job] = (job.prompt_len + job.num_generated, next(self._drop_seq))
                bisect.insort(self._dropped_order, (*key, job))

    def _note_started(self, started: list[Job], now: float) -> None:
        """These fresh jobs run for the first time at `now`."""
        for job in started:
            self._not_fresh(job)
        self._on_started(started)
        ema = self.start_wait_ema
        for job in started:
            self.started_by_priority[job.priority] += 1
            ema += START_WAIT_WEIGHT * ((now - job.arrival_time) - ema)
        self.start_wait_ema = ema
        for job in started:
            job.first_scheduled_time = now

    def on_step_done(self, batch: Sequence[Job], now: float, cost: float,
                     charges: Mapping[Job, float] | None = None) -> None:
        for job, charge in charged(batch, cost, charges):
            job.service_in_queue += charge
            job.service_total += charge
            job.last_scheduled_time = now


class _Walk:
    """One schedule() tick's walk over the jobs in priority order, forming the batch (the module docstring's rule).

    Each job the walk yields goes through three steps (run): the checks that pass it over without asking memory/
    for room, the room (can_fit, else _make_room: evict for it, or wait for the room being freed), and taking it
    (allocate, and into the batch). What the walk has learned so far, so that later jobs cost less to refuse:
    - the batch (chosen, started: its fresh jobs; run keeps its tokens and size);
    - refused_from: admission (may_start) refused a job with no KV needing this many tokens, so it refuses every
      such job that needs as many or more until the next evict, or an allocate that may loosen it (not in place):
      past capacity hundreds of started jobs wait with their KV dropped, and each was asked every tick;
    - unfit (and ask): the jobs memory/ says neither fit nor may evict (KV parked on the host), asked when one is
      refused, forgotten at an eviction (it may free room); an allocate keeps it true (memory/'s contract). An
      empty answer stays empty until the free room shrinks (an allocate): `ask` says when to ask again;
    - refused: a job was refused room (none could be made, or it waits for room being freed): from then on a
      job parked on the host is not brought back on demand;
    - exhausted: every eviction candidate is spent, so a later job runs only if its KV fits what is left;
    - gate: whether the walk still yields fresh jobs, and which started jobs it may leave out (Gate).
    """

    __slots__ = ("policy", "now", "kv", "chosen", "started", "victims", "on_host", "gate", "hold", "refused_from",
                 "unfit", "ask", "refused", "exhausted", "ended")

    def __init__(self, policy: PriorityPolicy, now: float, kv: KVAdmission) -> None:
        self.policy, self.now, self.kv = policy, now, kv
        self.chosen: dict[Job, None] = {}  # the batch, in order (so `preempted` comes out in a deterministic order)
        self.started: list[Job] = []  # fresh jobs in the batch
        self.victims = Victims(policy, now, self.chosen)
        self.on_host = kv.parked()
        self.gate = Gate()
        self.hold = policy.fresh_waits_for_started
        self.refused_from = NEVER
        self.unfit: Container[Job] = ()
        self.ask = True
        self.refused = self.exhausted = False
        self.ended = False  # no later job can get room this tick: the walk ends

    def run(self) -> None:
        """Walk the jobs, highest priority first, in three steps a job (inline: they are asked of every job
        walked, the rare outcomes in the methods below): 1. the checks that pass it over without asking memory/
        for room; 2. its room (can_fit, else _make_room); 3. its room given (allocate), into the batch."""
        policy, kv, gate, evicted, on_host = self.policy, self.kv, self.gate, self.victims.evicted, self.on_host
        can_fit, allocate, chosen, started, now = kv.can_fit, kv.allocate, self.chosen, self.started, self.now
        config, hold, dropped = policy.config, self.hold, policy._dropped
        max_seqs, budget, kv_cap = config.max_num_seqs, config.max_num_batched_tokens, config.max_batch_kv_tokens
        tokens = size = kv_tokens = 0  # the batch's tokens and jobs; its KV tokens (pipeline parallelism: kv_cap)
        over_budget = 0  # fresh jobs the token budget refused: past max_num_seqs of them, the gate closes
        unfit, refused, exhausted = self.unfit, self.refused, self.exhausted  # (changed only by _make_room)
        # Chunked prefill: the jobs of the last batch that decode keep a token each of the budget ahead of a chunk.
        chunked, decoders = config.enable_chunked_prefill, set()
        if chunked:
            decoders = {j for j in policy._running if not j.in_flight and j.num_computed
                        and j.prompt_len + j.num_generated - j.num_computed == 1}
        reserve = len(decoders)
        for job in policy._walk(gate):
            # 1. Passed over without asking memory/ for room.
            if job in unfit:  # neither fits nor may evict (KV parked on the host; a started job: no gate)
                if hold:
                    gate.fresh = False
                continue
            # The tokens it computes now: job.num_new_tokens (or a chunk of it) and _fits_token_budget, inlined.
            context = job.prompt_len + job.num_generated
            done = job.num_computed  # (nothing before allocate changes it)
            n = context - done
            if chunked and n > 1:
                n = policy.chunk(n, tokens, size, reserve)  # 0: no room left for a chunk
            if (tokens + n > budget and size) or not n:
                if job.first_scheduled_time is None:  # fresh
                    over_budget += 1
                    gate.fresh = over_budget < max_seqs
                continue
            if job.in_flight or (evicted and job in evicted):  # in flight: running in a later pipeline stage
                continue
            if kv_cap is not None and size and kv_tokens + context > kv_cap:
                continue  # this batch holds its share of the device's KV: the next batch in flight takes it
            if not job.kv_ready:  # job.ready, in_flight being False: its KV is moving
                kv.note_blocked(job)
                self._started_waits(job)
                continue
            if not done and not self._may_start(job, context):  # no KV: admission counts its whole context
                continue
            if refused and job in on_host:  # parked: not brought back ahead of a job that waits for room
                if hold:
                    gate.fresh = False
                continue
            if exhausted and not kv.room_for(done + n):
                self._started_waits(job)
                continue  # nothing left to evict and its whole KV does not fit the room left (make_room's answer)
            # 2. Its room.
            if not can_fit(job, n):
                room = self._make_room(job, n)
                unfit, refused, exhausted = self.unfit, self.refused, self.exhausted
                if not room:
                    if self.ended:
                        break
                    continue
            # 3. Given (unless its KV must come back from the host first), into the batch.
            grant = allocate(job, n)
            if grant is None:  # (no room after all: nothing changed)
                continue
            if not grant.in_place and self.refused_from != NEVER:  # (in place: no refusal can have loosened)
                self.refused_from = gate.no_kv_from = NEVER
            if not done and dropped:
                policy._forget_dropped(job)  # (its KV may come back now: a cached prefix, or the step)
            self.ask = True
            if not job.kv_ready:  # its KV was on the host: the upload started, it runs when it lands
                self._started_waits(job)
                continue
            chosen[job] = None
            job.num_scheduled = n
            job.last_scheduled_time = now  # (read in the tick only of jobs not chosen: the eviction order's ENST)
            if job.first_scheduled_time is None:
                started.append(job)
            elif decoders and job in decoders:
                reserve -= 1
            tokens += n
            if kv_cap is not None:
                kv_tokens += context
            size += 1
            if size >= max_seqs or tokens >= budget:
                break

    def _started_waits(self, job: Job) -> None:
        """A started job waits for KV (on the host, moving, dropped, or no room for it): with
        fresh_waits_for_started, no fresh job starts after it this tick."""
        if self.hold and job.first_scheduled_time is not None:
            self.gate.fresh = False

    def _may_start(self, job: Job, context: int) -> bool:
        """Overload admission for a job with no KV, whatever the chunk it would compute now."""
        if context < self.refused_from and self.kv.may_start(job, context):
            return True
        if context < self.refused_from:
            self.refused_from = self.gate.no_kv_from = context
        if job.first_scheduled_time is None or self.hold:
            self.gate.fresh = False
        return False

    def _make_room(self, job: Job, n: int) -> bool:
        """The job's n tokens do not fit the device now: whether they do after evicting lower-priority jobs, if it
        may; False when it does not run this tick (no room could be made, or it waits for room copies free)."""
        kv = self.kv
        if not kv.may_evict_for(job):
            if self.ask:
                self.unfit, self.ask = kv.parked_unfit(), False
                if not self.refused:
                    self.gate.skip = self.unfit
            self._started_waits(job)
            return False
        room = self.victims.make_room(job, n, kv)
        # An eviction may have freed room: what memory/ refused is asked again.
        self.unfit, self.ask = (), True
        self.refused_from = self.gate.no_kv_from = NEVER
        if not self.refused:
            self.gate.skip = ()
        if not room:
            self._refused(job, n)
        return room

    def _refused(self, job: Job, n: int) -> None:
        """No room could be made for the job (or it waits for room being freed)."""
        kv, gate, victims = self.kv, self.gate, self.victims
        self.refused = True
        self._started_waits(job)
        # From here on every job parked on the host is passed over (run's step 1); each is started, ready and holds KV,
        # so none of the checks before that one acts on it: the walk may leave it out.
        gate.skip = self.on_host
        self.exhausted = victims.spent  # stays so for the tick: no candidate comes back
        if self.exhausted and not kv.room_for(1):
            # Every ready resident job below this one is evicted and not one block is free or freeing unpromised:
            # no later job in the walk can get room this tick. Past capacity thousands of started jobs wait on
            # the host; this ends the walk here.
            self.ended = True
            return
        # Nothing left to evict and no room coming: the room only shrinks for the rest of the tick, so a new job
        # that needs more than it (or than this one) cannot start in this tick.
        policy = self.policy
        if victims.spent and gate.fresh and (
                (job.first_scheduled_time is None and policy._later_fresh_need_at_least(job, n))
                or (policy._fresh_lens and not kv.room_for(policy._fresh_lens[0]))):
            gate.fresh = False


class KeyedPriorityPolicy(PriorityPolicy):
    """Priority by a per-job key, smaller first, after the request class; ties in arrival order.

    Jobs sit in two lists kept sorted by rank = (class, key, arrival sequence):
    the started ones and the fresh ones (never run), each with a parallel list
    of the ranks it is sorted by, so the walk's merge and every binary search
    compare stored tuples instead of calling back into Python. A static key is
    computed once, when the job is added, and placed by binary search. A dynamic
    key (it changes as jobs run: SRPT) is static too while the job is fresh (it
    has not run), and changes only for the jobs a step ran (on_step_done), so
    before a tick that follows a step only those are re-ranked and the started
    list re-sorted (timsort: near-linear on a near-sorted list); within a tick
    no key changes. The walk merges the two lists. The wait estimate is the
    job's place in the merged order, in batches of max_num_seqs, times one
    decode step; a started job's is cached until the order, its rank or its
    context changes.
    """

    dynamic_key: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._started: list[Job] = []
        self._started_ranks: list[tuple] = []  # parallel to _started (dynamic key: as of the last re-sort)
        self._fresh: list[Job] = []
        self._fresh_ranks: list[tuple] = []  # parallel to _fresh
        self._seq: dict[Job, int] = {}  # job -> arrival sequence (tie-break)
        self._fixed_rank: dict[Job, tuple] = {}  # jobs whose rank cannot change: all (static key), fresh (dynamic)
        # Dynamic key: the started jobs' current ranks, as of the last re-sort less the jobs a step ran since
        # (on_step_done: a dynamic key may change only for the jobs that ran); None before the first tick.
        self._tick_rank: dict[Job, tuple] | None = None
        self._moved: list[Job] = []  # jobs taken out of _tick_rank since the re-sort (their rank may have moved)
        self._sorted = not self.dynamic_key  # _started_ranks are the current ranks (no step since the re-sort)
        self._counter = itertools.count()
        self._positions: dict[Job, int] | None = None  # cache: place in the started list
        self._waits: dict[Job, tuple[int, float]] = {}  # cache: started job -> (context_len, wait estimate)

    @abstractmethod
    def _key(self, job: Job) -> float:
        """Smaller runs first (within a request class)."""

    def _rank(self, job: Job) -> tuple[int, float, int]:
        rank = self._fixed_rank.get(job)
        if rank is None and self._tick_rank is not None:
            rank = self._tick_rank.get(job)
        return rank if rank is not None else (job.priority, self._key(job), self._seq[job])

    def _started_jobs(self) -> Iterable[Job]:
        return self._started

    def _walk(self, gate: Gate) -> Iterator[Job]:
        # schedule() re-ranks a dynamic key first (_before_schedule), so the stored ranks are current.
        return self._merge(gate, self._started_ranks)

    def _priority_order(self) -> Iterator[Job]:
        # Outside a tick a dynamic key may have moved since the last re-sort: merge by the current ranks.
        started_ranks = list(map(self._rank, self._started)) if self.dynamic_key else self._started_ranks
        return self._merge(Gate(), started_ranks)

    def _merge(self, gate: Gate, started_ranks: list[tuple]) -> Iterator[Job]:
        started, fresh, fresh_ranks = self._started, self._fresh, self._fresh_ranks
        ns, nf = len(started), len(fresh)  # (no job joins or leaves the lists during a walk)
        i = j = 0
        while i < ns:
            if j < nf and gate.fresh and fresh_ranks[j] < started_ranks[i]:
                yield fresh[j]
                j += 1
            else:
                yield started[i]
                i += 1
        while j < nf and gate.fresh:
            yield fresh[j]
            j += 1

    def add(self, job: Job, now: float) -> None:
        if job in self._seq:
            raise ValueError(f"job {job.job_id} was already added")
        self._seq[job] = next(self._counter)
        rank = (job.priority, self._key(job), self._seq[job])
        if job.first_scheduled_time is None:
            self._fixed_rank[job] = rank
            i = bisect.bisect_right(self._fresh_ranks, rank)
            self._fresh.insert(i, job)
            self._fresh_ranks.insert(i, rank)
        else:
            if self.dynamic_key:  # the started list is sorted by the ranks of the last re-sort
                i = bisect.bisect_right(self._started, rank, key=self._rank)
                if self._tick_rank is not None:
                    self._tick_rank[job] = rank
            else:
                self._fixed_rank[job] = rank
                i = bisect.bisect_right(self._started_ranks, rank)
            self._started.insert(i, job)
            self._started_ranks.insert(i, rank)
        self._positions = None
        self._count_in(job)

    def _fresh_index(self, job: Job) -> int:
        i = bisect.bisect_left(self._fresh_ranks, self._fixed_rank[job])
        return i if i < len(self._fresh) and self._fresh[i] is job else self._fresh.index(job)

    def _started_index(self, job: Job) -> int:
        rank = self._rank(job) if self._sorted else None
        if rank is None:  # a dynamic key that may have moved since the last re-sort
            return self._started.index(job)
        i = bisect.bisect_left(self._started_ranks, rank)
        return i if i < len(self._started) and self._started[i] is job else self._started.index(job)

    def remove(self, job: Job) -> None:
        if job not in self._seq:
            return
        if job.first_scheduled_time is None:
            i = self._fresh_index(job)
            del self._fresh[i], self._fresh_ranks[i]
        else:
            i = self._started_index(job)
            del self._started[i], self._started_ranks[i]
        del self._seq[job]
        self._fixed_rank.pop(job, None)
        if self._tick_rank is not None:
            self._tick_rank.pop(job, None)
        self._running.pop(job, None)
        self._positions = None
        self._count_out(job)

    def _on_started(self, jobs: list[Job]) -> None:
        for job in jobs:
            i = self._fresh_index(job)
            del self._fresh[i], self._fresh_ranks[i]
            if self.dynamic_key:  # started: its rank moves as it runs (this tick's, until the step)
                rank = self._fixed_rank.pop(job)
                if self._tick_rank is not None:
                    self._tick_rank[job] = rank
            else:
                rank = self._fixed_rank[job]
            i = bisect.bisect_right(self._started_ranks, rank)  # current: re-ranked at the tick's start
            self._started.insert(i, job)
            self._started_ranks.insert(i, rank)
        self._positions = None

    def _before_schedule(self, now: float) -> None:
        if self.dynamic_key:
            if not self._sorted:
                started, tick_rank = self._started, self._tick_rank
                ranks = None
                if tick_rank:  # re-rank only the jobs whose rank may have moved, read the rest in C
                    for job in self._moved:
                        if job in self._seq and job not in tick_rank:
                            tick_rank[job] = self._rank(job)
                    try:
                        ranks = list(map(tick_rank.__getitem__, started))
                    except KeyError:  # (a started job with no rank kept: rank them all)
                        ranks = None
                if ranks is None:  # the first tick, or every rank moved (GittinsPolicy's refresh)
                    ranks = list(map(self._rank, started))
                    self._tick_rank = dict(zip(started, ranks))
                self._moved = []
                # Sort the places by rank (tuples compared directly, not (rank, job) pairs: a level less of tuple
                # comparison in each of the sort's ~n comparisons).
                places = sorted(range(len(ranks)), key=ranks.__getitem__)
                order = list(map(started.__getitem__, places))
                if order != started:  # (most ticks the jobs that ran keep their places)
                    self._started = order
                    self._positions = None
                self._started_ranks = list(map(ranks.__getitem__, places))
                self._sorted = True

    def on_step_done(self, batch: Sequence[Job], now: float, cost: float,
                     charges: Mapping[Job, float] | None = None) -> None:
        super().on_step_done(batch, now, cost, charges)
        waits = self._waits
        for job in batch:  # their contexts grew (and a dynamic key moved): their wait estimates are stale
            waits.pop(job, None)
        if self.dynamic_key and batch:
            self._ranks_moved(batch)
            self._sorted = False

    def _ranks_moved(self, jobs: Sequence[Job]) -> None:
        """These started jobs' ranks may have moved (they ran, or were promoted): the next re-sort re-ranks them."""
        tick_rank = self._tick_rank
        if tick_rank is not None:
            for job in jobs:
                tick_rank.pop(job, None)
            self._moved.extend(jobs)

    def _wait_estimate(self, job: Job, now: float) -> float:
        if self._positions is None:
            self._positions = {j: i for i, j in enumerate(self._started)}
            self._waits = {}
        place = self._positions.get(job)
        if place is not None:  # started: cached until the order, the job's rank or its context changes
            hit = self._waits.get(job)
            if hit is not None and hit[0] == job.context_len:
                return hit[1]
            place += bisect.bisect_left(self._fresh_ranks, self._rank(job))
            wait = self._wait_at(place, job)
            self._waits[job] = (job.context_len, wait)
            return wait
        r = self._rank(job)
        if not self._sorted:  # a dynamic key: the started list's ranks may have moved since its sort
            place = self._fresh_index(job) + bisect.bisect_left(self._started, r, key=self._rank)
        else:
            place = self._fresh_index(job) + bisect.bisect_left(self._started_ranks, r)
        return self._wait_at(place, job)

    def _wait_at(self, place: int, job: Job) -> float:
        """The wait of a job with `place` jobs ahead of it in the merged order."""
        seqs = self.config.max_num_seqs
        step = self.cost.t_dec(min(seqs, len(self._seq)), job.context_len)
        return (place // seqs + 1) * step
