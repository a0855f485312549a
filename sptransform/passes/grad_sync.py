"""Gradient sync for replicated parameters that meet split activations.

A replicated parameter read by an op whose output is split (a norm weight in the
sequence-parallel region, a bias added after ḡ, a per-head weight inside a
region), or upstream of a ``take_local`` cut (learned positions), gets only this
rank's share of its gradient. This pass routes each such parameter through one
``sync_grads`` per layer, whose backward sums the whole bucket in one all-reduce:

    before:  w = placeholder; y = layer_norm(x_s, [h], w, b)
    after:   w = placeholder; w_s, b_s = sync_grads(group, w, b); y = layer_norm(x_s, [h], w_s, b_s)

Which parameters, and their layer, is read from dataflow (``sptransform_spec`` and
``sptransform_cut_of`` metadata); the layer of a parameter is that of the first
row-parallel linear after its first use (a row-parallel bias: its linear's layer).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch.fx as fx

from sptransform.runtime.collectives import sync_grads
from sptransform.graph.plan import ParallelPlan


def bucket_replicated_grads(gm: fx.GraphModule, plan: ParallelPlan, row_layers: list[tuple[fx.Node, int]]) -> fx.GraphModule:
    params = {n: n.meta["sptransform_param"] for n in gm.graph.nodes if n.meta.get("sptransform_param")}
    replicated = {n for n, name in params.items() if plan.placements.get(name) is None or plan.placements[name].spec is None}
    needing: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.meta.get("sptransform_spec") is not None and node.op == "call_function":
            needing |= {a for a in node.all_input_nodes if a in replicated}
        if node.meta.get("sptransform_cut_of") is not None:
            needing |= _replicated_param_ancestors(node.meta["sptransform_cut_of"], replicated)
    if not needing:
        return gm
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = sorted((position[r], layer) for r, layer in row_layers)
    exit_bias_layer = {e.bias: e.layer for e in plan.exits if e.bias is not None}
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for param in sorted(needing, key=lambda p: position[p]):
        first_use = min(position[u] for u in param.users)
        layer = exit_bias_layer.get(param)
        if layer is None:
            layer = next((layer for pos, layer in rows if pos > first_use), len(rows) and rows[-1][1] + 1)
        buckets[layer].append(param)
        plan.sync_params[params[param]] = layer
    for layer, members in sorted(buckets.items()):
        first_user = min((u for p in members for u in p.users), key=lambda u: position[u])
        users = {p: list(p.users) for p in members}
        with gm.graph.inserting_before(first_user):
            bucket = gm.graph.call_function(sync_grads, (plan.group, *members))
            outs = []
            for i, p in enumerate(members):
                out = gm.graph.call_function(operator.getitem, (bucket, i))
                out.meta["val"] = p.meta.get("val")
                outs.append(out)
        for p, out in zip(members, outs):
            for user in users[p]:
                user.replace_input_with(p, out)
    gm.graph.lint()
    gm.recompile()
    return gm


def _replicated_param_ancestors(node: fx.Node, replicated: set[fx.Node]) -> set[fx.Node]:
    found, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in replicated:
            found.add(n)
            continue
        if n.meta.get("sptransform_spec") is None:
            stack.extend(n.all_input_nodes)
    return found
