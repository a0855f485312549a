"""The token-weighting pass on hand-built graphs: which outputs are token means (found from the
loss op and its arguments, through casts), and the rewrite: the loss's value unchanged, its
gradient scaled by dp * (this replica's count) / (the replicas' count)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from simulate import one_rank
from sptransform.passes.token_weighting import find_token_mean_losses, weight_by_token_counts
from sptransform.runtime.ops import vocab_parallel_cross_entropy
from sptransform.runtime.tokens import weight_by_tokens

aten = torch.ops.aten


def _loss_graph(op, *extra, cast: bool = False, scalar: bool = True, **kwargs) -> fx.GraphModule:
    """(loss, logits) = (op(logits, target, *extra, **kwargs), logits), the loss optionally through a cast."""
    graph = fx.Graph()
    logits, target = graph.placeholder("logits"), graph.placeholder("target")
    logits.meta["val"], target.meta["val"] = torch.empty(6, 8), torch.empty(6, dtype=torch.long)
    loss = graph.call_function(op, (logits, target, *extra), kwargs)
    loss.meta["val"] = torch.empty(()) if scalar else torch.empty(6)
    out = loss
    if op is aten.nll_loss_forward.default:
        out = graph.call_function(operator.getitem, (loss, 0))
        out.meta["val"] = torch.empty(())
    if cast:
        out = graph.call_function(aten.to.dtype, (out, torch.float32))
        out.meta["val"] = torch.empty(())
    graph.output((out, logits))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("build, ignore_index", [
    (lambda: _loss_graph(aten.cross_entropy_loss.default), -100),
    (lambda: _loss_graph(aten.cross_entropy_loss.default, None, 1, -1, 0.1, cast=True), -1),  # label smoothing
    (lambda: _loss_graph(aten.nll_loss_nd.default, ignore_index=7), 7),
    (lambda: _loss_graph(aten.nll_loss_forward.default, None, 1, -100), -100),
    (lambda: _loss_graph(vocab_parallel_cross_entropy, None, 4, 8, -100, 1, "tp"), -100),
])
def test_token_mean_losses_are_found_from_the_op_and_its_reduction(build, ignore_index):
    (match,) = find_token_mean_losses(build())
    assert (match.output_index, match.ignore_index, match.target.name) == (0, ignore_index, "target")


@pytest.mark.parametrize("build", [
    lambda: _loss_graph(aten.cross_entropy_loss.default, None, 2),  # sum
    lambda: _loss_graph(aten.cross_entropy_loss.default, None, 0, scalar=False),  # per token
    lambda: _loss_graph(aten.nll_loss.default, "class weights"),  # the mean is over the targets' weights
    lambda: _loss_graph(vocab_parallel_cross_entropy, None, 4, 8, -100, 2, "tp"),
    lambda: _loss_graph(aten.mse_loss.default),
])
def test_other_losses_are_left_as_the_mean_of_replica_means(build):
    gm = build()
    code = gm.code
    assert find_token_mean_losses(gm) == []
    assert weight_by_token_counts(gm, group="dp", size=2).code == code


def test_the_weighted_loss_keeps_its_value_and_scales_its_gradient_by_the_token_share():
    """One real rank: the replicas' count is this rank's, so the weight is size * n / n = size;
    with every target ignored the weight is 0, not NaN (single device: no target, no gradient)."""
    gm = _loss_graph(aten.cross_entropy_loss.default)
    with one_rank() as group:
        weight_by_token_counts(gm, group=group, size=2)
        logits = torch.randn(6, 8, requires_grad=True)
        target = torch.tensor([1, 2, -100, 3, -100, 4])
        loss, _ = gm(logits, target)
        plain = torch.nn.functional.cross_entropy(logits, target)
        assert torch.equal(loss, plain)
        (grad,) = torch.autograd.grad(loss, logits)
        (plain_grad,) = torch.autograd.grad(plain, logits)
        torch.testing.assert_close(grad, 2 * plain_grad)
        ignored = torch.full((6,), -100)
        (none,) = torch.autograd.grad(weight_by_tokens(logits.sum() * 0, ignored, -100, group, 2), logits)
        assert torch.equal(none, torch.zeros_like(logits))
    assert sum(n.target is weight_by_tokens for n in gm.graph.nodes) == 1
