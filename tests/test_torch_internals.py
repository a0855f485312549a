"""Private torch APIs go through one module, and another torch version is a clear error."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sptransform"


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _private_uses(path: pathlib.Path) -> list[str]:
    """Imports of private torch/functorch modules or names, and ``torch._x`` attribute chains."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in ("torch", "functorch") and _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "functorch"):
            if _private(node.module):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            if node.attr.startswith("_"):
                found.append(f"torch.{node.attr}")
    return found


def test_no_module_but_torch_internals_uses_private_torch_apis():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "torch_internals.py":
            continue
        uses = _private_uses(path)
        if uses:
            offenders[str(path.relative_to(PACKAGE))] = sorted(set(uses))
    assert not offenders, f"private torch APIs outside torch_internals.py: {offenders}"


def test_the_checker_sees_private_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from torch._guards import detect_fake_mode\nimport torch\nx = torch._C\n"
                      "from torch.distributed.tensor.placement_types import _StridedShard\n")
    assert _private_uses(sample) == ["torch._guards", "torch.distributed.tensor.placement_types._StridedShard",
                                     "torch._C"]


@pytest.mark.parametrize("allow", [False, True])
def test_another_torch_version_is_a_clear_error(allow):
    """Import sptransform with torch reporting 2.15: an ImportError naming the tested version,
    or a warning when SPTRANSFORM_ALLOW_UNTESTED_TORCH=1."""
    code = (
        "import os, warnings, torch; torch.__version__ = '2.15.0'\n"
        f"os.environ['SPTRANSFORM_ALLOW_UNTESTED_TORCH'] = {'1' if allow else '0'!r}\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    try:\n"
        "        import sptransform\n"
        "        print('IMPORTED', [str(w.message) for w in caught])\n"
        "    except ImportError as e:\n"
        "        print('ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    if allow:
        assert out.startswith("IMPORTED") and "tested on torch 2.13.x" in out
    else:
        assert out.startswith("ERROR") and "tested on torch 2.13.x" in out and "pip install torch==2.13.0" in out


def test_tested_version_matches_pyproject():
    internals = importlib.import_module("sptransform.torch_internals")
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    major, minor = internals.TESTED_TORCH
    assert f'"torch>={major}.{minor},<{major}.{minor + 1}"' in pyproject
