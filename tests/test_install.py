"""What a clean install needs is declared: every third-party module sptransform imports is in
``pyproject.toml``'s dependencies or an extra, torch is bounded to the tested minor version, and
the package ships its ``py.typed`` marker."""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

import sptransform
from sptransform.torch_internals import TESTED_TORCH

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = pathlib.Path(sptransform.__file__).resolve().parent
IMPORT_NAME = {"safetensors": "safetensors", "transformers": "transformers", "matplotlib": "matplotlib",
               "networkx": "networkx", "torch": "torch", "functorch": "torch", "tqdm": "tqdm", "rich": "rich"}
"""Distribution of each top-level module (they coincide here; a new import must be added)."""


def _imported_modules() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "sptransform":
                    found.setdefault(top, str(path.relative_to(PACKAGE)))
    return found


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_third_party_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= _requirement_names(extra)
    imported = _imported_modules()
    undeclared = {m: where for m, where in imported.items() if IMPORT_NAME.get(m, m) not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    # load_hf_weights reads through DCP's HuggingFaceStorageReader, which imports safetensors itself
    assert "safetensors" in _requirement_names(project["optional-dependencies"]["hf"])


def test_torch_is_bounded_to_the_tested_minor_version_and_the_package_is_typed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    major, minor = TESTED_TORCH
    assert f"torch>={major}.{minor},<{major}.{minor + 1}" in project["dependencies"]
    assert (PACKAGE / "py.typed").is_file()
