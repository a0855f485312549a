"""The driver: the one visible pass list (``PASSES``), and the one AOTAutograd driver.

Every path (``parallelize``'s module, its pipeline stages, ``sptransform memory``, the
``sptransform`` torch.compile backend) captures the model (``capture.capture``: torch.export,
fake parameters), then runs ``PASSES`` top to bottom (``build_parallel_graph``):

    remove_dead_code ... repeat_grouped_kv   passes.canonicalize     canonical forms (tp > 1)
    analyse                                  graph.analysis          linears, regions, head, loss -> placements
                                             (+ passes.unfuse)       a projection left whole whose output is taken
                                                                     apart: one linear per piece, if that splits one
    split_bias                               passes.canonicalize     row biases added after the partial sum
    parallel_plan                            graph.plan              the plan, the tp_rank input
    propagate                                graph.propagate         every node: replicated / split / partial
                                             (+ graph.strided_storage) rows read whole beside split ones: stored in
                                                                     equal segments, if that moves nothing more
    gradient_reductions                      graph.gradients         where gradients arrive partial
    tensor_parallel                          passes.tensor_parallel  local shapes, collectives, f, buckets
    dropout                                  passes.dropout          rank-aware masks
    analyse_layers                           graph.analysis          tp = 1, dp > 1: layers, head, loss (reads only)
    expert_parallel                          passes.expert_parallel  ep > 1: experts split, tokens exchanged
    data_parallel                            passes.data_parallel    dp > 1: gradient averaging / ZeRO gathers
    token_weighting                          passes.token_weighting  dp > 1, dp_loss="tokens": token-mean losses
                                                                     weighted by each replica's token count

Each entry is a ``passes.base.Pass``: a function ``(gm, build) -> PassResult``, the ``Build``
fields and ``node.meta`` keys it requires and adds, and a predicate of the options saying
whether it runs (``passes.base`` checks the contract). Later, outside this list:

    [pipeline split]             pipeline.plan                  pp > 1: stages at layer boundaries
    [remat partition, compile]   passes.remat + compile_graphs  recompute != "none": AOTAutograd (the
                                                                 partition runs ``passes.remat.JOINT_PASSES``
                                                                 on the joint graph), then inductor
                                                                 (compile="inductor") or eager
    [schedule collectives]       passes.overlap                 each partitioned graph (unless overlap=False):
                                                                 issue collectives early, wait late

Sequence parallelism is not a pass of its own: it is how the propagation reduces the partial
sums leaving a block (a reduce-scatter to the sequence split instead of an all-reduce).
``plan_pipeline`` runs the split; ``compile_graphs.aot_compile`` is the only call of AOTAutograd in
sptransform (the parallel module, each pipeline stage, the measurement drivers and the backend
go through it). At DEBUG level (logger ``sptransform.passes``) each pass logs the graph's node
counts by op overload that it changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from sptransform.capture import CapturedGraph, Entry, FakeTemplate, capture
from sptransform.compile_graphs import compile_with_remat
from sptransform.logs import logger
from sptransform.graph.analysis import analyze, constant_nodes, parameter_placements
from sptransform.graph.findings import ModelAnalysis
from sptransform.graph.lookups import constant_lookup_problems
from sptransform.graph.fingerprint import GraphFingerprint, fingerprint
from sptransform.graph.gradients import GradientPlan, gradient_plan
from sptransform.graph.nodes import data_dependent, describe, shape_of
from sptransform.graph.placement import DimShard
from sptransform.graph.plan import ParallelGraph, ParallelPlan, ParamPlacement
from sptransform.graph.propagate import Propagation, SequenceSplit, move_kind, propagate
from sptransform.graph.strided_storage import strided_placements, whole_runs
from sptransform.graph.rules import ShardingError
from sptransform.graph.read_split import gathering, split_parameters
from sptransform.options import ParallelOptions, PipelineOptions
from sptransform.passes.base import Pass, PassResult, run_passes
from sptransform.passes.canonicalize import (
    functional_copies, narrow_as_slice, remove_dead_code, repeat_grouped_kv, sizes_as_arguments, split_bias,
    written_norms,
)
from sptransform.passes.data_parallel import DataParallelPlan, data_parallel, zero_dim
from sptransform.passes.dropout import shard_dropout
from sptransform.passes.expert_parallel import ExpertGroups, ExpertParallelPlan, expert_parallel, tensor_parallel_dims
from sptransform.graph.experts import data_nodes, find_expert_regions, is_bmm_seed
from sptransform.passes.token_weighting import weight_by_token_counts
from sptransform.passes.unfuse import unfused_analysis
from sptransform.passes.shard_whole import shard_whole, stored_split, whole_parameters
from sptransform.passes.tensor_parallel import add_rank_input, apply_placements
from sptransform.pipeline.plan import PipelinePlan
from sptransform.pipeline.plan import plan_pipeline as _plan_pipeline
from sptransform.pipeline.plan import resplit_pipeline
from sptransform.runtime.collectives import _resolve
from sptransform.runtime.explain import collective_counts
from sptransform.runtime.rng import RankGenerators
from sptransform.torch_internals import (
    local_tensor_mode, maybe_disable_local_tensor_mode,
)

log = logger(__name__)


@dataclass
class Build:
    """One build's record. The first fields are the caller's; the others are ``None`` until the
    pass that ``adds`` them has run (``passes.base.run_passes`` checks the order)."""

    captured: CapturedGraph
    options: ParallelOptions
    group: str | None
    """The tensor-parallel process group's name."""
    dp_group: str | None
    """The data-parallel process group's name (``options.dp > 1``)."""
    generators: RankGenerators
    """The module's dropout generators (the dropout pass's ops are their bound methods)."""
    overlap: bool
    """Whether gradient buckets stay in flight (``ParallelOptions.overlaps_buckets``)."""
    experts: ExpertGroups | None = None
    """The expert-parallel groups (``options.ep > 1``)."""
    entry: Entry | None = None
    """Another forward of the module being built (``capture.Entry``): which inputs are stored split
    as their readers read them, which outputs stay split."""
    analysis: ModelAnalysis | None = None
    single_device_analysis: ModelAnalysis | None = None
    """At tp=1 with dp > 1: the captured graph's analysis, for its layers (``build_parallel_graph``)."""
    placements: dict[str, ParamPlacement] | None = None
    plan: ParallelPlan | None = None
    params: dict[fx.Node, str] | None = None
    """Parameter placeholders -> FQN."""
    constant: set[fx.Node] | None = None
    """Nodes computed from parameters, buffers and constants only."""
    propagation: Propagation | None = None
    gradients: GradientPlan | None = None
    expert_parallel: ExpertParallelPlan | None = None
    data_parallel: DataParallelPlan | None = None

    def layer_rows(self) -> list[tuple[fx.Node, int]]:
        """(row-parallel linear, its layer) of every region: the gradient buckets' layers."""
        analysis = self.analysis if self.analysis is not None else self.single_device_analysis
        return [(lm.node, r.layer) for r in analysis.regions for lm in r.rows] if analysis is not None else []


