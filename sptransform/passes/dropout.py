"""Dropout of split activations.

    before:  y = dropout(x_r, p, train)                 # x_r: this rank's part
    after:   y = independent_dropout(x_r, p, train, g)  # rank's own generator
        or   y = reference_dropout(x_r, p, train, dim, table, rank, full_shape, full_stride)

``independent`` (default): masks of split activations come from a generator per
rank (seed + rank), so shards get independent masks, reproducible run after run;
replicated activations keep ATen's dropout on the default generator, identical on
every rank when ranks are seeded alike. ``reference``: every rank draws the full
mask exactly as the single-device model would and keeps its slice, so the parallel
model's masks equal the original's bit for bit (at tp times the RNG work).
Reads ``sptransform_spec`` and the original ``val`` (global shape and strides).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.fx as fx

from sptransform.runtime.ops import independent_dropout, reference_dropout
from sptransform.graph.plan import ParallelPlan
from sptransform.graph.sharding import describe, packet
from sptransform.passes.localize import index_table

aten = torch.ops.aten


def shard_dropout(
    gm: fx.GraphModule, plan: ParallelPlan, *, mode: Literal["independent", "reference"], generators: int
) -> fx.GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        spec = node.meta.get("sptransform_spec")
        if spec is None:
            continue
        if packet(node) is aten.scaled_dot_product_attention:
            p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
            if p:
                _fused_dropout(node, mode, plan)
            continue
        if packet(node) is not aten.dropout:
            continue
        x, p, train = node.args
        if mode == "reference":
            val = x.meta["val"]
            table = index_table(gm, x, spec, plan.tp)
            node.target = reference_dropout
            node.args = (x, p, train, spec.dim, table, plan.rank, list(val.shape), list(val.stride()))
        else:
            node.target = independent_dropout
            node.args = (x, p, train, generators)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


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
