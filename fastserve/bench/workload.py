"""Workloads for the load generator, the simulator and the benchmarks: what to send, and when.

What this is: dataset readers that turn a file into `WorkItem`s (prompt length, output length, prompt
text when the dataset has it, arrival time), synthetic length distributions, and `load_workload()`,
which picks items and gives them arrival times (the arrival processes live in arrivals.py).

    ShareGPT JSON   [{"id", "conversations": [{"from", "value"}]}]: the first human turn and the gpt turn
                    right after it; vLLM benchmark_serving's filters (see `LengthFilter`). Whole
                    conversations (every human turn and the gpt answer after it): read_sharegpt_conversations,
                    for the multi-turn replay (multiturn.py)
    Alpaca JSON     [{"instruction", "input", "output"}]: instruction + "\\n" + input (if non-empty) -> output
    Azure 2023 CSV  TIMESTAMP,ContextTokens,GeneratedTokens: real arrival times and lengths, no text
    lengths CSV     input_tokens,output_tokens (the *_lengths.csv files), no text
    synthetic       fixed, uniform (+-range ratio) or input:output-ratio lengths, no text

Token counts exclude BOS/EOS (as the *_lengths.csv files do); a caller passes `count_tokens(text) -> int`
(tokens.py builds one from a model directory or GPT-2's BPE files).
What this is not: an HTTP client (loadgen.py) or a tokenizer (engine/tokenizer.py). Paths always come from
the caller; nothing here knows where datasets live. A malformed file raises `DatasetError` naming the file
and the record index (JSON) or line number (CSV).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from fastserve.bench.arrivals import gamma_arrivals, trace_arrivals

CountTokens = Callable[[str], int]
DATASETS = ("sharegpt", "alpaca", "azure-conv", "azure-code", "lengths", "synthetic")
TRACE_DATASETS = ("azure-conv", "azure-code")  # arrival times come from the file


@dataclass(frozen=True)
class WorkItem:
    prompt_len: int  # prompt tokens (no BOS)
    output_len: int  # tokens to generate
    prompt_text: str | None  # None for datasets without text (traces, lengths, synthetic)
    arrival_s: float  # seconds after the start of the run


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and the record or line."""


@dataclass(frozen=True)
class LengthFilter:
    """vLLM benchmark_serving's ShareGPT filter: drop pairs that are too short or do not fit the context."""

    min_len: int = 4  # both prompt and output need at least this many tokens
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def keeps(self, prompt_len: int, output_len: int) -> bool:
        return (prompt_len >= self.min_len and output_len >= self.min_len
                and prompt_len <= self.max_prompt_len and prompt_len + output_len <= self.max_total_len)


# -- readers -------------------------------------------------------------------------------------------------
def _load_json_list(path: Path) -> list:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return data


