"""What a traced forward does besides its tensor computation, watched while ``torch.export``
runs it, and refused where the captured graph would silently differ from the model.

A captured graph keeps the tensor ops of one traced call. Three things a forward can do are not
tensor ops and would be lost or frozen: a custom ``torch.autograd.Function`` (export keeps its
forward, drops its backward), a Python-level random draw (the one traced outcome replayed at
every step), and a write to the model's own Python state (``self.calls += 1``: done once, while
tracing). Each has a watch (a context manager around the export) and a refusal that names every
site; ``capture._capture`` runs them.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import sys
import threading
import traceback
from typing import Callable

import torch
import torch.nn as nn

from sptransform.torch_internals import autograd_function_class, pytree, quiet_fake_tensor_meta_failures

# Functions of torch whose backward is the forward's own vector-Jacobian product (recomputation),
# so tracing their forward alone loses nothing.
_EXACT_BACKWARD = ("torch.utils.checkpoint.CheckpointFunction",)
# The autograd of a ``torch.library`` custom op (``register_autograd``): export keeps the op as one
# node of the graph and AOTAutograd differentiates it by the registered backward, so nothing is lost
# (transformers' ``grouped_mm_fallback``, its MoE experts' grouped matmul on CPU).
_LIBRARY_AUTOGRAD_MODULE = "torch._library.autograd"


def _custom_autograd_functions(outputs) -> dict[str, str]:
    """Every custom ``torch.autograd.Function`` on the autograd graph behind ``outputs`` whose
    backward tracing the forward would lose: its qualified name -> where its backward is."""
    found: dict[str, str] = {}
    seen, stack = set(), [t.grad_fn for t in pytree.tree_leaves(outputs)
                          if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        forward_cls = autograd_function_class(fn)
        if forward_cls is not None:
            name = f"{forward_cls.__module__}.{forward_cls.__qualname__}"
            if name not in _EXACT_BACKWARD and forward_cls.__module__ != _LIBRARY_AUTOGRAD_MODULE:
                code = getattr(forward_cls.backward, "__code__", None)
                found[name] = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "?"
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


class CustomFunctionWatch:
    """Reads the autograd graph of the forward that ``torch.export`` traces. Non-strict export
    runs the forward in Python on fake tensors with autograd recording, so its outputs'
    ``grad_fn`` chain holds a node per custom Function applied (export's graph keeps only the
    Function's forward ops, no marker). Watching that very run (a forward hook on the fake
    copy, removed on exit) sees the code path export took. A separate fake run of the forward
    would not: transformers' MoE experts call ``torch._grouped_mm`` eagerly, whose meta kernel
    refuses float32 (so that run fails), and its traceable custom op while exported."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.found: dict[str, str] = {}

    def _read(self, module, args, output) -> None:
        self.found.update(_custom_autograd_functions(output))

    def __enter__(self) -> "CustomFunctionWatch":
        self._handle = self.module.register_forward_hook(self._read)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def refuse_custom_autograd_functions(watch: CustomFunctionWatch) -> None:
    """``torch.export`` traces a custom ``torch.autograd.Function``'s forward and drops its
    backward, so the parallel model would differentiate the forward instead. Name every such
    function the traced forward applied (``CustomFunctionWatch``)."""
    found = watch.found
    if found:
        raise ValueError(
            "the model calls custom torch.autograd.Function(s) whose backward torch.export does not keep "
            "(the parallel model would use the plain gradient of their forward instead): "
            + "; ".join(f"{name} (backward at {where})" for name, where in sorted(found.items()))
            + ". Write the forward with ordinary torch ops, or keep the function outside the model"
        )


_RANDOM_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
                 "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate", "betavariate",
                 "paretovariate", "weibullvariate", "triangular", "getrandbits", "binomialvariate")
_NUMPY_DRAWS = ("rand", "randn", "random", "random_sample", "ranf", "sample", "uniform", "randint", "random_integers",
                "choice", "normal", "standard_normal", "permutation", "shuffle", "binomial", "poisson", "beta",
                "exponential", "gamma", "bytes")


