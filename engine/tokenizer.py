"""Text <-> token ids, and streaming detokenization.

What this is: a small typed wrapper around the Rust `tokenizers` library that loads a Hugging Face model
directory the way transformers 5's AutoTokenizer does (for facebook/opt-*: byte-level BPE, "</s>" prepended
as BOS; a tokenizer.json, as Llama-family checkpoints ship, brings its own pre-tokenizer and post-processor),
and `IncrementalDetokenizer`, which turns generated ids into text one step at a time without ever emitting
half of a UTF-8 character.

A .gguf file path loads the tokenizer its metadata describes (engine/gguf_tokenizer.py). The model's own chat
template (tokenizer_config.json's `chat_template`, a chat_template.jinja file, or a GGUF file's
tokenizer.chat_template) is kept as `chat_template` for the server; rendering it is serving/chat_template.py's.

What this is not: a general AutoTokenizer (no SentencePiece model files or padding; truncation only from
the left, for vLLM's truncate_prompt_tokens), and not a trainer (modelmaker/tiny_tokenizer.py trains the
built-in tiny model's tokenizer).

Loading rules (mirroring transformers 5):
  * tokenizer.json wins over vocab.json + merges.txt; with tokenizer.json, its own post-processor decides
    whether BOS is prepended (transformers 5 ignores `add_bos_token` then); without it, `add_bos_token`
    in tokenizer_config.json does (OPT sets it to true).
  * bos/eos/unk/pad come from special_tokens_map.json, then tokenizer_config.json, then config.json's
    `*_token_id`, then OPT's defaults ("</s>", "</s>", "<unk>", "<pad>") or GPT-2's "<|endoftext|>",
    whichever is in the vocabulary. A named token that is not in the vocabulary gets no id (transformers
    would invent a new id past the model's embedding; we do not).
  * Decoding skips the tokens registered as special; ids the vocabulary does not know decode to "".
  * `eos_token_ids`: every id that ends generation: the eos token's, config.json's `eos_token_id` and
    generation_config.json's (an int or a list: Llama 3 Instruct lists <|end_of_text|> and <|eot_id|>); a GGUF
    file's tokenizer.ggml.eos_token_id and tokenizer.ggml.eot_token_id.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from engine.gguf_checkpoint import GGUFCheckpoint, is_gguf
from engine.gguf_tokenizer import gguf_tokenizer

_REPLACEMENT_CHAR = "\ufffd"  # what lossy UTF-8 decoding puts where bytes do not form a character
_SPECIAL_NAMES = ("bos", "eos", "unk", "pad")
_DEFAULT_TOKENS = {
    "bos": ("</s>", "<|endoftext|>"),
    "eos": ("</s>", "<|endoftext|>"),
    "unk": ("<unk>", "<|endoftext|>"),
    "pad": ("<pad>",),
}


class TokenizerError(ValueError):
    """A tokenizer directory or file is missing or malformed, or an input cannot be tokenized."""


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"malformed {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"malformed {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _added_token(value: Any, where: str, special: bool = True) -> AddedToken | None:
    """A token as the HF configs write it: a string, {"content": ..., flags}, or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=special, **flags)
    raise TokenizerError(f"malformed token {value!r} in {where}: expected a string or {{'content': ...}}")


def _load_backend(model_dir: Path, add_prefix_space: bool) -> tuple[tokenizers.Tokenizer, bool]:
    """The Rust tokenizer and whether it came from tokenizer.json."""
    tokenizer_json = model_dir / "tokenizer.json"
    vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
    try:
        if tokenizer_json.is_file():
            return tokenizers.Tokenizer.from_file(str(tokenizer_json)), True
        if vocab.is_file() and merges.is_file():
            # Byte-level BPE exactly as transformers' GPT2Tokenizer (OPT's class) builds it.
            backend = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges), fuse_unk=False))
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
            backend.decoder = decoders.ByteLevel()
            return backend, False
    except Exception as e:  # the Rust side raises plain Exception for unreadable files
        bad = tokenizer_json if tokenizer_json.is_file() else f"{vocab} + {merges}"
        raise TokenizerError(f"malformed tokenizer in {bad}: {e}") from e
    raise TokenizerError(f"no tokenizer in {model_dir}: expected tokenizer.json, or vocab.json + merges.txt")


