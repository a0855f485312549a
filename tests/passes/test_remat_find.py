"""The find half of rematerialisation (``passes.remat_find``) on the joint graph of a two-linear
MLP: how nodes are classified, what each policy constrains, and the cuts the solver returns.
Nothing here rewrites a graph (``passes.remat.apply_plan`` does; tests/passes/test_remat.py)."""

from __future__ import annotations

import dataclasses

import pytest

from sptransform.graph.nodes import packet
import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.graph.nodes import is_tangent, is_view
from sptransform.passes.base import declared_meta_keys
from sptransform.passes.remat import JOINT_PASSES, Partition, remat_partition
from sptransform.passes.remat_find import (
    MinCut, RematOptions, analysis_cost, best_within_budget, pareto, plan_remat, policy_constraints,
    solution_from_saved,
)
from sptransform.compile_graphs import aot_compile, state_count
from tiny_models import TinyConfig, TinyLM

aten = torch.ops.aten


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):  # x: [8, 16]
        return (self.down(F.gelu(self.up(x)).view(8, 64)).sum(),)


@pytest.fixture(scope="module")
def analysis():
    """The joint analysis the remat partition computed for MLP (policy none)."""
    seen = {}
    module, x = MLP(), torch.randn(8, 16)
    partition = remat_partition(RematOptions(), state_indices=list(range(state_count(module))),
                                on_partition=lambda a, plan, fw, bw: seen.update(analysis=a))
    run = aot_compile(module, [x], partition_fn=partition, overlap=False)
    run(x)
    return seen["analysis"]


def _ops(analysis, op):
    return [n for n in analysis.forward if getattr(n.target, "overloadpacket", None) is op]


def test_the_forward_holds_no_tangent_and_parameters_cost_no_bytes(analysis):
    assert analysis.forward and not any(is_tangent(n) for n in analysis.forward)
    placeholders = [n for n in analysis.forward if n.op == "placeholder"]
    params = placeholders[:4]  # up.weight, up.bias, down.weight, down.bias
    assert all(analysis.save_bytes[p] == 0 for p in params)
    assert analysis.save_bytes[placeholders[4]] == 8 * 16 * 4  # the input: an activation


def test_the_backward_needs_the_up_projection_and_views_are_free(analysis):
    (up,) = [n for n in _ops(analysis, aten.addmm) if n.args[1].op == "placeholder"]
    assert up in analysis.needed_by_backward  # gelu's backward reads its input
    assert analysis.cost[up].matmul_flops == 2 * 8 * 16 * 64
    assert all(n in analysis.free for n in analysis.forward if is_view(n))


def test_policy_none_bans_every_costly_recompute_and_budget_constrains_nothing(analysis):
    none = policy_constraints(analysis, RematOptions(policy="none"))
    assert not none.must_recompute
    assert aten.gelu in {packet(n) for n in analysis.fusible}  # memory-bound: may be recomputed
    sums = [n for n in analysis.forward if packet(n) is aten.sum]
    assert sums and all(n in none.banned for n in sums)  # a reduction: its small output is saved, never run again
    assert {n for n in analysis.forward if n not in analysis.free | analysis.fusible} <= none.banned
    assert not analysis.fusible & none.banned
    eager = policy_constraints(analysis, RematOptions(policy="none", recompute_fusible=False))
    assert {n for n in analysis.forward if n not in analysis.free} <= eager.banned
    budget = policy_constraints(analysis, RematOptions(policy="budget", budget=10**9))
    assert not budget.must_recompute
    assert budget.banned == {n for n in analysis.forward if n.op == "placeholder"}


def test_policy_none_recomputes_no_matmul(analysis):
    plan = plan_remat(analysis, RematOptions(policy="none"))
    assert plan.saved and plan.solution.recompute.matmul_flops == 0


def test_the_cheapest_cut_recomputes_nothing_costly_and_the_smallest_saves_least(analysis):
    options = RematOptions(policy="budget", budget=10**9)
    cut = MinCut(analysis, policy_constraints(analysis, options), options)
    cheapest, smallest = cut.cheapest(), cut.smallest()
    assert cheapest.recompute.matmul_flops == 0
    assert smallest.saved_bytes <= cheapest.saved_bytes
    assert analysis_cost(smallest, options) >= analysis_cost(cheapest, options)


def test_saving_nothing_recomputes_the_matmuls_and_saving_all_needed_recomputes_nothing(analysis):
    nothing = solution_from_saved(analysis, set())
    assert nothing.saved_bytes == 0 and nothing.recompute.matmul_flops > 0
    everything = solution_from_saved(analysis, set(analysis.needed_by_backward))
    assert everything.recompute.matmul_flops == 0 and everything.saved_bytes > 0


def test_pareto_drops_solutions_beaten_in_bytes_and_cost(analysis):
    options = RematOptions()
    nothing = solution_from_saved(analysis, set())
    everything = solution_from_saved(analysis, set(analysis.needed_by_backward))
    worse = dataclasses.replace(everything, recompute=nothing.recompute)  # as many bytes, more recompute
    assert pareto([everything, worse, nothing], options) == [nothing, everything]


def test_a_budget_that_fits_everything_recomputes_no_matmul_and_one_below_all_fits_none(analysis):
    options = RematOptions(policy="budget", budget=10**9)
    candidates = [solution_from_saved(analysis, set()), solution_from_saved(analysis, set(analysis.needed_by_backward))]
    best = best_within_budget(analysis, candidates, 10**9, options)
    assert best.recompute.matmul_flops == 0
    assert best_within_budget(analysis, candidates, -1, options) is None


class Tupled(nn.Module):
    """AOTAutograd wants tuple outputs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return (self.model(*args),)


def test_the_joint_passes_write_exactly_the_meta_keys_they_declare():
    """A one-layer LM with dropout under policy full: its dropout is replayed (``recompute``)."""
    module = Tupled(TinyLM(TinyConfig(dropout=0.1)))
    ids = torch.randint(0, 61, (2, 8))
    partition = remat_partition(RematOptions(policy="full"), state_indices=list(range(state_count(module))))
    keys = {}

    def recording(joint, joint_inputs, **kwargs):
        keys["before"] = {key for n in joint.graph.nodes for key in n.meta}
        fw, bw = partition(joint, joint_inputs, **kwargs)
        keys["after"] = {key for n in joint.graph.nodes for key in n.meta}
        return fw, bw

    aot_compile(module, [ids, ids], partition_fn=recording, overlap=False)(ids, ids)
    assert keys["after"] - keys["before"] == declared_meta_keys(JOINT_PASSES, Partition)
