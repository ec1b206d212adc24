"""lm-evaluation-harness (`lm_eval`) against a live server.py, on a small local task (tests/data/lm_eval_tasks:
a YAML per task and a JSON Lines file, read with --include_path; nothing downloaded):

- `local-completions`: a multiple-choice task (loglikelihood requests: token ids, echo, logprobs) and a
  generate_until task, in one run. Each loglikelihood and is-greedy flag must equal transformers'
  OPTForCausalLM on the same checkpoint, computed here; one extra question, whose right answer is the model's
  own greedy continuation, makes sure that an is-greedy True comes through too. Each generated text must equal
  transformers' greedy generation from the same tokens, cut at the stop string.
- `local-chat-completions` (--apply_chat_template): the generate_until task; each text must equal what the
  server answers the same messages over plain HTTP.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.clients.client_helpers import SERVED_NAME, console_script
from tests.server_fixtures import post_json

TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tasks"
GREEDY_QUESTION = "Scheduling at token granularity"
MAX_GEN_TOKS = 8  # fastserve_gen.yaml's max_gen_toks


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """(tokenizer, transformers' OPTForCausalLM) on the tiny model's checkpoint, in float64 for the reference."""
    import torch
    from transformers import AutoTokenizer, OPTForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = OPTForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    return tok, model


def logprobs(model, ids: list[int]):
    """log softmax of the next-token logits after each position of `ids` (float64)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair (its TemplateAPI._encode_pair with add_bos_token False):
    the whole text encoded without special tokens, cut after the context's own encoding."""
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    assert whole[:len(ctx)] == ctx, (context, continuation)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, reference) -> Path:
    """The repository's task folder, copied, with one more question whose first choice is the model's greedy
    continuation (two tokens that survive decoding and re-encoding)."""
    tok, model = reference
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for f in TASKS.iterdir():
        shutil.copyfile(f, out / f.name)
    ids = tok(GREEDY_QUESTION, add_special_tokens=False).input_ids
    for _ in range(2):
        ids.append(int(logprobs(model, ids)[-1].argmax()))
    greedy = tok.decode(ids[-2:])
    assert encode_pair(tok, GREEDY_QUESTION, " " + greedy.lstrip())[1] == ids[-2:] and greedy.startswith(" "), \
        repr(greedy)
    doc = {"question": GREEDY_QUESTION, "choices": [greedy.lstrip(), "token", "granularity"], "answer": 0,
           "target": greedy.lstrip()}
    with open(out / "fastserve_tasks.jsonl", "a") as f:
        f.write(json.dumps(doc) + "\n")
    return out


def run_lm_eval(model_type: str, model_args: str, tasks: str, task_dir: Path, out: Path, env: dict,
                *extra: str) -> tuple[dict, dict[str, list[dict]]]:
    """`lm_eval --model MODEL_TYPE ...` in `task_dir`: (its results JSON, {task: its logged samples})."""
    cmd = [console_script("lm_eval"), "--model", model_type, "--model_args", model_args, "--include_path", ".",
           "--tasks", tasks, "--output_path", str(out), "--log_samples", *extra]
    proc = subprocess.run(cmd, cwd=task_dir, env=env, capture_output=True, text=True, timeout=240)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log
    (results,) = out.glob("*/results_*.json")
    samples = {}
    for task in tasks.split(","):
        (f,) = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in f.read_text().splitlines()]
    return json.loads(results.read_text()), samples


def test_lm_eval_local_completions(idle_server, reference, task_dir, client_env, tmp_path, tiny_model_dir):
    tok, model = reference
    model_args = (f"model={SERVED_NAME},base_url={idle_server.url}/v1/completions,tokenizer={tiny_model_dir},"
                  "tokenizer_backend=huggingface,max_retries=1")
    results, samples = run_lm_eval("local-completions", model_args, "fastserve_mc,fastserve_gen", task_dir,
                                   tmp_path / "out", client_env)
    n_docs = len((task_dir / "fastserve_tasks.jsonl").read_text().splitlines())
    assert 0 <= results["results"]["fastserve_mc"]["acc,none"] <= 1
    assert 0 <= results["results"]["fastserve_gen"]["exact_match,none"] <= 1

    # loglikelihood: every (context, continuation) scored by lm-eval through the server = transformers'
    assert len(samples["fastserve_mc"]) == n_docs
    greedy_flags = []
    for s in samples["fastserve_mc"]:
        for i, args in enumerate(s["arguments"].values()):
            ctx, cont = encode_pair(tok, args["arg_0"], args["arg_1"])
            lp = logprobs(model, ctx + cont)
            want = sum(float(lp[len(ctx) + j - 1, t]) for j, t in enumerate(cont))
            want_greedy = all(int(lp[len(ctx) + j - 1].argmax()) == t for j, t in enumerate(cont))
            got, got_greedy = s["resps"][i][0]
            assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-4), (args, got, want)
            assert (got_greedy == "True") == want_greedy, (args, got_greedy)
            greedy_flags.append(want_greedy)
    assert any(greedy_flags) and not all(greedy_flags)

    # generate_until: the text = transformers' greedy tokens from the same prompt tokens, cut at the stop string
    import torch

    assert len(samples["fastserve_gen"]) == n_docs
    for s in samples["fastserve_gen"]:
        prompt, gen_args = s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]
        ids = tok(prompt, add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_GEN_TOKS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        want = tok.decode(out[0, len(ids):], skip_special_tokens=True).split(gen_args["until"][0])[0]
        assert s["resps"][0][0] == want, (prompt, s["resps"][0][0], want)


def test_lm_eval_local_chat_completions(idle_server, task_dir, client_env, tmp_path):
    model_args = f"model={SERVED_NAME},base_url={idle_server.url}/v1/chat/completions,max_retries=1"
    results, samples = run_lm_eval("local-chat-completions", model_args, "fastserve_gen", task_dir,
                                   tmp_path / "out", client_env, "--apply_chat_template")
    assert 0 <= results["results"]["fastserve_gen"]["exact_match,none"] <= 1
    n_docs = len((task_dir / "fastserve_tasks.jsonl").read_text().splitlines())
    assert len(samples["fastserve_gen"]) == n_docs
    for s in samples["fastserve_gen"]:
        (messages,) = s["arguments"]["gen_args_0"]["arg_0"]
        messages = json.loads(messages)
        assert messages == [{"role": "user", "content": s["doc"]["question"]}]
        status, _, body = post_json(idle_server.url + "/v1/chat/completions",
                                    {"model": SERVED_NAME, "messages": messages, "max_tokens": MAX_GEN_TOKS,
                                     "temperature": 0, "stop": ["\n"]})
        assert status == 200, body
        got = s["resps"][0][0]
        assert got and got == body["choices"][0]["message"]["content"], (got, body)