def _named_special_tokens(
    model_dir: Path, tok_cfg: dict[str, Any], backend: tokenizers.Tokenizer
) -> dict[str, AddedToken | None]:
    """bos/eos/unk/pad, resolved in transformers' order (see the module docstring)."""
    sources = [("tokenizer_config.json", tok_cfg)]
    if "added_tokens_decoder" not in tok_cfg:  # transformers reads special_tokens_map.json only then
        sources.insert(0, ("special_tokens_map.json", _read_json(model_dir / "special_tokens_map.json")))
    model_cfg = _read_json(model_dir / "config.json")
    named: dict[str, AddedToken | None] = {}
    for name in _SPECIAL_NAMES:
        key = f"{name}_token"
        source = next(((file, cfg) for file, cfg in sources if key in cfg), None)
        config_id = model_cfg.get(f"{key}_id")
        if source is not None:
            named[name] = _added_token(source[1][key], f"{model_dir / source[0]} ({key})")
        elif isinstance(config_id, int) and backend.id_to_token(config_id) is not None:
            named[name] = _added_token(backend.id_to_token(config_id), "config.json")
        else:
            default = next((t for t in _DEFAULT_TOKENS[name] if backend.token_to_id(t) is not None), None)
            named[name] = _added_token(default, "defaults")
    return named


def _register_config_added_tokens(
    backend: tokenizers.Tokenizer, tok_cfg: dict[str, Any], where: Path
) -> None:
    """Register tokenizer_config.json's `added_tokens_decoder` entries that the vocabulary already holds."""
    for idx, value in tok_cfg.get("added_tokens_decoder", {}).items():
        special = bool(value.get("special", False)) if isinstance(value, dict) else False
        token = _added_token(value, f"{where} (added_tokens_decoder)", special=special)
        if token is not None and str(backend.token_to_id(token.content)) == str(idx):
            (backend.add_special_tokens if special else backend.add_tokens)([token])


def _with_id(backend: tokenizers.Tokenizer, token: AddedToken | None) -> tuple[str, int] | None:
    """(content, id) of a token in the vocabulary, else None."""
    token_id = backend.token_to_id(token.content) if token is not None else None
    return (token.content, token_id) if token is not None and token_id is not None else None


def _chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str | None:
    """The directory's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a string,
    or transformers' list of named templates, whose "default" is taken); None when it ships none."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def _token_ids(value: Any) -> list[int]:
    """An `eos_token_id` value as the configs write it (an int, a list of ints, or absent) as a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def checkpoint_eos_token_ids(path: str | os.PathLike) -> list[int]:
    """The ids a checkpoint names as ending generation: config.json's and generation_config.json's
    `eos_token_id` in a directory, tokenizer.ggml.eos_token_id and tokenizer.ggml.eot_token_id in a GGUF file."""
    path = Path(path)
    if is_gguf(path):
        with GGUFCheckpoint(path) as gguf:
            return [i for key in ("eos", "eot") for i in _token_ids(gguf.field(f"tokenizer.ggml.{key}_token_id"))]
    return [i for name in ("config.json", "generation_config.json")
            for i in _token_ids(_read_json(path / name).get("eos_token_id"))]


