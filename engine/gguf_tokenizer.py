"""The tokenizer a GGUF file describes (tokenizer.ggml.* metadata), built as a `tokenizers` byte-level BPE.

What it is: the vocabulary and merges of a "gpt2"-model file (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen2),
the pre-tokenizer its `tokenizer.ggml.pre` names (llama.cpp's regexes, as the models' own tokenizer.json
files write them), its control tokens as special tokens, user-defined ones as added tokens, BOS prepended
when tokenizer.ggml.add_bos_token says so, the bos/eos/unk/pad ids it names, and tokenizer.chat_template.
engine/tokenizer.py's Tokenizer.from_pretrained calls it for a .gguf path. Refused with a one-line error that
says to pass --tokenizer: other tokenizer models (SentencePiece "llama", ...) and pre-tokenizers not below.
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


def gguf_tokenizer(path: str | Path) -> tuple[tokenizers.Tokenizer, dict[str, AddedToken | None], str | None]:
    """(backend, bos/eos/unk/pad tokens, chat template or None) of the GGUF file at `path`."""
    with GGUFCheckpoint(path) as gguf:
        kind, pre = gguf.field("tokenizer.ggml.model"), gguf.field("tokenizer.ggml.pre", "default")
        tokens = gguf.field("tokenizer.ggml.tokens")
        if kind != "gpt2" or not tokens:
            raise CheckpointError(f"{Path(path).name}: GGUF tokenizer model {kind!r} is not supported (only gpt2, "
                                  "byte-level BPE); pass --tokenizer with the model's Hugging Face tokenizer")
        pre_tokenizer = _pre_tokenizer(pre)
        if pre_tokenizer is None:
            raise CheckpointError(f"{Path(path).name}: GGUF pre-tokenizer {pre!r} is not supported; pass "
                                  "--tokenizer with the model's Hugging Face tokenizer")
        merges = [tuple(m.split(" ", 1)) for m in gguf.field("tokenizer.ggml.merges", [])]
        types = gguf.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, kind in zip(tokens, types) if kind == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
        named = {name: gguf.field(f"tokenizer.ggml.{key}_token_id") for name, key in
                 (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
        special = {name: AddedToken(tokens[i], special=True, normalized=False) if i is not None else None
                   for name, i in named.items()}
        bos = named["bos"]
        if bos is not None and gguf.field("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                                   special_tokens=[(tokens[bos], bos)])
        return backend, special, gguf.field("tokenizer.chat_template")
