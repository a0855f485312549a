"""The rematerialisation pass: options and errors, the budget solver's frontier, random ops and
collectives, fused attention, the partitioned graphs under inductor's decompositions."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sptransform.measure import measure_shape, partition_module
from sptransform.measure.flops import node_cost, recomputed_nodes
from sptransform.measure.parallel import fake_process_group
from sptransform.graph.nodes import is_collective
from sptransform.passes.remat import POLICIES, RematOptions, analysis_cost
from sptransform.planner.presets import PRESETS
from sptransform.torch_internals import inductor_decomposed
from tiny_models import LayoutConfig, LayoutLM

TINY = PRESETS["gpt2-tiny"]  # 2 layers, h=128, 4 heads, explicit attention, dropout 0.1


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="use one of") as err:
        RematOptions(policy="everything")
    for name in POLICIES:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "budget"}, "needs budget"),
        ({"policy": "budget", "budget": 1.5}, "must be in"),
        ({"policy": "budget", "budget": -3}, "negative"),
        ({"policy": "selective", "budget": 100}, "only applies"),
    ],
)
def test_bad_budgets_are_rejected_at_the_boundary(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RematOptions(**kwargs)


@pytest.fixture(scope="module")
def tiny_budget():
    """gpt2-tiny (2 layers) at s=256, partitioned with a budget: its whole hull."""
    return measure_shape(TINY, options=RematOptions(policy="budget", budget=0.5), seq=256, num_layers=2)


def test_budget_below_full_recompute_names_the_minimum_feasible_budget(tiny_budget):
    minimum = tiny_budget.partitioned.plan.minimum_feasible_bytes
    full = measure_shape(TINY, options=RematOptions(policy="full"), seq=256, num_layers=2)
    assert minimum <= full.memory.total
    with pytest.raises(ValueError, match=f"minimum feasible budget of {minimum} bytes"):
        measure_shape(TINY, options=RematOptions(policy="budget", budget=minimum - 1), seq=256, num_layers=2)
    fits = measure_shape(TINY, options=RematOptions(policy="budget", budget=minimum), seq=256, num_layers=2)
    assert fits.memory.total <= minimum


def test_budget_result_fits_and_its_frontier_is_a_convex_staircase(tiny_budget):
    plan = tiny_budget.partitioned.plan
    assert tiny_budget.memory.total <= 0.5 * measure_shape(
        TINY, options=RematOptions(policy="none"), seq=256, num_layers=2).memory.total + 6000  # + RNG states
    costs = [analysis_cost(s, RematOptions()) for s in plan.frontier]
    sizes = [s.saved_bytes for s in plan.frontier]
    assert sizes == sorted(sizes)
    assert all(a >= b for a, b in zip(costs, costs[1:]))  # more bytes never cost more recompute
    assert len(plan.frontier) > 2 * 2  # layers switch one at a time


@pytest.mark.parametrize("policy", ["none", "selective", "full", "norm_upproj"])
def test_budget_policy_is_on_or_below_each_named_policy(tiny_budget, policy):
    named = measure_shape(TINY, options=RematOptions(policy=policy), seq=256, num_layers=2)
    budget = named.memory.total
    if budget < tiny_budget.partitioned.plan.minimum_feasible_bytes:
        pytest.skip("named policy below the budget solver's minimum")
    best = measure_shape(TINY, options=RematOptions(policy="budget", budget=budget), seq=256, num_layers=2)
    assert best.memory.total <= budget
    assert analysis_cost(best.partitioned.plan.solution, RematOptions()) <= analysis_cost(
        named.partitioned.plan.solution, RematOptions()) * (1 + 1e-6)


def test_selective_without_rng_replay_saves_the_attention_masks():
    replayed = measure_shape(TINY, options=RematOptions(policy="selective"), seq=256)
    kept = measure_shape(TINY, options=RematOptions(policy="selective", replay_rng=False), seq=256)
    a, s = TINY.num_heads, 256
    mask_bytes = a * s * s  # b=1, one byte per element
    assert kept.memory.per_layer()["dropout_masks"] > mask_bytes > replayed.memory.per_layer()["dropout_masks"]
    assert any("random op" in note for note in kept.memory.notes)


def test_selective_says_so_when_attention_is_a_fused_kernel():
    m = measure_shape(PRESETS["llama-7b"].with_(num_layers=1), options=RematOptions(policy="selective"), seq=128)
    assert m.flops.recompute_flops == 0
    assert any("fused kernel" in note for note in m.memory.notes)
    none = measure_shape(PRESETS["llama-7b"].with_(num_layers=1), options=RematOptions(policy="none"), seq=128)
    assert m.memory.total == none.memory.total


class _OwnGeneratorDropout(nn.Module):
    """Dropout drawn from a generator of its own (as sharded dropout does)."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        h = self.up(x)
        keep = torch.empty(h.shape, dtype=h.dtype).bernoulli_(0.9, generator=self.generator)
        return (x + self.down(F.gelu(h * keep / 0.9))).square().mean()


def _grads(module, partitioned, x):
    module.generator.manual_seed(0)
    for p in module.parameters():
        p.grad = None
    loss = partitioned.compiled(x)[0]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def test_own_generator_draws_are_replayed_exactly():
    torch.manual_seed(0)
    module, x = _OwnGeneratorDropout(64), torch.randn(128, 64)
    reference = partition_module(module, [x], options=RematOptions(policy="none"))
    frugal_plan = partition_module(module, [x], options=RematOptions(policy="budget", budget=10**9)).plan
    minimum = frugal_plan.minimum_feasible_bytes
    frugal = partition_module(module, [x], options=RematOptions(policy="budget", budget=minimum))
    assert frugal.plan.solution.replayed  # the 32 KiB mask is dropped, a 5 KiB state kept
    assert frugal.memory().total < reference.memory().total
    loss0, grads0 = _grads(module, reference, x)
    loss1, grads1 = _grads(module, frugal, x)
    assert torch.equal(loss0, loss1)
    for a, b in zip(grads0, grads1):
        assert torch.equal(a, b)


