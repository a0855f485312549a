"""A deep copy of a module that also rebinds its closures.

``copy.deepcopy`` treats functions as atoms: a lambda or closure stored on a module (x-transformers'
tied head ``self.to_logits = lambda t: t @ self.token_emb.emb.weight.t()``, a hook-like callable
built in ``__init__``) is shared by the copy and still reads the *original* module's tensors. The
copy then computes with two sets of weights: its own, and, through the closure, the original's,
whose gradients land in the original. Everything in sptransform that copies a user's model (the
fake template it traces, ``verify``'s reference and parallel copies) must read the copy's own
tensors, or the program traced and the program compared differ from the one the user runs.

``faithful_deepcopy`` copies such functions too. A copied function's closure cells are rebound,
*after* the whole copy is made, to the copies of the objects they held (so a closure over a
sibling module copied later is rebound as well); a cell holding anything the copy did not copy
(a global config, a foreign module) keeps sharing it, exactly as ``copy.deepcopy`` would.
A cell holding a bound method of an object the copy copied (``weight_of = self.embedding_weight``)
gets the method bound to the copy. Functions without a closure (plain module-level functions) stay
shared.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import types
from typing import Any, Iterator

from sptransform.torch_internals import deepcopy_dispatch_table

_LOCK = threading.Lock()
# Why the module-level dispatch table: ``copy.deepcopy`` looks a function's type up there before
# ``__deepcopy__`` or ``__reduce_ex__``, and a function object cannot carry its own hook.
_DISPATCH = deepcopy_dispatch_table()


def faithful_deepcopy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """``copy.deepcopy(obj, memo)``, with closures rebound to the copy (see the module docstring)."""
    memo = {} if memo is None else memo
    cells: list[tuple[types.CellType, Any]] = []
    with _copying_functions(cells):
        result = copy.deepcopy(obj, memo)
    for cell, original in cells:
        copied = memo.get(id(original), original)
        if copied is original and isinstance(original, types.MethodType) and id(original.__self__) in memo:
            # a closure over a bound method (``weight_of = self.embedding_weight``): the method object
            # itself was never copied (every attribute access makes a new one), but its object was
            copied = types.MethodType(original.__func__, memo[id(original.__self__)])
        if copied is not original:
            cell.cell_contents = copied
    return result


@contextlib.contextmanager
def _copying_functions(cells: list) -> Iterator[None]:
    def copy_function(fn: types.FunctionType, memo: dict) -> types.FunctionType:
        if fn.__closure__ is None:
            return fn
        new_cells = []
        for cell in fn.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell (a name bound later in the enclosing scope)
                new_cells.append(types.CellType())
                continue
            new_cell = types.CellType(content)
            cells.append((new_cell, content))
            new_cells.append(new_cell)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(new_cells))
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__dict__.update(fn.__dict__)
        new.__qualname__ = fn.__qualname__
        memo[id(fn)] = new
        return new

    with _LOCK:
        previous = _DISPATCH.get(types.FunctionType)
        _DISPATCH[types.FunctionType] = copy_function
        try:
            yield
        finally:
            if previous is None:
                del _DISPATCH[types.FunctionType]
            else:
                _DISPATCH[types.FunctionType] = previous


__all__ = ["faithful_deepcopy"]
