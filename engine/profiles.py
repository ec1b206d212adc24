"""Which job profile the engine schedules by, and where profiles live.

load_cost_model() picks, in this order:
1. `EngineConfig.profile == "analytic"`: the roofline estimate of
   engine/analytic_profile.py (tests and quick starts; never measures);
2. `EngineConfig.profile = PATH` (--profile): that file; a missing or
   malformed file is a ValueError that names it and says what to do;
3. a profile in the profile folder whose key matches this engine's (model
   name, dtype, tensor/pipeline parallel sizes, hardware). The folder is
   `profiles/` at the repository root, or $FASTSERVE_PROFILE_DIR when set;
   `fastserve profile` writes there by default (profiles/README.md);
4. a short profile an earlier start measured for the same key and model
   shape, kept in the profile cache: $FASTSERVE_PROFILE_CACHE, else
   $XDG_CACHE_HOME/fastserve/profiles (~/.cache/fastserve/profiles);
   FASTSERVE_PROFILE_CACHE=off turns it off;
5. otherwise a short profile measured now, on the engine's own executor
   (engine/job_profiler.STARTUP_GRID), announced by one log line (a warning,
   but INFO for the built-in tiny model, which is always measured this way:
   a stored profile's key names the CPU, so none would match another machine),
   and written to the profile cache for the next start (not for the tiny
   model).

Profiles follow the schema "fastserve.profile/1" (scheduler/cost_model.py);
lookups between grid points interpolate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

from engine.analytic_profile import analytic_profile
from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.job_profiler import KEY_FIELDS, STARTUP_GRID, profile_executor, profile_key
from engine.model.registry import ModelConfig
from engine.model_names import TINY_OPT, is_tiny_opt
from scheduler.cost_model import PROFILE_SCHEMA, ProfiledCostModel

log = logging.getLogger(__name__)

ANALYTIC = "analytic"
DEFAULT_PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
PROFILE_DIR_ENV = "FASTSERVE_PROFILE_DIR"
PROFILE_CACHE_ENV = "FASTSERVE_PROFILE_CACHE"


def profile_dir() -> Path:
    """Where profiles are looked up: $FASTSERVE_PROFILE_DIR, else profiles/ at the repo root."""
    return Path(os.environ.get(PROFILE_DIR_ENV) or DEFAULT_PROFILE_DIR)


def profile_cache_dir() -> Path | None:
    """Where start-up profiles are kept between starts: $FASTSERVE_PROFILE_CACHE, else
    $XDG_CACHE_HOME/fastserve/profiles or ~/.cache/fastserve/profiles; None when FASTSERVE_PROFILE_CACHE is off."""
    given = os.environ.get(PROFILE_CACHE_ENV, "")
    if given.lower() in ("off", "0", "none"):
        return None
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastserve" / "profiles"


def startup_cache_path(folder: Path, key: dict, model_config: ModelConfig, max_len: int) -> Path:
    """The cache file of a start-up profile: the key's readable name and a hash of what else the costs depend on
    (the model's shape, whatever its name, and the longest prompt the grid measured)."""
    shape = json.dumps([dataclasses.asdict(model_config), max_len, dataclasses.asdict(STARTUP_GRID)], sort_keys=True,
                       default=str)
    digest = hashlib.sha256(shape.encode()).hexdigest()[:12]
    return folder / f"startup__{profile_filename(key).removesuffix('.json')}__{digest}.json"


def profile_filename(key: dict) -> str:
    """A readable file name for a key: tiny-opt__float32__tp1-pp1__cpu-amd-epyc.json."""
    hardware = re.sub(r"[^a-z0-9]+", "-", str(key["hardware"]).lower()).strip("-")
    return (f"{key['model']}__{key['dtype']}__tp{key['tensor_parallel_size']}-pp{key['pipeline_parallel_size']}"
            f"__{hardware}.json")


def key_matches(have: dict, want: dict) -> bool:
    return all(have.get(f) == want.get(f) for f in KEY_FIELDS)


def find_profile(key: dict, folder: Path) -> Path | None:
    """The first *.json in folder (by name) whose schema and key match; None if none does.
    Files that are not profiles, or are unreadable, are skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            log.debug("skipping %s: not a readable JSON profile (%s)", path, e)
            continue
        if (isinstance(data, dict) and data.get("schema") == PROFILE_SCHEMA and isinstance(data.get("key"), dict)
                and key_matches(data["key"], key)):
            return path
    return None


def engine_profile_key(config: EngineConfig, model_config: ModelConfig, executor: Executor) -> dict:
    return profile_key(model_config.name, executor.dtype, executor.device, config.tensor_parallel_size,
                       config.pipeline_parallel_size)


def load_cost_model(config: EngineConfig, model_config: ModelConfig,
                    executor: Executor) -> tuple[ProfiledCostModel, str]:
    """The engine's cost model and a line saying where it came from (see the module docstring)."""
    key = engine_profile_key(config, model_config, executor)
    if config.profile == ANALYTIC:
        cost = analytic_profile(model_config, key["hardware"].split(":")[0], executor.dtype.itemsize, key["dtype"])
        return cost, "analytic estimate (engine/analytic_profile.py)"
    if config.profile:
        cost = _read(Path(config.profile), "--profile")
        if not executor.simulated and not key_matches(cost.key, key):
            log.warning("profile %s was measured for %s; this engine is %s", config.profile, cost.key, key)
        return cost, f"profile {config.profile}"
    folder = profile_dir()
    found = find_profile(key, folder)
    if found is not None:
        return _read(found, f"the profile folder {folder}"), f"profile {found}"
    max_len = config.max_model_len or model_config.max_position_embeddings
    cache = None if is_tiny_opt(config.model) else profile_cache_dir()
    cached = startup_cache_path(cache, key, model_config, max_len) if cache is not None else None
    if cached is not None and cached.is_file():
        try:
            cost = ProfiledCostModel.from_dict(json.loads(cached.read_text()))
        except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
            log.warning("ignoring the cached start-up profile %s (%s); measuring again", cached, e)
        else:
            log.info("job profile: the start-up profile an earlier start measured, cached in %s", cached)
            return cost, f"start-up profile (short grid) cached in {cached}"
    start = time.perf_counter()
    cost = profile_executor(executor, model_config.vocab_size, key, STARTUP_GRID.clipped(max_len))
    kept = _keep(cost, cached)
    # The built-in tiny model (no --model, or tiny-opt) is measured at every start by design: said at INFO.
    log.log(
        logging.INFO if is_tiny_opt(config.model) else logging.WARNING,
        "no job profile for %s %s tp%d pp%d on %s in %s: measured a short one at start-up (%.1f s)%s; "
        "for a fuller one, stored where every start finds it, run `fastserve profile --model %s`", key["model"],
        key["dtype"], key["tensor_parallel_size"], key["pipeline_parallel_size"], key["hardware"], folder,
        time.perf_counter() - start, f", cached in {kept} for the next start" if kept else "", config.model or TINY_OPT,
    )
    return cost, "start-up profile (short grid)"


def _keep(cost: ProfiledCostModel, path: Path | None) -> Path | None:
    """Write a start-up profile to the cache (atomically: a temporary file renamed); the path, or None when there
    is no cache or it cannot be written (logged; serving goes on)."""
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cost.to_dict(), indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the start-up profile in %s (%s)", path, e)
        return None
    return path


def _read(path: Path, origin: str) -> ProfiledCostModel:
    """The profile at path, or a ValueError that says what is wrong with it and what to do."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("it does not hold a JSON object")
        return ProfiledCostModel.from_dict(data)
    except FileNotFoundError:
        problem = "it does not exist"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"it is not valid JSON ({e})"
    except OSError as e:
        problem = f"it cannot be read ({e})"
    except ValueError as e:
        problem = str(e)
    raise ValueError(
        f"{origin}: cannot use job profile {path}: {problem}. Write one with `fastserve profile`, "
        f"or pass --profile {ANALYTIC} for an estimate from the model's shape"
    )