def _bos_eos_template(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    """transformers' `update_post_processor` for one text: "[bos] $A [eos]"."""
    single = " ".join([*([bos[0]] if bos else []), "$A", *([eos[0]] if eos else [])])
    return processors.TemplateProcessing(single=single, special_tokens=[t for t in (bos, eos) if t])


class Tokenizer:
    """Byte-level BPE tokenizer of an OPT-family model directory (see `from_pretrained`)."""

    def __init__(self, backend: tokenizers.Tokenizer, special: dict[str, AddedToken | None],
                 chat_template: str | None = None, eos_token_ids: Sequence[int] = ()):
        self._backend = backend
        self.chat_template = chat_template  # the model's own Jinja chat template, if it ships one
        ids = {n: (backend.token_to_id(t.content) if t is not None else None) for n, t in special.items()}
        self.bos_token_id: int | None = ids.get("bos")
        self.eos_token_id: int | None = ids.get("eos")
        # Every id that ends generation: the eos token's first, then the checkpoint's others.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            i for i in (self.eos_token_id, *eos_token_ids) if i is not None))
        self.pad_token_id: int | None = ids.get("pad")
        self.unk_token_id: int | None = ids.get("unk")
        # The number of ids the tokenizer can produce: largest id + 1 (equals len(vocab) when ids are dense).
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        bos_first = backend.encode("").ids[:1] == [self.bos_token_id]  # what the post-processor prepends
        self.add_bos: bool = self.bos_token_id is not None and bos_first
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}  # id -> text, special or not

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json (preferred), else vocab.json + merges.txt, with the special tokens and BOS
        behaviour that transformers 5's AutoTokenizer gives the same directory; or a GGUF file's tokenizer."""
        model_dir = Path(model_dir)
        if is_gguf(model_dir):
            return cls(*gguf_tokenizer(model_dir), eos_token_ids=checkpoint_eos_token_ids(model_dir))
        if not model_dir.is_dir():
            raise TokenizerError(f"tokenizer directory {model_dir} does not exist or is not a directory")
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        backend, from_json = _load_backend(model_dir, bool(tok_cfg.get("add_prefix_space", False)))
        backend.no_padding()
        backend.no_truncation()
        _register_config_added_tokens(backend, tok_cfg, model_dir / "tokenizer_config.json")
        special = _named_special_tokens(model_dir, tok_cfg, backend)
        backend.add_special_tokens([t for t in special.values() if _with_id(backend, t)])
        if not from_json:
            bos = _with_id(backend, special["bos"]) if tok_cfg.get("add_bos_token") else None
            eos = _with_id(backend, special["eos"]) if tok_cfg.get("add_eos_token") else None
            backend.post_processor = _bos_eos_template(bos, eos)
        return cls(backend, special, _chat_template(model_dir, tok_cfg), checkpoint_eos_token_ids(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True, truncate_to: int | None = None) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, OPT's "</s>" BOS comes first. `truncate_to` N keeps
        at most N ids, cutting the text's tokens from the left and keeping the added special tokens (BOS +
        the last N-1 text tokens), as transformers does with truncation_side="left" (vLLM's setting)."""
        if truncate_to is None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        enc = self._backend.encode(text, add_special_tokens=False)
        keep = truncate_to - (self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0)
        if len(enc.ids) > max(keep, 0):
            enc.truncate(max(keep, 0), direction="left")
        return self._backend.post_process(enc, add_special_tokens=add_special_tokens).ids[-truncate_to:]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text (in parallel on the Rust side)."""
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD, unknown ids become ""."""
        ids = list(ids)
        if any(i < 0 for i in ids):
            raise TokenizerError(f"cannot decode negative token id {min(ids)}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry of id `i` (byte-level form, e.g. "Ġthe"), or None if there is none."""
        return self._backend.id_to_token(i) if i >= 0 else None

    @property
    def all_special_ids(self) -> set[int]:
        """Ids that `decode(..., skip_special_tokens=True)` leaves out."""
        return set(self._special_ids)


class IncrementalDetokenizer:
    """Streams output text token by token and never emits a broken UTF-8 character.

    Invariant: the concatenation of every `step()` return and `flush()` equals `tokenizer.decode(token_ids)`.
    It holds because text is only emitted up to a "clean" boundary: vLLM's scheme keeps a window of ids
    from `prefix` on; `read` splits it into already-emitted context and pending ids. A step decodes the
    window; if its text ends in U+FFFD (a character still missing bytes), the pending ids are held back,
    else the text past the context is emitted and the window slides. Each step is O(window), not O(length).

    With `spaces_between_special_tokens=False` (and special tokens kept), an added token that directly follows
    another is emitted as its bare text, without the space a decoder may put before it (vLLM's rule; then the
    invariant above holds up to those spaces). Byte-level BPE decoders (OPT's) put no such space.
    """

    PROMPT_CONTEXT = 5  # prompt ids kept as decoding context (vLLM's initial prefix offset)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # vLLM: the setting only matters when special tokens are kept
        self._join_added = not skip_special_tokens and not spaces_between_special_tokens
        self._last_added = False  # the previous output token was an added token (for _join_added)
        context = list(prompt_ids[-self.PROMPT_CONTEXT :]) if self.PROMPT_CONTEXT else []
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # a prompt cut mid-character must not absorb the output's first bytes
        self._window: list[int] = context  # ids from the prefix offset on
        self._read = len(context)  # window[:read] is context already emitted (or prompt)
        self.text = ""  # all output text emitted so far
        self.token_ids: list[int] = []  # output token ids so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _pending_text(self) -> str:
        """Text of the pending ids: the window's text past its context (prefix-stable at a clean boundary)."""
        return self._decode(self._window)[len(self._decode(self._window[: self._read])) :]

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids; return the text they complete ("" while a character is still partial)."""
        emitted = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._window.append(token_id)
            if self._join_added:
                added = self._tokenizer.added_tokens.get(token_id)
                if added is not None and self._last_added and self._read == len(self._window) - 1:
                    emitted.append(added)  # the bare token: nothing else is pending after an added token
                    self._window = self._window[self._read :]
                    self._read = len(self._window)
                    continue
                self._last_added = added is not None
            pending = self._pending_text()
            if pending and not pending.endswith(_REPLACEMENT_CHAR):
                emitted.append(pending)
                self._window = self._window[self._read :]
                self._read = len(self._window)
        out = "".join(emitted)
        self.text += out
        return out

    def flush(self) -> str:
        """At finish: emit whatever is held back, U+FFFD included (those bytes will never complete)."""
        out = self._pending_text()
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self.text += out
        return out


def sequence_end_ids(tokenizer: Tokenizer, model_dir: str | os.PathLike) -> tuple[int, ...]:
    """The ids that end a sequence: the tokenizer's, then the model checkpoint's (which differ when the tokenizer
    is loaded from elsewhere), each once."""
    return tuple(dict.fromkeys([*tokenizer.eos_token_ids, *checkpoint_eos_token_ids(model_dir)]))
