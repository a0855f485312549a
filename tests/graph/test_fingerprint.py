"""The captured graph's fingerprint (``graph.fingerprint``): the same in every process for the
same program, different where the program differs, blind to the device index."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.fingerprint import fingerprint


class Small(nn.Module):
    def __init__(self, act=F.silu, scale: float = 1.0):
        super().__init__()
        self.act, self.scale = act, scale
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        steps = torch.arange(x.shape[-1], device=x.device)  # a device argument: cpu here, cuda:r on rank r
        return self.down(self.act(self.up(x + steps)) * self.scale).sum()


def _print(model, x=None):
    return fingerprint(capture(FakeTemplate(model, torch.device("cpu")), (torch.randn(2, 8) if x is None else x,), {}).gm)


def test_the_same_program_has_one_fingerprint_in_every_process():
    here = _print(Small()).digest
    code = ("import sys, torch; sys.path.insert(0, 'tests/graph'); from test_fingerprint import Small, _print; "
            "print(_print(Small()).digest)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert int(other.stdout.split()[-1]) == here  # (Python's own str hash differs from process to process)


def test_another_op_a_constant_or_a_shape_changes_it_and_the_first_differing_node_is_found():
    base = _print(Small())
    for other in (_print(Small(act=F.gelu)), _print(Small(scale=2.0)), _print(Small(), torch.randn(3, 8))):
        assert other.digest != base.digest
    gelu = _print(Small(act=F.gelu))
    first = next(i for i, (a, b) in enumerate(zip(base.hashes, gelu.hashes)) if a != b)
    assert "silu" in str(base.nodes[first].target) and "gelu" in str(gelu.nodes[first].target)


def test_the_device_index_does_not_count():
    graph = capture(FakeTemplate(Small(), torch.device("cpu")), (torch.randn(2, 8),), {}).gm
    before = fingerprint(graph).digest
    (arange,) = [n for n in graph.graph.nodes if n.target == torch.ops.aten.arange.default]
    assert arange.kwargs["device"] == torch.device("cpu")
    arange.kwargs = {**arange.kwargs, "device": torch.device("cpu", 1)}  # what rank 1 of a GPU job records
    assert fingerprint(graph).digest == before


def test_the_order_the_graph_was_traced_in_does_not_count():
    class Masks(nn.Module):  # masks built in a loop over a set of layer types: another order per process
        def __init__(self, order):
            super().__init__()
            self.order, self.up = order, nn.Linear(8, 8)

        def forward(self, x):
            masks = {kind: (x > (0.1 if kind == "full" else 0.2)).float() for kind in self.order}
            return (self.up(x) * masks["full"] + masks["sliding"]).sum()

    one, other = _print(Masks(["full", "sliding"])), _print(Masks(["sliding", "full"]))
    assert one.hashes != other.hashes and one.digest == other.digest
