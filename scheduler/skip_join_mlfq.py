"""Skip-join MLFQ: the default policy (FastServe section 4.1, Algorithm 1;
ENST from section 4.2).

Rule, on the engine's clock, with every time a *profiled* cost:
- Queues Q1..Qn (index 0..n-1, 0 the highest) have quanta
  q1 = t_dec(batch 1, a 16-token context) and q_(i+1) = quantum_ratio * q_i,
  with just enough queues that q_n covers the longest service: with the
  "service" ladder (mlfq_ladder; the engine's default) t_init(max_prompt_len)
  plus max_prompt_len decode steps alone (a job's share of a step is largest
  when it runs alone), so a job keeps sinking as it decodes and the queues
  order jobs by the service they have had (least attained service first,
  at a quantum_ratio granularity); with the
  paper's "prefill" ladder t_init(max_prompt_len) (5 queues for OPT-13B, so
  a job that has decoded a while is in the last queue).
- Skip-join: a new job enters the highest queue whose quantum covers its
  first iteration, min{i : q_i >= t_init(prompt_len)} (the last queue if none).
  With prefix caching the first iteration is the work the job really needs:
  a job whose first c prompt tokens were cached when it was added
  (Job.num_cached_prompt_tokens) is priced as the cost model prices a chunk
  of the rest over that prefix, F(n) + chunk_attention(c, n), n = prompt_len - c
  (never above t_init(prompt_len)), so a follow-up turn over a long cached
  history enters as short work; its ENST follows from that queue. If the
  cached blocks are evicted before it starts it computes more, in that queue.
  With chunked prefill (enable_chunked_prefill) the rule still prices the whole
  prompt: the job enters the queue whose quantum covers its whole prefill, each
  chunk is charged to it there like any of its work (so its chunks
  may use up the quantum and demote it before its first token), and a partly
  prefilled job is an ordinary started job of its queue for the batch, eviction
  and ENST (T_execute counts it as any job of its queue; its own ENST is that
  of a job waiting in its queue).
- Each iteration every job of the batch is charged its share of the
  iteration's cost, by the tokens it computes in it (scheduler/policy.py,
  step_charges: not the whole iteration, which burnt a decoding job's
  quantum beside a long prompt); when a job's service in its queue exceeds
  the queue's quantum it is demoted by eta (demotion_step) queues, clamped
  to the last (in the last queue it goes to the tail: round robin, under the
  paper's rules), and its service is reset.
- Starvation prevention: a job not in the batch whose starve time exceeds
  alpha (starvation_threshold; None = off) is promoted to the tail of Q1,
  its service reset. A job already in Q1 stays where it is.
- Overload (starvation_factor f; default 1 in the engine, None = the rule above): a
  job is promoted only once it has waited max(alpha, f x W), W the recent
  wait of jobs at their first run (an exponential average over started
  jobs). Below capacity W is under alpha and this is the paper's rule.
  Past capacity every waiting job is older than alpha: promoting them all
  to Q1 every alpha turns admission into arrival order (FCFS) and the batch
  into round robin over every started job, each rotation a swap out and in
  (the copies cost batch room, so throughput). With f the promotions slow
  as the wait grows: admission stays skip-join's (short prompts first), a
  job that waited f times the going wait goes ahead of the rest, in order.
  Two more rules come with the factor (the overload rules; None gives the
  paper's): a promoted job that never ran goes into Q1 at its arrival place
  (ahead of the jobs that arrived after it) rather than at the tail, so the
  starving are served in arrival order, as FCFS would; and the last queue
  keeps its order (no round robin: a job there is never rotated to the
  tail), since past capacity each rotation parks a job on the host and
  brings another back, copies that take batch room (measured in
  docs/experiments.md, "Past capacity"). Both change nothing while every job
  fits the batch.
- Alike-lengths mode (adapt_to_alike_lengths; off by default, and never for
  naive MLFQ): from the output lengths of the last HISTORY finished jobs
  and the started jobs held, censored (scheduler.gittins.length_pmf),
  once the Gittins index they give a job at the median length is ALIKE_ON x
  that at one token out (alike lengths: a started job is the nearer to
  finishing), no job is demoted, started jobs move to Q1 (keeping their
  place) and run to completion ahead of the fresh jobs after them, and a
  fresh job waits behind a started one that waits for KV (set_alike_lengths);
  off again at ALIKE_OFF.
- Age promotion (starvation_age k; None = off): a job whose time in the
  system exceeds k x the mean time in the system, N / mu (N the jobs held,
  mu the completion rate over the last AGE_WINDOW completions: Little's law),
  moves to the STARVING band, above every queue and class, oldest first,
  and is never demoted there: it runs to completion. Under least attained
  service the longest jobs would otherwise wait until the load lets up; this
  bounds their wait by a multiple of the going time in the system, which
  grows with the backlog as FCFS's waits do, so it does not turn into round
  robin past capacity (a fixed alpha does: every waiting job is older than
  alpha there). Measured in docs/experiments.md, "Sensitivity to alpha".
- Request classes (Job.priority, lower first): each class has its own queues
  Q1..Qn (a band), and every queue of a more urgent class comes before any
  queue of a less urgent one. "Q1" for promotion is Q1 of the most urgent
  class that has jobs, whatever the starving job's class, so starvation
  prevention bounds every class's wait (alpha plus an iteration, once
  promoted); when the promoted job uses that quantum it is demoted into its
  own class's queues. With one class this is exactly the paper's rule.
- Batch: see priority_policy.py. Order: by band (class), queue, then FIFO by
  the time the job entered its queue.
- ENST(i) = min(alpha - starve_time(i), T_execute(i)) for job i in Q_b, with
  T_execute(i) = (1/B) * sum_{a<b} n_a (q_a + ... + q_(b-1)), n_a = jobs in
  Q_a of i's band, B = the batch size running now (the last tick's batch, or
  max_num_seqs when none runs; the paper's formula has the batch limit, which
  past capacity memory keeps the batch far below); a job of a more
  urgent band in Q_a adds q_a + ... + q_max(a,b) (it runs at least through
  i's level before i does). 0 for a running job.
  It can be negative: the job is overdue for promotion. T_execute is the same
  for every job of a queue: it is computed once per queue and kept until a
  job enters, leaves or changes queue.

Data: per band and queue, two insertion-ordered dicts (FIFO with O(1)
removal): the started jobs and the fresh ones (never run), merged by entry
sequence as the tick walks them, so a tick walks jobs in priority order
without sorting and skips the fresh ones once one is refused (past capacity
they are nearly all the jobs); ENST is O(queues x bands); a heap of (last run
time, jobs) entries, one pushed per tick for the jobs preempted in it (they
all last ran in the previous iteration) and one per arrival, finds the
starving jobs without scanning all of them.

MLFQPolicy (scheduler/mlfq.py) is this policy with skip_join = False.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from itertools import filterfalse

from scheduler.gittins import HISTORY, REFRESH_EVERY, censored_lengths, index_growth
from scheduler.job import Job
from scheduler.policy import CostModel, PolicyName, SchedulerConfig, charged
from scheduler.priority_policy import NEVER, Gate, PriorityPolicy

SHORT_CONTEXT = 16  # tokens: the context at which q1 = t_dec(1, SHORT_CONTEXT)
STARVING = -(1 << 30)  # the band of age-promoted jobs: before every request class


def mlfq_quanta(config: SchedulerConfig, cost: CostModel) -> list[float]:
    """[q1, q2, ...]: geometric by quantum_ratio, the last covering the longest service a job can need: with the
    "service" ladder its first iteration and max_prompt_len decode steps at half the context, each alone (a job is
    charged its share of each iteration, step_charges: the most when it runs alone), with the paper's "prefill"
    ladder t_init(max_prompt_len)."""
    q1 = cost.t_dec(1, SHORT_CONTEXT)
    if not q1 > 0:
        raise ValueError(f"the profile's decode time at batch 1 is {q1} s; it must be > 0 to set quanta")
    longest = cost.t_init(config.max_prompt_len)
    if not math.isfinite(longest):
        raise ValueError(f"the profile's prefill time for {config.max_prompt_len} tokens is {longest} s")
    if config.mlfq_ladder == "service":
        step = cost.t_dec(1, max(1, config.max_prompt_len // 2))
        longest += config.max_prompt_len * step
    quanta = [q1]
    while quanta[-1] < longest:
        quanta.append(quanta[-1] * config.quantum_ratio)
    return quanta


# Demotion needs service > quantum beyond float noise: six 0.1 s steps after 1.0 s are 1.6000000000000003 s,
# which has not exceeded a 1.6 s quantum.
QUANTUM_SLACK = 1 + 1e-9
# Finished jobs before the alike-lengths mode may turn on (then checked every REFRESH_EVERY): the first to finish
# are the short ones, and on ShareGPT 1 sample of 6 of 32 lengths reads alike; none of 200 samples of 128 did.
ALIKE_MIN_HISTORY = 256
# The mode turns on where the learned Gittins index of a job at the median length is at least ALIKE_ON x that of a
# job with one token out (scheduler.gittins.index_growth), and off again at ALIKE_OFF or below (between: as it was).
# On random 256-length samples the Azure 2023 traces read up to 1.55 (their whole traces 0.6-1.0) and lengths uniform
# over 0.5-1.5x a mean of 16-817 tokens 2.0-11. Past capacity the short jobs finish first, and the finished lengths
# alone read the shortest third of a heavy tail as alike: the started jobs still held count too, as censored
# (Kaplan-Meier: scheduler.gittins.length_pmf). The mode stays opt-in (engine/config.py).
ALIKE_ON, ALIKE_OFF = 2.0, 1.0

class _Band:
    """One request class's queues: per level, started and fresh jobs in entry order. Jobs join at the
    tail (a new entry) of an insertion-ordered dict, except a fresh job that starts: it keeps its entry
    (its place), so when a later entry is already started it goes to `late`, a short list sorted by
    entry, until it next moves; and a fresh job promoted under the overload rules: it keeps its arrival
    entry, in `promoted`, a list sorted by entry (promotions come in arrival order, so it is appended)."""

    __slots__ = ("started", "late", "fresh", "promoted")

    def __init__(self, levels: int) -> None:
        self.started: list[dict[Job, None]] = [{} for _ in range(levels)]
        self.late: list[list[Job]] = [[] for _ in range(levels)]
        self.fresh: list[dict[Job, None]] = [{} for _ in range(levels)]
        self.promoted: list[list[Job]] = [[] for _ in range(levels)]

    def sizes(self) -> list[int]:
        return [len(s) + len(x) + len(f) + len(p)
                for s, x, f, p in zip(self.started, self.late, self.fresh, self.promoted)]


class SkipJoinMLFQPolicy(PriorityPolicy):
    name = PolicyName.SKIP_JOIN_MLFQ
    skip_join = True  # False: every new job enters Q1 (naive MLFQ)
    learns_length_shape = True  # the alike-lengths mode (off for naive MLFQ, a baseline)

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self.quanta = mlfq_quanta(config, cost)
        self._limits = [q * QUANTUM_SLACK for q in self.quanta]  # demotion thresholds
        if config.starvation_factor is not None:  # the overload rules: the last queue keeps its order
            self._limits[-1] = math.inf
        self._ladder_limits = self._limits
        # The alike-lengths mode: the output lengths of finished jobs, and whether they say a started job is the
        # nearer to finishing (then no demotion, and a fresh job waits behind a started one that waits for KV).
        self._lengths: deque[int] = deque(maxlen=HISTORY)
        self._since_check = 0
        self.alike_lengths = False
        self.num_mode_changes = 0
        self._learns_length_shape = self.learns_length_shape and config.adapt_to_alike_lengths
        self._offsets = [0.0, *itertools.accumulate(self.quanta)]  # [k] = q_0 + ... + q_(k-1)
        # [b][a] = offsets[b] - offsets[a] for a < b: the service a job in Q_a has ahead of one in Q_b (ENST)
        self._gaps = [[self._offsets[b] - self._offsets[a] for a in range(b)] for b in range(len(self.quanta))]
        self._bands: dict[int, _Band] = {}  # request class -> its queues
        self._band_keys: list[int] = []  # sorted: the walk's band order
        self._band_of: dict[Job, int] = {}  # every job the policy holds -> the band it sits in
        self._entry: dict[Job, int] = {}  # job -> sequence number of its entry into its queue (FIFO order)
        self._queue_waits: dict[tuple[int, int], float] | None = None  # T_execute by (band, level)
        self._starving: list[tuple[float, int, tuple[Job, ...]]] = []  # heap: (last_scheduled_time, seq, jobs)
        # Age promotion: jobs in arrival order (popped once old enough), and the last completions' times.
        self._by_arrival: deque[Job] = deque()
        self._now = 0.0
        self._fresh_starving: list[tuple[float, int, Job]] = []  # heap of arrivals: (arrival, seq, job)
        # Starving jobs left in Q1 because their class was the most urgent present; should a more urgent
        # class arrive, they are promoted into its Q1 (their heap entries are spent).
        self._held_in_q1: dict[Job, None] = {}
        self._held_top = 0
        self._seq = itertools.count()
        self.num_promotions = 0
        self.num_demotions = 0
        self._threshold: float | None = None  # promotion_threshold(), computed for W = _threshold_for
        self._threshold_for: float | None = None

    # -- metrics ---------------------------------------------------------------------------
    def queue_lengths(self) -> list[int]:
        """Jobs per level, Q1 first, over every band."""
        out = [0] * len(self.quanta)
        for band in self._bands.values():
            for level, n in enumerate(band.sizes()):
                out[level] += n
        return out

    # -- placement ---------------------------------------------------------------------------
    def entry_queue(self, prompt_len: int, cached: int = 0) -> int:
        """Skip-join: the highest queue whose quantum covers the first iteration, t_init(prompt_len), or with
        `cached` prompt tokens cached (prefix caching) the uncached rest's (first_iteration_cost)."""
        if not self.skip_join:
            return 0
        level = bisect.bisect_left(self.quanta, self.first_iteration_cost(prompt_len, cached))
        return min(level, len(self.quanta) - 1)

    def first_iteration_cost(self, prompt_len: int, cached: int = 0) -> float:
        """t_init(prompt_len); with a cached prefix of `cached` tokens, the cost model's price of the rest as a
        chunk over that prefix (what its first iteration computes), at most t_init(prompt_len)."""
        whole = self.cost.t_init(prompt_len)
        if cached <= 0 or cached >= prompt_len:
            return whole
        return min(whole, self.cost.batch_cost((), (), ((cached, prompt_len - cached),)))

    def _band(self, key: int) -> _Band:
        band = self._bands.get(key)
        if band is None:
            band = self._bands[key] = _Band(len(self.quanta))
            bisect.insort(self._band_keys, key)
        return band

    def _place(self, job: Job, key: int, level: int, fresh: bool) -> None:
        """Put the job at the tail of a queue (a new entry: service reset)."""
        self._band_of[job] = key
        self._entry[job] = next(self._seq)
        job.queue, job.service_in_queue = level, 0.0
        band = self._band(key)
        (band.fresh if fresh else band.started)[level][job] = None
        self._queue_waits = None

    def _unplace(self, job: Job) -> None:
        self._take(self._bands[self._band_of[job]], job)
        self._queue_waits = None

    def _take(self, band: _Band, job: Job) -> bool:
        """Remove the job from its queue in the band; True if it had started."""
        level = job.queue
        if band.started[level].pop(job, 0) is None:
            return True
        if band.fresh[level].pop(job, 0) is None or self._unpromote(band, job):
            return False
        late = band.late[level]
        del late[bisect.bisect_left(late, self._entry[job], key=self._entry.__getitem__)]
        return True

    def _unpromote(self, band: _Band, job: Job) -> bool:
        """Remove the job from the band's promoted fresh jobs of its level; False if it is not there."""
        promoted = band.promoted[job.queue]
        if not promoted:
            return False
        i = bisect.bisect_left(promoted, self._entry[job], key=self._entry.__getitem__)
        if i < len(promoted) and promoted[i] is job:
            del promoted[i]
            return True
        return False

    def _holds(self, job: Job) -> bool:
        return job in self._band_of

    def add(self, job: Job, now: float) -> None:
        if self._holds(job):
            raise ValueError(f"job {job.job_id} was already added")
        fresh = job.first_scheduled_time is None  # (a job that ran elsewhere before comes in started)
        self._place(job, job.priority, self.entry_queue(job.prompt_len, job.num_cached_prompt_tokens), fresh)
        self._count_in(job)
        if fresh and self.config.starvation_factor is not None and self.config.starvation_threshold is not None:
            heapq.heappush(self._fresh_starving, (job.last_scheduled_time, next(self._seq), job))
        else:
            self._wait_from(job.last_scheduled_time, [job])  # its arrival
        if self.config.starvation_age is not None:
            self._by_arrival.append(job)

    def remove(self, job: Job) -> None:
        if self._holds(job):
            if job.finished and job.num_generated >= 1 and self._learns_length_shape:
                self._learn_length(job.num_generated)
            if self.config.starvation_age is not None:
                self._completions.append(self._now)
            self._unplace(job)
            del self._band_of[job], self._entry[job]
            self._held_in_q1.pop(job, None)
            self._running.pop(job, None)
            self._count_out(job)

    # -- the alike-lengths mode ----------------------------------------------------------------
    def _learn_length(self, n: int) -> None:
        lengths = self._lengths
        lengths.append(n)
        self._since_check += 1
        if len(lengths) >= ALIKE_MIN_HISTORY and (self._since_check >= REFRESH_EVERY
                                                  or len(lengths) == ALIKE_MIN_HISTORY):
            self._since_check = 0
            # Started jobs still held (the one finishing now aside) count as censored: L > their tokens so far.
            growth = index_growth(lengths, censored_lengths(self._band_of))
            self.set_alike_lengths(growth >= ALIKE_ON if not self.alike_lengths else growth > ALIKE_OFF)

    def set_alike_lengths(self, on: bool) -> None:
        """Alike lengths (on): no demotion; a job that starts (and, as the mode turns on, every started job, in its
        order) moves to Q1 of its band, keeping its place among the jobs there, so started jobs run to completion
        ahead of the fresh jobs that came after them, which keep skip-join's entry order (shortest prefill first,
        then arrival); and a fresh job does not start while a started job ahead of it waits for KV. Off: the
        service ladder (least attained service)."""
        if on == self.alike_lengths:
            return
        self.alike_lengths = on
        self.num_mode_changes += 1
        self._limits = [math.inf] * len(self.quanta) if on else self._ladder_limits
        self.fresh_waits_for_started = on
        if on:  # the jobs started before: to Q1 of their band too, in their order (else fresh jobs pass them)
            entry = self._entry
            for band in self._bands.values():
                jobs = [job for started, late in zip(band.started, band.late)
                        for job in heapq.merge(started, late, key=entry.__getitem__)]
                for job in jobs:  # new entries at Q1's tail, in walk order (their old ones span queues)
                    self._take(band, job)
                    job.queue, job.service_in_queue = 0, 0.0
                    entry[job] = next(self._seq)
                    band.started[0][job] = None
            self._queue_waits = None

    # -- the PriorityPolicy hooks -------------------------------------------------------------
    def _walk(self, gate: Gate) -> Iterator[Job]:
        # A started job the gate says schedule() would pass over is left out (past capacity most started jobs
        # are parked on the host or wait with their KV dropped, and are): the gate changes only while the walk
        # is suspended, so it is read anew after each yield.
        entry = self._entry
        known_from, known = NEVER, set()  # the dropped jobs left out for a refusal of no_kv_from = known_from
        for key in self._band_keys:
            band = self._bands[key]
            for started, late, fresh, promoted in zip(band.started, band.late, band.fresh, band.promoted):
                if late:
                    started = heapq.merge(started, late, key=entry.__getitem__)
                if promoted:
                    fresh = heapq.merge(fresh, promoted, key=entry.__getitem__)
                if not fresh or not gate.fresh:
                    # The jobs in gate.skip are passed over in C (filterfalse: past capacity hundreds a tick), the
                    # filter made anew on the same iterator whenever the gate changed while the walk was suspended.
                    it = iter(started)
                    while True:
                        skip, no_kv = gate.skip, gate.no_kv_from
                        if no_kv == NEVER:  # (no job left out for its context: the common case, without the test)
                            for job in filterfalse(skip.__contains__, it):
                                yield job
                                if gate.skip is not skip or gate.no_kv_from != no_kv:
                                    break
                            else:
                                break
                            continue
                        # The dropped jobs the policy knows of that the refusal covers, left out in C too; any
                        # other job with no KV is tested here as before.
                        if no_kv < known_from:  # a smaller refusal (none was kept until now: NEVER): add
                            known.update(self._dropped_in(no_kv, known_from))  # (no job is kept during a walk)
                            known_from = no_kv
                        elif no_kv > known_from:  # a larger one after an eviction reset the refusal: start anew
                            known, known_from = set(self._dropped_in(no_kv)), no_kv
                        for job in filterfalse(known.__contains__, filterfalse(skip.__contains__, it)):
                            if not job.num_computed and job.prompt_len + job.num_generated >= no_kv:
                                continue
                            yield job
                            if gate.skip is not skip or gate.no_kv_from != no_kv:
                                break
                        else:
                            break
                    continue
                if not started and not late:
                    for job in fresh:
                        if not gate.fresh:
                            break
                        yield job
                    continue
                s_it, f_it = iter(started), iter(fresh)  # merge the FIFOs by entry order
                s, f = next(s_it, None), next(f_it, None)
                while s is not None or f is not None:
                    if f is not None and gate.fresh and (s is None or entry[f] < entry[s]):
                        yield f
                        f = next(f_it, None)
                    elif s is not None:
                        if s not in gate.skip and (
                                s.num_computed or s.prompt_len + s.num_generated < gate.no_kv_from):
                            yield s
                        s = next(s_it, None)
                    else:
                        break

    def _rank(self, job: Job) -> tuple:
        return (self._band_of[job], job.queue, self._entry[job])

    def _started_jobs(self) -> set[Job]:
        jobs: set[Job] = set()
        for band in self._bands.values():  # (set.update walks the queues in C: past capacity they hold thousands)
            jobs.update(*band.started, *band.late)
        return jobs

    def _on_started(self, jobs: list[Job]) -> None:
        entry = self._entry
        to_top = self.alike_lengths
        for job in jobs:
            key = self._band_of[job]
            band = self._bands[key]
            if band.fresh[job.queue].pop(job, 0) is not None:
                self._unpromote(band, job)
            if to_top:  # alike lengths: to Q1, keeping its place, so it runs ahead of the fresh jobs after it
                job.queue, job.service_in_queue = 0, 0.0
            started = band.started[job.queue]
            if started and entry[next(reversed(started))] > entry[job]:  # it keeps its place
                bisect.insort(band.late[job.queue], job, key=entry.__getitem__)
            else:
                started[job] = None
        if to_top:
            self._queue_waits = None

    def _wait_from(self, since: float, jobs: Sequence[Job]) -> None:
        """Start the starvation clock of jobs that last ran (or arrived) at `since`."""
        if self.config.starvation_threshold is not None:
            heapq.heappush(self._starving, (since, next(self._seq), tuple(jobs)))

    def _on_preempted(self, jobs: list[Job]) -> None:
        since = jobs[0].last_scheduled_time
        if all(job.last_scheduled_time == since for job in jobs):  # they all ran in the last iteration
            self._wait_from(since, jobs)
            return
        by_time: dict[float, list[Job]] = {}
        for job in jobs:
            by_time.setdefault(job.last_scheduled_time, []).append(job)
        for since, group in by_time.items():
            self._wait_from(since, group)

    def promotion_threshold(self) -> float | None:
        """How long a job waits before it is promoted: alpha, or max(alpha, f x W) with a starvation factor.
        Kept until W changes (every wait estimate reads it)."""
        if self._threshold_for != self.start_wait_ema:
            alpha, f = self.config.starvation_threshold, self.config.starvation_factor
            self._threshold_for = self.start_wait_ema
            self._threshold = alpha if alpha is None or f is None else max(alpha, f * self.start_wait_ema)
        return self._threshold

    def _before_schedule(self, now: float) -> None:
        """Promote every job that has waited longer than the promotion threshold to the tail of Q1 (of the
        most urgent class)."""
        heap, running, band_of = self._starving, self._running, self._band_of
        promoted = 0
        top = min(self._classes) if self._classes else 0
        held = self._held_in_q1
        if held and top != self._held_top:  # a more urgent class arrived: they go to its Q1
            for job in list(held):
                if band_of.get(job, top) != top:
                    self._unplace(job)
                    self._place(job, top, 0, job.first_scheduled_time is None)
                    job.num_promotions += 1
                    promoted += 1
        self._held_top = top
        limit = self.promotion_threshold()
        fresh_heap = self._fresh_starving
        if fresh_heap:  # jobs that never ran: promoted after max(alpha, f x W), in arrival order
            while fresh_heap and now - fresh_heap[0][0] > limit:
                job = heapq.heappop(fresh_heap)[2]
                if job.first_scheduled_time is not None or job not in band_of:
                    continue  # it started (its later waits are on the other heap) or left
                if band_of[job] != top or job.queue != 0:  # to Q1 at its arrival place (it keeps its entry)
                    self._unplace(job)
                    band_of[job] = top
                    job.queue, job.service_in_queue = 0, 0.0
                    bisect.insort(self._band(top).promoted[0], job, key=self._entry.__getitem__)
                    job.num_promotions += 1
                    promoted += 1
                held[job] = None
        if heap and now - heap[0][0] > limit:  # alpha None: the heap stays empty
            bands, entry, seq = self._bands, self._entry, self._seq
            q1 = self._band(top)
            while heap and now - heap[0][0] > limit:
                since, _, group = heapq.heappop(heap)
                for job in group:  # _unplace and _place inlined: this loop can touch every waiting job
                    if job.last_scheduled_time != since or job in running:
                        continue  # stale: the job ran since
                    key = band_of.get(job)
                    if key is None:
                        continue  # it left
                    held[job] = None  # starving until it runs (on_step_done) or leaves (remove)
                    if key == top and job.queue == 0:
                        continue  # it left, or it is in Q1 already
                    band = bands[key]
                    if band.started[job.queue].pop(job, 0) is None or self._take(band, job):  # (_take inlined)
                        q1.started[0][job] = None
                    else:
                        q1.fresh[0][job] = None
                    band_of[job], entry[job] = top, next(seq)
                    job.queue, job.service_in_queue = 0, 0.0
                    job.num_promotions += 1
                    promoted += 1
        self._now = now
        if self._by_arrival:
            promoted += self._promote_by_age(now)
        if promoted:
            self.num_promotions += promoted
            self._queue_waits = None

    def _promote_by_age(self, now: float) -> int:
        """Move every job older than age_limit() to the STARVING band (oldest first); it runs to completion."""
        limit = self.age_limit(now)
        if limit is None:
            return 0
        queue, band_of, promoted = self._by_arrival, self._band_of, 0
        while queue and (queue[0] not in band_of or now - queue[0].arrival_time > limit):
            job = queue.popleft()
            if job not in band_of:
                continue  # it finished
            started = job.first_scheduled_time is not None
            self._unplace(job)
            self._held_in_q1.pop(job, None)
            self._place(job, STARVING, 0, not started)
            job.num_promotions += 1
            promoted += 1
        return promoted

    def on_step_done(self, batch: Sequence[Job], now: float, cost: float,
                     charges: Mapping[Job, float] | None = None) -> None:
        # PriorityPolicy.on_step_done's charging, fused with the demotion check: one pass per job.
        last, eta, limits, band_of = len(self.quanta) - 1, self.config.demotion_step, self._limits, self._band_of
        bands, entry, seq = self._bands, self._entry, self._seq
        moved = False
        held = self._held_in_q1
        if held:
            for job in batch:
                held.pop(job, None)
        for job, charge in charged(batch, cost, charges):
            job.service_total += charge
            job.last_scheduled_time = now
            service = job.service_in_queue = job.service_in_queue + charge
            if service > limits[job.queue] and band_of.get(job, STARVING) != STARVING:  # used up its quantum
                level = job.queue
                new = min(level + eta, last)
                if new != level:
                    job.num_demotions += 1
                    self.num_demotions += 1
                # _unplace and _place inlined; a promoted job sinks into its own class's queues.
                band = bands[band_of[job]]
                key = job.priority
                target = bands.get(key) or self._band(key)
                if band.started[level].pop(job, 0) is None or self._take(band, job):  # (_take's first case)
                    target.started[new][job] = None
                else:  # charged without having been scheduled (tests drive on_step_done alone)
                    target.fresh[new][job] = None
                band_of[job], entry[job] = key, next(seq)
                job.queue, job.service_in_queue = new, 0.0
                moved = True
        if moved:
            self._queue_waits = None

    def _execute_waits(self) -> dict[tuple[int, int], float]:
        """B x T_execute for a job of each (band, queue), B the batch size (see the module docstring): the
        queued service ahead of it; _wait_estimate divides by the batch size running now."""
        off, n = self._offsets, len(self.quanta)
        waits: dict[tuple[int, int], float] = {}
        ahead = [0.0] * n  # per level b: what the jobs of more urgent bands add
        for key in self._band_keys:
            sizes = self._bands[key].sizes()
            for b, gaps in enumerate(self._gaps):  # sum(sizes[a] * (off[b] - off[a]) for a < b), its terms in C
                waits[(key, b)] = sum(map(operator.mul, sizes, gaps)) + ahead[b]
            if len(self._band_keys) > 1:
                for b in range(n):
                    ahead[b] += sum(sizes[a] * (off[max(a, b) + 1] - off[a]) for a in range(n) if sizes[a])
        return waits

    def _wait_estimate(self, job: Job, now: float) -> float:
        waits = self._queue_waits
        if waits is None:
            waits = self._queue_waits = self._execute_waits()
        # B: the batch size running now (the last tick's batch), not max_num_seqs: past capacity memory, not the
        # sequence limit, bounds the batch, and jobs ahead go through it B at a time (nothing runs: the limit).
        t_execute = waits[(self._band_of[job], job.queue)] / (len(self._running) or self.config.max_num_seqs)
        # promotion_threshold(), its cache read inline: the planner asks this of every job parked on the host.
        alpha = self._threshold if self._threshold_for == self.start_wait_ema else self.promotion_threshold()
        # job.starve_time(now), inlined: the proactive planner and the eviction order call this per job.
        return t_execute if alpha is None else min(alpha - (now - job.last_scheduled_time), t_execute)
