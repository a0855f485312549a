"""The package's import graph: no cycles (function-level imports included), arrows only downward."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sptransform"

# Lower layers may not import higher ones. A module's layer is the first prefix that matches.
LAYERS = [
    ("sptransform.cli", 9),
    ("sptransform.__main__", 9),
    ("sptransform.backend", 8),
    ("sptransform.equivalence", 8),
    ("sptransform.verify_ranks", 8),
    ("sptransform.measure", 7),
    ("sptransform.api", 7),
    ("sptransform.generation", 7),
    ("sptransform.transform", 6),
    ("sptransform.compile_graphs", 5),
    ("sptransform.pipeline", 5),
    ("sptransform.passes", 4),
    ("sptransform.runtime", 3),
    ("sptransform.graph", 2),
    ("sptransform.planner", 1),
    ("sptransform.capture", 2),
    ("sptransform.capture_watches", 1),
    ("sptransform.options", 0),
    ("sptransform.copying", 0),
    ("sptransform.torch_internals", 0),
    ("sptransform.logs", 0),
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    if module == "sptransform":  # the package's __init__: the public face
        return 9
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} has no layer in tests/test_layout.py: add it")


def import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):  # every import, at any depth
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def test_no_import_cycle():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_imports_point_down():
    upward = [(a, b) for a, b in import_graph().edges if _layer(b) > _layer(a)]
    assert not upward, "imports that point up a layer: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_graph_imports_no_pass_or_runtime():
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if a.startswith("sptransform.graph")
           and not b.startswith(("sptransform.graph", "sptransform.capture", "sptransform.torch_internals", "sptransform.options"))]
    assert not bad, bad


def _private(dotted: str) -> bool:
    return dotted.split(".")[0] == "torch" and any(part.startswith("_") for part in dotted.split(".")[1:])


def test_private_torch_apis_only_through_torch_internals():
    """``import torch._x`` / ``from torch.a._b import c`` / ``from torch.a import _c`` and
    attribute use such as ``torch._dynamo.x`` appear in ``torch_internals.py`` only (op overloads
    reached through ``torch.ops`` are op identity, not private Python API)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "torch_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                parts, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    parts.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id == "torch":
                    dotted = ".".join(["torch", *reversed(parts)])
                    if not dotted.startswith("torch.ops."):
                        names = [dotted]
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {n}" for n in names if _private(n)]
    assert not found, "private torch APIs outside torch_internals.py:\n" + "\n".join(sorted(set(found)))
