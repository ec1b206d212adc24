"""Chat templates: a list of chat messages -> one prompt string.

OPT was never trained for chat and ships no template, so FastServe has a plain
default (below); `--chat-template FILE` replaces it with any Jinja template in
the Hugging Face `chat_template` convention: it sees `messages` (a list of
{"role", "content"}), `add_generation_prompt` (always true here) and
`bos_token` / `eos_token`, and renders the prompt text. The engine's
tokenizer then adds OPT's BOS token itself, so templates should not.

Templates render in Jinja's immutable sandbox (no attribute access to Python
internals, no file system), as transformers does.

What this is not: message validation (serving/openai_protocol.py does that).
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ValidationError

# The default: one "Role: content" line per message, then "Assistant:" for the reply.
#   System: You are terse.
#   User: Hello
#   Assistant:
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ m['role'] | capitalize }}: {{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise_exception(message: str) -> None:
    """What Hugging Face templates call to refuse a conversation."""
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise_exception
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

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for `messages` (already validated)."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._tokens)
        except TemplateError as e:
            raise ValidationError(f"the chat template failed on these messages: {e}", param="messages") from e
