"""The load generator (fastserve bench serve) as a vLLM user types it: --backend openai|openai-chat|vllm,
--host/--port, text prompts by default, the tokenizer chosen without being named (and a warning when it cannot
be the server's), failed requests named beside the SLO verdict, vLLM's top-level result fields; against the
in-test fake server and, end to end, against the real server.py with no tokenizer named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastserve.bench import loadgen
from fastserve.bench import plot as loadgen_plot
from fastserve.bench import tokens as loadgen_tokenizer
from fastserve.server_process import ServerProcess
from tests.test_loadgen import REPO, FakeServer

CONVERSATIONS = [("Tell me about the sea and the sky today", "The sea is blue and the sky is wide open"),
                 ("What is a good name for a small red cat", "A good name is Pepper or maybe Ginger"),
                 ("Write two words about autumn leaves please", "Falling gold, quiet and slow in the wind"),
                 ("Hi", "Hello")]  # the last one is too short for vLLM's ShareGPT filter


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def sharegpt(tmp_path) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": q},
                                                                 {"from": "gpt", "value": a}]}
                                for i, (q, a) in enumerate(CONVERSATIONS)]))
    return path


def test_chat_backend_sends_messages_with_text_parts_to_host_and_port(fake, sharegpt, tiny_model_dir, capsys):
    before = len(fake.bodies)
    rc = loadgen.main(["--backend", "openai-chat", "--host", "127.0.0.1", "--port", str(fake.port),
                       "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--num-prompts", "3",
                       "--tokenizer", str(tiny_model_dir), "--disable-tqdm"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert f"token counting: the tokenizer of {tiny_model_dir} (--tokenizer)" in out
    assert "a vocabulary of 4096, but the model's is 50:" in err  # the fake server's vocab
    bodies = fake.bodies[before:]
    texts = {q for q, _ in CONVERSATIONS[:3]}
    assert len(bodies) == 3 and all("prompt" not in b and "max_tokens" not in b for b in bodies)
    for b in bodies:
        (message,) = b["messages"]
        assert message["role"] == "user" and message["content"][0]["type"] == "text"
        assert message["content"][0]["text"] in texts and b["max_completion_tokens"] >= 4
        assert b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is False
    assert "Successful requests:                     3" in out


def test_completions_send_text_by_default_and_token_ids_on_request(fake, sharegpt, tiny_model_dir, capsys):
    common = ["--base-url", fake.url, "--backend", "vllm", "--dataset-name", "sharegpt", "--dataset-path",
              str(sharegpt), "--num-prompts", "2", "--tokenizer", str(tiny_model_dir), "--disable-tqdm"]
    before = len(fake.bodies)
    assert loadgen.main(common) == 0
    assert all(b["prompt"] in {q for q, _ in CONVERSATIONS} for b in fake.bodies[before:])
    before = len(fake.bodies)
    assert loadgen.main([*common, "--token-id-prompts"]) == 0
    assert all(isinstance(b["prompt"], list) and b["ignore_eos"] for b in fake.bodies[before:])
    with pytest.raises(SystemExit) as e:
        loadgen.main(["--backend", "openai-chat", "--dataset-name", "synthetic"])
    assert e.value.code == 2 and "openai-chat sends text" in capsys.readouterr().err


def test_failed_requests_are_named_beside_the_slo_verdict_and_vllms_fields_are_top_level(fake, tmp_path, capsys):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("input_tokens,output_tokens\n5,4\n8,4\n12,4\n")
    rc = loadgen.main(["--base-url", fake.url, "--endpoint", "/flaky", "--dataset-name", "lengths",
                       "--dataset-path", str(lengths), "--num-prompts", "3", "--sweep", "50,100", "--disable-tqdm",
                       "--slo-per-token", "10", "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "r.json"])
    out = capsys.readouterr().out
    assert rc == 3  # some requests failed
    verdicts = [line for line in out.splitlines() if line.startswith("Throughput at SLO")]
    assert len(verdicts) == 2 and all("none of the swept rates (failed requests: 1 at 50 req/s, 1 at 100 req/s"
                                      in v for v in verdicts), verdicts
    result = json.loads((tmp_path / "r.json").read_text())
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "request_throughput", "output_throughput",
                "completed", "duration", "input_lens", "generated_texts", "tokenizer_id", "max_concurrency"):
        assert key in result, key
    assert result["request_rate"] == 100 and result["completed"] == 2 == result["runs"][-1]["completed"]
    assert result["backend"] == "openai" and result["per_token_latency_mean_s"] > 0


def test_plot_legends_use_each_runs_label(fake, tmp_path, monkeypatch):
    real, seen = loadgen_plot.plot_results, []
    monkeypatch.setattr(loadgen_plot, "plot_results", lambda *a: seen.append(real(*a)))
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("input_tokens,output_tokens\n5,4\n")
    common = ["--base-url", fake.url, "--dataset-name", "lengths", "--dataset-path", str(lengths), "--num-prompts",
              "1", "--sweep", "50,100", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path)]
    assert loadgen.main([*common, "--result-filename", "baseline-run.json"]) == 0  # no --label
    assert loadgen.main([*common, "--result-filename", "b.json", "--label", "skip-join", "--plot",
                         str(tmp_path / "p.png"), "--compare", str(tmp_path / "baseline-run.json")]) == 0
    assert seen == [["skip-join", "baseline-run"]] and (tmp_path / "p.png").stat().st_size > 0


def test_tokenizer_choice_order_and_mismatch_warning(tiny_model_dir, tmp_path):
    gpt2 = REPO / "tests" / "data" / "gpt2-bpe"
    chosen = loadgen_tokenizer.choose_counter(None, None, str(tiny_model_dir), "elsewhere")
    assert chosen.source == f"the tokenizer of {tiny_model_dir} (--model)" and chosen.vocab_size == 4096
    chosen = loadgen_tokenizer.choose_counter(None, None, "opt-13b", str(tiny_model_dir))
    assert chosen.source.endswith("(the model the server lists at /v1/models)")
    # the names server.py knows: its default, SmolLM2's GGUF file (its own tokenizer), and the tiny model
    chosen = loadgen_tokenizer.choose_counter(None, None, None, "SmolLM2-135M-Instruct")
    assert chosen.source.endswith(".gguf (the model the server lists at /v1/models)") and chosen.vocab_size == 49152
    chosen = loadgen_tokenizer.choose_counter(None, None, None, "tiny-opt")
    assert chosen.source.endswith("tiny-opt (the model the server lists at /v1/models)")
    chosen = loadgen_tokenizer.choose_counter(None, None, None, "elsewhere")
    assert "built-in tiny model's; the server lists 'elsewhere', not a model here" in chosen.source
    assert chosen.count("Hello world") > 0
    assert loadgen_tokenizer.mismatch_warning(chosen, 4096) is None
    assert loadgen_tokenizer.mismatch_warning(chosen, None) is None
    assert "a vocabulary of 4096, but the model's is 50272" in loadgen_tokenizer.mismatch_warning(chosen, 50272)
    bpe = loadgen_tokenizer.gpt2_bpe_counter(gpt2)  # counts as OPT does (50257 ids in a 50272-row embedding)
    assert loadgen_tokenizer.mismatch_warning(bpe, 50272) is None
    assert loadgen_tokenizer.mismatch_warning(bpe, 4096) is not None
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        loadgen_tokenizer.choose_counter(str(tmp_path), None, None, None)


def test_sharegpt_with_no_tokenizer_named_against_the_real_server(tiny_model_dir, sharegpt, tmp_path):
    """No tokenizer named: the server lists its --model directory, and the load generator counts with it."""
    srv = ServerProcess(["--model", str(tiny_model_dir), "--profile", "analytic", "--num-gpu-blocks-override",
                         "512", "--num-host-blocks-override", "64"], tmp_path)
    try:
        srv.wait_ready(timeout=120)
        for backend in ("openai", "openai-chat"):
            proc = subprocess.run(
                [sys.executable, "-m", "fastserve.bench.loadgen", "--base-url", srv.url, "--backend", backend,
                 "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--num-prompts", "3",
                 "--request-rate", "4",
                 "--save-result", "--result-dir", str(tmp_path / backend), "--disable-tqdm"],
                cwd=REPO, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert (f"token counting: the tokenizer of {tiny_model_dir} (the model the server lists at /v1/models)"
                    in proc.stdout)
            assert "warning" not in proc.stderr and "Failed requests:                         0" in proc.stdout
            (saved,) = (tmp_path / backend).glob(f"{backend}-4qps-*.json")
            assert json.loads(saved.read_text())["completed"] == 3
    finally:
        srv.stop()
