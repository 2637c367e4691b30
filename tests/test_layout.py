"""The package reads top to bottom: no import cycle, no upward import, a framework-free core.

Imports are read from the source with ``ast`` (imports inside functions included), so a lazy import cannot
hide a cycle or a forbidden dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hetero_plugins"

#: Module paths kept as one-release aliases of moved modules (``sys.modules[__name__] = moved``).
ALIASES = {"allocators", "planner", "sampler", "partition", "time_model", "sim", "horovod_lr"}

#: The adapters may import their frameworks; everything else in the package is the core.
ADAPTERS = ("hetero_plugins.horovod", "hetero_plugins.apps", "hetero_plugins.cli")
#: The one seam of the core that may touch ``torch.distributed`` (the package and its modules).
COLLECTIVES_SEAM = "hetero_plugins.collectives"
FORBIDDEN_IN_CORE = ("lightning", "pytorch_lightning", "horovod", "torch.distributed")

#: Layers, lowest first: a module may import its own layer or lower ones, never a higher one.
LAYERS = [
    ("base", ("_validation", "_files", "telemetry", "metrics", "cluster", "emulation", "lr_scaling", "collectives", "progress")),
    ("engines", ("balancing", "aggregation")),
    ("scheduler", ("scheduler",)),
    ("glue", ("horovod", "apps", "cli", "callbacks", "strategies")),
]


def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "callbacks"):
        rel = ["callbacks", *path.relative_to(ROOT / "callbacks").with_suffix("").parts]
    elif path.is_relative_to(ROOT / "strategies"):
        rel = ["strategies", *path.relative_to(ROOT / "strategies").with_suffix("").parts]
    else:
        rel = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if rel and rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(["hetero_plugins", *rel])


def _sources() -> dict[str, Path]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "callbacks").rglob("*.py"), *(ROOT / "strategies").rglob("*.py")]
    out = {}
    for f in files:
        name = _module_name(f)
        if name.count(".") == 1 and name.split(".")[1] in ALIASES:
            continue
        out[name] = f
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every module name ``path`` imports, at any depth of the file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


SOURCES = _sources()


def _internal_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in SOURCES.items():
        targets = set()
        for imp in _imports(path, name):
            # "from pkg import submodule" names the submodule; "from mod import Class" names the module.
            while imp and imp not in SOURCES:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and imp.startswith("hetero_plugins"):
                targets.add(imp)
        edges[name] = targets
    return edges


def _layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else ""
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    return len(LAYERS) - 1 if top else -1


def test_the_scan_sees_the_whole_package() -> None:
    assert "hetero_plugins.balancing.planner" in SOURCES
    assert "hetero_plugins.callbacks.batch_balancer" in SOURCES
    assert "hetero_plugins.strategies.hetero_ddp" in SOURCES
    assert len(SOURCES) > 40


def test_core_imports_no_framework_and_no_collectives() -> None:
    offenders = []
    for name, path in SOURCES.items():
        if name.startswith(ADAPTERS) or name.startswith(("hetero_plugins.callbacks", "hetero_plugins.strategies")):
            continue
        for imp in _imports(path, name):
            if (name == COLLECTIVES_SEAM or name.startswith(COLLECTIVES_SEAM + ".")) and imp.startswith("torch.distributed"):
                continue
            if any(imp == f or imp.startswith(f + ".") for f in FORBIDDEN_IN_CORE):
                offenders.append(f"{name} imports {imp}")
    assert not offenders, "the core must stay framework-free:\n" + "\n".join(sorted(offenders))


def test_no_import_cycle_inside_the_package() -> None:
    edges = _internal_edges()
    # A package's __init__ re-exporting its own submodules is not a cycle of the design.
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_import() -> None:
    offenders = []
    for name, targets in _internal_edges().items():
        if name == "hetero_plugins":
            continue  # the package face re-exports and registers the learned allocators
        for t in targets:
            if t == "hetero_plugins":
                continue
            if _layer(t) > _layer(name):
                offenders.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not offenders, "imports must point down the layers:\n" + "\n".join(sorted(offenders))


def test_private_names_stay_inside_their_package() -> None:
    offenders = []
    for name, path in SOURCES.items():
        pkg = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hetero_plugins"):
                src_pkg = node.module if (node.module in SOURCES and SOURCES[node.module].name == "__init__.py") else node.module.rsplit(".", 1)[0]
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and src_pkg != pkg:
                        offenders.append(f"{name} imports {node.module}.{alias.name}")
    assert not offenders, "private names crossing packages:\n" + "\n".join(sorted(offenders))


def test_private_modules_stay_inside_their_package() -> None:
    """``a.b._m`` may be imported by the modules of ``a.b`` only (``hetero_plugins._validation`` by all)."""
    offenders = []
    for name, targets in _internal_edges().items():
        for t in targets:
            parts = t.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")]
            if private and not name.startswith(".".join(parts[: private[0]]) + "."):
                offenders.append(f"{name} imports {t}")
    assert not offenders, "private modules crossing packages:\n" + "\n".join(sorted(offenders))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_module_size(name: str) -> None:
    lines = SOURCES[name].read_text().count("\n")
    assert lines <= 600, f"{name} has {lines} lines: split it by concern"
