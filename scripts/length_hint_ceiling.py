"""What an output-length predictor could buy at and past capacity (issue 24's goals: mean per-token latency within
2x of the SRPT oracle at 1.5x FCFS's capacity, P95 within 1.3x at 1.0x), measured two ways:

    python scripts/length_hint_ceiling.py accuracy                       # a predictor trained on ShareGPT's prompts
    python scripts/length_hint_ceiling.py ceiling --loads 1.0,1.5 --seeds 5 --sigmas 0,0.5,1,2.4

- `accuracy`: how well a prompt predicts its answer's length here. Every human turn of the ShareGPT conversations
  (../shared/datasets/sharegpt/, the text behind sharegpt_lengths.csv) followed by a ChatGPT answer, through vLLM's
  length filter, lengths in GPT-2/OPT BPE tokens. A ridge regression of log(output tokens) on hashed word and
  word-pair features of the prompt plus log(prompt tokens), trained on four fifths of the conversations and scored
  on the fifth it never saw (5 folds; every prediction is out of fold). Prints Spearman's rank correlation of
  prediction and truth, and that of the prompt's length alone.
- `ceiling`: what a hint of a given quality buys, whatever the predictor. Each request gets a hint of its output
  length, true length x exp(sigma z) with z ~ N(0, 1) drawn per request (sigma 0: the true length), and the Gittins
  order (scheduler/gittins.py) learns one index per quartile of the hint, from the finished jobs of that quartile
  (HintedGittinsPolicy): the optimal order for a job whose length is drawn from its quartile's distribution. Beside
  it, on the same traces: the pooled Gittins order (no hint), skip-join (the default) and the SRPT oracle. The
  capacity section's setup (scripts/steady_state.py: OPT-13B A100-40GB profile, ShareGPT lengths, 3,000 requests,
  the middle 80% of arrivals, loads in units of FCFS's capacity C, paired ratios per seed with a 95% interval).

The hinted order is a study, not a server option: a hint of sigma > 0 is a stand-in for a predictor of that rank
correlation (printed beside it), and sigma 0 hands the scheduler each job's quartile, which no server knows.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import re
import sys
import warnings
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from steady_state import Setup, fmt, ratio_stat, run_point, stat, trace_for  # noqa: E402

from fastserve.bench.workload import LengthFilter  # noqa: E402
from scheduler.gittins import HISTORY, MIN_HISTORY, RERANK_BLOCK, STARVING_KEY, GittinsPolicy, LearnedIndex  # noqa: E402
from scheduler.job import Job  # noqa: E402

SHAREGPT_TEXT = REPO.parent / "shared" / "datasets" / "sharegpt" / "sharegpt_v3_random1000.json"
GPT2_BPE = REPO.parent / "shared" / "datasets" / "gpt2-bpe"
C_SHAREGPT = 2.980  # FCFS's capacity on this setup (docs/experiments.md, capacity section; --capacity to change)
BASELINES = ("srpt", "skip-join-mlfq", "gittins")


# -- the hinted order ------------------------------------------------------------------------------------------------
class HintedGittinsPolicy(GittinsPolicy):
    """The Gittins order with one learned index per bucket of a per-job length hint (bucket k: edges[k-1] <= hint <
    edges[k]), each learned from the output lengths of the finished jobs of its bucket; the pooled index ranks a
    bucket's jobs until that bucket has MIN_HISTORY finished jobs. Everything else is GittinsPolicy's."""

    def __init__(self, config, cost, hint: Callable[[Job], float], edges: Sequence[float]) -> None:
        super().__init__(config, cost)
        self._hint, self._edges = hint, list(edges)
        self._bucket_lengths = [deque(maxlen=HISTORY) for _ in range(len(self._edges) + 1)]
        self._bucket_learned: list[LearnedIndex | None] = [None] * (len(self._edges) + 1)
        self._bucket_of: dict[Job, int] = {}
        self.hints: list[tuple[float, int]] = []  # (hint, output tokens asked) per job, for the hint's quality

    def bucket(self, job: Job) -> int:
        b = self._bucket_of.get(job)
        if b is None:
            hint = self._hint(job)
            self.hints.append((hint, job.max_new_tokens))
            b = self._bucket_of[job] = bisect.bisect_right(self._edges, hint)
        return b

    def _learned_for(self, job: Job) -> LearnedIndex | None:
        if self._learned is None:  # before any distribution: the pooled order's (shortest prefill, then LAS)
            return None
        return self._bucket_learned[self.bucket(job)] or self._learned

    def _key(self, job: Job) -> float:
        if job in self._starving:
            return STARVING_KEY + job.arrival_time
        return -self.index(job)

    def _fresh_indices(self, fresh: list[Job]) -> np.ndarray:
        prefill = np.array([self._prefill_left(job) for job in fresh])
        buckets = np.array([self.bucket(job) for job in fresh])
        out = np.empty(len(fresh))
        for b in np.unique(buckets):
            rows = np.flatnonzero(buckets == b)
            learned = self._bucket_learned[b] or self._learned
            for i in range(0, len(rows), RERANK_BLOCK):
                block = rows[i:i + RERANK_BLOCK]
                out[block] = learned.with_prefill(prefill[block], 0)
        return out

    def _refresh(self) -> None:
        for b, lengths in enumerate(self._bucket_lengths):
            if len(lengths) >= MIN_HISTORY:
                self._bucket_learned[b] = LearnedIndex(np.asarray(lengths, dtype=np.int64), self._d)
        super()._refresh()

    def remove(self, job: Job) -> None:
        if job in self._seq and job.finished and job.num_generated >= 1:
            self._bucket_lengths[self.bucket(job)].append(job.num_generated)
        super().remove(job)
        self._bucket_of.pop(job, None)


def noisy_hint(sigma: float, seed: int) -> Callable[[Job], float]:
    """A hint of the output length: the true length (the simulator asks each request for exactly its dataset
    length: max_new_tokens) x exp(sigma z), z ~ N(0, 1) drawn per job from (seed, job id)."""
    def hint(job: Job) -> float:
        z = random.Random(f"{seed}:{job.job_id}").gauss(0.0, 1.0)
        return job.max_new_tokens * math.exp(sigma * z)
    return hint


def hint_edges(sigma: float, buckets: int) -> list[float]:
    """The hint's quantiles (buckets - 1 edges) over the dataset's filtered output lengths (one 3,000-request
    sample, its own draws): what a deployment knows of its predictor's outputs."""
    trace, _ = trace_for(Setup(), 1.0, 0)
    rng = np.random.default_rng(12345)
    lengths = np.array([out for _, _, out in trace], dtype=float)
    hints = np.repeat(lengths, 10) * np.exp(sigma * rng.standard_normal(len(lengths) * 10))
    return [float(x) for x in np.quantile(hints, [k / buckets for k in range(1, buckets)])]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties ranked by position: fine for the continuous predictions here)."""
    ra = np.argsort(np.argsort(np.asarray(a, dtype=float), kind="stable"), kind="stable")
    rb = np.argsort(np.argsort(np.asarray(b, dtype=float), kind="stable"), kind="stable")
    return float(np.corrcoef(ra, rb)[0, 1])


def run_one(task: tuple[str, float | None, list[float] | None, float, int]) -> dict:
    """One simulation: a baseline policy by name, or ("hinted", sigma, edges, rate, seed)."""
    label, sigma, edges, rate, seed = task
    if label != "hinted":
        out = run_point(Setup(), label, rate, seed)
        return {"label": label} | out
    made: list[HintedGittinsPolicy] = []

    def make(engine):
        made.append(HintedGittinsPolicy(engine.scheduler.config, engine.cost_model, noisy_hint(sigma, seed), edges))
        return made[0]

    out = run_point(Setup(), "gittins", rate, seed, make_scheduler=make)
    hints = made[0].hints
    return {"label": f"hinted sigma={sigma:g}", "hint_spearman": spearman([h for h, _ in hints], [n for _, n in hints])
            } | out


def ceiling(args) -> int:
    loads = [float(x) for x in args.loads.split(",")]
    sigmas = [float(x) for x in args.sigmas.split(",")]
    seeds = list(range(args.seeds))
    edges = {s: hint_edges(s, args.buckets) for s in sigmas}
    tasks = [(b, None, None, load * args.capacity, seed) for load in loads for b in BASELINES for seed in seeds]
    tasks += [("hinted", s, edges[s], load * args.capacity, seed) for load in loads for s in sigmas for seed in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run_one, tasks))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(f"C = {args.capacity} req/s; {len(seeds)} seeds; hint buckets: {args.buckets} (quantiles of the hint)")
    for load in loads:
        rate = load * args.capacity
        rows = [r for r in results if abs(r["rate"] - rate) < 1e-9]
        labels = list(dict.fromkeys(r["label"] for r in rows))
        by = {lab: sorted((r for r in rows if r["label"] == lab), key=lambda r: r["seed"]) for lab in labels}
        oracle = by["srpt"]
        print(f"\n{load:g}C ({rate:.3f} req/s)\n")
        print("| order | hint's rank correlation | mean s/token | P95 | mean / oracle | P95 / oracle | served req/s |")
        print("|---|---|---|---|---|---|---|")
        for lab in labels:
            rs = by[lab]
            rho = f"{stat([r['hint_spearman'] for r in rs]).mean:.2f}" if "hint_spearman" in rs[0] else "-"
            mean = [r["mean_per_token_s"] for r in rs]
            tail = [r["p95_per_token_s"] for r in rs]
            print(f"| {lab} | {rho} | {fmt(stat(mean))} | {fmt(stat(tail))} | "
                  f"{fmt(ratio_stat(mean, [r['mean_per_token_s'] for r in oracle]))} | "
                  f"{fmt(ratio_stat(tail, [r['p95_per_token_s'] for r in oracle]))} | "
                  f"{fmt(stat([r['served_rate'] for r in rs]))} |")
    return 0


# -- the predictor's accuracy ----------------------------------------------------------------------------------------
def prompt_answer_pairs(path: Path = SHAREGPT_TEXT) -> list[tuple[int, str, int, int]]:
    """(conversation, prompt text, prompt tokens, answer tokens) for every human turn followed by a ChatGPT answer,
    through vLLM's length filter (the one every workload here uses)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(GPT2_BPE / "encoder.json"), str(GPT2_BPE / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    keep = LengthFilter()
    pairs = []
    for conv, item in enumerate(json.loads(path.read_text())):
        turns = item["conversations"]
        for ask, answer in zip(turns, turns[1:]):
            if ask["from"] == "human" and answer["from"] == "gpt":
                n_in, n_out = len(tok.encode(ask["value"]).ids), len(tok.encode(answer["value"]).ids)
                if keep.keeps(n_in, n_out):
                    pairs.append((conv, ask["value"], n_in, n_out))
    return pairs


