"""Training of the built-in tiny model's tokenizer.

What this is: `train_tiny_tokenizer`, which trains a byte-level BPE (GPT-2/OPT style) on the small English
corpus in modelmaker/tiny_corpus.txt and writes it in OPT's Hugging Face layout, so that both
`engine.tokenizer.Tokenizer` and transformers' AutoTokenizer load it and give the same ids (BOS "</s>" first).
Training is deterministic: the same files, byte for byte, on every run and machine.

`train_word_tokenizer` writes a word-level one (one id per white-space-separated word of the corpus, "<unk>" for
any other): a random-weight model's output then survives decode -> encode, as a trained model's text does, and
a byte-level BPE's random output does not (random byte tokens merge differently when re-encoded, and stray
bytes become U+FFFD). Multi-turn benchmarks of prefix caching need that: the next turn sends the previous
answer back as text (fastserve make-model --tokenizer word).

What this is not: a tokenizer for real text (the corpus is ~26 KB; OPT checkpoints ship their own), and
not the loader (engine/tokenizer.py), which the engine uses; this module is development tooling
(modelmaker/), outside the engine's imports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

from engine.tokenizer import Tokenizer, TokenizerError

CORPUS = Path(__file__).resolve().parent / "tiny_corpus.txt"  # shipped in the wheel (pyproject package-data)
SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0, 1, 2, 3, as in OPT's vocab.json
BYTE_ALPHABET_SIZE = 256  # byte-level BPE starts from every byte, so any text can be encoded

# The HF configs of facebook/opt-*: BOS and EOS are both "</s>", and BOS is prepended to every text.
_SPECIAL_TOKENS_MAP = {"bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
_TOKENIZER_CONFIG = {
    **_SPECIAL_TOKENS_MAP,
    "add_bos_token": True,
    "add_prefix_space": False,
    "errors": "replace",
    "model_max_length": 2048,
    "tokenizer_class": "GPT2Tokenizer",
}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def train_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 4096) -> Tokenizer:
    """Train on modelmaker/tiny_corpus.txt and write tokenizer.json, vocab.json, merges.txt,
    tokenizer_config.json and special_tokens_map.json into `out_dir`; return the loaded tokenizer.

    `vocab_size` is an upper bound: training stops early once every word of the corpus is one token.
    """
    min_size = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise TokenizerError(f"vocab_size={vocab_size} is too small: byte-level BPE needs {min_size} or more")
    out = _corpus_and_out_dir(out_dir)

    # The same pipeline transformers' GPT2Tokenizer builds for OPT (see engine/tokenizer.py).
    backend = tokenizers.Tokenizer(models.BPE(fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Rust's trainer breaks ties in pair counts by pair ids, not by hash order, so the result does not
    # depend on thread count or hash seeds; tests/test_tokenizer.py checks this byte for byte.
    backend.train([str(CORPUS)], trainer)
    backend.model.save(str(out))  # vocab.json + merges.txt
    return _save_opt_layout(backend, out, _TOKENIZER_CONFIG)


def _corpus_and_out_dir(out_dir: str | os.PathLike) -> Path:
    """The output directory (made if missing), once the training corpus is known to be there."""
    if not CORPUS.is_file():
        raise TokenizerError(f"tiny tokenizer corpus {CORPUS} is missing")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _save_opt_layout(backend: tokenizers.Tokenizer, out: Path, config: dict) -> Tokenizer:
    """OPT's BOS ("</s>" first) as the post-processor, then tokenizer.json, tokenizer_config.json and
    special_tokens_map.json into `out`; the tokenizer loaded back as the engine loads it."""
    bos = ("</s>", backend.token_to_id("</s>"))
    backend.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[bos])
    backend.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", _SPECIAL_TOKENS_MAP)
    return Tokenizer.from_pretrained(out)


# Words the default chat template (serving/chat_template.py) writes, so that they are not "<unk>".
CHAT_TEMPLATE_WORDS = "System: User: Assistant:"


def train_word_tokenizer(out_dir: str | os.PathLike) -> Tokenizer:
    """A word-level tokenizer (split on white space; no decoder, so decoding joins words with one space) over the
    corpus's words and the chat template's, written as tokenizer.json + the OPT configs; return it loaded.
    Decoding then encoding any ids that are not special gives the same ids back."""
    out = _corpus_and_out_dir(out_dir)
    backend = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], show_progress=False)
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    backend.train_from_iterator([*lines, CHAT_TEMPLATE_WORDS], trainer)  # ties broken by word: deterministic
    return _save_opt_layout(backend, out, {**_TOKENIZER_CONFIG, "tokenizer_class": "PreTrainedTokenizerFast"})