def _tensor_parallel(build: Build) -> bool:
    return build.options.tp > 1


def _data_parallel(build: Build) -> bool:
    return build.options.dp > 1


def _token_weighted(build: Build) -> bool:
    return build.options.dp > 1 and build.options.dp_loss == "tokens"


def _expert_parallel(build: Build) -> bool:
    return build.options.ep > 1


def _data_parallel_alone(build: Build) -> bool:
    return build.options.tp == 1 and build.options.dp > 1


def _analyse_layers(gm: fx.GraphModule, build: Build) -> PassResult:
    """At tp=1 no pass analyses the graph, and the data-parallel pass puts its buckets between the
    parameters and the linears reading them, where the analysis no longer finds a parameter
    operand (hence no head and no loss): analyse the graph before it (the passes edit its nodes in
    place, so what it finds stays in the graph) for what later reads the loss output (pipeline
    stages, microbatched steps), and for the layers the data-parallel buckets follow (a bucket
    by size could straddle two pipeline stages). Reads the graph only."""
    build.single_device_analysis = analyze(build.captured, 1)
    return PassResult(gm, False)


def _changed(gm: fx.GraphModule, count: int) -> PassResult:
    return PassResult(gm, count > 0)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes]


def _analyse(gm: fx.GraphModule, build: Build) -> PassResult:
    """Linears, regions, head and loss (``graph.analysis``); the parameters' placements."""
    tp, sp = build.options.tp, build.options.sp
    analysis = analyze(build.captured, tp, _kept_outputs(build))
    unfused = unfused_analysis(build.captured, analysis, tp, _kept_outputs(build))  # pieces as linears of their own
    if unfused is not None:
        gm, analysis = unfused
    if sp and analysis.seq_len is None:
        raise ValueError("sp=True needs an attention or a short convolution over the sequence to find the sequence "
                         "dim; none was found: pass sp=False")
    if sp and analysis.seq_len % tp:
        raise ValueError(
            f"sequence length {analysis.seq_len} is not divisible by tp={tp}; sequence parallelism splits "
            f"the sequence evenly: use a length that is a multiple of {tp}, or sp=False"
        )
    build.analysis, build.placements = analysis, parameter_placements(analysis, tp)
    return PassResult(gm, unfused is not None)