FEATURE_BITS = 20


def features(text: str, prompt_tokens: int) -> dict[int, float]:
    """Hashed words and word pairs of the prompt (its first 400 words, lower case), unit length, plus log(prompt
    tokens) and a bias in the two last columns."""
    words = re.findall(r"[a-z0-9]+|[^\sa-z0-9]", text.lower())[:400]
    grams = words + [a + " " + b for a, b in zip(words, words[1:])]
    cols = {zlib.crc32(g.encode()) % (1 << FEATURE_BITS) for g in grams}
    norm = 1.0 / math.sqrt(max(len(cols), 1))
    out = dict.fromkeys(cols, norm)
    out[1 << FEATURE_BITS] = math.log1p(prompt_tokens)
    out[(1 << FEATURE_BITS) + 1] = 1.0
    return out


def out_of_fold_predictions(pairs, folds: int = 5, ridge: float = 1.0) -> np.ndarray:
    """Kernel ridge regression (a linear kernel over features()) of log(output tokens); fold k holds the
    conversations numbered k mod folds and is predicted by a model fitted on the others."""
    import torch

    warnings.filterwarnings("ignore", message="Sparse")  # torch's notes that sparse tensors are beta
    rows, cols, vals = [], [], []
    for i, (_, text, n_in, _) in enumerate(pairs):
        for c, v in features(text, n_in).items():
            rows.append(i)
            cols.append(c)
            vals.append(v)
    x = torch.sparse_coo_tensor(np.array([rows, cols]), torch.tensor(vals, dtype=torch.float64),
                                (len(pairs), (1 << FEATURE_BITS) + 2)).coalesce()
    gram = torch.sparse.mm(x, x.t().coalesce()).to_dense().numpy()
    y = np.log(np.array([n_out for *_, n_out in pairs], dtype=float))
    fold = np.array([conv % folds for conv, *_ in pairs])
    pred = np.empty(len(pairs))
    for k in range(folds):
        train, test = fold != k, fold == k
        centre = y[train].mean()
        alpha = np.linalg.solve(gram[np.ix_(train, train)] + ridge * np.eye(int(train.sum())), y[train] - centre)
        pred[test] = gram[np.ix_(test, train)] @ alpha + centre
    return np.exp(pred)


