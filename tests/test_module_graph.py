"""The module graph of proto, libs and services: no import cycle, and one meaning per module name."""

# Every import statement counts, at module level or inside a function (a function-level import that closes
# a cycle is still a cycle, only a deferred one). Importing `a.b.c` also runs the `__init__` of `a` and
# `a.b`, so an import edge reaches those packages too, except the importer's own enclosing packages (they
# are already being imported when it runs).

from __future__ import annotations

import ast
import graphlib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proto", "libs", "services")

# Basenames that mean the same job wherever they appear: package shells, each service's own shell, and
# per-component pieces whose folder says which component. Anything else must be unique in the tree.
SAME_JOB = {
    "__init__": "package marker and its public names",
    "__main__": "`python -m <package>` entry",
    "base": "the interface of a pluggable backend, beside its implementations (kvtransfer, EP dispatch)",
    "service": "a service's shell (libs/bus/service.py is the base every services/<name>/service.py uses)",
    "settings": "one frozen settings object per service or shared group (libs/bus/settings.py is the base)",
    "metrics": "the Prometheus metrics of the component its folder names (gateway, EP group)",
    "engine": "the worker-facing Engine API: libs/engine in one process, libs/ep over a group of ranks",
    "loader": "a checkpoint into a model: whole (libs/engine) or one EP rank's expert shard (libs/ep)",
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, a package under its own name (its __init__)."""
    found = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    # `from a import b` imports a, and a.b too when b is a module
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules (ours only) that importing it runs, at any depth of its source."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, name, is_package):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    mod = ".".join(parts[:i])
                    if mod in files and mod != name and mod not in own:
                        graph[name].add(mod)
    return graph


def test_the_graph_sees_function_level_imports_and_package_inits():
    graph = import_graph()
    # libs/engine/layers/fp8_linear.py imports the kernels inside functions (Triton loads lazily)
    assert "libs.kernels.backend" in graph["libs.engine.layers.fp8_linear"]
    assert "libs.kernels" in graph["libs.engine.layers.fp8_linear"]  # the package __init__ runs too
    assert "libs.engine" not in graph["libs.engine.engine"]  # its own package is not an edge
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300


def test_no_import_cycle():
    try:
        order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
    assert set(order) == set(module_files())


def test_no_two_modules_share_a_name_with_different_jobs():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in module_files().values():
        by_name[path.stem].append(path.relative_to(ROOT).as_posix())
    shared = {stem: paths for stem, paths in by_name.items() if len(paths) > 1 and stem not in SAME_JOB}
    assert not shared, f"one name, several jobs: rename one of each {shared}"


def test_the_workers_hold_the_engine_with_no_type_ignore():
    """Engine and EPEngine both satisfy libs.engine.protocol.EngineLike (mypy checks load_engine's two returns),
    so nothing on the worker side needs to silence the type checker to hold either."""
    seam = [*(ROOT / "libs/worker").glob("*.py"), *(ROOT / "services").glob("*_worker/*.py")]
    assert len(seam) > 10
    silenced = [p.relative_to(ROOT).as_posix() for p in seam if "type: ignore" in p.read_text()]
    assert not silenced, silenced
