"""Routing with data-dependent shapes on real gloo ranks: JetMoE (experts and attention experts
split by ``.tolist()`` of the routing counts) and an index-based MoE (tokens picked with
``torch.where`` and scattered back with ``index_add_``, Mixtral's eager loop) train like the
originals at tp=2, with and without sequence parallelism, in float64.

What decides the routing runs whole on every rank on all the tokens (routers replicated); ops
that only read the routed rows are split along their static dims: the index MoE's experts (each
its own ``nn.Linear`` modules) column/row like a dense MLP, beside its attention. JetMoE's experts
and attention experts, slices of 3-D parameters run on the groups of rows of one ``.tolist()``
split, are one block per layer each (a row-parallel linear per expert). DBRX,
whose Python loop runs over the experts ``nonzero`` found, stays refused, naming that line;
pipeline stages (pp > 1) refuse data-dependent shapes.

One spawn of 2 ranks runs every case."""

from __future__ import annotations

import copy
import datetime
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

from simulate import spawn_with_deadline, train_like_reference

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sweep_transformers as sweep  # noqa: E402  (each family shrunk as the sweep shrinks it)
from models import zoo  # noqa: E402

CASES = (  # (model, sp, the share of the parameter bytes a rank may hold at tp=2)
    ("jetmoe", False, 0.53),  # 0.520: experts and attention experts split (0.983 when they ran whole)
    ("jetmoe", True, 0.53),
    ("moe_index", True, 0.51),  # attention and experts split (0.76 when the experts ran whole), router whole
    ("moe_index", False, 0.51),
)


def _model(name: str):
    if name in zoo.ZOO:
        model, (idx, targets) = zoo.build(name)
        return model.double(), {"idx": idx, "targets": targets}
    classes = {entry["model_type"]: entry["class"] for entry in sweep.families([name])}
    model, _, _ = sweep.build(name, classes[name], sweep.Target(layers=1))
    torch.manual_seed(1)
    batch = dict(input_ids=torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16)))
    return model.double(), batch


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for name, sp, bound in CASES:  # one process group for every case: spawning is the slow part
            _train_and_compare(name, sp, bound, world)
        _compiled_across_graph_breaks(world)
        _pipeline_is_refused(world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_and_compare(name: str, sp: bool, bound: float, world: int) -> None:
    import sptransform

    model, batch = _model(name)
    ref = copy.deepcopy(model)
    pm = sptransform.parallelize(model, tp=world, sp=sp, example_inputs=batch, dropout_rng="reference")
    what = f"{name} sp={sp} "
    if dist.get_rank() == 0:  # the figure the README quotes (pytest -s shows it)
        print(f"{what}: each rank holds {pm.held_share():.3f} of the parameter bytes at tp={world}")
    assert pm.held_share() <= bound, f"{what}: each rank holds {pm.held_share():.3f}\n{pm.explain()}"
    assert "depend on the data" in pm.explain(), pm.explain()
    # (rtol, atol). float64, but transformers casts to float32 where the model says .float() (JetMoE's
    # router logits, the loss's logits): float32's rounding there; the zoo's model is float64 throughout.
    close = (1e-9, 1e-11) if name in zoo.ZOO else (1e-4, 1e-5)  # the latter as test_experts_gloo.py
    # the loss and every gradient at each of 3 steps, the parameters after two optimizer steps
    train_like_reference(pm, ref, [batch] * 3, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                         loss_tol=close, grad_tol=close, params_tol=close, seed=100, step_after_last=False,
                         what=what)


def _compiled_across_graph_breaks(world: int) -> None:
    """``torch.compile(pm)``: dynamo breaks the graph at the routing's ``nonzero``, so f's output
    (an identity forward whose backward all-reduces) and the gradient buckets' outputs cross a
    graph boundary. Before ``collectives.fresh`` they were views, which AOTAutograd replays outside
    the compiled graph, and their backward all-reduce was lost: every gradient off by up to 1e-2
    at tp=2 with no error. The routed loop MoE with a shared expert (a dense MLP split beside the
    experts), float64, 3 AdamW steps."""
    import sptransform
    from torch._dynamo import lookup_backend  # (tests may reach torch's private API; the package does not)

    from models.routed import RoutedConfig, RoutedLM

    torch.manual_seed(0)
    model = RoutedLM(RoutedConfig(dispatch="loop", experts=3, top_k=2, shared=True)).double()
    ref = copy.deepcopy(model)
    batches = [(ids, ids) for ids in (torch.randint(0, 64, (2, 8)) for _ in range(3))]
    pm = sptransform.parallelize(model, tp=world, sp=False, example_inputs=batches[0])
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    close = (1e-9, 1e-11)
    train_like_reference(pm, ref, batches, parallel=torch.compile(pm, backend=counting),
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), loss_tol=close,
                         grad_tol=close, params_tol=close, what="compiled loop MoE ")
    assert len(graphs) >= 2, f"{len(graphs)} graph(s): no graph break, so no boundary was tested"


def _pipeline_is_refused(world: int) -> None:
    """Pipeline stages run on static shapes: refused at parallelize, on every rank alike."""
    import sptransform

    model, batch = _model("moe_index")
    with pytest.raises(ValueError, match=rf"pp={world}: the model's forward has shapes that depend on the data"):
        sptransform.parallelize(model, tp=1, pp=world, example_inputs=batch)


@pytest.mark.slow
def test_data_dependent_routing_trains_like_the_original_on_gloo():
    spawn_with_deadline(_worker, 2, 900.0)


def test_index_routing_is_equal_on_simulated_ranks():
    """The fast lane's check (the spawn above is slow): the index MoE, float64, tp=2 + SP."""
    import sptransform

    model, batch = _model("moe_index")
    report = sptransform.verify(model, tp=2, sp=True, example_inputs=batch, processes=False, compile="eager", rtol=1e-9)
    assert report.status == "equal", report
    assert report.held_share <= 0.51, report


def test_a_loop_over_data_dependent_experts_is_refused_naming_its_line():
    import sptransform

    model, batch = _model("dbrx")
    report = sptransform.verify(model, tp=2, example_inputs=batch, processes=False)
    assert report.status == "refused", report
    assert re.search(r"Python control flow at .*modeling_dbrx\.py, line \d+ \(for expert_idx in expert_hit:\) "
                     r"depends on the values of a tensor.*range\(num_experts\)", report.error), report.error


def test_recompute_refuses_data_dependent_shapes():
    """The recompute partition re-traces without a shape environment (``nonzero`` raised there on
    real ranks): refused at parallelize instead."""
    import sptransform

    model, batch = _model("moe_index")
    with pytest.raises(ValueError, match=r"recompute='selective': the model's forward has shapes that depend on the data"):
        sptransform.parallelize(model, tp=1, recompute="selective", example_inputs=batch)