def _field(path: Path, where: str, record: object, name: str, kind: type) -> object:
    """record[name], checked to be a `kind`; `where` names the record ("record 7")."""
    if not isinstance(record, dict):
        raise DatasetError(f"{path}: {where}: expected an object, got {type(record).__name__}")
    if name not in record:
        raise DatasetError(f"{path}: {where}: missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind):
        raise DatasetError(f"{path}: {where}: field {name!r} should be {kind.__name__}, got {type(value).__name__}")
    return value


def _conversation_turns(path: Path, i: int, record) -> list[dict]:
    """Record i's `conversations`, each turn checked to have string `from` and `value` fields."""
    turns = _field(path, f"record {i}", record, "conversations", list)
    for j, turn in enumerate(turns):
        for name in ("from", "value"):
            _field(path, f"record {i}, conversations[{j}]", turn, name, str)
    return turns


def read_sharegpt(path: str | Path, count_tokens: CountTokens,
                  length_filter: LengthFilter | None = LengthFilter()) -> list[WorkItem]:
    """The first human->gpt pair of each conversation; conversations without one are skipped."""
    path = Path(path)
    items = []
    for i, record in enumerate(_load_json_list(path)):
        turns = _conversation_turns(path, i, record)
        first = next((j for j, t in enumerate(turns) if t["from"] == "human"), None)
        if first is None or first + 1 >= len(turns) or turns[first + 1]["from"] != "gpt":
            continue
        prompt, answer = turns[first]["value"], turns[first + 1]["value"]
        items.append(WorkItem(count_tokens(prompt), count_tokens(answer), prompt, 0.0))
    return apply_filter(items, length_filter)


@dataclass(frozen=True)
class Conversation:
    """A ShareGPT conversation as (user text, the dataset's answer text) turns, in order."""

    conversation_id: str
    turns: tuple[tuple[str, str], ...]


def read_sharegpt_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation with at least one human turn answered by a gpt turn: its human -> gpt pairs, in
    order (a human turn not followed by a gpt answer, and anything else, is skipped)."""
    path = Path(path)
    out = []
    for i, record in enumerate(_load_json_list(path)):
        turns = _conversation_turns(path, i, record)
        pairs = tuple((turns[j]["value"], turns[j + 1]["value"]) for j in range(len(turns) - 1)
                      if turns[j]["from"] == "human" and turns[j + 1]["from"] == "gpt")
        if pairs:
            out.append(Conversation(str(record.get("id", i)), pairs))
    return out


def read_alpaca(path: str | Path, count_tokens: CountTokens,
                length_filter: LengthFilter | None = None) -> list[WorkItem]:
    """instruction + "\\n" + input (when non-empty) as the prompt, output as the answer."""
    path = Path(path)
    items = []
    for i, record in enumerate(_load_json_list(path)):
        instruction, extra, output = (_field(path, f"record {i}", record, name, str)
                                      for name in ("instruction", "input", "output"))
        prompt = instruction + ("\n" + extra if extra else "")
        items.append(WorkItem(count_tokens(prompt), count_tokens(output), prompt, 0.0))
    return apply_filter(items, length_filter)


def _csv_rows(path: Path, columns: tuple[str, ...]):
    """(line number, row dict) for each data row, after checking the header has `columns`."""
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise DatasetError(f"{path}: line 1: header lacks column(s) {', '.join(missing)}; "
                               f"expected {','.join(columns)}")
        for row in reader:
            if None in row or any(row.get(c) is None for c in columns):
                raise DatasetError(f"{path}: line {reader.line_num}: expected {len(reader.fieldnames)} fields")
            yield reader.line_num, row


def _count(path: Path, line: int, row: dict, column: str, minimum: int) -> int:
    text = row[column].strip()
    try:
        value = int(text)
    except ValueError:
        raise DatasetError(f"{path}: line {line}: {column} {text!r} is not an integer") from None
    if value < minimum:
        raise DatasetError(f"{path}: line {line}: {column} is {value}; it must be at least {minimum}")
    return value


def _timestamp(path: Path, line: int, text: str) -> float:
    """Seconds since the epoch of "2023-11-16 18:15:46.6805900" (7 fraction digits; py3.10 reads only 6)."""
    whole, _, fraction = text.strip().partition(".")
    try:
        base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        return base.timestamp() + (float("0." + fraction) if fraction else 0.0)
    except ValueError:
        raise DatasetError(f"{path}: line {line}: TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'") \
            from None


def read_azure_trace(path: str | Path, length_filter: LengthFilter | None = None) -> list[WorkItem]:
    """Azure LLM inference trace 2023: arrival_s = seconds after the first request (kept when filtering)."""
    path = Path(path)
    stamps, items = [], []
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        stamp = _timestamp(path, line, row["TIMESTAMP"])
        if stamps and stamp < stamps[-1]:
            raise DatasetError(f"{path}: line {line}: TIMESTAMP goes backwards")
        stamps.append(stamp)
        items.append(WorkItem(_count(path, line, row, "ContextTokens", 0),
                              _count(path, line, row, "GeneratedTokens", 0), None, 0.0))
    items = [replace(it, arrival_s=t) for it, t in zip(items, trace_arrivals(stamps))]
    return apply_filter(items, length_filter)


def read_lengths(path: str | Path, length_filter: LengthFilter | None = None) -> list[WorkItem]:
    """A *_lengths.csv file: input_tokens,output_tokens per row."""
    path = Path(path)
    items = [WorkItem(_count(path, line, row, "input_tokens", 0), _count(path, line, row, "output_tokens", 0),
                      None, 0.0)
             for line, row in _csv_rows(path, ("input_tokens", "output_tokens"))]
    return apply_filter(items, length_filter)


def synthetic_lengths(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                      io_ratio: float | None = None, seed: int = 0) -> list[WorkItem]:
    """n items of fixed lengths, or uniform within +-range_ratio of them (vLLM's random dataset).

    io_ratio (the paper's Fig. 14 sweeps) keeps input_len + output_len and splits it input:output = io_ratio:1.
    """
    if n < 0 or input_len < 1 or output_len < 1 or not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"synthetic lengths need n >= 0, lengths >= 1 and 0 <= range_ratio < 1; got n={n}, "
                         f"input_len={input_len}, output_len={output_len}, range_ratio={range_ratio}")
    if io_ratio is not None:
        if io_ratio <= 0:
            raise ValueError(f"io_ratio must be > 0, got {io_ratio}")
        total = input_len + output_len
        input_len = min(total - 1, max(1, round(total * io_ratio / (1 + io_ratio))))
        output_len = total - input_len
    rng = random.Random(seed)

    def draw(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - range_ratio)), int(center * (1 + range_ratio))))

    return [WorkItem(draw(input_len), draw(output_len), None, 0.0) for _ in range(n)]


def apply_filter(items: list[WorkItem], length_filter: LengthFilter | None) -> list[WorkItem]:
    if length_filter is None:
        return items
    return [it for it in items if length_filter.keeps(it.prompt_len, it.output_len)]


# -- picking items and timing them ------------------------------------------------------------------------------
def select(items: list[WorkItem], n: int, seed: int, keep_order: bool) -> list[WorkItem]:
    """n items: the first n (traces, whose order is their timing) or a seeded sample (with replacement
    only when n exceeds the dataset)."""
    if not items:
        raise DatasetError("the dataset has no items left (after filtering)")
    if keep_order:
        return items[:n]
    rng = random.Random(seed)
    if n <= len(items):
        return rng.sample(items, n)
    return [rng.choice(items) for _ in range(n)]


def load_workload(name: str, n: int, *, path: str | Path | None = None, count_tokens: CountTokens | None = None,
                  rate: float | None = None, burstiness: float = 1.0, trace_speedup: float = 1.0,
                  length_filter: LengthFilter | None = None, synthetic: dict | None = None,
                  seed: int = 0, stats: dict | None = None) -> list[WorkItem]:
    """n WorkItems of dataset `name`, timed by a gamma process at `rate` (burstiness 1 = Poisson; inf = all at
    once). rate None: trace datasets keep their timestamps (divided by trace_speedup), others get inf.
    `stats`, when given, receives what the length filter did: {"read": items in the dataset, "kept": after
    the filter, "dropped": read - kept, "filter": the filter's description} (see filter_line)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if name != "synthetic" and path is None:
        raise ValueError(f"dataset {name!r} needs a path (--dataset-path)")
    if name in ("sharegpt", "alpaca") and count_tokens is None:
        raise ValueError(f"dataset {name!r} needs a token counter (--tokenizer DIR or --gpt2-bpe DIR)")
    if name == "sharegpt":
        length_filter = length_filter or LengthFilter()
        items = read_sharegpt(path, count_tokens, None)
    elif name == "alpaca":
        items = read_alpaca(path, count_tokens, None)
    elif name in TRACE_DATASETS:
        items = read_azure_trace(path, None)
    elif name == "lengths":
        items = read_lengths(path, None)
    else:
        items = synthetic_lengths(n, seed=seed, **(synthetic or {}))
    read = len(items)
    items = apply_filter(items, length_filter)
    if stats is not None:
        stats.update(read=read, kept=len(items), dropped=read - len(items), filter=describe_filter(length_filter))
    if not items:
        raise DatasetError(f"{path or name}: no items left after filtering by {length_filter}")
    picked = select(items, n, seed, keep_order=name in TRACE_DATASETS)
    if name in TRACE_DATASETS and rate is None:
        times = trace_arrivals([it.arrival_s for it in picked], trace_speedup)
    else:
        times = gamma_arrivals(len(picked), float("inf") if rate is None else rate, burstiness, seed)
    return [replace(it, arrival_s=t) for it, t in zip(picked, times)]


def describe_filter(length_filter: LengthFilter | None) -> str:
    if length_filter is None:
        return "no length filter"
    if length_filter == LengthFilter():
        return "vLLM's length filter (prompt and output >= 4, prompt <= 1024, total <= 2048 tokens)"
    return (f"length filter (prompt and output >= {length_filter.min_len}, prompt <= {length_filter.max_prompt_len},"
            f" total <= {length_filter.max_total_len} tokens)")


def filter_line(stats: dict) -> str:
    """One line saying what the length filter dropped, from load_workload's `stats`."""
    share = stats["dropped"] / stats["read"] if stats["read"] else 0.0
    return f"{stats['filter']}: dropped {stats['dropped']} of {stats['read']} dataset items ({share:.1%})"
