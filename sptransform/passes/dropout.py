"""Dropout of split activations.

    before:  y = dropout(x_r, p, train)                 # x_r: this rank's part
    after:   y = g.dropout_op(x_r, p, train)            # rank's own generator (g: the module's)
        or   y = reference_dropout(x_r, p, train, dim, table, rank, full_shape, full_stride)

``independent`` (default): masks of split activations come from a generator per
rank (seed + rank), so shards get independent masks, reproducible run after run;
replicated activations keep ATen's dropout on the default generator, identical on
every rank when ranks are seeded alike. ``reference``: every rank draws the full
mask exactly as the single-device model would and keeps its slice, so the parallel
model's masks equal the original's bit for bit (at tp times the RNG work).
Reads ``sptransform_spec`` and the original ``val`` (global shape and strides).

``native_dropout`` (what ``dropout`` becomes when capture functionalizes the graph, e.g. for a
forward with in-place writes through views) gets the same treatment, keeping its
``(output, mask)`` result: left as is, it would draw on the rank's shard from the default
generator, neither the single device's mask nor independent ones.

Other random ops over a split activation (``rand_like``, ``bernoulli``, ...) are refused in
``reference`` mode (only dropout's masks are reproduced) and noted in ``independent`` mode
(drawn from the default generator: the same pattern on every rank's shard). Attention kernels
(``scaled_dot_product_attention`` and its ``_scaled_dot_product_*`` kernels) are found by their
``dropout_p`` argument.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.fx as fx

from sptransform.runtime.rng import RankGenerators
from sptransform.runtime.ops import (
    reference_dropout,
    reference_native_dropout,
)
from sptransform.graph.plan import ParallelPlan
from sptransform.graph.placement import DimShard
from sptransform.graph.nodes import describe, packet
from sptransform.passes.localize import index_table
from sptransform.torch_internals import op_schema
from sptransform.torch_internals import OpOverload

aten = torch.ops.aten


def shard_dropout(
    gm: fx.GraphModule, plan: ParallelPlan, *, mode: Literal["independent", "reference"], generators: RankGenerators
) -> fx.GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        kind = packet(node)
        fused = _fused_dropout_p(node)  # scaled_dot_product_attention and its kernels
        if fused is not None:
            if fused and node.meta.get("sptransform_spec") is not None:
                _fused_dropout(node, mode, plan)
            continue
        if kind is not aten.dropout and kind is not aten.native_dropout:
            if _draws_over_a_split(node):
                _other_random(node, mode, plan)
            continue
        native = kind is aten.native_dropout
        x, p, train = _arguments(node)
        # native_dropout's (out, mask) result carries no spec of its own: its input's split is its split
        spec = x.meta.get("sptransform_spec") if native else node.meta.get("sptransform_spec")
        if not isinstance(spec, DimShard):
            continue  # a replicated input: ATen's dropout, the same mask on every rank
        if mode == "reference":
            val = x.meta["val"]
            table = index_table(gm, x, spec, plan.tp)
            node.target = reference_native_dropout if native else reference_dropout
            node.args = (x, p, train, spec.dim, table, plan.rank, list(val.shape), list(val.stride()))
        else:
            node.target = generators.native_dropout_op if native else generators.dropout_op
            node.args = (x, p, train)
        node.kwargs = {}
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _arguments(node: fx.Node) -> tuple:
    """(input, p, train) of ``dropout(input, p, train)`` or ``native_dropout(input, p, train=None)``,
    whether passed by position or by name."""
    names = ("input", "p", "train")
    values = list(node.args) + [node.kwargs.get(n) for n in names[len(node.args):]]
    return tuple(values)


def _fused_dropout_p(node: fx.Node) -> float | None:
    """The ``dropout_p`` of an op that takes one (an attention kernel), else None."""
    schema = op_schema(node.target) if node.op == "call_function" else None
    if schema is None:
        return None
    for i, argument in enumerate(schema.arguments):
        if argument.name == "dropout_p":
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get("dropout_p", argument.default_value or 0.0)
    return None


def _draws_over_a_split(node: fx.Node) -> bool:
    """A random op (``rand_like``, ``bernoulli``, ...) whose result or input is split over the ranks."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    return any(isinstance(n.meta.get("sptransform_spec"), DimShard) for n in (node, *node.all_input_nodes))


def _other_random(node: fx.Node, mode: str, plan: ParallelPlan) -> None:
    if mode == "reference":
        raise ValueError(
            f"{describe(node)} draws random numbers over an activation split across the ranks; sptransform "
            "reproduces only dropout's masks bit for bit: use dropout_rng='independent', or nn.Dropout / "
            "F.dropout for the mask"
        )
    plan.notes.append(
        f"{node.name}: a random draw over a split activation comes from the default generator, so the "
        "shards get the same random pattern on every rank"
    )


def _fused_dropout(node: fx.Node, mode: str, plan: ParallelPlan) -> None:
    if mode == "reference":
        raise ValueError(
            f"{describe(node)} applies dropout inside a fused attention kernel, whose mask "
            "sptransform cannot reproduce bit for bit: use dropout_rng='independent', or "
            "explicit (eager) attention, or attention dropout 0"
        )
    plan.notes.append(
        f"{node.name}: attention dropout inside the fused kernel draws from the default "
        "generator, so head shards get the same mask pattern on every rank"
    )
