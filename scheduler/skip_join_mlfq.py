"""Skip-join MLFQ: the default policy (FastServe section 4.1, Algorithm 1;
ENST from section 4.2).

Rule, on the engine's clock, with every time a *profiled* cost:
- Queues Q1..Qn (index 0..n-1, 0 the highest) have quanta
  q1 = t_dec(batch 1, a 16-token context) and q_(i+1) = quantum_ratio * q_i,
  with just enough queues that q_n >= t_init(max_prompt_len).
- Skip-join: a new job enters the highest queue whose quantum covers its
  first iteration, min{i : q_i >= t_init(prompt_len)} (the last queue if none).
- Each iteration every job of the batch is charged the whole iteration's
  cost; when a job's service in its queue exceeds the queue's quantum it is
  demoted by eta (demotion_step) queues, clamped to the last (in the last
  queue it goes to the tail: round robin), and its service is reset.
- Starvation prevention: a job not in the batch whose starve time exceeds
  alpha (starvation_threshold; None = off) is promoted to Q1, its service
  reset. A job already in Q1 stays where it is.
- Batch: see priority_policy.py. Order: by queue, then FIFO by the time the
  job entered its queue.
- ENST(i) = min(alpha - starve_time(i), (1/B) * sum_{a<b} n_a (q_a + ... + q_(b-1)))
  for job i in Q_b, n_a = jobs in Q_a, B = max_num_seqs; 0 for a running job.
  It can be negative: the job is overdue for promotion. The second term is
  the same for every job of a queue: it is computed once per queue and kept
  until a job enters, leaves or changes queue.

Data: one insertion-ordered dict per queue (FIFO with O(1) removal), so a tick
walks jobs in priority order without sorting and ENST is O(number of queues);
a heap of (last run time, jobs) entries, one pushed per tick for the jobs
preempted in it (they all last ran in the previous iteration) and one per
arrival, finds the starving jobs without scanning all of them.

MLFQPolicy (scheduler/mlfq.py) is this policy with skip_join = False.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence

from scheduler.job import Job
from scheduler.policy import CostModel, PolicyName, SchedulerConfig
from scheduler.priority_policy import PriorityPolicy

SHORT_CONTEXT = 16  # tokens: the context at which q1 = t_dec(1, SHORT_CONTEXT)


def mlfq_quanta(config: SchedulerConfig, cost: CostModel) -> list[float]:
    """[q1, q2, ...]: geometric by quantum_ratio, the last covering t_init(max_prompt_len)."""
    q1 = cost.t_dec(1, SHORT_CONTEXT)
    if not q1 > 0:
        raise ValueError(f"the profile's decode time at batch 1 is {q1} s; it must be > 0 to set quanta")
    longest = cost.t_init(config.max_prompt_len)
    if not math.isfinite(longest):
        raise ValueError(f"the profile's prefill time for {config.max_prompt_len} tokens is {longest} s")
    quanta = [q1]
    while quanta[-1] < longest:
        quanta.append(quanta[-1] * config.quantum_ratio)
    return quanta


# Demotion needs service > quantum beyond float noise: six 0.1 s steps after 1.0 s are 1.6000000000000003 s,
# which has not exceeded a 1.6 s quantum.
QUANTUM_SLACK = 1 + 1e-9

class SkipJoinMLFQPolicy(PriorityPolicy):
    name = PolicyName.SKIP_JOIN_MLFQ
    skip_join = True  # False: every new job enters Q1 (naive MLFQ)

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self.quanta = mlfq_quanta(config, cost)
        self._limits = [q * QUANTUM_SLACK for q in self.quanta]  # demotion thresholds
        self._offsets = [0.0, *itertools.accumulate(self.quanta)]  # [k] = q_0 + ... + q_(k-1)
        self._queues: list[dict[Job, None]] = [{} for _ in self.quanta]  # FIFO by entry
        self._queue_waits: list[float] | None = None  # T_execute by queue; None: the queues changed since
        self._starving: list[tuple[float, int, tuple[Job, ...]]] = []  # heap: (last_scheduled_time, seq, jobs)
        self._seq = itertools.count()
        self.num_promotions = 0
        self.num_demotions = 0

    # -- metrics ---------------------------------------------------------------------------
    def queue_lengths(self) -> list[int]:
        return [len(q) for q in self._queues]

    # -- placement ---------------------------------------------------------------------------
    def entry_queue(self, prompt_len: int) -> int:
        """Skip-join: the highest queue whose quantum covers t_init(prompt_len)."""
        if not self.skip_join:
            return 0
        level = bisect.bisect_left(self.quanta, self.cost.t_init(prompt_len))
        return min(level, len(self.quanta) - 1)

    def _move(self, job: Job, level: int) -> None:
        self._queue_waits = None
        del self._queues[job.queue][job]
        job.queue = level
        job.service_in_queue = 0.0
        self._queues[level][job] = None

    def _holds(self, job: Job) -> bool:
        return 0 <= job.queue < len(self._queues) and job in self._queues[job.queue]

    def add(self, job: Job, now: float) -> None:
        if self._holds(job):
            raise ValueError(f"job {job.job_id} was already added")
        job.queue = self.entry_queue(job.prompt_len)
        job.service_in_queue = 0.0
        self._queues[job.queue][job] = None
        self._queue_waits = None
        self._wait_from(job.last_scheduled_time, [job])  # its arrival

    def remove(self, job: Job) -> None:
        if self._holds(job):
            del self._queues[job.queue][job]
            self._running.pop(job, None)
            self._queue_waits = None

    # -- the PriorityPolicy hooks -------------------------------------------------------------
    def _priority_order(self) -> Iterable[Job]:
        return itertools.chain.from_iterable(self._queues)

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

    def _before_schedule(self, now: float) -> None:
        """Promote every job that has waited longer than alpha to Q1."""
        alpha = self.config.starvation_threshold
        heap, running, queues = self._starving, self._running, self._queues
        q1 = queues[0]
        promoted = 0
        while heap and now - heap[0][0] > alpha:  # alpha None: the heap stays empty
            since, _, group = heapq.heappop(heap)
            for job in group:  # _holds and _move inlined: this loop can touch every waiting job
                if job.last_scheduled_time != since or job in running:
                    continue  # stale: the job ran since
                level = job.queue
                if level == 0 or job not in queues[level]:
                    continue  # already in Q1, or it left
                del queues[level][job]
                job.queue, job.service_in_queue = 0, 0.0
                q1[job] = None
                job.num_promotions += 1
                promoted += 1
        if promoted:
            self.num_promotions += promoted
            self._queue_waits = None

    def on_step_done(self, batch: Sequence[Job], now: float, cost: float) -> None:
        # PriorityPolicy.on_step_done's charging, fused with the demotion check: one pass per job.
        last, eta, queues = len(self.quanta) - 1, self.config.demotion_step, self._queues
        limits = self._limits
        for job in batch:
            job.service_total += cost
            job.last_scheduled_time = now
            service = job.service_in_queue = job.service_in_queue + cost
            level = job.queue
            if service > limits[level] and job in queues[level]:  # used up its quantum (and still held)
                new = min(level + eta, last)
                if new != level:
                    job.num_demotions += 1
                    self.num_demotions += 1
                del queues[level][job]  # _move, inlined
                job.queue, job.service_in_queue = new, 0.0
                queues[new][job] = None
                self._queue_waits = None

    def _execute_waits(self) -> list[float]:
        """T_execute for a job of each queue: (1/B) * sum_{a<b} n_a (q_a + ... + q_(b-1))."""
        off, sizes = self._offsets, [len(q) for q in self._queues]
        seqs = self.config.max_num_seqs
        return [sum(sizes[a] * (off[b] - off[a]) for a in range(b)) / seqs for b in range(len(sizes))]

    def _wait_estimate(self, job: Job, now: float) -> float:
        waits = self._queue_waits
        if waits is None:
            waits = self._queue_waits = self._execute_waits()
        t_execute = waits[job.queue]
        alpha = self.config.starvation_threshold
        return t_execute if alpha is None else min(alpha - job.starve_time(now), t_execute)
