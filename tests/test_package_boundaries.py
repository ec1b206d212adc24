"""The model-making tooling (modelmaker/) stays out of the serving stack's imports, and the built-in tiny model
still appears on a fresh machine: server.py with no --model builds it; the engine alone only loads it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.server_fixtures import REPO, ServerProcess

TOOLING = "modelmaker"
# The packages that serve models (DESIGN.md's layers); scripts/, tests/ and server.py may use the tooling.
SERVING_STACK = ("engine", "scheduler", "memory", "fastserve_kernels", "serving")


def imported_modules(path: Path) -> set[str]:
    """Every module name an `import` or `from ... import` in this file names (relative imports resolved
    against its package)."""
    package = path.parent.relative_to(REPO).parts
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_scan_sees_the_tooling_where_it_is_imported():
    """The scan itself: it finds the imports that server.py and the scripts do have."""
    assert any(n.split(".")[0] == TOOLING for n in imported_modules(REPO / "server.py"))
    assert any(n.split(".")[0] == TOOLING for n in imported_modules(REPO / "scripts" / "make_tiny_model.py"))


def test_serving_stack_never_imports_the_model_tooling():
    offenders = []
    for package in SERVING_STACK:
        for path in sorted((REPO / package).rglob("*.py")):
            bad = sorted(n for n in imported_modules(path) if n.split(".")[0] == TOOLING)
            if bad:
                offenders.append(f"{path.relative_to(REPO)}: {', '.join(bad)}")
    assert not offenders, "the engine loads models, it does not make them:\n" + "\n".join(offenders)


def test_engine_without_a_model_says_how_to_build_the_tiny_one(tmp_path: Path):
    missing = tmp_path / "not-built"
    code = "from engine.engine import Engine; Engine()"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FASTSERVE_DEFAULT_MODEL": str(missing)})
    assert r.returncode != 0 and "FileNotFoundError" in r.stderr and "make model" in r.stderr, r.stderr
    assert not missing.exists()  # the engine did not build it


def test_server_with_no_model_builds_the_tiny_one(tmp_path: Path):
    where = tmp_path / "models" / "tiny-opt"
    srv = ServerProcess(["--profile", "analytic", "--num-gpu-blocks-override", "64", "--num-host-blocks-override",
                         "64"], tmp_path, env={**os.environ, "FASTSERVE_DEFAULT_MODEL": str(where)})
    try:
        srv.wait_ready()
        assert (where / "config.json").is_file() and (where / "tokenizer.json").is_file()
    finally:
        srv.stop()
    assert "FastServe: serving tiny-opt" in srv.log(), srv.log()


def test_no_module_of_the_serving_stack_imports_one_that_imports_it():
    """No import circles inside the serving stack (memory/kv_manager.py <-> memory/proactive.py was one: the
    planner now reads the KV state through the KVView protocol, defined beside it)."""
    graph: dict[str, set[str]] = {}
    for package in SERVING_STACK:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            graph[name] = {m for m in imported_modules(path) if m.split(".")[0] in SERVING_STACK}
    pairs = [(a, b) for a, deps in graph.items() for b in deps
             if b in graph and a in graph[b] and not (a == b.rsplit(".", 1)[0] or b == a.rsplit(".", 1)[0])]
    assert not pairs, f"modules that import each other: {sorted(pairs)}"
    assert "memory.kv_manager" not in graph["memory.proactive"]