def _kept_outputs(build: Build) -> set[fx.Node]:
    """The output nodes the entry returns split (``Entry.split_outputs``): a node returned at
    several positions only if every one of them is (one placement per node reaches the output).
    Both the region walk (they may read a block's split tensors) and the propagation (they are
    not gathered) read this one set."""
    if build.entry is None:
        return set()
    flat = list(build.captured.gm.graph.find_nodes(op="output")[0].args[0])
    return {value for value in flat if isinstance(value, fx.Node)
            and all(i in build.entry.split_outputs for i, other in enumerate(flat) if other is value)}


def _split_bias(gm: fx.GraphModule, build: Build) -> PassResult:
    for region in build.analysis.regions:
        for row in region.rows:
            split_bias(gm, row.node)
    return PassResult(gm, bool(build.analysis.regions))


def _parallel_plan(gm: fx.GraphModule, build: Build) -> PassResult:
    """The plan the rewrite fills, with the ``tp_rank`` input it reads."""
    options, analysis, placements, captured = build.options, build.analysis, build.placements, build.captured
    tp = options.tp
    # A real rank's graph may be specialized on its rank; one serving simulated ranks may not.
    static_rank = None if local_tensor_mode() is not None else _resolve(build.group).rank()
    plan = ParallelPlan(tp=tp, sp=options.sp, group=build.group, rank=add_rank_input(gm), static_rank=static_rank,
                        placements=placements, seq_len=analysis.seq_len if options.sp else None,
                        overlap=build.overlap)
    if analysis.head is not None:
        plan.vocab = analysis.head.out_features
        plan.vocab_per_rank = -(-plan.vocab // tp)
    plan.notes.extend(analysis.notes)
    plan.linears = _split_linears(analysis, placements)
    state = dict(zip(captured.state_placeholders, captured.state_names))
    build.plan = plan
    build.params = {node: name for node, name in state.items() if name in captured.param_names}
    return PassResult(gm, True)


def _split_linears(analysis: ModelAnalysis, placements: Mapping[str, ParamPlacement]) -> tuple[int, int]:
    """(linears whose weight is split, linears)."""
    return (sum(1 for lm in analysis.linears.values()
                if placements.get(lm.weight_name) is not None and placements[lm.weight_name].spec is not None),
            len(analysis.linears))


def _propagate(gm: fx.GraphModule, build: Build) -> PassResult:
    """Every node's placement, from the parameters' (``graph.propagate``)."""
    changed = bool(build.analysis.read_whole_rows) and whole_runs(gm, build.params, build.analysis) > 0
    build.constant = constant_nodes(gm, set(build.captured.state_placeholders))
    kept = _kept_outputs(build)
    seeds, cut_seeds = _seeds(build.params, build.placements)

    def run(seeds: dict) -> Propagation:
        sequence = SequenceSplit(build.analysis.seq_len) if build.options.sp else None
        return propagate(gm, seeds, tp=build.options.tp, constant=build.constant, sequence=sequence,
                         cut_seeds=cut_seeds, keep_outputs=kept)

    build.propagation = run(seeds)
    strided = strided_placements(build.analysis, build.placements, build.options.tp)
    if strided is not None:  # fused weights with rows read whole stored split, if nothing else moves more
        strided_seeds, strided_cuts = _seeds(build.params, strided)
        sequence = SequenceSplit(build.analysis.seq_len) if build.options.sp else None
        try:
            trial = propagate(gm, strided_seeds, tp=build.options.tp, constant=build.constant, sequence=sequence,
                              cut_seeds=strided_cuts, keep_outputs=kept)
        except ShardingError:
            trial = None
        exempt = {u for node, name in build.params.items() if name in build.analysis.read_whole_rows for u in node.users}
        if trial is not None and _moves_no_more(trial, build.propagation, exempt):
            build.placements.clear()  # (the plan's placements are this dict)
            build.placements.update(strided)
            seeds, cut_seeds = strided_seeds, strided_cuts
            build.propagation = trial
    split_inputs = _split_input_seeds(build)
    if split_inputs:  # stored as read: what the first propagation cut locally is now given split
        build.propagation = run({**seeds, **split_inputs})
        users = build.captured.user_placeholders
        build.plan.input_specs.update({users.index(node): spec for node, spec in split_inputs.items()})
    if build.options.ep == 1:  # (expert parallelism places the experts' parameters itself)
        _store_read_splits(build, lambda more: run({**seeds, **split_inputs, **more}))
    return PassResult(gm, changed)


def _seeds(params: dict[fx.Node, str], placements: Mapping[str, ParamPlacement]) -> tuple[dict, dict]:
    """(seeds, cut seeds) of the propagation: each split parameter's placeholder -> its split, in
    the second map when it is stored whole and cut in the graph."""
    seeds, cut_seeds = {}, {}
    for node, name in params.items():
        placement = placements.get(name)
        if placement is not None and placement.spec is not None:
            (cut_seeds if placement.stored_whole else seeds)[node] = placement.spec
    return seeds, cut_seeds


def _moves_no_more(trial: Propagation, base: Propagation, exempt: set[fx.Node]) -> bool:
    """Whether ``trial`` moves no more tensors of any kind, and no more bytes of any kind, than
    ``base``, edges from ``exempt`` (the slices of rows read whole, which ``trial`` gathers) aside."""
    def moves(prop: Propagation) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for node, _, have, want in prop.changes():
            kind = move_kind(have, want)
            if node not in exempt and kind != "cut":
                count, size = out.get(kind, (0, 0))
                value = node.meta.get("val")
                out[kind] = (count + 1, size + (value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0))
        return out

    theirs = moves(base)
    return all(n <= theirs.get(kind, (0, 0))[0] and size <= theirs.get(kind, (0, 0))[1]
               for kind, (n, size) in moves(trial).items())


def _store_read_splits(build: Build, run: Callable[[dict], Propagation]) -> None:
    """Replicated parameters that every reader cuts to one even split are stored so
    (``graph.read_split``); a seed whose split makes a reader gather is dropped and the rest tried
    again."""
    untied = {node: name for node, name in build.params.items() if name not in build.captured.tied}
    found = split_parameters(untied, build.propagation, build.constant, build.options.tp)
    for _ in range(3):
        if not found:
            return
        trial = run(found)
        bad = gathering(trial, found, build.constant)
        if not bad:
            build.propagation = trial
            for node, spec in found.items():
                build.placements[build.params[node]] = ParamPlacement(spec, "split as every reader reads it")
            build.plan.linears = _split_linears(build.analysis, build.placements)
            return
        found = {node: spec for node, spec in found.items() if node not in bad}


def _split_input_seeds(build: Build) -> dict[fx.Node, DimShard]:
    """The entry's split inputs that every reader reads in one even split (``Shard``) after a
    propagation that held them whole: each is stored that way instead, so no rank holds the rest
    (a KV cache read by heads). One read whole, or in two splits, stays whole."""
    if build.entry is None or not build.entry.split_inputs:
        return {}
    users = build.captured.user_placeholders[: build.captured.num_user_inputs]
    found = {}
    for index in build.entry.split_inputs:
        node = users[index]
        reads = {build.propagation.reads[user][node] for user in node.users if node in build.propagation.reads.get(user, {})}
        if len(reads) != 1:
            continue
        (spec,) = reads
        if isinstance(spec, DimShard) and spec.segments == ((0, shape_of(node)[spec.dim]),):
            found[node] = spec
    return found


def _gradient_reductions(gm: fx.GraphModule, build: Build) -> PassResult:
    """Where gradients arrive partial (``graph.gradients``)."""
    inputs = {n for n in build.captured.user_placeholders if isinstance(n.meta.get("val"), torch.Tensor)
              and n.meta["val"].is_floating_point()}
    build.gradients = gradient_plan(gm, build.propagation, params=set(build.params), constant=build.constant,
                                    inputs=inputs, through_gathers=build.options.ep == 1)
    build.plan.notes.extend(f"{n.name} runs whole on every rank: no rule splits it"
                            for n in build.propagation.gathered_ops())
    build.plan.notes.extend(build.propagation.notes.values())
    routing = build.propagation.routing_ops()
    if routing:
        build.plan.notes.append(
            f"{len(routing)} ops whose shapes depend on the data (token routing: nonzero, boolean masks, "
            f".tolist() of counts) run whole on every rank on all the tokens, any parameter they read replicated "
            f"(ops that only read routed rows are split along their other dims where a rule splits them): "
            + ", ".join(n.name for n in routing[:6]) + (", ..." if len(routing) > 6 else ""))
    return PassResult(gm, False)


def _apply_placements(gm: fx.GraphModule, build: Build) -> PassResult:
    gm = apply_placements(gm, build.propagation, build.gradients, build.plan, params=build.params,
                          layer_rows=build.layer_rows())
    return PassResult(gm, True)


def _dropout(gm: fx.GraphModule, build: Build) -> PassResult:
    options, captured = build.options, build.captured
    if options.dropout_rng == "reference" and captured.lost_draws:
        raise ValueError(
            f"the forward draws {captured.lost_draws} dropout mask(s) (or other random tensors) that no output "
            "reads, and capture, which had to functionalize the graph (in-place writes through views), erased "
            "them: every later dropout of the parallel model would draw from another point of the random "
            "stream than the single device's, so dropout_rng='reference' cannot reproduce its masks. Use "
            "dropout_rng='independent' (every rank still draws the same replicated masks), or compare in eval()"
        )
    before = _targets(gm)
    gm = shard_dropout(gm, build.plan, mode=options.dropout_rng, generators=build.generators)
    return PassResult(gm, _targets(gm) != before)


def _add_data_parallel(gm: fx.GraphModule, build: Build) -> PassResult:
    """Gradient averaging buckets, or ZeRO gathers (``passes.data_parallel``), after the
    tensor-parallel rewrite when there is one (its placements give the local shapes)."""
    options, captured = build.options, build.captured
    placements = build.placements or {}
    state = dict(zip(captured.state_placeholders, captured.state_names))
    trainable = {node: name for node, name in state.items() if name in captured.param_names
                 and node.meta.get("val") is not None and node.meta["val"].requires_grad}
    dims, local_shapes = {}, {}
    for node, name in trainable.items():
        placement = placements.get(name)
        storage = placement.storage if placement is not None else None
        if storage is not None and placement.padded_rows is not None:  # uneven over the tp ranks: kept whole over dp
            dims[name] = None
            continue
        shape = list(node.meta["val"].shape)
        split: tuple[int, ...] = ()
        if storage is not None:
            shape[storage.dim] = storage.local_size(options.tp)
            split = (storage.dim,)
        if build.expert_parallel is not None and name in build.expert_parallel.experts:
            # this rank's experts, in pieces over the dp / ep ranks holding the same ones
            shape[0] //= options.ep
            local_shapes[name] = tuple(shape)
            replicas = options.dp // options.ep
            dims[name] = zero_dim(tuple(shape), (0, *split), replicas) if options.zero >= 1 and replicas > 1 else None
            continue
        local_shapes[name] = tuple(shape)
        dims[name] = zero_dim(tuple(shape), split, options.dp) if options.zero >= 1 else None
    experts = build.expert_parallel
    build.data_parallel = DataParallelPlan(group=build.dp_group, size=options.dp, zero=options.zero, dims=dims,
                                           local_shapes=local_shapes, overlap=build.overlap,
                                           expert_group=build.experts.replicas if experts is not None else None,
                                           experts=frozenset(experts.experts) if experts is not None else frozenset(),
                                           ep=options.ep)
    return PassResult(data_parallel(gm, trainable, build.data_parallel, build.layer_rows()), True)


def _split_experts(gm: fx.GraphModule, build: Build) -> PassResult:
    """Routed experts split over the expert-parallel ranks (``passes.expert_parallel``); the
    regions come from dataflow (``graph.experts``). Every problem is raised at once."""
    captured, groups, ep = build.captured, build.experts, build.options.ep
    state = dict(zip(captured.state_placeholders, captured.state_names))
    params = {node: name for node, name in state.items() if name in captured.param_names}
    regions, problems = find_expert_regions(gm, params, data_nodes(gm, captured.user_placeholders),
                                           emitted=tensor_parallel_dims)
    # every expert on every token (a matmul batched over them: shared experts stacked, say) is dense
    # compute; experts that ep does not divide are left whole there, as without ep, not refused
    dense = [r for r in regions if all(is_bmm_seed(seed) for seed in r.seeds)
             and any(shape_of(param)[0] % ep for param in r.seeds.values())]
    regions = [r for r in regions if r not in dense]
    experts: dict[str, int] = {}
    for region in regions:
        for param in [*region.seeds.values(), *region.padded]:
            experts[params[param]] = shape_of(param)[0]
    problems += [f"{name} has {count} experts, which ep={ep} does not divide" for name, count in experts.items()
                 if count % ep]
    if not regions and dense:
        problems.append("the only experts found are applied to every token by a batched matmul and ep=" + str(ep)
                        + " does not divide their counts (" + ", ".join(sorted(
                            f"{params[p]}: {shape_of(p)[0]}" for r in dense for p in r.seeds.values())) + "): use ep=1")
    if not regions and not problems:
        problems.append(
            "no expert weights gathered by routing indices (w[idx], transformers' experts_implementation="
            "'batched_mm'), read by a grouped matmul with offsets (its default 'grouped_mm') or by a matmul batched "
            "over the experts (bmm(x [E, T, K], w [E, K, N]), or an einsum 'etk,ekn->etn': every expert on every "
            "token) were found; experts applied another way (a loop over experts, an einsum that sums over them) are "
            "not split by ep yet: use ep=1 "
            "(tp splits experts read by grouped_mm or bmm, or run in a loop on the rows routed to them, by their "
            "hidden dims)")
    if problems:
        raise ValueError(f"ep={ep} cannot split the experts of this model: " + "\n  ".join(problems))
    build.expert_parallel = ExpertParallelPlan(group=groups.group, size=ep, rank=groups.rank, experts=experts)
    return PassResult(expert_parallel(gm, regions, params, build.expert_parallel), True)


def _shard_whole(gm: fx.GraphModule, build: Build) -> PassResult:
    """Parameters split in the graph that no DTensor placement stores split (always), and with
    ``shard_whole`` what the tensor-parallel rewrite keeps whole: stored in 1/tp pieces and
    gathered where a layer reads them (``passes.shard_whole``); the placements record the
    storage split."""
    experts = build.expert_parallel
    found = whole_parameters(build.params, build.placements, build.options.tp,
                             skip=frozenset(experts.experts) if experts is not None else frozenset(),
                             computed_whole=build.options.shard_whole)
    for node, dim in found.items():
        name = build.params[node]
        build.placements[name] = stored_split(build.placements.get(name), dim, shape_of(node)[dim])
    gm = shard_whole(gm, found, group=build.group, tp=build.options.tp, rank=build.plan.rank,
                     layer_rows=build.layer_rows())
    return PassResult(gm, bool(found))


def _weight_tokens(gm: fx.GraphModule, build: Build) -> int:
    """How many token-mean loss outputs ``passes.token_weighting`` weighted."""
    before = _targets(gm)
    weight_by_token_counts(gm, group=build.dp_group, size=build.options.dp)
    return len(_targets(gm)) - len(before)


# The pass list, run top to bottom on the captured graph. ``requires``/``adds`` name ``Build``
# fields and ``node.meta`` keys (``passes.base``); ``enabled`` says for which options a pass runs.
PASSES: list[Pass] = [
    Pass("remove_dead_code", lambda gm, b: _changed(gm, remove_dead_code(gm)), enabled=_tensor_parallel),
    # every tp: the graph runs under autograd (tp=1 with dp or pp too), and copy has no formula
    Pass("functional_copies", lambda gm, b: _changed(gm, functional_copies(gm))),
    Pass("narrow_as_slice", lambda gm, b: _changed(gm, narrow_as_slice(gm)), enabled=_tensor_parallel),
    Pass("sizes_as_arguments", lambda gm, b: _changed(gm, sizes_as_arguments(gm)), enabled=_tensor_parallel),
    Pass("written_norms", lambda gm, b: _changed(gm, written_norms(gm)), enabled=_tensor_parallel),
    Pass("repeat_grouped_kv", lambda gm, b: _changed(gm, repeat_grouped_kv(gm, tp=b.options.tp)),
         enabled=_tensor_parallel),
    Pass("analyse", _analyse, adds=("analysis", "placements"), enabled=_tensor_parallel),
    Pass("split_bias", _split_bias, requires=("analysis",), enabled=_tensor_parallel),
    Pass("parallel_plan", _parallel_plan, requires=("analysis", "placements"), adds=("plan", "params"),
         enabled=_tensor_parallel),
    Pass("propagate", _propagate, requires=("analysis", "placements", "params"), adds=("constant", "propagation"),
         enabled=_tensor_parallel),
    Pass("gradient_reductions", _gradient_reductions, requires=("propagation", "constant", "params", "plan"),
         adds=("gradients",), enabled=_tensor_parallel),
    Pass("tensor_parallel", _apply_placements, requires=("analysis", "propagation", "gradients", "plan", "params"),
         adds=("sptransform_spec",), enabled=_tensor_parallel),
    Pass("dropout", _dropout, requires=("plan", "sptransform_spec", "val"), enabled=_tensor_parallel),
    Pass("analyse_layers", _analyse_layers, adds=("single_device_analysis",), enabled=_data_parallel_alone),
    Pass("expert_parallel", _split_experts, requires=("val",), adds=("expert_parallel",), enabled=_expert_parallel),
    Pass("shard_whole", _shard_whole, requires=("plan", "params"), enabled=_tensor_parallel),
    Pass("data_parallel", _add_data_parallel, requires=("val",), adds=("data_parallel",), enabled=_data_parallel),
    Pass("token_weighting", lambda gm, b: _changed(gm, _weight_tokens(gm, b)), requires=("val",),
         enabled=_token_weighted),
]


def build_parallel_graph(
    template: FakeTemplate, args: tuple, kwargs: dict, options: ParallelOptions, group: str | None, generators: RankGenerators,
    dp_group: str | None = None, device_type: str = "cpu", entry: Entry | None = None,
    experts: ExpertGroups | None = None, on_capture: Callable[[GraphFingerprint], None] | None = None,
) -> ParallelGraph:
    """Capture, then ``PASSES`` in order. ``dp_group``: the data-parallel process group's name
    (``options.dp > 1``); ``device_type``: where the graph runs (whether its gradient buckets
    stay in flight, ``ParallelOptions.overlaps_buckets``). At tp=1 the captured graph runs as
    is, data parallelism aside: no analysis, no plan. ``entry``: capture another forward of the
    module (``capture.Entry``), with its own ``sp``. ``on_capture``: called with the captured graph's
    fingerprint before any pass runs (the ranks compare theirs there, before a pass may refuse on
    some rank only)."""
    start = time.perf_counter()
    if entry is not None and entry.sp is not None:
        options = replace(options, sp=entry.sp)
    with maybe_disable_local_tensor_mode():  # tracing sees one rank, never simulated ones
        captured = capture(template, args, kwargs, entry)
        captured_fingerprint = fingerprint(captured.gm)
    if on_capture is not None:
        on_capture(captured_fingerprint)
    with maybe_disable_local_tensor_mode():
        # evaluated as plain tensors of one rank, too
        problems = constant_lookup_problems(captured.gm, dict(zip(captured.state_placeholders, captured.state_names)))
    captured_s = time.perf_counter() - start
    routed = [n for n in captured.gm.graph.nodes if data_dependent(n)]
    if routed and options.remat is not None:
        # AOTAutograd's partition re-traces the graph with fake tensors of no shape environment,
        # where ``nonzero`` raises DynamicOutputShapeException (found on real ranks).
        raise ValueError(
            f"recompute={options.recompute!r}: the model's forward has shapes that depend on the data "
            f"({len(routed)} ops, first {describe(routed[0])}), which the recompute partition cannot trace yet: "
            "use recompute='none' (tp, sp and dp run such graphs, the routing whole on every rank)")
    if problems:  # one device raises IndexError('index out of range in self') inside the model
        raise IndexError(
            "these inputs make the model index past the end of a table: " + "; ".join(problems) + ". On one "
            "device the model raises IndexError('index out of range in self') here; pass shorter inputs "
            "(a sequence no longer than the table's rows)")
    log.info("captured %s: %d graph nodes, %d parameters and buffers, in %.1f s", type(template.module).__name__,
             len(captured.gm.graph.nodes), len(captured.state_names), captured_s)
    build = Build(captured, options, group, dp_group, generators, overlap=options.overlaps_buckets(device_type),
                  entry=entry, experts=experts)
    captured.gm = run_passes(PASSES, captured.gm, build)
    graph = ParallelGraph(captured, build.analysis, build.plan, _single_device_analysis=build.single_device_analysis)
    graph.data_parallel = build.data_parallel
    graph.expert_parallel = build.expert_parallel
    graph.fingerprint = captured_fingerprint
    log.info("transformed for tp=%d sp=%s dp=%d: %s; collectives per step: %s; in %.1f s", options.tp, options.sp,
             options.dp, _linears_split(build.plan), _collectives(captured.gm) or "none",
             time.perf_counter() - start - captured_s)
    return graph


def _linears_split(plan: ParallelPlan | None) -> str:
    if plan is None:
        return "the captured graph runs unchanged"
    split, total = plan.linears
    return f"{split} of {total} linears split"


def _collectives(gm: fx.GraphModule) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in sorted(collective_counts(gm).items()))


