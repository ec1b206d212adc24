"""fastserve/bench/workload.py and fastserve/bench/arrivals.py: dataset readers on the project's shared files (marked
`datasets`) and on small files in the same formats, malformed files, synthetic lengths, and the arrival processes
(seeded, with the right means and burstiness)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from fastserve.bench import tokens as loadgen_tokenizer
from fastserve.bench import workload
from fastserve.bench.arrivals import gamma_arrivals, poisson_arrivals, trace_arrivals
from fastserve.bench.workload import DatasetError, LengthFilter, WorkItem
from tests.conftest import DATA
from tests.conftest import shared_dataset as dataset


@pytest.fixture(scope="module")
def gpt2_count():
    return loadgen_tokenizer.gpt2_bpe_counter(DATA / "gpt2-bpe").count


def lengths_csv(relpath: str) -> list[tuple[int, int]]:
    with open(dataset(relpath), newline="") as f:
        return [(int(r["input_tokens"]), int(r["output_tokens"])) for r in csv.DictReader(f)]


# -- readers on the shared files ------------------------------------------------------------------------------
@pytest.mark.datasets
def test_sharegpt_takes_the_first_human_gpt_pair_with_the_published_lengths(gpt2_count):
    items = workload.read_sharegpt(dataset("sharegpt/sharegpt_v3_random1000.json"), gpt2_count, length_filter=None)
    # sharegpt_lengths.csv was derived the same way (first human turn, the gpt turn after it, GPT-2 BPE).
    assert [(it.prompt_len, it.output_len) for it in items] == lengths_csv("sharegpt_lengths.csv")
    assert len(items) == 991 and all(it.prompt_text is not None and it.arrival_s == 0.0 for it in items)


@pytest.mark.datasets
def test_sharegpt_applies_vllms_filter_by_default(gpt2_count):
    items = workload.read_sharegpt(dataset("sharegpt/sharegpt_v3_random1000.json"), gpt2_count)
    expected = [(i, o) for i, o in lengths_csv("sharegpt_lengths.csv")
                if i >= 4 and o >= 4 and i <= 1024 and i + o <= 2048]
    assert [(it.prompt_len, it.output_len) for it in items] == expected
    assert 100 < len(items) < 991


@pytest.mark.datasets
def test_alpaca_joins_instruction_and_input_and_matches_the_published_lengths(gpt2_count):
    path = dataset("alpaca/alpaca_5000.json")
    items = workload.read_alpaca(path, gpt2_count)
    assert [(it.prompt_len, it.output_len) for it in items] == lengths_csv("alpaca_lengths.csv")
    records = json.loads(path.read_text())
    with_input = next(i for i, r in enumerate(records) if r["input"])
    without = next(i for i, r in enumerate(records) if not r["input"])
    assert items[with_input].prompt_text == records[with_input]["instruction"] + "\n" + records[with_input]["input"]
    assert items[without].prompt_text == records[without]["instruction"]


def test_sharegpt_and_alpaca_readers_on_small_files_counted_with_gpt2_bpe(tmp_path, gpt2_count):
    """The readers' rules on files written here in the published formats (the datasets tests above check them on
    the whole shared files): ShareGPT's first human turn and the gpt turn right after it, no pair no item;
    Alpaca's instruction, then "\\n" and the input when there is one."""
    human = "What's a KV cache, in one line?"
    answer = "The keys and values of past tokens, kept so they are not recomputed."
    sharegpt = [
        {"id": "a_0", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": human},
                                        {"from": "gpt", "value": answer}, {"from": "human", "value": "More?"}]},
        {"id": "b_1", "conversations": [{"from": "gpt", "value": "A chunk that starts mid-answer."}]},  # no human
        {"id": "c_0", "conversations": [{"from": "human", "value": "Hi"}, {"from": "human", "value": "Hello?"}]},
    ]
    items = workload.read_sharegpt(write(tmp_path, "s.json", json.dumps(sharegpt)), gpt2_count, length_filter=None)
    assert [(it.prompt_text, it.prompt_len, it.output_len) for it in items] == [
        (human, gpt2_count(human), gpt2_count(answer))]
    assert gpt2_count(human) == 11  # transformers GPT2Tokenizer: What 's Ġa ĠK V Ġcache , Ġin Ġone Ġline ?
    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
              {"instruction": "Name a colour.", "input": "", "output": "Blue."}]
    items = workload.read_alpaca(write(tmp_path, "a.json", json.dumps(alpaca)), gpt2_count)
    assert [it.prompt_text for it in items] == ["Add the numbers.\n2 and 3", "Name a colour."]
    assert [(it.prompt_len, it.output_len) for it in items] == [
        (gpt2_count("Add the numbers.\n2 and 3"), 1), (gpt2_count("Name a colour."), 2)]


