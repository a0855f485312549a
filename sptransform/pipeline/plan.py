"""Pipeline plan: the graph-only planning of a pipeline (no process group).

``plan_pipeline`` takes the (tensor/sequence-parallel) graph of one microbatch and
returns where the stages begin, what each stage's graph is, where each stage runs,
and which parameters several stages read:

    find loss output -> find layer boundaries (repeated residual blocks) -> measure layer costs -> balance -> split

The costs are measured on the single-device graph (``pipeline_costs``); the
microbatches each stage keeps in flight come from the schedule's own action order
(``pipeline_schedule``), so that a 1F1B first stage, which holds activations for
up to pp microbatches, is charged for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from sptransform.graph.analysis import analyze, find_loss_output
from sptransform.graph.nodes import data_dependent, describe
from sptransform.capture import FakeTemplate, capture
from sptransform.graph.plan import ParallelGraph
from sptransform.passes.pipeline_split import GraphFlow, LayerBoundary, StageGraph, balance_layers, find_stage_cuts, split_graph
from sptransform.pipeline.costs import LayerCost, measure_layer_costs
from sptransform.options import PipelineOptions
from sptransform.torch_internals import maybe_disable_local_tensor_mode, pytree
from sptransform.pipeline.schedule import inflight, pipeline_order, schedule_spec, stage_ranks

@dataclass
class TiedParameter:
    name: str
    stages: list[int]
    ranks: list[int]

    @property
    def colocated(self) -> bool:
        return len(self.ranks) == 1


@dataclass
class PipelinePlan:
    options: PipelineOptions
    num_layers: int
    boundaries: list[LayerBoundary]
    """Every layer boundary found (``num_layers - 1``)."""
    starts: list[int]
    """First layer of each stage."""
    stages: list[StageGraph]
    stage_rank: list[int]
    costs: list[LayerCost]
    inflight: list[int]
    tied: list[TiedParameter]
    notes: list[str] = field(default_factory=list)
    found: str = ""
    """What the layers are, in words (``StageCuts.found``)."""

    def stages_of(self, rank: int) -> list[StageGraph]:
        return [s for s in self.stages if self.stage_rank[s.index] == rank]


def plan_pipeline(graph: ParallelGraph, template: FakeTemplate, args: tuple, kwargs: dict,
                  options: PipelineOptions) -> PipelinePlan:
    """Boundaries, costs, balance and split of ``graph`` (captured on one microbatch)."""
    captured = graph.captured
    routed = [n for n in captured.gm.graph.nodes if data_dependent(n)]
    if routed:
        # Stage graphs are split and run by torch's pipelining on static shapes; a size known
        # only at run time meets a guard there (a crash, on some ranks): refused here instead.
        raise ValueError(
            f"pp={options.pp}: the model's forward has shapes that depend on the data ({len(routed)} ops, first "
            f"{describe(routed[0])}); pipeline stages do not run such graphs yet: use pp=1 (tp, sp and dp "
            "run them, the data-dependent routing whole on every rank)")
    analysis = graph.model_analysis()
    flow = GraphFlow(captured, find_loss_output(captured, analysis))
    num_stages = options.num_stages
    cuts = find_stage_cuts(flow, analysis, num_stages)
    num_layers, boundaries = cuts.num_layers, cuts.boundaries
    if num_layers < num_stages:
        raise ValueError(
            f"pp={options.pp} x stages_per_rank={options.virtual} = {num_stages} pipeline stages need at least "
            f"{num_stages} transformer layers; the model has {num_layers}: use pp x stages_per_rank <= {num_layers} "
            f"(found {cuts.found})"
        )
    spec = schedule_spec(options.schedule)
    ranks = stage_ranks(spec, options.pp, options.virtual)
    held = inflight(pipeline_order(spec, options.pp, options.virtual, options.n_microbatches), num_stages)
    costs = _layer_costs(graph, flow, boundaries, num_layers, template, args, kwargs)
    starts = balance_layers([c.time for c in costs], num_stages,
                            activation_bytes=[c.activation_bytes for c in costs], inflight=held)
    stages = split_graph(flow, [boundaries[s - 1] for s in starts[1:]], num_layers)
    tied = []
    for name in sorted(captured.param_names):
        users = [s.index for s in stages if name in s.state_names]
        if len(users) > 1:
            tied.append(TiedParameter(name, users, sorted({ranks[s] for s in users})))
    return PipelinePlan(options, num_layers, boundaries, starts, stages, ranks, costs, held, tied, found=cuts.found)


def _layer_costs(graph: ParallelGraph, flow: GraphFlow, boundaries, num_layers, template, args, kwargs):
    """Costs measured on the single-device graph (the one split when no pass rewrote it: tp=1 and
    dp=1; else a fresh capture, since the passes' collectives run on pieces of the parameters)."""
    flat = pytree.tree_leaves((tuple(args), dict(kwargs)))
    if graph.plan is None and graph.data_parallel is None:
        return measure_layer_costs(flow, boundaries, num_layers, flat)
    with maybe_disable_local_tensor_mode():
        single = capture(template, args, kwargs)
    analysis = analyze(single, 1)
    single_flow = GraphFlow(single, find_loss_output(single, analysis))
    single_cuts = find_stage_cuts(single_flow, analysis, num_layers)
    if single_cuts.num_layers != num_layers:
        raise ValueError(
            f"the single-device graph has {single_cuts.num_layers} layers ({single_cuts.found}) where the "
            f"tensor-parallel one has {num_layers}: the pipeline cannot measure its stages; report this model "
            "to sptransform, or use tp=1"
        )
    return measure_layer_costs(single_flow, single_cuts.boundaries, num_layers, flat)


def first_microbatch(args: tuple, kwargs: dict, n_microbatches: int) -> tuple[tuple, dict, int]:
    """The first of ``n_microbatches`` slices along dim 0 of every tensor input, and the batch size."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("pipeline parallelism splits tensor inputs into microbatches, and none was given: pass example_inputs=")
    batch = tensors[0].shape[0] if tensors[0].dim() else None
    for x in tensors:
        if x.dim() == 0 or x.shape[0] != batch:
            raise ValueError(
                f"every tensor input is split into microbatches along dim 0, so all need the same batch size; "
                f"got shapes {[tuple(t.shape) for t in tensors]}: pass per-sample inputs with the batch first"
            )
    if batch % n_microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"a batch of {batch} cannot be split into n_microbatches={n_microbatches} equal microbatches: "
            f"use n_microbatches in {set(divisors)}, or a batch that is a multiple of {n_microbatches}"
        )
    size = batch // n_microbatches
    sliced = [x[:size] if isinstance(x, torch.Tensor) else x for x in leaves]
    mb_args, mb_kwargs = pytree.tree_unflatten(sliced, spec)
    return mb_args, mb_kwargs, batch
def resplit_pipeline(graph: ParallelGraph, plan: PipelinePlan) -> PipelinePlan:
    """``graph`` (the model captured again, in another train/eval mode) cut at ``plan``'s stage
    starts. Stages keep their layers, ranks and parameters; costs are not measured again."""
    captured = graph.captured
    analysis = graph.model_analysis()
    flow = GraphFlow(captured, find_loss_output(captured, analysis))
    cuts = find_stage_cuts(flow, analysis, plan.options.num_stages)
    if cuts.num_layers != plan.num_layers:
        raise ValueError(
            f"the model captured in its other train/eval mode has {cuts.num_layers} layers ({cuts.found}), not "
            f"{plan.num_layers}: a pipeline needs one layer structure in both modes"
        )
    boundaries = cuts.boundaries
    stages = split_graph(flow, [boundaries[s - 1] for s in plan.starts[1:]], plan.num_layers)
    for old, new in zip(plan.stages, stages):
        extra = set(new.state_names) - set(old.state_names)
        if extra:
            raise ValueError(
                f"in its other train/eval mode, pipeline stage {new.index} reads {sorted(extra)}, which the stage "
                "was not given when the pipeline was built: build the pipeline in the mode you train in"
            )
    return replace(plan, boundaries=boundaries, stages=stages)