class PythonRandomWatch:
    """Python-level random draws during the traced forward: the ``random`` module (its functions,
    and its global generator's own methods, which a function imported by name still calls) and
    ``numpy.random``'s module functions. Export runs the forward once and keeps what that run
    computed, so such a draw (a layer skipped when ``random.uniform(0, 1) < layerdrop``) is fixed in
    the graph for every later step, and each rank traces its own. Records where the model drew."""

    def __init__(self):
        self.sites: list[str] = []
        self._restore: list[Callable[[], None]] = []
        self._inside = False

    def _record(self, name: str) -> None:
        if self._inside:  # (uniform calls random: one draw, one site)
            return
        ours = (os.path.dirname(random.__file__) + os.sep + "random.py", os.path.dirname(__file__) + os.sep,
                os.path.dirname(inspect.getfile(torch)) + os.sep)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            ours += (os.path.dirname(inspect.getfile(numpy)) + os.sep,)
        frames = [f for f in traceback.extract_stack() if not f.filename.startswith(ours)]
        where = f"{frames[-1].filename}, line {frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else "?"
        self.sites.append(f"{name} at {where}")

    def _patch(self, owner, attr: str, name: str, *, global_only: bool = False) -> None:
        had = attr in vars(owner)
        original = getattr(owner, attr)

        @functools.wraps(original)
        def drawing(*args, **kwargs):
            # (another thread drawing meanwhile, a data loader's, is not the traced forward)
            if threading.get_ident() == self._thread and (not global_only or (args and args[0] is self._global)):
                self._record(name)
            outer, self._inside = self._inside, True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = outer

        setattr(owner, attr, drawing)
        self._restore.append(lambda: setattr(owner, attr, original) if had else delattr(owner, attr))

    def __enter__(self) -> "PythonRandomWatch":
        self._global = getattr(random.random, "__self__", None)  # the generator random's functions are methods of
        self._thread = threading.get_ident()
        for attr in _RANDOM_DRAWS:
            if hasattr(random, attr):
                self._patch(random, attr, f"random.{attr}")
        for attr in ("random", "getrandbits"):  # what every method of the global generator draws from
            self._patch(random.Random, attr, f"random.{attr}", global_only=True)
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            for attr in _NUMPY_DRAWS:
                if callable(getattr(numpy_random, attr, None)):
                    self._patch(numpy_random, attr, f"numpy.random.{attr}")
        return self

    def __exit__(self, *exc) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})  # (compared by what the graph reads)


def module_state(module: nn.Module) -> dict[tuple[str, str], object]:
    """Every submodule's own Python attributes (``vars``, but parameters, buffers and the
    submodule table), keyed by (submodule path, attribute), and each submodule by ``(path, "")``."""
    state: dict[tuple[str, str], object] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        state[(path, "")] = sub
        for key, value in vars(sub).items():
            if key not in _MODULE_INTERNALS:
                state[(path, key)] = value
    return state


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, (torch.Tensor, nn.Module)) or type(a) is not type(b):
        return False  # (a tensor or module put in another's place is another one, whatever its values)
    try:
        return bool(a == b)
    except Exception:  # no comparison (or an ambiguous one): a change
        return False


def state_changes(before: dict, after: dict) -> list[str]:
    """What changed between two ``module_state`` snapshots, one line each; the attributes of a
    submodule that appeared are one line (the submodule)."""
    new = {path for path, key in after if key == "" and (path, "") not in before}
    lines = []
    for where in dict.fromkeys([*before, *after]):
        path, key = where
        if key and path in new:
            continue
        name = ".".join(p for p in (path, key) if p) or "the model"
        if where not in after:
            lines.append(f"{name} deleted")
        elif where not in before:
            lines.append(f"{name} set to {_short(after[where])}" if key else f"submodule {name} added")
        elif not _same(before[where], after[where]):
            lines.append(f"{name}: {_short(before[where])} -> {_short(after[where])}")
    return lines


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    text = repr(value)
    plain = isinstance(value, (int, float, str, bool, type(None))) and len(text) <= 40
    return text if plain else f"a {type(value).__name__}"


