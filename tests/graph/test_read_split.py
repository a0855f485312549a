"""Parameters every reader cuts to one split are stored split (``graph.read_split``): found on
small graphs, carried back through ops on parameters only, refused where any reader needs more."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.graph.placement import whole
from sptransform.graph.propagate import propagate
from sptransform.graph.read_split import gathering, split_parameters

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.analysis import constant_nodes
from sptransform.passes.canonicalize import remove_dead_code


def _graph(module: nn.Module, *args):
    captured = capture(FakeTemplate(module, torch.device("cpu")), args, {})
    remove_dead_code(captured.gm)
    return captured, dict(zip(captured.state_placeholders, captured.state_names))


class PerChannel(nn.Module):
    """A column linear's features scaled by ``exp(decay)`` and shifted by ``skip``, per feature;
    ``whole_too`` also reads ``skip`` whole (its sum joins every feature)."""

    def __init__(self, whole_too: bool = False):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.decay = nn.Parameter(torch.randn(16))
        self.skip = nn.Parameter(torch.randn(16))
        self.down = nn.Linear(16, 8, bias=False)
        self.whole_too = whole_too

    def forward(self, x):
        h = F.silu(self.up(x)) * -torch.exp(self.decay.float()) + self.skip
        if self.whole_too:
            h = h + self.skip.sum()
        return self.down(h)


def _found(module):
    captured, params = _graph(module, torch.randn(2, 4, 8))
    gm = captured.gm
    by_name = {name: node for node, name in params.items()}
    seeds = {by_name["up.weight"]: whole(0, 16), by_name["down.weight"]: whole(1, 16)}
    constant = constant_nodes(gm, set(params))
    prop = propagate(gm, seeds, tp=2, constant=constant, sequence=None)
    found = split_parameters({n: name for n, name in params.items()}, prop, constant, 2)
    names = {params[n]: spec for n, spec in found.items()}
    trial = propagate(gm, {**seeds, **found}, tp=2, constant=constant, sequence=None)
    return names, {params[n] for n in gathering(trial, found, constant)}


def test_parameters_cut_per_feature_through_a_cast_and_exp_are_stored_split():
    names, gathered = _found(PerChannel())
    assert names == {"decay": whole(0, 16), "skip": whole(0, 16)}
    assert not gathered


def test_a_parameter_also_read_whole_stays_replicated():
    names, _ = _found(PerChannel(whole_too=True))
    assert names == {"decay": whole(0, 16)}
