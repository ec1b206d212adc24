"""The tokenizer a GGUF file describes (tokenizer.ggml.* metadata), built as a `tokenizers` BPE.

What it is, for the two tokenizer models most GGUF files name in tokenizer.ggml.model:
  * "gpt2" (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen2): the vocabulary and merges of the file, the
    pre-tokenizer its `tokenizer.ggml.pre` names (llama.cpp's regexes, as the models' own tokenizer.json files
    write them), bytes mapped to characters GPT-2's way;
  * "llama" (SentencePiece BPE: Llama 2, Mistral 7B, TinyLlama): the vocabulary with byte fallback (a character
    not in it is its UTF-8 bytes, one <0xNN> token each), merges from the file or, as these files have none,
    derived from the vocabulary ranked by the pieces' scores (transformers' generate_merges order), spaces
    written "▁" with one "▁" before the text (Metaspace, prepend_scheme "first", as transformers' LlamaTokenizer;
    none when tokenizer.ggml.add_space_prefix is false), decoded back (▁ -> space, bytes fused into characters,
    the leading space stripped), BOS prepended unless tokenizer.ggml.add_bos_token is false (llama.cpp's
    default for these files), <unk> for an id the vocabulary lacks;
and for both: control tokens (token type 3) as special tokens never split, user-defined ones as added tokens,
the bos/eos/unk/pad ids it names, and tokenizer.chat_template. engine/tokenizer.py's Tokenizer.from_pretrained
calls it for a .gguf path. Refused with a one-line error that says to pass --tokenizer: other tokenizer models
("t5", "bert", ...) and "gpt2" pre-tokenizers not below.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from engine.errors import CheckpointError
from engine.gguf_checkpoint import GGUFCheckpoint

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer | None:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is not None:  # the split regex, then bytes to characters without GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in ("smollm", "starcoder"):  # digits one by one, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt2"):
        return byte_level
    return None


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces of the vocabulary,
    ranked by the piece's score (highest first; then the longer left part, the longer right part), the splits of
    one piece in the order of their parts' ids: transformers' generate_merges, whose order its GGUF tokenizer
    uses."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked += [(left, right, score) for left, right in splits]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _sentencepiece(gguf: GGUFCheckpoint, tokens: list[str]) -> tokenizers.Tokenizer:
    """The backend of a "llama" (SentencePiece BPE) vocabulary: byte fallback, "▁" for spaces."""
    scores = gguf.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges = gguf.field("tokenizer.ggml.merges")
    merges = ([tuple(m.split(" ", 1)) for m in merges] if merges else sentencepiece_merges(tokens, scores))
    unk = gguf.field("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=True,
                                              byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(gguf.field("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first" if prefix else "never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return backend


def _byte_level(gguf: GGUFCheckpoint, tokens: list[str], pre: str, name: str) -> tokenizers.Tokenizer:
    """The backend of a "gpt2" (byte-level BPE) vocabulary with the file's merges and pre-tokenizer."""
    pre_tokenizer = _pre_tokenizer(pre)
    if pre_tokenizer is None:
        raise CheckpointError(f"{name}: GGUF pre-tokenizer {pre!r} is not supported; pass "
                              "--tokenizer with the model's Hugging Face tokenizer")
    merges = [tuple(m.split(" ", 1)) for m in gguf.field("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def gguf_tokenizer(path: str | Path) -> tuple[tokenizers.Tokenizer, dict[str, AddedToken | None], str | None]:
    """(backend, bos/eos/unk/pad tokens, chat template or None) of the GGUF file at `path`."""
    with GGUFCheckpoint(path) as gguf:
        kind, pre = gguf.field("tokenizer.ggml.model"), gguf.field("tokenizer.ggml.pre", "default")
        tokens = gguf.field("tokenizer.ggml.tokens")
        if kind not in ("gpt2", "llama") or not tokens:
            raise CheckpointError(f"{Path(path).name}: GGUF tokenizer model {kind!r} is not supported (gpt2, "
                                  "byte-level BPE, and llama, SentencePiece BPE, are); pass --tokenizer with the "
                                  "model's Hugging Face tokenizer")
        backend = (_sentencepiece(gguf, tokens) if kind == "llama"
                   else _byte_level(gguf, tokens, pre, Path(path).name))
        types = gguf.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, kind in zip(tokens, types) if kind == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
        named = {name: gguf.field(f"tokenizer.ggml.{key}_token_id") for name, key in
                 (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
        special = {name: AddedToken(tokens[i], special=True, normalized=False) if i is not None else None
                   for name, i in named.items()}
        if kind == "llama":  # named ones (<unk> is token type 2) are special too, as in transformers
            backend.add_special_tokens([t for t in special.values() if t is not None])
        bos = named["bos"]
        if bos is not None and gguf.field("tokenizer.ggml.add_bos_token", kind == "llama"):
            backend.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                                   special_tokens=[(tokens[bos], bos)])
        return backend, special, gguf.field("tokenizer.chat_template")