class StateWatch:
    """The model's Python state as the traced forward leaves it: snapshots (``module_state``) as the
    forward starts and as it returns, inside the trace (``torch.export`` puts every attribute back
    afterwards, and only warns of tensors assigned)."""

    def __init__(self, module: nn.Module):
        self.module, self.changes = module, []

    def __enter__(self) -> "StateWatch":
        module = self.module
        self._own = vars(module).get("forward")
        inner = module.forward

        @functools.wraps(inner)
        def watched(*args, **kwargs):
            before = module_state(module)
            out = inner(*args, **kwargs)
            self.changes = state_changes(before, module_state(module))
            return out

        module.forward = watched
        return self

    def __exit__(self, *exc) -> None:
        if self._own is None:
            del self.module.forward
        else:
            self.module.forward = self._own


def refuse_state_written_every_call(module: nn.Module, fake_mode, fake_args: tuple, fake_kwargs: dict,
                                    changes: list[str]) -> None:
    """A captured graph is the forward's tensor computation; what the forward does to the model's
    Python state (``self.calls += 1``, ``self.aux_loss = loss`` for the training loop to read) happens
    once, while tracing, on sptransform's copy. A write that the forward repeats the same way is
    harmless (a submodule swapped or a table built on the first call: BigBird switches to full
    attention for short sequences), so the forward runs twice more on the fake copy ``module``, under its ``fake_mode`` (the first run
    redoes the traced call's writes, which export undid): what the second changes again is what
    every later call would change, and is refused, naming each attribute. A second run that raises
    is refused too (it read what the first wrote)."""
    if not changes:
        return
    saved = {path: dict(vars(sub)) for path, sub in module.named_modules(remove_duplicate=False)}
    try:
        with quiet_fake_tensor_meta_failures(), fake_mode, torch.enable_grad():
            module(*fake_args, **fake_kwargs)  # the traced call's writes (export undid them)
            after = module_state(module)
            module(*fake_args, **fake_kwargs)
    except Exception as err:  # (it was traced once already: a run that fails changed what it reads)
        again = [f"{', '.join(changes[:5])}; running it again raised {type(err).__name__}: {str(err)[:120]}"]
    else:
        again = state_changes(after, module_state(module))
    finally:  # the template as export left it (its first run's writes undone), for later captures
        for path, sub in module.named_modules(remove_duplicate=False):
            if path in saved:
                sub.__dict__.clear()
                sub.__dict__.update(saved[path])
    if again:
        raise ValueError(
            f"the model's forward changes its own Python state at every call ({'; '.join(again[:6])}"
            + (f"; and {len(again) - 6} more" if len(again) > 6 else "")
            + "): a captured graph runs only the tensor computation, so after the one traced call these attributes "
            "keep the values they had then: a counter or a warm-up branch that reads them stays where it was, and a "
            "value stored on the module for the training loop (an auxiliary loss) is never updated. Return such "
            "values from forward, or keep the state outside the model"
        )


def refuse_python_random(watch: PythonRandomWatch) -> None:
    """A graph traced through a Python-level random draw keeps that one draw's outcome forever
    (``PythonRandomWatch``): refused, naming every site, rather than trained wrong."""
    if watch.sites:
        sites = list(dict.fromkeys(watch.sites))
        raise ValueError(
            f"the model's forward draws Python random numbers ({'; '.join(sites[:5])}"
            + (f"; and {len(sites) - 5} more" if len(sites) > 5 else "")
            + "): a captured graph keeps the outcome of the one traced draw and would replay it at every step "
            "(e.g. the same layers skipped by layerdrop forever), each rank its own. Turn the randomness off "
            "(layerdrop=0, eval()), or draw with torch inside the computation (a torch.rand mask multiplied in, "
            "which the graph keeps as a draw per step)"
        )