def plan_pipeline(graph: ParallelGraph, template: FakeTemplate, args: tuple, kwargs: dict,
                  options: PipelineOptions) -> PipelinePlan:
    """[pipeline split]: layer boundaries, measured costs, balance, one graph per stage."""
    plan = _plan_pipeline(graph, template, args, kwargs, options)
    log.debug("pipeline split: %d layers into %d stages starting at layers %s",
              plan.num_layers, len(plan.stages), plan.starts)
    return plan


# ---------------------------------------------------------------------------
# the AOTAutograd driver


@dataclass
class GraphFactory:
    """What a parallel module asks for when it meets a new input signature, mode or dtype: the
    transformed graph (``build``), the pipeline split, and, with ``recompute``, the
    AOTAutograd-partitioned runner (``compile``). Handing this to the runtime keeps
    ``runtime/`` free of passes. It owns the module's dropout generators (graphs call their
    methods, so they are freed with the module and its graphs)."""

    template: FakeTemplate
    options: ParallelOptions
    group: str | None
    generators: RankGenerators
    device: torch.device
    dp_group: str | None = None
    """The data-parallel process group's name (``options.dp > 1``)."""
    experts: ExpertGroups | None = None
    """The expert-parallel groups (``options.ep > 1``)."""
    check_first: Callable[[GraphFingerprint], None] | None = None
    """Called with the first graph's fingerprint as captured, before any pass runs on it:
    ``parallelize`` compares it across the ranks (``runtime.rendezvous.agree_on_graph``)."""
    _split_experts: frozenset[str] | None = None
    """The expert parameters the first graph split (stored split by the module): every later graph
    must split the same ones, or it would read a rank's experts as all of them."""

    def build(self, args: tuple, kwargs: dict, *, modes: Mapping[str, bool] | None = None,
              dtypes: Mapping[str, torch.dtype] | None = None, entry: Entry | None = None) -> ParallelGraph:
        """The parallel graph of ``args``/``kwargs``, captured with the template's submodules in
        ``modes`` (name -> training) and its parameters/buffers in ``dtypes`` (name -> dtype);
        ``entry``: of another forward of the module (``capture.Entry``)."""
        if modes is not None:
            self.template.set_modes(modes)
        if dtypes is not None:
            with maybe_disable_local_tensor_mode():  # fake tensors of one rank, never simulated ones
                self.template.retype(dtypes)
        check, self.check_first = self.check_first, None  # the first build only
        graph = build_parallel_graph(self.template, args, kwargs, self.options, self.group, self.generators,
                                     self.dp_group, self.device.type, entry, self.experts, on_capture=check)
        if self.experts is not None:
            split = graph.data_parallel.experts
            if self._split_experts is None:
                self._split_experts = split
            elif split != self._split_experts:
                raise ValueError(
                    f"this call's graph splits the experts {sorted(split)} over the ep ranks, but the module stores "
                    f"{sorted(self._split_experts)} split (found on its first call): the routing differs between the two "
                    "calls (another mode or input?); call with inputs like the example's")
        graph.gm.to(self.device)  # index tables the passes added live with the parameters
        return graph

    def plan_pipeline(self, graph: ParallelGraph, args: tuple, kwargs: dict, pipeline: PipelineOptions) -> PipelinePlan:
        return plan_pipeline(graph, self.template, args, kwargs, pipeline)

    def split_like(self, graph: ParallelGraph, plan: PipelinePlan) -> PipelinePlan:
        """``graph`` (the same model captured in another train/eval mode) cut at ``plan``'s stage
        starts: the same layers, parameters and ranks per stage, no new cost measurement."""
        return resplit_pipeline(graph, plan)

    def compile(self, gm: fx.GraphModule, inputs: list, state_positions: Sequence[int]) -> Callable:
        remat = self.options.remat
        if remat is None:
            raise ValueError("compile() partitions by a recompute policy, and recompute='none'")
        start = time.perf_counter()
        runner = compile_with_remat(gm, inputs, remat, state_positions, compile=self.options.compile,
                                    overlap=self.options.overlap is not False)
        log.info("partitioned (recompute=%r) and compiled (%s) in %.1f s", self.options.recompute,
                 self.options.compile, time.perf_counter() - start)
        return runner
