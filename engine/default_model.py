"""The built-in tiny model: where it lives, and building it when missing.

`LLM(model=None)` and `python server.py` with no --model use it. It is a
random-weight OPT of ~5M parameters (2048-token context) with its own
byte-level BPE tokenizer, written deterministically by engine/model_maker.py
and engine/tiny_tokenizer.py (scripts/make_tiny_model.py is the CLI).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.model_maker import TINY_SHAPE, opt_config, write_opt_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = Path(os.environ.get("FASTSERVE_DEFAULT_MODEL", REPO_ROOT / "models" / "tiny-opt"))
TINY_SEED = 0


def build_tiny_model(out_dir: str | Path) -> Path:
    """Write the tiny model (tokenizer + config + weights) into out_dir, atomically."""
    from engine.tiny_tokenizer import train_tiny_tokenizer

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-opt-", dir=out.parent))
    try:
        tok = train_tiny_tokenizer(tmp)
        write_opt_checkpoint(tmp, opt_config(vocab_size=tok.vocab_size, **TINY_SHAPE), seed=TINY_SEED)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        build_tiny_model(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR
