"""Which tokenizer the load generator counts text tokens with (ShareGPT and Alpaca give text, not counts).

What this is: choose_counter() picks, in the order a vLLM user expects, and says which and why:
  1. --tokenizer DIR, or --gpt2-bpe DIR (OpenAI's encoder.json + vocab.bpe);
  2. --model, when it is a model this machine can read: a directory, a GGUF file, or a name server.py knows
     (SmolLM2-135M-Instruct, tiny-opt) (vLLM's --model is also its tokenizer);
  3. the model the server lists at /v1/models, when it is such a model (server.py lists its --model value, and
     SmolLM2-135M-Instruct when it was given none);
  4. the built-in tiny model's tokenizer.
mismatch_warning() says when the counter cannot be the server's: its vocabulary is larger than the server's
model's, or smaller by more than the padding OPT checkpoints add (GPT-2 BPE counts as OPT's). Token counts
decide which items fit the context and how many tokens each asks for; another tokenizer's counts can send a
request past the server's context.
Errors (an unreadable tokenizer) are workload.DatasetError. What this is not: a dataset reader (workload.py)
or a tokenizer (engine/tokenizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastserve.bench.workload import CountTokens, DatasetError

VOCAB_PADDING = 128  # a checkpoint's embedding rows beyond its tokenizer's ids (OPT: 50272 vs 50265)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


@dataclass(frozen=True)
class TokenCounter:
    count: CountTokens  # tokens of a text, without BOS/EOS
    vocab_size: int
    source: str  # which tokenizer, and why it was chosen


def model_dir_counter(model_dir: str | Path, why: str) -> TokenCounter:
    from engine.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot load a tokenizer from {model_dir} ({why}): {e}") from None
    return TokenCounter(lambda text: len(tok.encode(text, add_special_tokens=False)), tok.vocab_size,
                        f"the tokenizer of {model_dir} ({why})")


def gpt2_bpe_counter(bpe_dir: str | Path) -> TokenCounter:
    import tokenizers
    from tokenizers import models, pre_tokenizers

    d = Path(bpe_dir)
    encoder, merges = d / "encoder.json", d / "vocab.bpe"
    for f in (encoder, merges):
        if not f.is_file():
            raise DatasetError(f"{f}: not found; --gpt2-bpe needs a folder with encoder.json and vocab.bpe")
    tok = tokenizers.Tokenizer(models.BPE.from_file(str(encoder), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return TokenCounter(lambda text: len(tok.encode(text).ids), tok.get_vocab_size(),
                        f"GPT-2 BPE from {bpe_dir} (--gpt2-bpe)")


def readable_model(name: str | None) -> Path | None:
    """`name` as a model whose tokenizer this machine can read: a directory holding one, a GGUF file, or a name
    that engine/model_names.py knows (SmolLM2-135M-Instruct when its package is installed; tiny-opt, built if
    missing)."""
    from engine.model_names import is_tiny_opt, model_path

    if not name:
        return None
    if is_tiny_opt(name):
        from modelmaker.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    try:
        path = model_path(name)
        if path.is_dir():
            return path if any((path / f).is_file() for f in TOKENIZER_FILES) else None
        return path if path.suffix == ".gguf" and path.is_file() else None
    except OSError:  # a named model that is not installed, an unreadable path
        return None


def choose_counter(tokenizer: str | None, gpt2_bpe: str | None, model: str | None,
                   served_model: str | None) -> TokenCounter:
    if tokenizer:
        return model_dir_counter(tokenizer, "--tokenizer")
    if gpt2_bpe:
        return gpt2_bpe_counter(gpt2_bpe)
    for name, why in ((model, "--model"), (served_model, "the model the server lists at /v1/models")):
        if (path := readable_model(name)) is not None:
            return model_dir_counter(path, why)
    from modelmaker.tiny_model import ensure_tiny_model

    listed = f"the server lists {served_model!r}, not a model here" if served_model else "no model named"
    return model_dir_counter(ensure_tiny_model(), f"the built-in tiny model's; {listed}; "
                                                  "pass --tokenizer DIR to count with the served model's")


def mismatch_warning(counter: TokenCounter, server_vocab: int | None,
                     hint: str = "pass --tokenizer with the served model's directory") -> str | None:
    if server_vocab is None:
        return None
    if counter.vocab_size > server_vocab or server_vocab - counter.vocab_size > VOCAB_PADDING:
        return (f"warning: counting tokens with {counter.source}, a vocabulary of {counter.vocab_size}, but the "
                f"model's is {server_vocab}: counts will differ from the model's own tokenizer's, so a prompt "
                f"near the context may not fit; {hint}")
    return None
