"""Private torch APIs go through one module, and another torch version is a clear error."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sptransform"


# Documented public functions whose names start with an underscore.
_PUBLIC_FUNCTIONS = frozenset({"os._exit"})  # exit without interpreter teardown (Python's os docs)


def _private(name: str) -> bool:
    if name in _PUBLIC_FUNCTIONS:
        return False
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


# Operators are reached as attributes of their namespace (``aten._softmax``,
# ``torch.ops._c10d_functional.wait_tensor``): those are names in the dispatcher's operator
# registry, which a graph pass must match on, not private Python APIs.
_OP_NAMESPACES = ("aten", "prims", "ops")


def _chain(node: ast.AST) -> list[str]:
    """``torch.ops.aten._softmax`` -> ["torch", "ops", "aten", "_softmax"]; [] if not a plain chain."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def _is_operator(node: ast.Attribute) -> bool:
    chain = _chain(node)
    return any(name in _OP_NAMESPACES for name in chain[:-1]) or chain[-2:-1] == ["torch"] and chain[-1] == "_C._nn"


def _defined_by(trees) -> set[str]:
    """Every ``_name`` sptransform defines itself: functions, classes, assigned names and
    attributes, arguments, and renaming imports. Reading any other ``_name`` off an object reads
    another library's private attribute, however the object is spelled."""
    defined = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
                defined.add(n.attr)
            elif isinstance(n, ast.arg):
                defined.add(n.arg)
            elif isinstance(n, ast.alias) and n.asname:
                defined.add(n.asname)
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sptransform") or \
                    isinstance(n, ast.ImportFrom) and n.level:
                defined.update(a.name for a in n.names)
    return {name for name in defined if _private(name)} | _PUBLIC


_REFLECTION = ("getattr", "hasattr", "setattr", "delattr")
# namedtuple's documented API is spelled with a leading underscore to stay out of field names.
_PUBLIC = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def _private_uses(tree: ast.AST, ours: set[str]) -> list[str]:
    """Private names of other libraries a module reaches: imports of private torch/functorch
    modules or names, attribute reads ``x._name`` of a ``_name`` sptransform does not define
    (whatever ``x`` is), and ``getattr(x, "_name")`` spelled as a string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in ("torch", "functorch") and _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "functorch"):
            if _private(node.module):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("sptransform") \
                and not node.level:
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr) \
                and not node.attr.startswith("__") and node.attr not in ours and not _is_operator(node):
            if ".".join(_chain(node)) not in _PUBLIC_FUNCTIONS:
                found.append(".".join(_chain(node)) or f"<expr>.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFLECTION \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) \
                and node.args[1].value not in ours:
            found.append(f'{node.func.id}(..., "{node.args[1].value}")')
    return found


def _offenders(package: pathlib.Path) -> dict[str, list[str]]:
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    ours = _defined_by(trees.values())
    offenders = {}
    for path, tree in trees.items():
        if path.name == "torch_internals.py":
            continue
        uses = _private_uses(tree, ours)
        if uses:
            offenders[str(path.relative_to(package))] = sorted(set(uses))
    return offenders


def test_no_module_but_torch_internals_uses_private_apis():
    offenders = _offenders(PACKAGE)
    assert not offenders, f"private APIs of other libraries outside torch_internals.py: {offenders}"


def test_the_checker_sees_private_imports_attributes_and_reflection(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "sample.py").write_text(
        "from torch._guards import detect_fake_mode\n"
        "import torch\n"
        "from torch._functorch import partitioners as torch_partitioners\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "x = torch._C\n"
        "y = torch_partitioners._extract_fwd_bwd_modules\n"      # private, spelled without torch._
        "def f(module, t):\n"
        "    children = module._modules\n"                       # nn.Module internals
        "    local = getattr(t, '_local_tensors')\n"             # reflection
        "    return t._mine, torch.ops.aten._softmax.default\n"  # our own name; an operator\n"
        "class Ours:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n")
    assert _offenders(package) == {"sample.py": sorted([
        "torch._guards", "torch.distributed.tensor.placement_types._StridedShard", "torch._functorch",
        "torch._C", "torch_partitioners._extract_fwd_bwd_modules", "module._modules",
        'getattr(..., "_local_tensors")'])}


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


def test_untested_torch_lacking_a_private_api_imports_and_fails_only_where_it_is_used():
    """With SPTRANSFORM_ALLOW_UNTESTED_TORCH=1 on a torch without one of the private APIs (here
    ``tensor_map`` removed from ``torch.distributed._local_tensor``, as torch 2.11 lacks it):
    sptransform imports, a warning names what is missing, every other name is bound to torch's
    own object, and the missing one raises an ImportError naming it when called."""
    code = (
        "import os, warnings, torch, torch.distributed._local_tensor as lt\n"
        "del lt.tensor_map\n"
        "os.environ['SPTRANSFORM_ALLOW_UNTESTED_TORCH'] = '1'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import sptransform.torch_internals as t\n"
        "print('WARNED', any('tensor_map' in str(w.message) for w in caught))\n"
        "print('BOUND', t.FakeTensorMode is __import__('torch._subclasses.fake_tensor', fromlist=['x']).FakeTensorMode,"
        " t.funcol.__name__, t.partitioners.__name__)\n"
        "try:\n"
        "    t.tensor_map(None, None)\n"
        "except ImportError as e:\n"
        "    print('RAISED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "WARNED True" in out.stdout, out.stderr[-2000:]
    assert "BOUND True torch.distributed._functional_collectives torch._functorch.partitioners" in out.stdout
    assert "RAISED torch.distributed._local_tensor.tensor_map is not in torch" in out.stdout


def test_reads_in_flight_lists_accesses_of_a_collective_result_before_its_wait():
    """The matcher behind ``guard_inductor_collective_reads``, on kernel orders written by hand,
    buffer names already resolved to what they alias."""
    from sptransform.torch_internals import Kernel, reads_in_flight

    def k(name, defines=(), reads=(), collective=False, waits_on=()):
        return Kernel(name, frozenset(defines), frozenset(reads), collective, frozenset(waits_on))

    copy, in_place = k("copy", {"b0"}, {"x"}), k("all_reduce_", {"b0"}, {"b0"}, collective=True)
    wait = k("wait", (), {"b0"}, waits_on={"b0"})
    reader, other = k("reader", {"y"}, {"b0", "z"}), k("other", {"w"}, {"x", "z"})
    assert reads_in_flight([copy, in_place, other, wait, reader]) == []  # read after the wait
    assert reads_in_flight([copy, in_place, reader, wait]) == ["reader reads b0 after all_reduce_ and before its wait wait"]
    assert reads_in_flight([copy, in_place, k("writer", {"b0"}, {"z"}), wait]) == [
        "writer reads b0 after all_reduce_ and before its wait wait"]  # a write into it too
    # out of place: its input may be read while it runs, its output not
    gather, wait_out = k("all_gather", {"out"}, {"inp"}, collective=True), k("wait", (), {"out"}, waits_on={"out"})
    assert reads_in_flight([gather, k("reads input", {"v"}, {"inp"}), wait_out]) == []
    assert len(reads_in_flight([gather, k("reads output", {"v"}, {"out"}), wait_out])) == 1
    assert reads_in_flight([k("reads output", {"v"}, {"out"}), wait_out]) == []  # nothing launched here
