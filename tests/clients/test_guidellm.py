"""guidellm (the vLLM project's load tester), its `guidellm run` command line, against a live server.py: the
completions and chat endpoints, streaming and not, 4 concurrent streams each (the four runs at once), with the
tiny model's tokenizer directory and a synthetic dataset (nothing downloaded).

guidellm exits 0 even when every request failed, so each run's JSON report is read: every request must have
succeeded, with the output length asked for (it sends ignore_eos), and a streaming run must have measured
TTFT and ITL over one stream iteration per token or more (it sends stream_options.continuous_usage_stats).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.clients.client_helpers import SERVED_NAME, console_script
from tests.server_fixtures import wait_idle

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 32, 8


def guidellm_command(url: str, endpoint: str, stream: bool, tokenizer: str, out: str) -> list[str]:
    """The exact command line (docs/api.md, "Clients tested", names the run)."""
    return [console_script("guidellm"), "run",
            "--backend", f"kind=openai_http,target={url},model={SERVED_NAME},request_format={endpoint},"
                         f"stream={str(stream).lower()}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


CASES = [(endpoint, stream) for endpoint in ("/v1/completions", "/v1/chat/completions") for stream in (True, False)]


@pytest.fixture(scope="module")
def runs(server, tiny_model_dir, client_env, tmp_path_factory):
    """The four runs, started at once (most of a run is guidellm importing itself, mostly on one core): {case:
    (process, its folder)}, each writing its console output to console.log and its report to benchmarks.json
    there. The server is checked idle once all have ended."""
    started = {}
    for endpoint, stream in CASES:
        work = tmp_path_factory.mktemp("guidellm")
        cmd = guidellm_command(server.url, endpoint, stream, str(tiny_model_dir), str(work / "benchmarks.json"))
        with open(work / "console.log", "wb") as log:
            started[endpoint, stream] = subprocess.Popen(cmd, cwd=work, env=client_env, stdout=log,
                                                         stderr=subprocess.STDOUT), work
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    wait_idle(server.url)


@pytest.mark.parametrize("endpoint,stream", CASES, ids=[f"{e}-{'stream' if s else 'no-stream'}" for e, s in CASES])
def test_guidellm_run(runs, endpoint, stream):
    proc, work = runs[endpoint, stream]
    proc.wait(timeout=240)
    console = (work / "console.log").read_text(errors="replace")
    log = console[-4000:]
    assert proc.returncode == 0, log
    assert "Benchmarking complete" in console, log

    report = json.loads((work / "benchmarks.json").read_text())
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
        # ITL is measured (it can be 0 ms: a client short of CPU reads a request's chunks in one go)
        assert m["inter_token_latency_ms"]["successful"]["mean"] >= 0
    else:
        assert iterations == 0