def accuracy(args) -> int:
    pairs = prompt_answer_pairs()
    truth = [n_out for *_, n_out in pairs]
    print(f"{len(pairs)} prompt/answer pairs of {len({p[0] for p in pairs})} conversations (vLLM's length filter)")
    print(f"prompt length alone: Spearman {spearman([p[2] for p in pairs], truth):.3f}")
    for ridge in args.ridge:
        pred = out_of_fold_predictions(pairs, args.folds, ridge)
        first = [i for i, p in enumerate(pairs) if i == 0 or pairs[i - 1][0] != p[0]]
        err = np.abs(np.log(pred) - np.log(truth))
        print(f"ridge {ridge:g}: out-of-fold Spearman {spearman(pred, truth):.3f} (first turns only "
              f"{spearman(pred[first], [truth[i] for i in first]):.3f}); median |log error| {np.median(err):.2f} "
              f"(x{math.exp(np.median(err)):.2f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    acc = sub.add_parser("accuracy", help="out-of-fold accuracy of a prompt-text predictor on ShareGPT")
    acc.add_argument("--folds", type=int, default=5)
    acc.add_argument("--ridge", type=lambda s: [float(x) for x in s.split(",")], default=[0.3, 1.0, 3.0])
    ceil = sub.add_parser("ceiling", help="the hinted Gittins order against the oracle in the simulator")
    ceil.add_argument("--loads", default="1.0,1.5", help="comma-separated multiples of --capacity")
    ceil.add_argument("--capacity", type=float, default=C_SHAREGPT, help="FCFS's capacity C, req/s")
    ceil.add_argument("--seeds", type=int, default=5)
    ceil.add_argument("--sigmas", default="0,0.5,1,2.4", help="comma-separated hint noise (log-normal sigma)")
    ceil.add_argument("--buckets", type=int, default=4, help="hint buckets (quantiles of the hint)")
    ceil.add_argument("--jobs", type=int, default=2)
    ceil.add_argument("--out", type=Path, help="write every run's metrics here (JSON)")
    args = ap.parse_args(argv)
    if args.cmd == "ceiling" and (args.seeds < 2 or args.buckets < 1):
        ap.error("--seeds must be >= 2 (an interval) and --buckets >= 1")
    return accuracy(args) if args.cmd == "accuracy" else ceiling(args)


if __name__ == "__main__":
    raise SystemExit(main())
