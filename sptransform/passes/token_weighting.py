"""Data parallelism weighted by tokens: a token-mean loss's gradient scaled by the replica's share.

    before:  loss = cross_entropy_loss(logits, target)            # mean over targets != -100
             return (loss, logits)
    after:   loss = cross_entropy_loss(logits, target)
             weighted = weight_by_tokens(loss, target, -100, dp, n)   # same value; gradient x n * cnt / total
             return (weighted, logits)

With ``dp > 1`` each replica's gradients are averaged (``passes.data_parallel``); for a loss that
is a mean over a replica's own non-ignored targets this gives the mean of the replicas' means,
not the single-device gradient of the concatenated batch, when the replicas count different
tokens. ``runtime.tokens.weight_by_tokens`` corrects that (its docstring has the arithmetic).

Which losses: found from dataflow, a 0-dim graph output that is, through value-preserving
casts and views only, a mean-reduced ATen ``cross_entropy_loss`` / ``nll_loss`` /
``nll_loss_nd`` (or the first output of ``nll_loss_forward``) without class weights (label smoothing allowed: torch divides its term by the
same count) or sptransform's ``vocab_parallel_cross_entropy`` with mean reduction. Any other
loss (a sum, class weights, a loss computed by the user from the logits) is left alone: its
gradients stay the mean of the replicas' gradients.

``find_token_mean_losses`` only matches (``TokenMeanLoss`` records); ``weight_token_mean_loss``
rewrites one match. Edits ``gm`` in place; the new node carries the loss's ``val``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from sptransform.logs import logger
from sptransform.graph.nodes import packet
from sptransform.runtime.ops import vocab_parallel_cross_entropy
from sptransform.runtime.tokens import weight_by_tokens

aten = torch.ops.aten
log = logger(__name__)

MEAN = 1
"""ATen's ``Reduction::Mean``."""

# A constant table: ops whose output holds their first input's value (a cast or a view of a scalar).
_SAME_VALUE = {aten.alias, aten.clone, aten.to, aten._to_copy, aten.view, aten.reshape, aten.contiguous}

# A constant table: ATen losses of (input, target, weight, reduction, ignore_index, ...) positions.
_ATEN_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss_forward, aten.nll_loss2d_forward}


@dataclass(frozen=True)
class TokenMeanLoss:
    """A graph output (``output_index`` of the flat outputs) that is the mean of ``loss`` over
    the entries of ``target`` other than ``ignore_index``."""

    output_index: int
    loss: fx.Node
    target: fx.Node
    ignore_index: int


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _token_mean(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(target, ignore_index) when ``node`` is a mean over non-ignored targets, else None."""
    if node.op != "call_function":
        return None
    if node.target is vocab_parallel_cross_entropy:
        target, ignore_index, reduction = node.args[1], node.args[5], node.args[6]
        return (target, int(ignore_index)) if reduction == MEAN else None
    if node.target is operator.getitem and node.args[1] == 0 and isinstance(node.args[0], fx.Node) \
            and packet(node.args[0]) in (aten.nll_loss_forward, aten.nll_loss2d_forward):
        node = node.args[0]  # (output, total_weight)[0]
    if packet(node) in _ATEN_LOSSES:
        if _arg(node, 2, "weight", None) is not None or _arg(node, 3, "reduction", MEAN) != MEAN:
            return None
        target = node.args[1]
        return (target, int(_arg(node, 4, "ignore_index", -100))) if isinstance(target, fx.Node) else None
    return None


def find_token_mean_losses(gm: fx.GraphModule) -> list[TokenMeanLoss]:
    """Every 0-dim output that is a token mean (module docstring), by dataflow."""
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    found = []
    for index, out in enumerate(flat):
        val = out.meta.get("val") if isinstance(out, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() != 0 or not val.is_floating_point():
            continue
        node = out
        while node.op == "call_function" and packet(node) in _SAME_VALUE and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        match = _token_mean(node)
        if match is not None:
            found.append(TokenMeanLoss(index, out, *match))
    return found


def weight_token_mean_loss(gm: fx.GraphModule, match: TokenMeanLoss, *, group: str, size: int) -> fx.Node:
    """Return ``weight_by_tokens(loss, ...)`` in place of ``match``'s output; the new node."""
    output = gm.graph.find_nodes(op="output")[0]
    with gm.graph.inserting_before(output):
        weighted = gm.graph.call_function(weight_by_tokens, (match.loss, match.target, match.ignore_index, group, size))
    weighted.meta["val"] = match.loss.meta["val"]
    outputs = output.args[0]
    if isinstance(outputs, (tuple, list)):
        new = list(outputs)
        new[match.output_index] = weighted
        output.args = (type(outputs)(new),)
    else:
        output.args = (weighted,)
    return weighted


def weight_by_token_counts(gm: fx.GraphModule, *, group: str, size: int) -> fx.GraphModule:
    """Find every token-mean loss output and weight its gradient (module docstring); the graph
    untouched when there is none."""
    matches = find_token_mean_losses(gm)
    for match in matches:
        weight_token_mean_loss(gm, match, group=group, size=size)
    if matches:
        gm.graph.lint()
        gm.recompile()
    log.debug("token weighting: %d token-mean loss output(s) weighted over %d replicas", len(matches), size)
    return gm
