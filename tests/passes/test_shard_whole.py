"""``passes.shard_whole``: what tensor parallelism keeps whole, stored in 1/tp pieces and gathered
where read. The matching (``whole_parameters``) on hand-made placeholders; the rewrite's
dataflow on a captured HF Falcon (a fused multi-query QKV, which no rule splits); the module on
simulated ranks: every parameter stored split, training equal to one device. Real ranks:
``tests/integration/test_shard_whole_gloo.py``."""

from __future__ import annotations

import copy
import operator
import os
import sys

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from simulate import simulated_ranks

from sptransform.graph.placement import ParamPlacement, whole
from sptransform.passes.shard_whole import whole_parameters
from sptransform.runtime.collectives import sync_grads
from sptransform.runtime.zero import gather_whole

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sweep_transformers as sweep  # noqa: E402  (each family shrunk as the sweep shrinks it)


def _placeholders(**shapes) -> dict[fx.Node, str]:
    """Parameter placeholders, each read by one op (``unread``: by none)."""
    graph = fx.Graph()
    out = {}
    for name, (shape, trainable) in shapes.items():
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, requires_grad=trainable)
        out[node] = name
    for node, name in out.items():
        if name != "unread":
            graph.call_function(torch.neg, (node,))
    return out


def test_whole_parameters_takes_every_trainable_whole_parameter_along_its_longest_dim_tp_divides():
    params = _placeholders(qkv=((80, 64), True), norm=((64,), True), split=((64, 64), True),
                           odd=((5, 3), True), frozen=((64, 8), False), expert=((4, 8, 8), True),
                           stored_whole=((96, 64), True), tall=((7, 12), True), unread=((64, 64), True))
    placements = {"split": ParamPlacement(whole(0, 64), "column"),
                  "stored_whole": ParamPlacement(whole(0, 96), "column", stored_whole=True)}
    found = {params[n]: dim for n, dim in whole_parameters(params, placements, 2, skip=frozenset({"expert"})).items()}
    # split already (storage), frozen, an expert split over ep, nothing even, read by nothing (a tied
    # weight's other name, stored as the name the graph reads): left alone; the rest
    # along the longest dim that 2 divides (12 of [7, 12]); stored whole and cut in the graph too
    assert found == {"qkv": 0, "norm": 0, "stored_whole": 0, "tall": 1}, found
    # at tp=16 only dims that 16 divides: qkv along 80 or 64 -> 80, norm's 64, stored_whole's 96
    found = {params[n]: dim for n, dim in whole_parameters(params, placements, 16, skip=frozenset({"expert"})).items()}
    assert found == {"qkv": 0, "norm": 0, "stored_whole": 0}, found


def _falcon(layers: int = 1):
    classes = {entry["model_type"]: entry["class"] for entry in sweep.families(["falcon"])}
    model, _, _ = sweep.build("falcon", classes["falcon"], sweep.Target(layers=layers))
    return model


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 16))
    return dict(input_ids=ids, labels=ids.clone())


def _gather_nodes(pm) -> list[fx.Node]:
    return [n for n in pm._last.gm.graph.nodes if n.target is gather_whole]


def test_without_the_option_only_what_is_split_in_the_graph_is_taken():
    params = _placeholders(norm=((64,), True), stored_whole=((96, 64), True))
    placements = {"stored_whole": ParamPlacement(whole(0, 96), "column", stored_whole=True)}
    found = {params[n]: d for n, d in whole_parameters(params, placements, 2, computed_whole=False).items()}
    assert found == {"stored_whole": 0}, found


def test_a_weight_split_in_the_graph_is_gathered_summing_its_gradient_and_its_whole_rows_count_once():
    """``gather_summed`` in front of the reads of a parameter cut in the graph: its ``copy_to_tp``
    (all-reduce backward) removed, the rows read whole behind one ``counted_once``."""
    from sptransform.passes.shard_whole import shard_whole
    from sptransform.runtime.collectives import copy_to_tp
    from sptransform.runtime.zero import counted_once, gather_summed

    graph = fx.Graph()
    w = graph.placeholder("w")
    w.meta["val"] = torch.empty(6, 4, requires_grad=True)
    rank = graph.placeholder("rank")
    entered = graph.call_function(copy_to_tp, (w, "tp"))
    split = graph.call_function(torch.ops.aten.slice.Tensor, (entered, 0, 0, 2))
    read_whole = graph.call_function(torch.ops.aten.slice.Tensor, (w, 0, 4, 6))
    graph.output((split, read_whole))
    gm = shard_whole(fx.GraphModule(torch.nn.Module(), graph), {w: 0}, group="tp", tp=2, rank=rank, layer_rows=[])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert copy_to_tp not in targets and gather_whole not in targets, targets
    (gather,) = [n for n in gm.graph.nodes if n.target is gather_summed]
    (once,) = [n for n in gm.graph.nodes if n.target is counted_once]
    (piece,) = gather.users
    assert piece.target is operator.getitem and set(piece.users) == {split, once}
    assert read_whole.args[0] is once and split.args[0] is piece


