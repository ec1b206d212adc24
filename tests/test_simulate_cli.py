"""`fastserve simulate` (fastserve/simulate.py) as a user types it: a shape name for --model (its config-only
directory written on first use), ShareGPT counted with a named or default tokenizer, and bad values as one line
with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastserve import make_model, simulate

REPO = Path(__file__).resolve().parents[1]

PROFILE = str(REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json")
GPT2_BPE = REPO / "tests" / "data" / "gpt2-bpe"


@pytest.fixture
def sharegpt(tmp_path) -> Path:
    """A ShareGPT-format file of 40 conversations (first human turn, then the answer), prompts of 3-120 words."""
    words = "the cache keeps keys and values of every past token so that decode reads them".split()
    records = [{"id": f"{i}_0", "conversations": [
        {"from": "human", "value": " ".join(words[j % len(words)] for j in range(3 + 3 * i))},
        {"from": "gpt", "value": " ".join(words[j % len(words)] for j in range(5 + 7 * (i % 9)))}]}
        for i in range(40)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


@pytest.fixture
def models_here(tmp_path, monkeypatch) -> Path:
    """Shape names resolve under tmp_path/models instead of the repository's models/."""
    monkeypatch.setattr(make_model, "MODELS_DIR", tmp_path / "models")
    return tmp_path / "models"


def test_shape_name_and_sharegpt_with_gpt2_bpe(models_here, tmp_path, sharegpt, capsys):
    out_json = tmp_path / "s.json"
    rc = simulate.main(["--model", "opt-13b", "--profile", PROFILE, "--dataset-name", "sharegpt", "--dataset-path",
                        str(sharegpt), "--gpt2-bpe", str(GPT2_BPE), "--num-prompts", "30", "--request-rate", "2",
                        "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert (models_here / "opt-13b-config" / "config.json").is_file()
    assert "token counting: GPT-2 BPE from" in out and "warning" not in err  # OPT's own counts
    summary = json.loads(out_json.read_text())
    assert summary["requests"] == 30 and summary["mean_per_token_s"] > 0 and summary["policy"] == "skip-join-mlfq"


def test_sharegpt_without_a_tokenizer_counts_with_the_models_and_warns(models_here, sharegpt, capsys):
    rc = simulate.main(["--model", "opt-13b", "--profile", PROFILE, "--dataset-name", "sharegpt", "--dataset-path",
                        str(sharegpt), "--num-prompts", "10", "--scheduling-policy", "fcfs"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert f"the tokenizer of {models_here / 'opt-13b-config'} (--model)" in out
    assert "pass --gpt2-bpe DIR to count as OPT does" in err


@pytest.mark.parametrize("args, words", [
    (["--model", "opt-13b", "--profile", "missing.json"], "--profile missing.json: no such file"),
    (["--model", "no/such/dir", "--profile", PROFILE], "--model no/such/dir: no config.json there"),
    (["--model", "opt-13b", "--profile", PROFILE, "--dataset-name", "lengths"], "needs a path (--dataset-path)"),
])
def test_bad_values_are_one_line_and_exit_2(models_here, capsys, args, words):
    assert simulate.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastserve simulate: error: ") and words in err and err.count("\n") == 1, err


def test_bad_choices_list_the_allowed_values(capsys):
    with pytest.raises(SystemExit) as e:
        simulate.main(["--model", "opt-13b", "--profile", PROFILE, "--scheduling-policy", "sjf"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "'sjf'" in err and "'fcfs', 'skip-join-mlfq', 'mlfq', 'fixed-priority', 'srpt'" in err
    help_text = simulate.build_parser().format_help()
    assert "opt-13b-a100-40gb-x1.json" in help_text and "opt-175b" in help_text


def test_synthetic_lengths_take_vllms_random_flags(models_here, tmp_path):
    """--dataset-name synthetic needs no file: lengths from --random-input-len / --random-output-len (it failed with a
    TypeError before the flags existed)."""
    out = tmp_path / "s.json"
    assert simulate.main(["--model", "opt-125m", "--profile", PROFILE, "--dataset-name", "synthetic",
                          "--num-prompts", "20", "--request-rate", "4", "--random-input-len", "64",
                          "--random-output-len", "16", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["requests"] == 20 and summary["mean_per_token_s"] > 0


def test_chunked_prefill_flags_reach_the_engine_and_itl_is_reported(models_here, tmp_path):
    """--max-num-batched-tokens and --enable-chunked-prefill / --no-enable-chunked-prefill: prompts of 1,500
    tokens under a 256-token budget are split (each chunk priced over its prefix), and the summary has ITL and P99
    TTFT; without chunking the same trace's P99 ITL holds a whole 1,500-token prefill."""
    runs = {}
    for flag in ("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
        out = tmp_path / f"{flag}.json"
        assert simulate.main(["--model", "opt-13b", "--profile", PROFILE, "--dataset-name", "synthetic",
                              "--num-prompts", "30", "--request-rate", "2", "--random-input-len", "1500",
                              "--random-output-len", "64", "--max-num-batched-tokens", "256", flag,
                              "--json", str(out)]) == 0
        runs[flag] = json.loads(out.read_text())
    on, off = runs["--enable-chunked-prefill"], runs["--no-enable-chunked-prefill"]
    for summary in (on, off):
        assert summary["requests"] == 30
        assert 0 < summary["median_itl_s"] <= summary["p99_itl_s"] and summary["mean_itl_s"] > 0
        assert summary["p99_ttft_s"] >= summary["mean_ttft_s"] * 0.5
    assert on["p99_itl_s"] < off["p99_itl_s"]
    help_text = simulate.build_parser().format_help()
    assert "--max-num-batched-tokens" in help_text and "--no-enable-chunked-prefill" in help_text