@pytest.mark.datasets
@pytest.mark.parametrize("name, count", [("conv", 19366), ("code", 8819)])
def test_azure_trace_has_increasing_arrivals_over_about_an_hour(name, count):
    items = workload.read_azure_trace(dataset(f"azure_llm_trace_2023/AzureLLMInferenceTrace_{name}.csv"))
    assert len(items) == count
    times = [it.arrival_s for it in items]
    assert times[0] == 0.0 and all(a <= b for a, b in zip(times, times[1:]))
    assert 3000 < times[-1] < 3700  # 2023-11-16 18:15/18:17 -> 19:14
    assert all(it.prompt_len >= 1 and it.output_len >= 0 and it.prompt_text is None for it in items)


def test_azure_trace_reads_sub_second_timestamps(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:16:00,10,2\n")
    items = workload.read_azure_trace(path)
    assert [it.arrival_s for it in items] == pytest.approx([0.0, 4.314579, 13.31941])
    assert [(it.prompt_len, it.output_len) for it in items] == [(374, 44), (396, 109), (10, 2)]


@pytest.mark.datasets
@pytest.mark.parametrize("name, count", [("alpaca_lengths.csv", 5000), ("sharegpt_lengths.csv", 991)])
def test_lengths_csv(name, count):
    items = workload.read_lengths(dataset(name))
    assert len(items) == count and [(it.prompt_len, it.output_len) for it in items] == lengths_csv(name)


def test_model_tokenizer_counts_without_bos(tiny_model_dir):
    from engine.tokenizer import Tokenizer

    count = loadgen_tokenizer.model_dir_counter(tiny_model_dir, "test").count
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    text = "Hello world, how are you today?"
    assert count(text) == len(tok.encode(text, add_special_tokens=False)) > 0
    assert count(text) == len(tok.encode(text)) - 1  # the tokenizer itself prepends BOS


# -- the vLLM filter's boundaries -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, output, kept", [
    (3, 100, False), (4, 4, True), (100, 3, False), (1024, 1024, True), (1025, 4, False), (1000, 1048, True),
    (1000, 1049, False)])
def test_length_filter_boundaries(prompt, output, kept):
    assert LengthFilter().keeps(prompt, output) is kept


# -- malformed files ----------------------------------------------------------------------------------------------
def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


count_words = lambda text: len(text.split())


@pytest.mark.parametrize("text, where", [
    ("[{", "not valid JSON"),
    ('{"conversations": []}', "expected a JSON list"),
    ('[{"conversations": []}, {"id": "x"}]', "record 1: missing field 'conversations'"),
    ('[{"conversations": "hi"}]', "record 0: field 'conversations' should be list, got str"),
    ('[{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt"}]}]',
     "record 0, conversations[1]: missing field 'value'"),
    ('[{"conversations": [{"from": "human", "value": 7}]}]', "record 0, conversations[0]: field 'value' should be"),
    ('[{"conversations": []}, 5]', "record 1: expected an object, got int"),
])
def test_malformed_sharegpt_names_file_and_record(tmp_path, text, where):
    path = write(tmp_path, "bad_sharegpt.json", text)
    with pytest.raises(DatasetError) as e:
        workload.read_sharegpt(path, count_words)
    assert str(path) in str(e.value) and where in str(e.value)