def test_counted_once_and_gather_summed_give_one_device_gradients_on_simulated_ranks():
    """Rank k holds rows [3k, 3k + 3) of w [6, 4]; rows [0, 2) are read split (each rank's part of
    a column-parallel read: a partial gradient), rows [4, 6) read whole (equal on both ranks): the
    pieces' gradients are one device's."""
    from sptransform.runtime.zero import counted_once, gather_summed

    full = torch.randn(6, 4, dtype=torch.float64)
    up = torch.randn(6, 4, dtype=torch.float64)
    with simulated_ranks(2) as mode:
        import torch.distributed as dist

        pieces = mode.rank_map(lambda r: full[3 * r: 3 * r + 3].clone()).requires_grad_()
        (w,) = gather_summed(dist.group.WORLD.group_name, 2, [0], [[6, 4]], pieces)
        mine = mode.rank_map(lambda r: torch.tensor([[float(r == 0)], [float(r == 1)]], dtype=torch.float64))
        loss = (w[0:2] * mine * up[0:2]).sum() + (counted_once(w, 2)[4:6] * up[4:6]).sum()
        loss.backward()
        grads = {r: pieces.grad._local_tensors[r] for r in range(2)}
    expected = torch.zeros(6, 4, dtype=torch.float64)
    expected[0:2], expected[4:6] = up[0:2], up[4:6]
    assert torch.equal(torch.cat([grads[0], grads[1]]), expected)


def test_falcon_stores_its_fused_multi_query_qkv_and_its_norms_in_pieces_and_trains_like_one_device_on_simulated_ranks():
    import sptransform

    model = _falcon()
    batch = _batch()
    # the reference outside the simulated ranks: LocalTensorMode computes this model's loss a little
    # differently (4.8426 in it, 4.8508 outside, the value the parallel model gives)
    ref_losses, ref_grads, ref_params = _train(copy.deepcopy(model), batch)
    with simulated_ranks(2):
        plain = sptransform.parallelize(copy.deepcopy(model), tp=2, example_inputs=batch)
        pm = sptransform.parallelize(model, tp=2, example_inputs=batch, shard_whole=True)
        # the fused multi-query QKV stored in 5 segments of 16 rows (query heads split, the K/V
        # head's rows gathered where read: graph.strided_storage); only the norms whole
        assert plain.held_share() < 0.51, plain.explain()
        assert "shard_whole=True would store these" not in plain.explain()  # 0.6% whole: no hint
        assert pm.held_share() == pytest.approx(0.5, abs=1e-9), pm.explain()
        whole_before = {n for n, p in plain.named_parameters()
                        if not isinstance(p, DTensor) or all(isinstance(x, Replicate) for x in p.placements)}
        assert whole_before and not any("query_key_value" in n for n in whole_before), whole_before
        assert all("layernorm" in n or "ln_f" in n for n in whole_before), whole_before
        for name, p in pm.named_parameters():
            assert isinstance(p, DTensor) and not isinstance(p.placements[-1], Replicate), (name, p.placements)
        explained = pm.explain()
        assert "computed whole but stored in 1/tp pieces" in explained and "gathered where read" in explained
        held_whole = explained.split("held whole on every rank")[-1].split("collectives (")[0] \
            if "held whole on every rank" in explained else ""
        assert "query_key_value" not in held_whole and "layernorm" not in held_whole, explained
        # one gather per layer bucket; each piece's placeholder feeds a gather, never a reader directly
        gathers = _gather_nodes(pm)
        assert 1 <= len(gathers) <= 3, [g.name for g in gathers]
        for gather in gathers:
            for piece in gather.args[5:]:
                assert set(piece.users) == {gather}, (piece.name, list(piece.users))
        # a partial gradient is summed by the rewrite's bucket after the gather (so the gradient is
        # whole on every rank when the gather's backward cuts its piece)
        synced = [arg for n in pm._last.gm.graph.nodes if n.target is sync_grads for arg in n.args[1:]]
        assert synced and all(arg.target is operator.getitem and arg.args[0].target is gather_whole
                              for arg in synced), synced
        losses, grads, params = _train(pm, batch)
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} loss: {m}")
        for name, grad in grads[step].items():
            torch.testing.assert_close(grad, ref_grads[step][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"step {step} {name}: {m}")
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _train(model, batch, steps: int = 3) -> tuple[list, list, dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
              for n, p in model.named_parameters()}
    return losses, grads, params


def test_shard_whole_is_refused_without_tensor_parallelism_and_checked_for_type():
    import sptransform

    with pytest.raises(ValueError, match="shard_whole=True.*tp=1"):
        sptransform.parallelize(torch.nn.Linear(4, 4), tp=1, shard_whole=True)
    with pytest.raises(TypeError, match="shard_whole"):
        sptransform.parallelize(torch.nn.Linear(4, 4), tp=2, shard_whole="yes")
    with pytest.raises(ValueError, match="shard_whole=True.*tp=1"):
        sptransform.verify(torch.nn.Linear(4, 4), tp=1, shard_whole=True)
