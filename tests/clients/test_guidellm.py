"""guidellm (the vLLM project's load tester), its `guidellm run` command line, against a live server.py: the
completions and chat endpoints, streaming and not, 4 concurrent streams, with the tiny model's tokenizer
directory and a synthetic dataset (nothing downloaded).

guidellm exits 0 even when every request failed, so each run's JSON report is read: every request must have
succeeded, with the output length asked for (it sends ignore_eos), and a streaming run must have measured
TTFT over one stream iteration per token or more (it sends stream_options.continuous_usage_stats).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.clients.client_helpers import SERVED_NAME, console_script

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 32, 8


def guidellm_command(url: str, endpoint: str, stream: bool, tokenizer: str, out: str) -> list[str]:
    """The exact command line (the README quotes it)."""
    return [console_script("guidellm"), "run",
            "--backend", f"kind=openai_http,target={url},model={SERVED_NAME},request_format={endpoint},"
                         f"stream={str(stream).lower()}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_run(idle_server, tiny_model_dir, client_env, tmp_path, endpoint, stream):
    out = tmp_path / "benchmarks.json"
    cmd = guidellm_command(idle_server.url, endpoint, stream, str(tiny_model_dir), str(out))
    proc = subprocess.run(cmd, cwd=tmp_path, env=client_env, capture_output=True, text=True, timeout=240)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log
    assert "Benchmarking complete" in proc.stdout, log

    report = json.loads(out.read_text())
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    errors = [r["info"]["error"] for r in bench["requests"].get("errored") or []]
    assert m["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, \
        (errors[:3], log)
    assert m["output_token_count"]["successful"]["total_sum"] == REQUESTS * OUTPUT_TOKENS
    assert m["prompt_token_count"]["successful"]["total_sum"] >= REQUESTS * PROMPT_TOKENS
    iterations = m["request_streaming_iterations_count"]["successful"]["total_sum"]
    ttft = m["time_to_first_token_ms"]["successful"]["mean"]
    if stream:
        assert iterations >= REQUESTS * OUTPUT_TOKENS and ttft > 0
        assert m["inter_token_latency_ms"]["successful"]["mean"] > 0
    else:
        assert iterations == 0
