"""Chat templates: a list of chat messages -> one prompt string.

A model that ships a chat template (tokenizer_config.json's `chat_template`,
chat_template.jinja, a GGUF file's tokenizer.chat_template) is served with it;
OPT was never trained for chat and ships none, so FastServe has a plain default
(below). `--chat-template FILE` replaces either with any Jinja template in
the Hugging Face `chat_template` convention: it sees `messages` (a list of
{"role", "content"} and, when the client sent one, "name"),
`add_generation_prompt` (the request's, default true), `documents` (the
request's, or none), `bos_token` / `eos_token`, and any request
`chat_template_kwargs`, and renders the prompt text. With the default template
or a --chat-template file the engine's tokenizer then adds its BOS token itself,
so those templates should not; a model's own template writes its BOS itself.

The default template writes a message's `name` after its role:
"User (alice): Hello". `continue_final_message` cuts the rendered text right
after the last message's content (transformers' rule), so the model continues
that message.

Templates render in the environment transformers' apply_chat_template builds,
so a model's own template gives the very prompt it was trained on: Jinja's
immutable sandbox (no attribute access to Python internals, no file system)
with trim_blocks and lstrip_blocks, the loopcontrols extension ({% break %},
{% continue %}), `{% generation %}` blocks (rendered as their content),
`raise_exception(message)`, `strftime_now(format)` and transformers' `tojson`
(non-ASCII kept, HTML characters not escaped; indent, separators, sort_keys).

What this is not: message validation (serving/openai_protocol.py does that).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ValidationError

# The default: one "Role: content" line per message (with its name, if any, after the role), then
# "Assistant:" for the reply.
#   System: You are terse.
#   User (alice): Hello
#   Assistant:
# A content that starts with white space is written right after the colon, any other after one space. So the
# generation prompt is a prefix of the next turn's rendering of the reply the model wrote after it: a byte-level
# BPE model answers "Assistant:" with " Hello" (the space is part of the word's token), and the next turn renders
# "Assistant: Hello", the same tokens, so a prefix cache finds the whole previous turn, answer included (always
# adding a space gave "Assistant:  Hello" and the cache stopped at the colon).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ m['role'] | capitalize }}{% if m['name'] %} ({{ m['name'] }}){% endif %}:"
    "{% if not m['content'][:1].isspace() %} {% endif %}{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise_exception(message: str) -> None:
    """What Hugging Face templates call to refuse a conversation."""
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter: json.dumps, where Jinja's own escapes HTML characters and non-ASCII."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it (for training
    masks); rendering a prompt, the block is its content."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from e
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_file(cls, path: str | Path, **tokens: str) -> ChatTemplate:
        try:
            source = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the chat template file {path}: {e.strerror}") from e
        return cls(source, **tokens)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
               extra: dict | None = None) -> str:
        """The prompt text for `messages` (already validated). `extra`: more template variables (vLLM's
        chat_template_kwargs; they win over the others, as in vLLM)."""
        variables = {"add_generation_prompt": add_generation_prompt, "documents": documents, **self._tokens,
                     **(extra or {})}
        try:
            text = self._template.render(messages=messages, **variables)
        except TemplateError as e:
            raise ValidationError(f"the chat template failed on these messages: {e}", param="messages") from e
        except Exception as e:  # a template that trips over a client's chat_template_kwargs value
            raise ValidationError(f"the chat template failed: {type(e).__name__}: {e}"[:300],
                                  param="chat_template_kwargs" if extra else "messages") from e
        if continue_final_message:  # transformers' rule: end right after the last message's content
            final = messages[-1]["content"].strip()
            if final not in text:
                raise ValidationError("continue_final_message: the last message's content does not appear in the "
                                      "rendered chat template", param="continue_final_message")
            text = text[: text.rindex(final) + len(final)]
        return text
