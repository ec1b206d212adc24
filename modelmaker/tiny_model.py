"""The built-in tiny model: building it, and building it when missing.

`python server.py --model tiny-opt` (and `make model`, `fastserve compare`, `fastserve bench soak`) build it
here; the engine itself only loads it from engine.config.DEFAULT_MODEL_DIR (`LLM(model=None)`,
EngineConfig(model=None), the name tiny-opt) and never builds it. It is a random-weight OPT of ~5M parameters
(2048-token context) with its own byte-level BPE tokenizer, written deterministically by
modelmaker/opt_checkpoint.py and modelmaker/tiny_tokenizer.py (`fastserve make-model`, fastserve/make_model.py,
is the CLI).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from engine.config import DEFAULT_MODEL_DIR
from modelmaker.opt_checkpoint import TINY_SHAPE, opt_config, write_opt_checkpoint
from modelmaker.tiny_tokenizer import train_tiny_tokenizer, train_word_tokenizer

TINY_SEED = 0
TOKENIZERS = {"bpe": train_tiny_tokenizer, "word": train_word_tokenizer}  # "bpe": the built-in model's
WORD_MODEL_DIR = DEFAULT_MODEL_DIR.parent / "tiny-opt-word"  # where the word-level twin goes by default
MODEL_DIRS = {"bpe": DEFAULT_MODEL_DIR, "word": WORD_MODEL_DIR}  # each tokenizer's model's default directory


def build_tiny_model(out_dir: str | Path, tokenizer: str = "bpe") -> Path:
    """Write the tiny model (tokenizer + config + weights) into out_dir, atomically. tokenizer="word" gives the
    same shape with a word-level tokenizer (modelmaker/tiny_tokenizer.py says why)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-opt-", dir=out.parent))
    try:
        tok = TOKENIZERS[tokenizer](tmp)
        write_opt_checkpoint(tmp, opt_config(vocab_size=tok.vocab_size, **TINY_SHAPE), seed=TINY_SEED)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_tiny_model(out_dir: str | Path | None = None, tokenizer: str = "bpe") -> Path:
    """out_dir (default: where the engine looks for the built-in model, or WORD_MODEL_DIR for the word-level
    twin), built first if it has no config.json."""
    out = Path(out_dir) if out_dir is not None else MODEL_DIRS[tokenizer]
    if not (out / "config.json").is_file():
        build_tiny_model(out, tokenizer)
    return out