@pytest.mark.parametrize("record, where", [
    ({"instruction": "a", "output": "b"}, "record 1: missing field 'input'"),
    ({"instruction": "a", "input": None, "output": "b"}, "record 1: field 'input' should be str, got NoneType"),
])
def test_malformed_alpaca_names_file_and_record(tmp_path, record, where):
    good = {"instruction": "a", "input": "", "output": "b"}
    path = write(tmp_path, "bad_alpaca.json", json.dumps([good, record]))
    with pytest.raises(DatasetError) as e:
        workload.read_alpaca(path, count_words)
    assert str(path) in str(e.value) and where in str(e.value)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD_ROW = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize("text, where", [
    (AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.0,12x,3\n", "line 3: ContextTokens '12x' is not an integer"),
    (AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.0,12\n", "line 3: expected 3 fields"),
    (AZURE_HEADER + GOOD_ROW + "yesterday,1,2\n", "line 3: TIMESTAMP 'yesterday' is not"),
    (AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:40.0,1,2\n", "line 3: TIMESTAMP goes backwards"),
    (AZURE_HEADER + "2023-11-16 18:15:40.0,1,-2\n", "line 2: GeneratedTokens is -2"),
    ("time,ContextTokens,GeneratedTokens\n" + GOOD_ROW, "line 1: header lacks column(s) TIMESTAMP"),
])
def test_malformed_azure_csv_names_file_and_line(tmp_path, text, where):
    path = write(tmp_path, "bad_azure.csv", text)
    with pytest.raises(DatasetError) as e:
        workload.read_azure_trace(path)
    assert str(path) in str(e.value) and where in str(e.value)


def test_malformed_lengths_csv_and_missing_file(tmp_path):
    path = write(tmp_path, "bad_lengths.csv", "input_tokens,output_tokens\n3,4\n5,4,9\n")
    with pytest.raises(DatasetError, match="line 3: expected 2 fields"):
        workload.read_lengths(path)
    with pytest.raises(DatasetError, match="nope.csv: cannot read"):
        workload.read_lengths(tmp_path / "nope.csv")
    with pytest.raises(DatasetError, match="nope.json: cannot read"):
        workload.read_alpaca(tmp_path / "nope.json", count_words)


# -- synthetic lengths and load_workload ------------------------------------------------------------------------
def test_synthetic_fixed_uniform_and_ratio():
    assert {(it.prompt_len, it.output_len) for it in workload.synthetic_lengths(5, 100, 20)} == {(100, 20)}
    uniform = workload.synthetic_lengths(2000, 100, 20, range_ratio=0.5, seed=3)
    assert min(it.prompt_len for it in uniform) == 50 and max(it.prompt_len for it in uniform) == 150
    assert min(it.output_len for it in uniform) == 10 and max(it.output_len for it in uniform) == 30
    assert uniform == workload.synthetic_lengths(2000, 100, 20, range_ratio=0.5, seed=3)
    (it,) = workload.synthetic_lengths(1, 256, 256, io_ratio=3.0)
    assert (it.prompt_len, it.output_len) == (384, 128)  # total 512 split 3:1
    with pytest.raises(ValueError, match="range_ratio"):
        workload.synthetic_lengths(1, 10, 10, range_ratio=1.0)
    with pytest.raises(ValueError, match="io_ratio"):
        workload.synthetic_lengths(1, 10, 10, io_ratio=0)


def test_load_workload_keeps_trace_order_and_times(tmp_path):
    rows = "".join(f"2023-11-16 18:00:{s:02d}.5,{10 + s},{s + 1}\n" for s in (0, 2, 6, 10))
    path = write(tmp_path, "trace.csv", AZURE_HEADER + rows)
    items = workload.load_workload("azure-conv", 3, path=path, trace_speedup=2.0)
    assert [it.arrival_s for it in items] == pytest.approx([0.0, 1.0, 3.0])
    assert [it.prompt_len for it in items] == [10, 12, 16]
    at_rate = workload.load_workload("azure-code", 3, path=path, rate=5.0, seed=1)
    assert [it.prompt_len for it in at_rate] == [10, 12, 16]  # the trace's lengths, Poisson times
    assert [it.arrival_s for it in at_rate] == pytest.approx(gamma_arrivals(3, 5.0, 1.0, seed=1))


def test_load_workload_samples_with_seed_and_filters(tmp_path):
    path = write(tmp_path, "l.csv", "input_tokens,output_tokens\n" + "".join(f"{i},{i}\n" for i in range(1, 21)))
    a = workload.load_workload("lengths", 5, path=path, rate=2.0, seed=7)
    assert a == workload.load_workload("lengths", 5, path=path, rate=2.0, seed=7)
    assert a != workload.load_workload("lengths", 5, path=path, rate=2.0, seed=8)
    many = workload.load_workload("lengths", 50, path=path, seed=7)  # more than there are: with replacement
    assert len(many) == 50 and all(it.arrival_s == 0.0 for it in many)  # rate inf
    fits = workload.load_workload("lengths", 30, path=path, length_filter=LengthFilter(1, 100, 10))
    assert all(it.prompt_len + it.output_len <= 10 for it in fits)
    with pytest.raises(DatasetError, match="no items left"):
        workload.load_workload("lengths", 3, path=path, length_filter=LengthFilter(1, 100, 1))
    with pytest.raises(ValueError, match="needs a token counter"):
        workload.load_workload("alpaca", 3, path=path)
    with pytest.raises(ValueError, match="unknown dataset"):
        workload.load_workload("imdb", 3, path=path)


def test_workitem_is_the_documented_shape():
    it = WorkItem(prompt_len=3, output_len=4, prompt_text=None, arrival_s=0.5)
    assert (it.prompt_len, it.output_len, it.prompt_text, it.arrival_s) == (3, 4, None, 0.5)


# -- arrival processes ----------------------------------------------------------------------------------------------
def test_arrivals_are_seeded_and_start_at_zero():
    a = poisson_arrivals(100, 4.0, seed=1)
    assert a == poisson_arrivals(100, 4.0, seed=1) != poisson_arrivals(100, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert gamma_arrivals(5, float("inf"), 0.5) == [0.0] * 5
    assert gamma_arrivals(0, 1.0) == []


def test_poisson_mean_gap_is_one_over_rate():
    rate = 8.0
    gaps = np.diff(poisson_arrivals(20001, rate, seed=0))
    # The sample mean's standard error is (1/rate)/sqrt(20000) = 0.7%; 5% is 7 of them.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std = mean


def test_burstiness_keeps_the_mean_and_orders_the_variance():
    rate = 2.0
    variances = []
    for burstiness in (0.25, 1.0, 4.0):
        gaps = np.diff(gamma_arrivals(20001, rate, burstiness, seed=0))
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.1)
        assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.25)
        variances.append(gaps.var())
    assert variances[0] > variances[1] > variances[2]


def test_trace_arrivals_scale():
    stamps = [100.0, 101.0, 103.0, 107.0]
    assert trace_arrivals(stamps) == [0.0, 1.0, 3.0, 7.0]
    assert trace_arrivals(stamps, speedup=2.0) == [0.0, 0.5, 1.5, 3.5]
    assert trace_arrivals(stamps, speedup=0.5) == [0.0, 2.0, 6.0, 14.0]
    with pytest.raises(ValueError, match="backwards at index 2"):
        trace_arrivals([1.0, 2.0, 1.5])
    with pytest.raises(ValueError, match="speedup"):
        trace_arrivals(stamps, speedup=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=3, rate=0.0), "rate must be > 0"), (dict(n=3, rate=-1.0), "rate must be > 0"),
    (dict(n=3, rate=1.0, burstiness=0.0), "burstiness"), (dict(n=-1, rate=1.0), "n must be")])
