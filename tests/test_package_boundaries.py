"""The packages' layers (docs/design.md, "Layout" and "Boundaries"): no module imports one of a layer above its own, no
modules import each other round a circle, and the `fastserve` command never reaches into scripts/ (which the wheel does
not ship). The model-making tooling (modelmaker/) stays out of the serving stack's imports, and the built-in tiny model
still appears on a fresh machine: server.py given `--model tiny-opt` builds it; the engine alone only loads it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.server_fixtures import REPO, ServerProcess

TOOLING = "modelmaker"
# The packages that serve models (docs/design.md, "Layout"); scripts/, tests/ and server.py may use the tooling.
SERVING_STACK = ("engine", "scheduler", "memory", "fastserve_kernels", "serving")
# Every top-level package (and server.py), lowest layer first: a module may import its own layer's and lower ones'.
# The wheel ships all but scripts/ (maintainers' experiments, benchmarks and the device check).
LAYERS = (("scheduler", "memory", "fastserve_kernels"), ("engine",), ("serving", TOOLING), ("server",), ("fastserve",),
          ("scripts",))
LAYER = {top: i for i, tops in enumerate(LAYERS) for top in tops}


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


def module_graph() -> dict[str, set[str]]:
    """Every module of LAYERS -> the modules of LAYERS it imports: `from a import b` imports a.b when that is a
    module, else a; a module's own package, which Python runs first, is not an edge."""
    paths = [REPO / "server.py", *(p for tops in LAYERS for top in tops if top != "server"
                                   for p in sorted((REPO / top).rglob("*.py")))]
    names = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}
    graph = {}
    for name, path in names.items():
        package = path.parent.relative_to(REPO).parts
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else ()
                module = ".".join([*base, *([node.module] if node.module else [])])
                found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in names else module for a in node.names)
        graph[name] = {m for m in found if m in names and m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges if e not in index or e in stack), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child in index:
                low[node] = min(low[node], index[child])
            else:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
    return out


def test_scan_sees_the_tooling_where_it_is_imported():
    """The scan itself: it finds the imports that server.py and the commands do have."""
    assert any(n.split(".")[0] == TOOLING for n in imported_modules(REPO / "server.py"))
    assert any(n.split(".")[0] == TOOLING for n in imported_modules(REPO / "fastserve" / "make_model.py"))


def test_the_cycle_finder_finds_circles_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(), "f": {"f"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_higher_layer():
    graph = module_graph()
    assert {"fastserve.cli", "fastserve.simulate", "server", "scripts.experiments.steady_state"} <= set(graph)
    assert "scripts.benchmarks.sim_vs_live" in graph  # every top-level package is scanned
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]])
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_fastserve_command_never_reaches_into_scripts():
    """Nothing the wheel ships imports scripts/ (it is not shipped) or loads a file by path or edits sys.path."""
    shipped = [p for tops in LAYERS[:-1] for top in tops if top != "server" for p in (REPO / top).rglob("*.py")]
    for path in [REPO / "server.py", *shipped]:
        text = path.read_text(encoding="utf-8")
        assert not any(n.split(".")[0] == "scripts" for n in imported_modules(path)), path
        assert "sys.path" not in text and "spec_from_file_location" not in text, path


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


def test_server_given_tiny_opt_builds_the_tiny_model(tmp_path: Path):
    where = tmp_path / "models" / "tiny-opt"
    srv = ServerProcess(["--model", "tiny-opt", "--profile", "analytic", "--num-gpu-blocks-override", "64",
                         "--num-host-blocks-override", "64"], tmp_path,
                        env={**os.environ, "FASTSERVE_DEFAULT_MODEL": str(where)}, cwd=tmp_path)
    try:
        srv.wait_ready()
        assert (where / "config.json").is_file() and (where / "tokenizer.json").is_file()
    finally:
        srv.stop()
    assert "FastServe: serving tiny-opt" in srv.log(), srv.log()


def test_no_modules_import_each_other_round_a_circle():
    """No import circles in any package (memory/kv_manager.py <-> memory/proactive.py was one: the planner now reads
    the KV state through the KVView protocol, defined beside it)."""
    graph = module_graph()
    assert not cycles(graph), f"modules that import each other round a circle: {cycles(graph)}"
    assert "memory.kv_manager" not in graph["memory.proactive"]
