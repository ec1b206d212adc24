"""Gittins-index scheduling: a non-clairvoyant order that adapts to the output lengths this server has served.

Why: least attained service (every MLFQ, skip-join included) is the right order when the longer a job has run,
the longer it is likely to run on (ShareGPT's heavy tail). When output lengths are alike (Fig. 14's uniform
rows) the opposite holds: a started job is nearer its end than a new one, and preempting it for a newcomer
delays both; past capacity it spreads the server over ever more started jobs and finishes fewer of them
(docs/experiments.md, Fig. 14: skip-join 1.6-4.5x the best baseline there, served 0.45-0.83x FCFS's). The
Gittins index is the order that minimizes mean (weighted) response time in an M/G/1 queue when sizes are
unknown but their distribution is known (Gittins 1989; Scully, Harchol-Balter and Scheller-Wolf, SOAP, 2018):
it is least attained service under decreasing hazard rates and run-to-completion under increasing ones. Here
the distribution is learned from the output lengths of the jobs the server has finished; no job's own output
length is read (Job.true_output_len is the SRPT oracle's alone).

Rule, on the engine's clock, every cost profiled:
- A job's work is its remaining prefill P plus one decode share d per output token after the first (the first
  comes with the prefill); d = t_dec(b, 512) / b, b the batch size running at the last refresh (max_num_seqs
  before one). A prompt runs inside a batch, as the engine runs it (scheduler/cost_model.py): P = d (its share
  of the step) + what its n tokens not yet computed or cached add to a step of b decoders,
  batch_cost([n], b x 512) - batch_cost([], b x 512). (It was t_init(n), the prompt alone: a full pass over
  the weights, 20-50 decode shares for a 20-token prompt on OPT-13B, which ranked fresh jobs below started
  ones; on Alpaca at 2x capacity one seed of three then read 1.8x skip-join's mean, new jobs waiting at the
  door: P99 TTFT 22 s. docs/scheduling.md, "Gittins".)
- The output length L (tokens, >= 1) has the distribution of the last HISTORY finished jobs, with every started
  job still held counted as censored: it says only L > g, g its tokens so far (Kaplan-Meier, length_pmf). Past
  capacity the short jobs finish first and the long ones wait half done, so the finished lengths alone read the
  distribution short (the censoring bias); with no started job held it is their empirical distribution. A job
  that has generated g tokens has the index
      G = max over thresholds t > g (lengths seen) of
          E[1{L <= t} / L | L > g]  /  (P + d * E[min(L, t) - max(g, 1) | L > g])
  the best ratio of what finishing within a budget is worth (1 / L: the objective is mean per-token latency)
  to the work that budget costs. Higher runs first; ties in arrival order. A job past every length seen has
  index 0 (last; age promotion bounds its wait).
- Until MIN_HISTORY jobs have finished there is no distribution: G = 1 / (P + d * (g + 1)), shortest remaining
  prefill first, then least attained service (what skip-join's entry and ladder do).
- The distribution is refreshed at MIN_HISTORY finished jobs, then every REFRESH_EVERY; every job is re-ranked.
- Where the learned index rises with service (a job at the median length outranks one with one token out: alike
  lengths), a fresh job waits while a started job ahead of it waits for KV (PriorityPolicy.fresh_waits_for_started):
  started jobs near their end are not held on the host while newcomers take the device, which past capacity
  spread the server over ever more started jobs and finished fewer. Where it falls (heavy tails: ShareGPT,
  Alpaca) the rule is off, as for skip-join: there it only delayed new long prompts (P99 TTFT at 1.5C 13-262 s
  against 2.8-3 s without it).
- Age promotion (starvation_age k, as skip-join's; None = off; scheduler/age_promotion.py): a job whose time in
  the system exceeds k x the mean time in the system (jobs held / completion rate over the last AGE_WINDOW
  completions: Little's law) goes ahead of every other job of its request class, oldest first.
- Request classes (Job.priority, lower first) come first. Batch formation, eviction and the preempted list:
  priority_policy.py; the ranks: KeyedPriorityPolicy (a dynamic key, re-ranked for the jobs a step ran, and for
  every job at a refresh).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from scheduler.age_promotion import STARVING_KEY, AgePromotedPolicy
from scheduler.job import Job
from scheduler.policy import CostModel, PolicyName, SchedulerConfig

HISTORY = 2000  # finished jobs whose output lengths make the distribution
MIN_HISTORY = 32  # finished jobs before the first distribution
REFRESH_EVERY = 128  # finished jobs between refreshes
DECODE_CONTEXT = 512  # the context length at which the decode share d is priced
RERANK_BLOCK = 1024  # fresh jobs re-ranked per array operation at a refresh


TAIL_MASS = 1e-4  # the constant-hazard tail past the longest job seen is followed until this much mass is left
TAIL_SPACING = 1.15  # its mass is gathered on lengths spaced this factor apart (a few dozen points, not thousands)


def length_pmf(lengths: np.ndarray, censored: np.ndarray | None = None) -> np.ndarray:
    """P(L = k) for k = 0..K, from finished jobs' output `lengths` (>= 1) and, where given, `censored`: the tokens
    generated so far by jobs not finished, each saying only L > g (those with g = 0 say nothing).

    Without censored jobs, the empirical distribution. With them, the Kaplan-Meier estimate: the hazard at k is the
    jobs finished at k over the jobs at risk there (finished at k or later, or censored at g >= k), S(k) the product
    of (1 - hazard) up to k. Nothing says how the mass S left past the longest job seen ends, so it ends at the
    constant hazard the observed range had on average (its finished jobs over its tokens at risk): a geometric tail,
    neither rising nor falling, gathered on lengths TAIL_SPACING apart until TAIL_MASS is left (the rest on the last).
    Putting that mass on the longest job seen instead (Efron's tail) reads a heavy tail under heavy censoring as
    alike lengths: every job left would finish there."""
    if censored is not None:
        censored = censored[censored >= 1]
    if censored is None or not len(censored):
        return np.bincount(lengths).astype(np.float64) / len(lengths)
    lmax = max(int(lengths.max()) if len(lengths) else 0, int(censored.max()))
    events = np.bincount(lengths, minlength=lmax + 1).astype(np.float64)
    at_risk = events[::-1].cumsum()[::-1] + np.bincount(censored, minlength=lmax + 1)[::-1].cumsum()[::-1]
    hazard = np.divide(events, at_risk, out=np.zeros(lmax + 1), where=at_risk > 0)
    surv = np.cumprod(1.0 - hazard)  # S(k) = P(L > k)
    pmf = -np.diff(np.concatenate(([1.0], surv)))  # P(L = k) = S(k - 1) - S(k)
    left = surv[lmax]
    if left <= TAIL_MASS:
        pmf[lmax] += left
        return pmf
    rate = min(1.0, events[1:].sum() / at_risk[1:].sum())  # finished per token at risk over the observed range
    # Tail points lmax + e for e on a grid TAIL_SPACING apart; each takes the geometric mass of (previous, e].
    span = int(np.ceil(np.log(TAIL_MASS / left) / np.log1p(-rate))) if rate < 1.0 else 1
    ends, e = [], 1
    while e < span:
        ends.append(e)
        e = max(e + 1, int(e * TAIL_SPACING))
    ends.append(span)
    beyond = left * (1.0 - rate) ** np.array(ends, dtype=np.float64)  # P(L > lmax + e)
    mass = -np.diff(np.concatenate(([left], beyond)))
    mass[-1] += beyond[-1]
    tail = np.zeros(lmax + span + 1)
    tail[:lmax + 1] = pmf
    tail[lmax + np.array(ends)] = mass
    return tail


def median_length(lengths: np.ndarray, censored: np.ndarray | None = None, pmf: np.ndarray | None = None) -> int:
    """The median output length: of the finished lengths with no censored job (as np.median, rounded down), else of
    length_pmf's estimate (the first k whose cumulative probability reaches 1/2; `pmf`: that estimate, if made)."""
    if censored is None or not len(censored[censored >= 1]):
        return int(np.median(lengths))
    if pmf is None:
        pmf = length_pmf(lengths, censored)
    return int(np.searchsorted(np.cumsum(pmf), 0.5 - 1e-12))


def censored_lengths(jobs: Iterable[Job]) -> np.ndarray:
    """The tokens generated so far by the started jobs among `jobs` that have not finished: each says only L > g."""
    return np.fromiter((j.num_generated for j in jobs if j.num_generated and not j.finished), dtype=np.int64)


class LearnedIndex:
    """The Gittins index over a distribution of output lengths (`counts`: P(L = k) for k = 0..lmax, length_pmf's),
    work priced at a decode share d per token (the module docstring's formula)."""

    def __init__(self, counts: np.ndarray, d: float, rows: Sequence[int] | None = None) -> None:
        """rows: the g whose started-job index the table holds (None: every g; the others are left 0)."""
        self.d = d
        lmax = len(counts) - 1
        surv = 1.0 - np.cumsum(counts)  # S(k) = P(L > k), k = 0..lmax
        surv[surv < 1e-12] = 0.0
        # What finishing a job of length l is worth: 1 / l, so the index orders for mean per-token latency (the
        # mean of e2e / output tokens, the paper's metric); a weight of 1 would order for mean latency.
        weight = counts / np.maximum(np.arange(lmax + 1), 1)
        wsurv = weight[::-1].cumsum()[::-1] - weight  # sum over l > k of weight(l)
        wsurv[wsurv < 1e-15] = 0.0
        cum = np.concatenate(([0.0], np.cumsum(surv)))  # cum[k] = sum_{j<k} S(j)
        cum = cum - cum[1]  # sum_{1 <= j < k} S(j) (the first token comes with the prefill)
        # Over k = 0..longest: S(k) = P(L > k); the weighted survival, sum over l > k of P(L = l) / l; and the
        # expected decode work, sum over 1 <= j < k of S(j); the last two also at each threshold t of the support.
        self.surv, self.wsurv, self.cum = surv, wsurv, cum
        support = np.flatnonzero(counts)
        self.support, self.wsurv_t, self.cum_t = support, wsurv[support], cum[support]
        # Started jobs with no prefill left: one row per g = 1..lmax-1, the best threshold t in the support above g.
        table = np.zeros(lmax + 1)
        gs = (np.arange(1, lmax) if rows is None
              else np.array(sorted({g for g in rows if 1 <= g < lmax}), dtype=np.int64))
        if len(gs):
            done = wsurv[gs][:, None] - self.wsurv_t[None, :]
            work = (self.cum_t[None, :] - cum[gs][:, None]) * d
            valid = (support[None, :] > gs[:, None]) & (surv[gs][:, None] > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(valid, done / np.where(work > 0, work, np.inf), 0.0)
            table[gs] = ratio.max(axis=1)
        self.table, self.table_list = table, table.tolist()

    def started(self, g: int) -> float:
        """The index of a job with g >= 1 tokens generated and no prefill left."""
        return self.table_list[g] if g < len(self.table_list) else 0.0

    def with_prefill(self, prefill: np.ndarray, g: int) -> np.ndarray:
        """Indices of jobs with `prefill` seconds of prefill left and g (0 or 1) tokens generated."""
        surv, wsurv, cum = self.surv, self.wsurv, self.cum
        g = min(g, len(surv) - 1)
        mask = self.support > g
        if surv[g] <= 0 or not mask.any():
            return np.zeros(len(prefill))
        done = (wsurv[g] - self.wsurv_t[mask]) / surv[g]
        work = (self.cum_t[mask] - cum[max(g, 1)]) / surv[g] * self.d
        ratio = done[None, :] / (prefill[:, None] + work[None, :] + 1e-12)
        return ratio.max(axis=1)

    def growth(self, median: int) -> float:
        """The index of a job at the median length over that of a job with one token out (0 with no such rows)."""
        table = self.table
        lmax = len(table) - 1
        if lmax < 2:
            return 0.0
        at = table[min(median, lmax - 1)]
        return float(at / table[1]) if table[1] > 0 else (math.inf if at > 0 else 0.0)

    def rises_with_service(self, median: int) -> bool:
        """Whether a job at the median length outranks one with one token out (alike lengths)."""
        return self.growth(median) > 1.0


def index_growth(lengths: Sequence[int], censored: Sequence[int] = ()) -> float:
    """Over these output lengths, the Gittins index of a job halfway through (at the median length) over that of a
    job with one token out: above 1 where a started job is the nearer to finishing (alike lengths: 2-3 for lengths
    uniform over 0.5-1.5x their mean), below 1 on heavy tails (ShareGPT 0.08, Alpaca 0.10, the Azure 2023 traces
    0.6-1.0). `censored`: the tokens so far of started jobs not finished (length_pmf). Two rows of the index, not
    its whole table."""
    arr, cen = np.asarray(lengths, dtype=np.int64), np.asarray(censored, dtype=np.int64)
    pmf = length_pmf(arr, cen)
    median = median_length(arr, cen, pmf)
    return LearnedIndex(pmf, 1.0, rows=(1, min(median, len(pmf) - 2))).growth(median)


class GittinsPolicy(AgePromotedPolicy):
    name = PolicyName.GITTINS
    dynamic_key = True  # a job's index moves as it generates
    fresh_waits_for_started = False  # until the learned index says a started job is nearer its end (_refresh)

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._lengths: deque[int] = deque(maxlen=HISTORY)
        self._since_refresh = 0
        self._price_at(config.max_num_seqs)  # until a refresh prices the work at the batch size running then
        self._learned: LearnedIndex | None = None  # the index learned from self._lengths (None before MIN_HISTORY)
        self._table_list: list[float] | None = None  # its started-job table, as a list (read per job in the hot loop)

    # -- the index -------------------------------------------------------------------------------------------
    def _price_at(self, batch: int) -> None:
        """Price the work at a step of `batch` decoders of DECODE_CONTEXT tokens: the step, the decode share d (a
        decoder's share of the step), and no prefill priced yet."""
        batch = max(1, batch)
        self._decoders = [DECODE_CONTEXT] * batch
        self._step = self.cost.t_dec(batch, DECODE_CONTEXT)  # = batch_cost([], self._decoders)
        self._d = max(self._step / batch, 1e-9)
        self._prefill_memo: dict[int, float] = {}  # prompt tokens left -> prefill work

    def _prefill_left(self, job: Job) -> float:
        if job.num_generated:
            return 0.0
        left = job.prompt_len - max(job.num_computed, job.num_cached_prompt_tokens)
        if left <= 0:
            return 0.0
        work = self._prefill_memo.get(left)
        if work is None:  # a prompt rides in a batch: its share of the step, plus what its tokens add to the step
            added = self.cost.batch_cost([left], self._decoders) - self._step
            work = self._prefill_memo[left] = self._d + max(0.0, added)
        return work

    def index(self, job: Job) -> float:
        """The job's Gittins index (higher runs first), 1/s."""
        g, p = job.num_generated, self._prefill_left(job)
        learned = self._learned_for(job)
        if learned is None:
            return 1.0 / (p + self._d * (g + 1))
        if p == 0.0 and g >= 1:
            return learned.started(g)
        return float(learned.with_prefill(np.array([p]), g)[0])

    def _learned_for(self, job: Job) -> LearnedIndex | None:
        """The learned index that ranks this job (one for all jobs here; a subclass may condition it on the job)."""
        return self._learned

    def _fresh_indices(self, fresh: list[Job]) -> np.ndarray:
        """The indices of fresh jobs (nothing generated: their prefill alone tells them apart), computed for all of
        them at once (thousands wait past capacity), a block of rows at a time."""
        prefill = np.array([self._prefill_left(job) for job in fresh])
        learned = self._learned
        if learned is None:
            return 1.0 / (prefill + self._d)
        return np.concatenate([learned.with_prefill(prefill[i:i + RERANK_BLOCK], 0)
                               for i in range(0, len(fresh), RERANK_BLOCK)])

    def _refresh(self) -> None:
        lengths = np.asarray(self._lengths, dtype=np.int64)
        censored = self.censored_lengths()
        pmf = length_pmf(lengths, censored)
        learned = self._learned = LearnedIndex(pmf, self._d)
        self._table_list = learned.table_list
        # The batch rule follows the index: where a job halfway through (the median length) outranks one that has
        # just started, started jobs are the nearer to finishing, and their room comes before a new job's.
        self.fresh_waits_for_started = learned.rises_with_service(median_length(lengths, censored, pmf))
        self._rerank()

    def censored_lengths(self) -> np.ndarray:
        """The tokens generated so far by every started job held (not finished: each says only L > g)."""
        return censored_lengths(self._seq)

    def _rerank(self) -> None:
        """Every job's index moved: re-sort the fresh list now, the started list at the next tick."""
        if self._fresh:
            fresh, starving = self._fresh, self._starving
            index = self._fresh_indices(fresh)
            ranks = [(job.priority, STARVING_KEY + job.arrival_time if job in starving else -float(x), self._seq[job])
                     for job, x in zip(fresh, index)]
            order = sorted(zip(ranks, fresh))
            self._fresh = [job for _, job in order]
            self._fresh_ranks = [rank for rank, _ in order]
            for rank, job in order:
                self._fixed_rank[job] = rank
        self._tick_rank = {}
        self._sorted = False
        self._positions = None

    def _order_key(self, job: Job) -> float:
        g, table = job.num_generated, self._table_list
        if g and table is not None:  # started, prefill done: the table (the tick re-ranks each job of the batch)
            return -table[g] if g < len(table) else 0.0
        return -self.index(job)

    # -- learning from finished jobs ---------------------------------------------------------------------------
    def remove(self, job: Job) -> None:
        held = job in self._seq
        super().remove(job)
        if held and job.finished and job.num_generated >= 1:
            self._lengths.append(job.num_generated)
            self._since_refresh += 1
            if (self._learned is None and len(self._lengths) >= MIN_HISTORY) or (
                    self._learned is not None and self._since_refresh >= REFRESH_EVERY):
                self._since_refresh = 0
                running = len(self._running)
                if running:
                    self._price_at(running)
                self._refresh()
