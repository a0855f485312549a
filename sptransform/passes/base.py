"""The pass interface: what one entry of the driver's pass list is, and the runner.

A pass is a function ``(gm, build) -> PassResult`` (as torch's ``fx.passes.infra.pass_base``):
``build`` is the driver's record of one build (a dataclass, ``transform.Build``) whose fields
carry what passes find for later ones (the analysis, the placements, the plan). Each ``Pass``
declares its contract in two lists of names:

* ``requires``: build fields it reads, and ``node.meta`` keys it reads;
* ``adds``: build fields it sets, and ``node.meta`` keys it writes.

A name is a build field if the build dataclass has a field of that name, else a meta key. The
runner checks, before a pass runs, that every name it requires was there from the start (a
field already set, a meta key capture put on some node) or is added by a pass that ran before
it; after it, that every field it adds is set. The check is about the list's order, not data:
a pass may find nothing to write (no dropout, no split), and later readers handle that.

With DEBUG logging on (logger ``sptransform.passes``) each pass logs how many nodes of each
op overload it added or removed.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.fx as fx

from sptransform.logs import logger

log = logger("sptransform.passes")


@dataclass(frozen=True)
class PassResult:
    gm: fx.GraphModule
    modified: bool


def _always(_build) -> bool:
    return True


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[fx.GraphModule, Any], PassResult]
    requires: tuple[str, ...] = ()
    """Build fields and ``node.meta`` keys the pass reads."""
    adds: tuple[str, ...] = ()
    """Build fields the pass sets and ``node.meta`` keys it writes."""
    enabled: Callable[[Any], bool] = _always
    """Whether the pass runs for this build (its options): a predicate, so the list shows every pass."""


def op_counts(gm: fx.GraphModule) -> Counter:
    """Nodes by op overload (``call_function``) or by kind (placeholders, outputs, attributes)."""
    return Counter(str(n.target) if n.op == "call_function" else n.op for n in gm.graph.nodes)


def op_count_change(before: Counter, after: Counter) -> dict[str, tuple[int, int]]:
    """{op: (count before, count after)} for the ops whose count changed."""
    return {op: (before[op], after[op]) for op in sorted(set(before) | set(after)) if before[op] != after[op]}


def run_logged(name: str, gm: fx.GraphModule, run: Callable[[], object]):
    """``run()``, with the op-count change of ``gm`` it made logged at DEBUG under ``name``."""
    if not log.isEnabledFor(logging.DEBUG):
        return run()
    before = op_counts(gm)
    result = run()
    after = op_counts(gm)
    change = op_count_change(before, after)
    log.debug("%s: %d -> %d nodes; %s", name, sum(before.values()), sum(after.values()),
              ", ".join(f"{op} {a}->{b}" for op, (a, b) in change.items()) or "no change")
    return result


def _fields(build) -> set[str]:
    return {f.name for f in dataclasses.fields(build)}


def _present(gm: fx.GraphModule, build) -> set[str]:
    """What is there before any pass: the build's fields already set, the meta keys on ``gm``."""
    fields = {name for name in _fields(build) if getattr(build, name) is not None}
    return fields | {key for n in gm.graph.nodes for key in n.meta}


def run_passes(passes: Sequence[Pass], gm: fx.GraphModule, build) -> fx.GraphModule:
    """Run the enabled ``passes`` on ``gm`` in order, checking each one's ``requires`` and
    ``adds`` (module docstring); returns the graph the last pass returned."""
    fields = _fields(build)
    available = _present(gm, build)
    for p in passes:
        if not p.enabled(build):
            continue
        missing = [key for key in p.requires if key not in available]
        if missing:
            raise AssertionError(f"pass {p.name!r} requires {missing}, which no earlier pass adds "
                                 f"(available: {sorted(available)}): the pass list is out of order")
        result = run_logged(p.name, gm, lambda: p.run(gm, build))
        if not isinstance(result, PassResult) or not isinstance(result.gm, fx.GraphModule):
            raise AssertionError(f"pass {p.name!r} returned {type(result).__name__}, not a PassResult")
        gm = result.gm
        unset = [key for key in p.adds if key in fields and getattr(build, key) is None]
        if unset:
            raise AssertionError(f"pass {p.name!r} declares it adds {unset} but left them unset")
        available |= set(p.adds)
    return gm


def declared_meta_keys(passes: Sequence[Pass], build_type) -> set[str]:
    """The ``node.meta`` keys ``passes`` declare they write (their ``adds`` that are no build field)."""
    fields = {f.name for f in dataclasses.fields(build_type)}
    return {key for p in passes for key in p.adds if key not in fields}


def insert_bucket(gm: fx.GraphModule, target: Callable, args: tuple, kwargs: dict, members: Sequence[fx.Node],
                  readers: dict[fx.Node, list[fx.Node]]) -> fx.Node:
    """Gradient and parameter buckets, as the tensor- and data-parallel passes insert them.

        before:  a = reader(p0); b = reader(p1)
        after:   bucket = target(*args, p0, p1); a = reader(bucket[0]); b = reader(bucket[1])

    Called inside ``gm.graph.inserting_before(...)``; ``readers[p]`` are the nodes that read
    ``p`` now (listed before the bucket was inserted, which reads ``p`` itself)."""
    bucket = gm.graph.call_function(target, args, kwargs)
    for i, p in enumerate(members):
        out = gm.graph.call_function(operator.getitem, (bucket, i))
        out.meta["val"] = p.meta.get("val")
        for reader in readers[p]:
            reader.replace_input_with(p, out)
    return bucket