def test_bad_arrival_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gamma_arrivals(**kwargs)


def test_load_workload_reports_what_the_filter_dropped(tmp_path):
    """`fastserve simulate`, the load generator and the experiments print this line: the one filter and its drops."""
    rows = [(3, 10), (10, 3), (1025, 10), (1000, 1049), (1000, 1048), (20, 30)]
    path = write(tmp_path, "l.csv", "input_tokens,output_tokens\n" + "".join(f"{a},{b}\n" for a, b in rows))
    stats: dict = {}
    items = workload.load_workload("lengths", 10, path=path, length_filter=LengthFilter(), stats=stats, seed=1)
    assert {(it.prompt_len, it.output_len) for it in items} == {(1000, 1048), (20, 30)}
    assert (stats["read"], stats["kept"], stats["dropped"]) == (6, 2, 4)
    assert workload.filter_line(stats) == ("vLLM's length filter (prompt and output >= 4, prompt <= 1024, total "
                                           "<= 2048 tokens): dropped 4 of 6 dataset items (66.7%)")


def test_simulate_filters_instead_of_clipping(tmp_path, capsys):
    """A request that does not fit vLLM's filter is dropped (and counted), not clipped to the context."""
    from fastserve import simulate

    rows = [(2000, 10), (10, 2100), (100, 50)] * 3
    path = write(tmp_path, "l.csv", "input_tokens,output_tokens\n" + "".join(f"{a},{b}\n" for a, b in rows))
    repo = Path(__file__).resolve().parents[1]
    summary = simulate.run(simulate.build_parser().parse_args([
        "--model", str(repo / "models" / "opt-13b-config") if (repo / "models" / "opt-13b-config").is_dir()
        else "opt-13b", "--profile", str(repo / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"),
        "--dataset-name", "lengths", "--dataset-path", str(path), "--num-prompts", "6", "--request-rate", "1"]))
    assert "dropped 6 of 9 dataset items" in capsys.readouterr().out
    assert summary["requests"] == 6 and summary["mean_per_token_s"] > 0
