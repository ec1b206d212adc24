"""The load generator's multi-turn ShareGPT replay (fastserve/bench/multiturn.py; docs/kv-cache.md, "Prefix caching"):
conversations read from a small file written here, each user turn sent over chat with the whole history after the
previous answer and a think time, against a real server with prefix caching on; the report's per-turn figures and hit
rate."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
import pytest

from fastserve.bench.client import RequestResult
from fastserve.bench.multiturn import conversation_arrivals, hit_rate, think_time
from fastserve.bench.workload import DatasetError, read_sharegpt_conversations
from tests.server_fixtures import REPO

WORDS = "river stone maple cloud lantern harbor meadow copper violet thunder orchard canyon".split()


def text(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n))


def conversations_file(tmp_path):
    convs = [
        {"id": "three", "conversations": [
            {"from": "human", "value": "Alpha asks: " + text(1, 40)}, {"from": "gpt", "value": text(2, 6)},
            {"from": "human", "value": text(3, 12)}, {"from": "gpt", "value": text(4, 5)},
            {"from": "human", "value": text(5, 10)}, {"from": "gpt", "value": text(6, 4)}]},
        {"id": "two", "conversations": [
            {"from": "system", "value": "ignored"},
            {"from": "human", "value": "Bravo wonders: " + text(7, 35)}, {"from": "gpt", "value": text(8, 6)},
            {"from": "human", "value": text(9, 8)}, {"from": "gpt", "value": text(10, 3)}]},
        {"id": "one", "conversations": [
            {"from": "human", "value": "Charlie says: " + text(11, 30)}, {"from": "gpt", "value": text(12, 5)},
            {"from": "human", "value": "unanswered"}]},
        {"id": "none", "conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(convs))
    return path


def test_reader_keeps_answered_human_turns_in_order(tmp_path):
    convs = read_sharegpt_conversations(conversations_file(tmp_path))
    assert [(c.conversation_id, len(c.turns)) for c in convs] == [("three", 3), ("two", 2), ("one", 1)]
    assert convs[1].turns[0][0].startswith("Bravo wonders: ")


def test_think_times_and_hit_rate():
    rng = np.random.default_rng(0)
    draws = [think_time(rng, 5.0, "exponential") for _ in range(4000)]
    assert 4.6 < np.mean(draws) < 5.4 and min(draws) >= 0 and len(set(draws)) == len(draws)
    assert think_time(rng, 2.0, "constant") == 2.0 and think_time(rng, 0.0, "exponential") == 0.0

    def r(prompt, cached, ok=True):
        res = RequestResult(prompt, 1, success=ok)
        res.prompt_tokens, res.cached_tokens = prompt, cached
        return res

    assert hit_rate([r(100, 0), r(200, 150), r(50, 50, ok=False), r(10, None)]) == 150 / 300
    assert hit_rate([r(10, None)]) is None


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastserve.bench.loadgen", *args, "--disable-tqdm"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags", [["--dataset-name", "alpaca"], ["--backend", "openai"], ["--think-time", "-1"],
                                   ["--max-turns", "0"], ["--token-id-prompts"]])
def test_multi_turn_refuses_bad_flags(tmp_path, flags):
    args = ["--multi-turn", "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "x.json"), *flags]
    proc = run_cli(args)
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr


@pytest.mark.parametrize("flag", [["--max-turns", "2"], ["--conversation-trace", "trace.csv"]])
def test_max_turns_needs_multi_turn(tmp_path, flag):
    proc = run_cli(["--dataset-name", "synthetic", *flag])
    assert proc.returncode == 2 and "--multi-turn" in proc.stderr


def azure_csv(path, seconds: list[float]):
    """An Azure 2023 trace CSV whose requests arrive at these seconds (18:15:00 + s)."""
    rows = "".join(f"2023-11-16 18:{15 + int(t) // 60:02d}:{t % 60:010.7f},100,20\n" for t in seconds)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    return path


def test_conversation_arrivals_from_a_trace_keep_its_shape(tmp_path):
    trace = azure_csv(tmp_path / "t.csv", [10.0, 10.5, 11.0, 14.0, 20.0, 21.0])
    assert conversation_arrivals(5, None, trace=str(trace)) == pytest.approx([0, 0.5, 1, 4, 10])
    assert conversation_arrivals(5, float("inf"), trace=str(trace), trace_speedup=2) == pytest.approx(
        [0, 0.25, 0.5, 2, 5])
    scaled = conversation_arrivals(5, 2.0, trace=str(trace))  # 5 conversations at 2/s: 4 gaps, 2 s in all
    assert scaled == pytest.approx([0, 0.1, 0.2, 0.8, 2.0])
    poisson = conversation_arrivals(5, 2.0, seed=3)
    assert poisson == conversation_arrivals(5, 2.0, seed=3) != scaled and poisson[0] == 0
    with pytest.raises(DatasetError, match="fewer than the 9"):
        conversation_arrivals(9, 2.0, trace=str(trace))
    with pytest.raises(DatasetError, match="one instant"):
        conversation_arrivals(2, 2.0, trace=str(azure_csv(tmp_path / "same.csv", [5.0, 5.0])))


@pytest.mark.parametrize("tokenizer", ["bpe", "word"])
def test_multi_turn_replay_against_a_caching_server(request, tokenizer, tmp_path):
    """bpe: the built-in tiny model, whose random answers do not survive decode -> encode, so the history's
    prompts hit and its answers need not. word: the same model with a word-level tokenizer, whose answers come
    back token for token: the previous turn's prompt and answer hit, to the last full block."""
    from tests.server_fixtures import DEFAULT_ARGS, shared_server, wait_idle

    model_dir = request.getfixturevalue({"bpe": "tiny_model_dir", "word": "word_model_dir"}[tokenizer])
    srv = shared_server(request, model_dir, (*DEFAULT_ARGS, "--enable-prefix-caching"))
    wait_idle(srv.url)
    think = 0.3
    # word: conversations open at an Azure trace's times scaled to 20/s (0, 0.05, 0.1 s: its gaps are 1:1)
    trace = ["--conversation-trace", str(azure_csv(tmp_path / "t.csv", [3.0, 5.0, 7.0]))] if tokenizer == "word" else []
    proc = run_cli(["--base-url", srv.url, "--multi-turn", "--dataset-name", "sharegpt",
                    "--dataset-path", str(conversations_file(tmp_path)), "--num-prompts", "3",
                    "--request-rate", "20", "--think-time", str(think), "--think-time-distribution", "constant",
                    "--tokenizer", str(model_dir), "--ignore-eos", "--cache-salt", uuid.uuid4().hex, *trace,
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("Serving Benchmark Result (20 conv/s)", "Multi-turn", "Prefix cache hit rate (cached/prompt):",
                 "Conversations (done/context/failed):    3/0/0 of 3", "Turns (ok of sent):", "Mean TTFT (ms):"):
        assert line in proc.stdout, (line, proc.stdout)
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    mt = run["multi_turn"]
    assert mt["turns"] == mt["turns_ok"] == 6 and run["completed"] == 6
    assert [mt["by_turn"][b]["turns"] for b in ("1", "2", "3", "4+")] == [3, 2, 1, 0]
    turns = {}
    for i, (conv, number) in enumerate(zip(run["conversation_indices"], run["turn_numbers"])):
        turns[(conv, number)] = i
    prompt, cached = run["prompt_tokens"], run["cached_tokens"]
    for (conv, number), i in turns.items():
        if number == 1:
            assert cached[i] == 0  # a new conversation (its own salt: nothing from other tests)
            if trace:  # opened no earlier than the scaled trace says
                assert run["start_times"][i] >= conv * 0.05 - 0.005
            continue
        prev = turns[(conv, number - 1)]
        # The whole history came back: this prompt holds the last one, and its blocks were cached.
        assert prompt[i] > prompt[prev] and cached[i] >= prompt[prev] - 2 * 16
        if tokenizer == "word":  # KV exists for all but the last answer token; whole blocks of 16 are named
            assert cached[i] >= prompt[prev] + run["output_lens"][prev] - 16
        # Sent after the previous answer arrived plus the think time.
        assert run["start_times"][i] >= run["start_times"][prev] + run["e2els"][prev] + think * 0.95
    assert mt["prefix_cache_hit_rate"] == pytest.approx(sum(cached) / sum(prompt))
    assert mt["prefix_cache_hit_rate"] > 0.3
    assert mt["by_turn"]["1"]["prefix_cache_hit_rate"] == 0.0 and mt["by_turn"]["2"]["prefix_cache_hit_rate"] > 0.5
    assert run["input_lens"] == prompt  # the server's counts
    assert all(n > 0 for n in run["output_lens"])
