"""A Llama-3-style checkpoint served over HTTP (the real openai client): its special tokens live in tokenizer.json,
its chat template in tokenizer_config.json, and its end-of-generation ids in three places (the tokenizer's eos
token, config.json's `eos_token_id`, generation_config.json's list); generation stops at any of them, and the chat
prompt the server builds is, token for token, transformers' apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.engine import Engine
from engine.tokenizer import Tokenizer
from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from tests.server_fixtures import QUICK_ARGS, served_client

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
           "<|eot_id|>"]
BASE_VOCAB = 4096  # the tiny tokenizer's vocabulary; the special tokens follow it, as Llama 3's follow its 128000
ID = {t: BASE_VOCAB + i for i, t in enumerate(SPECIAL)}
# Meta-Llama-3-8B-Instruct's chat template, as its tokenizer_config.json ships it.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# What a model's template may lean on beyond Llama 3's: block tags on lines of their own (trim_blocks and
# lstrip_blocks decide the white space), transformers' tojson (no HTML escapes, non-ASCII kept), {% break %},
# {% generation %} blocks, namespace().
FEATURES_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
<<SYS>>{{ message['content'] | tojson }}<</SYS>>
    {% elif message['role'] == 'assistant' %}
{% generation %}
<|start_header_id|>assistant<|end_header_id|>
{{ message['content'] | trim }}<|eot_id|>
{% endgeneration %}
    {% else %}
        {%- set ns.turns = ns.turns + 1 %}
<|start_header_id|>{{ message['role'] }} {{ ns.turns }}<|end_header_id|>
{{ message['content'] }}<|eot_id|>
    {%- endif %}
    {%- if loop.index >= 4 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "You are a terse <b>café</b> assistant."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "  Hi. What do you need?\n"},
    {"role": "user", "content": "A haiku about caches, please."},
    {"role": "assistant", "content": "Cut off by the break."},
]


def write_llama3_checkpoint(out: Path, tokenizer_dir: Path, chat_template: str | list) -> Path:
    """A random-weight LlamaForCausalLM directory in Llama 3 Instruct's layout: the tiny tokenizer's BPE with
    Llama 3's special tokens added to tokenizer.json (<|begin_of_text|> prepended by its post-processor),
    tokenizer_config.json naming bos/eos and the chat template, config.json's eos_token_id <|end_of_text|>,
    generation_config.json's [<|eom_id|>, <|eot_id|>]."""
    cfg = llama_config(vocab_size=BASE_VOCAB + len(SPECIAL), bos_token_id=ID["<|begin_of_text|>"],
                       eos_token_id=ID["<|end_of_text|>"])
    write_llama_checkpoint(out, cfg)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = [dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
             for t, i in ID.items()]
    spec["added_tokens"] += added
    bos = "<|begin_of_text|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [ID[bos]], "tokens": [bos]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    decoder = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "bos_token": bos, "eos_token": "<|eot_id|>", "chat_template": chat_template,
        "clean_up_tokenization_spaces": False, "model_max_length": 8192, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ID[bos], "eos_token_id": [ID["<|eom_id|>"], ID["<|eot_id|>"]], "do_sample": True}))
    return out


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return write_llama3_checkpoint(tmp_path_factory.mktemp("llama3"), tiny_model_dir, LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def llama3_client(llama3_dir, tmp_path_factory):
    with served_client(llama3_dir, (*QUICK_ARGS, "--num-gpu-blocks-override", "256"),
                       tmp_path_factory.mktemp("llama3-logs")) as client:
        yield client


def test_the_tokenizer_names_every_eos_id_of_the_checkpoint(llama3_dir):
    assert Tokenizer.from_pretrained(llama3_dir).eos_token_ids == (
        ID["<|eot_id|>"], ID["<|end_of_text|>"], ID["<|eom_id|>"])


@pytest.mark.parametrize("token", ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"])
def test_generation_stops_at_each_eos_id(llama3_client, token):
    """Each end id (the tokenizer's eos token, config.json's, generation_config.json's), pushed to be the first
    token sampled, ends the completion with "stop" and leaves no text; with ignore_eos it does not end it; with
    min_tokens 3 it is banned until three tokens exist, then comes fourth and ends it."""
    def complete(**extra):
        return llama3_client.completions.create(model=llama3_client.models.list().data[0].id, prompt="Hello",
                                                max_tokens=5, temperature=0, logit_bias={str(ID[token]): 100},
                                                extra_body=extra)

    stopped = complete()
    assert (stopped.choices[0].finish_reason, stopped.choices[0].text, stopped.usage.completion_tokens) == (
        "stop", "", 1)
    running = complete(ignore_eos=True)
    assert (running.choices[0].finish_reason, running.usage.completion_tokens) == ("length", 5)
    late = complete(min_tokens=3)
    assert (late.choices[0].finish_reason, late.usage.completion_tokens) == ("stop", 4)


def test_a_token_that_is_no_eos_id_does_not_stop(llama3_client):
    out = llama3_client.completions.create(model=llama3_client.models.list().data[0].id, prompt="Hello",
                                           max_tokens=4, temperature=0, logit_bias={str(ID["<|eom_id|>"] - 2): 100})
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("length", 4)


def server_prompt_ids(client: openai.OpenAI, messages: list[dict]) -> tuple[int, list[int]]:
    """(the prompt's token count, its ids after the first) as the server tokenized the chat, from vLLM's
    prompt_logprobs (null for the first position, then a map that holds each prompt token's id)."""
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    rest = [int(next(iter(p))) for p in resp.model_extra["prompt_logprobs"][1:]]
    return resp.usage.prompt_tokens, rest


def transformers_prompt(model_dir: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)


def test_the_chat_prompt_is_transformers_apply_chat_template(llama3_client, llama3_dir):
    want = transformers_prompt(llama3_dir)
    assert want[:2] == [ID["<|begin_of_text|>"], ID["<|start_header_id|>"]] and want.count(ID["<|eot_id|>"]) == 5
    assert server_prompt_ids(llama3_client, MESSAGES) == (len(want), want[1:])


def test_a_named_default_template_renders_as_transformers_does(tmp_path, tiny_model_dir):
    """tokenizer_config.json's chat_template as a list of named templates: "default" is the one chat uses, in
    transformers' Jinja environment."""
    templates = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                 {"name": "default", "template": FEATURES_TEMPLATE}]
    model_dir = write_llama3_checkpoint(tmp_path / "model", tiny_model_dir, templates)
    want = transformers_prompt(model_dir)
    text = AutoTokenizer.from_pretrained(model_dir).decode(want)
    assert '<<SYS>>"You are a terse <b>café</b> assistant."<</SYS>>\n' in text and "user 2<|end_header_id|>" in text
    assert "break" not in text and text.endswith("please.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    (tmp_path / "logs").mkdir()
    with served_client(model_dir, (*QUICK_ARGS, "--num-gpu-blocks-override", "64"), tmp_path / "logs") as client:
        assert server_prompt_ids(client, MESSAGES) == (len(want), want[1:])


def test_a_tokenizer_from_elsewhere_keeps_the_models_eos_ids(llama3_dir, tiny_model_dir):
    """--tokenizer naming another directory: the model directory's config.json and generation_config.json ids
    still end generation, after the tokenizer's own."""
    engine = Engine(EngineConfig(model=str(llama3_dir), tokenizer=str(tiny_model_dir), profile="analytic",
                                 num_gpu_blocks_override=16))
    assert engine.eos_token_ids == (2, ID["<|end_of_text|>"], ID["<|eom_id|>"], ID["<|eot_id|>"])