class _SequenceParallelMLP(nn.Module):
    """LayerNorm on the local sequence shard, all-gather, MLP, reduce-scatter, residual."""

    def __init__(self, width: int, group: str):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.group = group

    def forward(self, x):
        from torch.distributed._functional_collectives import all_gather_single_autograd, reduce_scatter_single_autograd

        y = all_gather_single_autograd(self.norm(x), 0, self.group)  # [s, h] from [s/t, h]
        z = reduce_scatter_single_autograd(self.down(F.gelu(self.up(y))), "sum", 0, self.group)
        return (x + z).sum()


@pytest.fixture
def sp_mlp():
    from sptransform.torch_internals import FakeTensorMode

    with fake_process_group(4) as group:
        with FakeTensorMode():
            module, x = _SequenceParallelMLP(64, group), torch.empty(32, 64, requires_grad=True)
        yield module, x


def _forward_collectives(backward) -> list:
    """Forward collectives the backward graph runs again."""
    return [n for n in recomputed_nodes(backward) if is_collective(n)]


def test_collectives_are_never_recomputed_unless_asked(sp_mlp):
    module, x = sp_mlp
    tight = RematOptions(policy="budget", budget=1, regather_sequence_shards=False)
    with pytest.raises(ValueError, match="minimum feasible budget") as err:
        partition_module(module, [x], options=tight)
    minimum = int(str(err.value).split("use budget >= ")[1])
    p = partition_module(module, [x], options=RematOptions(policy="budget", budget=minimum,
                                                          regather_sequence_shards=False))
    assert not _forward_collectives(p.backward)
    assert p.memory().by_region()["collectives"] > 0  # the gathered tensor is kept


def test_sequence_parallel_saves_the_local_shard_and_gathers_again(sp_mlp):
    module, x = sp_mlp
    # recompute_fusible=False: only the regather differs between the two partitions
    kept = partition_module(module, [x], options=RematOptions(policy="none", regather_sequence_shards=False,
                                                              recompute_fusible=False))
    shard = partition_module(module, [x], options=RematOptions(policy="none", recompute_fusible=False))
    assert _forward_collectives(shard.backward) and not _forward_collectives(kept.backward)
    gathered, local = 128 * 64 * 4, 32 * 64 * 4
    assert kept.memory().total - shard.memory().total == gathered - local
    gather = next(n for n in _forward_collectives(shard.backward) if node_cost(n).comm_bytes)
    assert node_cost(gather).comm_bytes == gathered  # priced by the bytes it moves
    assert shard.flops().recomputed.comm_bytes == gathered



def _run_decomposed(config: LayoutConfig, policy):
    """Partition ``LayoutLM(config)``, re-trace its forward with inductor's decompositions and run
    it, then re-trace and run its backward for the saved tensors as that forward laid them out
    (what AOTAutograd hands inductor's backward once the forward reports its output strides).
    Returns the loss, the parameters' gradients and which saved tensors came out laid out
    otherwise than the joint trace had them."""
    torch.manual_seed(0)
    model = LayoutLM(config)
    ids, targets = torch.randint(0, config.vocab, (2, 8)), torch.randint(0, config.vocab, (2, 8))
    options = RematOptions(policy="budget", budget=policy) if isinstance(policy, float) else RematOptions(policy=policy)
    p = partition_module(model, [ids, targets], options=options)
    for graph in (p.forward, p.backward):
        assert not graph.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
    state = [*model.parameters(), *model.buffers()]
    loss, *saved = inductor_decomposed(p.forward, [*state, ids, targets])(*state, ids, targets)
    traced = [n.meta["val"] for n in p.backward.graph.find_nodes(op="placeholder")][: len(saved)]
    relaid = [i for i, (x, t) in enumerate(zip(saved, traced)) if x.stride() != t.stride()]
    seed = torch.ones_like(loss)
    grads = inductor_decomposed(p.backward, [*saved, seed])(*saved, seed)
    reference = model(ids, targets)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    for param, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(grad, param.grad, rtol=1e-5, atol=1e-6)
    return relaid


@pytest.mark.parametrize("policy", ["selective", "full", 0.5])
def test_partitioned_graphs_retrace_with_inductor_decompositions_and_train_like_eager(policy):
    """Inductor compiles each partitioned graph re-traced with its decompositions, which may lay
    values out otherwise than the joint trace: its ``cat`` of one non-empty tensor (rotary over
    the whole head joined with an empty rest) keeps the transposed layout of q and k where
    ATen's returns them contiguous. The joint graph's ``view`` of the rotated q for the softcap
    attention's ``q @ k.mT`` failed there (inductor: "Cannot view a tensor with shape ..."); the
    partition's graphs have reshapes, and both re-trace and give eager's loss and gradients."""
    _run_decomposed(LayoutConfig(rope_dims=8, attention="softcap"), policy)


def test_saved_tensors_laid_out_otherwise_by_the_decomposed_forward_train_like_eager():
    """With SDPA and ``"selective"`` the rotated q is saved, and the decomposed forward hands it
    over transposed where the joint trace (and so the backward graph's input) has it
    contiguous: the backward must be compiled for the forward's reported strides
    (``compile_graphs.aot_compile``), and then gives eager's gradients."""
    relaid = _run_decomposed(LayoutConfig(rope_dims=8, attention="sdpa"), "selective")
    assert relaid, "no saved tensor was laid out otherwise: the test no longer covers the case"
