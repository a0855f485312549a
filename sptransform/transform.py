"""The driver: the one visible pass list, and the one AOTAutograd driver.

Every path (``parallelize``'s module, its pipeline stages, ``sptransform memory``, the
``sptransform`` torch.compile backend) runs the passes listed here, in this order:

    capture                      capture.capture                torch.export, fake parameters
    canonicalize                 passes.canonicalize            dead code out, row biases split off
    analyse                      graph.analysis                 linears, regions, head, loss -> seeds
    propagate placements         graph.propagate                every node: replicated / split / partial
    gradient reductions          graph.gradients                where gradients arrive partial
    tensor + sequence parallel   passes.tensor_parallel         local shapes, collectives, f, buckets
    dropout                      passes.dropout                 rank-aware masks
    [data parallel]              passes.data_parallel           dp > 1: gradient averaging / ZeRO-3 gathers
    [pipeline split]             pipeline.plan                  pp > 1: stages at layer boundaries
    [remat partition, compile]   passes.remat + aot_compile     recompute != "none": AOTAutograd, then
                                                                 inductor (compile="inductor") or eager
    [schedule collectives]       passes.overlap                 each partitioned graph (unless overlap=False):
                                                                 issue collectives early, wait late

Sequence parallelism is not a pass of its own: it is how the propagation reduces the partial
sums leaving a block (a reduce-scatter to the sequence split instead of an all-reduce).
``build_parallel_graph`` runs everything up to dropout; ``plan_pipeline`` the split; ``aot_compile`` is
the only call of AOTAutograd in sptransform (the parallel module, each pipeline stage, the
measurement drivers and the backend go through it). At DEBUG level (logger
``sptransform.transform``) each pass logs the graph's node counts by op before and after.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.analysis import analyze, constant_nodes, parameter_placements
from sptransform.graph.gradients import gradient_plan
from sptransform.graph.plan import ParallelGraph, ParallelPlan
from sptransform.graph.propagate import SequenceSplit, propagate
from sptransform.options import GRAPH_COMPILERS, GraphCompiler, ParallelOptions, PipelineOptions, RematOptions
from sptransform.passes.canonicalize import functional_copies, narrow_as_slice, remove_dead_code, repeat_grouped_kv, split_bias
from sptransform.passes.data_parallel import DataParallelPlan, data_parallel, zero_dim
from sptransform.passes.dropout import shard_dropout
from sptransform.passes.overlap import schedule_collectives
from sptransform.passes.remat import remat_partition
from sptransform.passes.tensor_parallel import add_rank_input, apply_placements
from sptransform.pipeline.plan import PipelinePlan
from sptransform.pipeline.plan import plan_pipeline as _plan_pipeline
from sptransform.pipeline.plan import resplit_pipeline
from sptransform.runtime.collectives import _resolve
from sptransform.runtime.rng import RankGenerators
from sptransform.torch_internals import (
    aot_module_simplified, inductor_graph_compilers, local_tensor_mode, make_boxed_func, maybe_disable_local_tensor_mode, pytree,
    stride_reporting,
)

log = logging.getLogger(__name__)


def _op_counts(gm: fx.GraphModule) -> Counter:
    return Counter(str(getattr(n.target, "__name__", n.target)) if n.op == "call_function" else n.op for n in gm.graph.nodes)


def _logged(name: str, gm: fx.GraphModule, run: Callable[[], object]):
    """Run one pass, logging node counts by op that changed (DEBUG)."""
    if not log.isEnabledFor(logging.DEBUG):
        return run()
    before = _op_counts(gm)
    result = run()
    after = _op_counts(gm)
    changed = {op: (before[op], after[op]) for op in sorted(set(before) | set(after)) if before[op] != after[op]}
    log.debug("%s: %d -> %d nodes; %s", name, sum(before.values()), sum(after.values()),
              ", ".join(f"{op} {a}->{b}" for op, (a, b) in changed.items()) or "no change")
    return result


def build_parallel_graph(
    template: FakeTemplate, args: tuple, kwargs: dict, options: ParallelOptions, group: str | None, generators: RankGenerators,
    dp_group: str | None = None, device_type: str = "cpu",
) -> ParallelGraph:
    """The pass list, top to bottom (see the module docstring). ``dp_group``: the data-parallel
    process group's name (``options.dp > 1``); ``device_type``: where the graph runs (whether its
    gradient buckets stay in flight, ``ParallelOptions.overlaps_buckets``)."""
    overlap = options.overlaps_buckets(device_type)
    with maybe_disable_local_tensor_mode():  # tracing sees one rank, never simulated ones
        captured = capture(template, args, kwargs)
    log.debug("capture: %d nodes", len(captured.gm.graph.nodes))
    if options.tp == 1:  # nothing to split: the captured graph runs as is, data parallelism aside
        graph = ParallelGraph(captured, None, None)
        if options.dp > 1:
            _add_data_parallel(graph, options, dp_group, {}, [], overlap)
        return graph
    gm, tp = captured.gm, options.tp
    _logged("remove_dead_code", gm, lambda: remove_dead_code(gm))
    _logged("functional_copies", gm, lambda: functional_copies(gm))
    _logged("narrow_as_slice", gm, lambda: narrow_as_slice(gm))
    _logged("repeat_grouped_kv", gm, lambda: repeat_grouped_kv(gm, tp=tp))
    analysis = analyze(captured, tp)
    if options.sp and analysis.seq_len is None:
        raise ValueError("sp=True needs an attention to find the sequence dim; none was found: pass sp=False")
    if options.sp and analysis.seq_len % tp:
        raise ValueError(
            f"sequence length {analysis.seq_len} is not divisible by tp={tp}; sequence parallelism splits "
            f"the sequence evenly: use a length that is a multiple of {tp}, or sp=False"
        )
    placements = parameter_placements(analysis, tp)
    _logged("split_bias", gm, lambda: [split_bias(gm, region.row.node) for region in analysis.regions])
    # A real rank's graph may be specialized on its rank; one serving simulated ranks may not.
    static_rank = None if local_tensor_mode() is not None else _resolve(group).rank()
    plan = ParallelPlan(tp=tp, sp=options.sp, group=group, rank=add_rank_input(gm), static_rank=static_rank,
                        placements=placements, seq_len=analysis.seq_len if options.sp else None,
                        overlap=overlap)
    if analysis.head is not None:
        plan.vocab = analysis.head.out_features
        plan.vocab_per_rank = -(-plan.vocab // tp)
    plan.notes.extend(analysis.notes)
    plan.linears = (sum(1 for lm in analysis.linears.values()
                        if placements.get(lm.weight_name) is not None and placements[lm.weight_name].spec is not None),
                    len(analysis.linears))
    state = dict(zip(captured.state_placeholders, captured.state_names))
    params = {node: name for node, name in state.items() if name in captured.param_names}
    seeds, cut_seeds = {}, {}
    for node, name in params.items():
        placement = placements.get(name)
        if placement is not None and placement.spec is not None:
            (cut_seeds if placement.stored_whole else seeds)[node] = placement.spec
    constant = constant_nodes(gm, set(state))
    sequence = SequenceSplit(analysis.seq_len) if options.sp else None
    propagation = propagate(gm, seeds, tp=tp, constant=constant, sequence=sequence, cut_seeds=cut_seeds)
    inputs = {n for n in captured.user_placeholders if isinstance(n.meta.get("val"), torch.Tensor)
              and n.meta["val"].is_floating_point()}
    gradients = gradient_plan(gm, propagation, params=set(params), constant=constant, inputs=inputs)
    plan.notes.extend(f"{n.name} runs whole on every rank: no rule splits it" for n in propagation.gathered_ops())
    layer_rows = [(r.row.node, r.layer) for r in analysis.regions]
    _logged("tensor_parallel", gm, lambda: apply_placements(gm, propagation, gradients, plan, params=params,
                                                           layer_rows=layer_rows))
    if options.dropout_rng == "reference" and captured.lost_draws:
        raise ValueError(
            f"the forward draws {captured.lost_draws} dropout mask(s) (or other random tensors) that no output "
            "reads, and capture, which had to functionalize the graph (in-place writes through views), erased "
            "them: every later dropout of the parallel model would draw from another point of the random "
            "stream than the single device's, so dropout_rng='reference' cannot reproduce its masks. Use "
            "dropout_rng='independent' (every rank still draws the same replicated masks), or compare in eval()"
        )
    _logged("dropout", gm, lambda: shard_dropout(gm, plan, mode=options.dropout_rng, generators=generators))
    graph = ParallelGraph(captured, analysis, plan)
    if options.dp > 1:
        _add_data_parallel(graph, options, dp_group, placements, layer_rows, overlap)
    return graph


def _add_data_parallel(graph: ParallelGraph, options: ParallelOptions, group: str | None, placements: dict,
                       layer_rows: list, overlap: bool) -> None:
    """[data parallel]: gradient averaging buckets, or ZeRO-3 gathers, after the tensor-parallel
    rewrite (``passes.data_parallel``); the plan records how each parameter is stored."""
    captured, gm = graph.captured, graph.gm
    state = dict(zip(captured.state_placeholders, captured.state_names))
    trainable = {node: name for node, name in state.items() if name in captured.param_names
                 and node.meta.get("val") is not None and node.meta["val"].requires_grad}
    dims, local_shapes = {}, {}
    for node, name in trainable.items():
        placement = placements.get(name)
        storage = placement.storage if placement is not None else None
        shape = list(node.meta["val"].shape)
        if storage is not None:
            if placement.padded_rows is not None:  # uneven over the tensor-parallel ranks: kept whole over dp
                dims[name] = None
                continue
            shape[storage.dim] = storage.local_size(options.tp)
        local_shapes[name] = tuple(shape)
        dims[name] = zero_dim(tuple(shape), storage.dim if storage is not None else None, options.dp) \
            if options.zero == 3 else None
    plan = DataParallelPlan(group=group, size=options.dp, zero=options.zero, dims=dims, local_shapes=local_shapes,
                            overlap=overlap)
    _logged("data_parallel", gm, lambda: data_parallel(gm, trainable, plan, layer_rows))
    graph.data_parallel = plan


def plan_pipeline(graph: ParallelGraph, template: FakeTemplate, args: tuple, kwargs: dict,
                  options: PipelineOptions) -> PipelinePlan:
    """[pipeline split]: layer boundaries, measured costs, balance, one graph per stage."""
    plan = _plan_pipeline(graph, template, args, kwargs, options)
    log.debug("pipeline split: %d layers into %d stages starting at layers %s",
              plan.num_layers, len(plan.stages), plan.starts)
    return plan


# ---------------------------------------------------------------------------
# the AOTAutograd driver


def eager_compiler(gm: fx.GraphModule, _example_inputs):
    """Run a partitioned forward or backward graph op by op (no code generation)."""
    return make_boxed_func(gm.forward)


def graph_compilers(compile: GraphCompiler, num_user_outputs: int, module: torch.nn.Module | None = None, *,
                    overlap: bool = True):
    """The forward and backward compilers AOTAutograd hands the partitioned graphs to:
    ``"eager"`` runs them op by op; ``"inductor"`` decomposes each with inductor's table and
    generates fused kernels (C++ on CPU, Triton on GPU). Either way the graphs are the
    partition's: inductor compiles them as given and does not partition again, keyed by rank
    in torch's on-disk caches (``rank_cache_tag``). With ``overlap``, each graph's
    collectives are first issued early and waited on late (``passes.overlap.schedule_collectives``)."""
    if compile == "eager":
        compilers = eager_compiler, eager_compiler
    elif compile == "inductor":
        compilers = inductor_graph_compilers(num_user_outputs, module if isinstance(module, fx.GraphModule) else None)
        compilers = tuple(_keyed_by_rank(c, rank_cache_tag()) for c in compilers)
    else:
        raise ValueError(f"compile={compile!r}: use one of {list(GRAPH_COMPILERS)}")
    return tuple(_scheduled(c) for c in compilers) if overlap else compilers


def rank_cache_tag() -> str:
    """``torch.compiler.config.cache_key_tag`` with this process's rank added
    (``"sptransform rank 3/8"``; unchanged without a process group of several ranks). The
    on-disk caches of torch's compile path (inductor's FX graph cache, AOTAutograd's cache,
    the autotuning cache) put the tag into their keys. The ranks of one machine share those
    caches (``TORCHINDUCTOR_CACHE_DIR``), and a real rank's graph may be specialised on its
    rank (``narrow_vocab``'s width is a constant of it). Today every such value is written
    into the graph's code, which the keys read; keyed by rank as well, a rank never loads what
    another compiled even where a future specialisation hides from the key; a rank's second
    run can still load its own. (torch 2.13's FX graph cache bypasses these partitioned graphs,
    seen on tp=2 GPT-2: the tag guards a torch that caches them.)"""
    tag = torch.compiler.config.cache_key_tag
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tag
    return f"{tag}|sptransform rank {dist.get_rank()}/{dist.get_world_size()}".lstrip("|")


def _keyed_by_rank(compiler, tag: str):
    """``compiler`` run with ``tag`` as the compile caches' key tag (``rank_cache_tag``): set
    for that one compile (AOTAutograd compiles the backward lazily, at the first backward)."""
    def compile_graph(gm: fx.GraphModule, example_inputs):
        with torch.compiler.config.patch(cache_key_tag=tag):
            return compiler(gm, example_inputs)
    return compile_graph


def _scheduled(compiler):
    """``compiler`` after the overlap pass [schedule collectives]."""
    def compile_graph(gm: fx.GraphModule, example_inputs):
        _logged("schedule_collectives", gm, lambda: schedule_collectives(gm))
        return compiler(gm, example_inputs)
    return compile_graph


def aot_compile(module: torch.nn.Module, tensor_inputs: Sequence[torch.Tensor], *, partition_fn,
                compile: GraphCompiler = "eager", overlap: bool = True) -> Callable:
    """The one AOTAutograd entry: ``module``'s joint graph, split by ``partition_fn``, with the
    forward and backward compiled by ``compile`` (``graph_compilers``). AOTAutograd lifts
    ``module``'s own parameters and buffers in front of ``tensor_inputs`` (``state_count``);
    ``overlap`` runs the overlap pass on both partitioned graphs. The joint graph is traced
    without decompositions (the partition reads the model's own ops); inductor decomposes each
    partitioned graph itself, and may lay a saved tensor out otherwise than the joint trace did:
    the backward is compiled for the strides the compiled forward reports (``stride_reporting``),
    as under ``torch.compile``."""
    fw_compiler, bw_compiler = graph_compilers(compile, _num_outputs(module), module, overlap=overlap)
    with stride_reporting(tensor_inputs):
        return aot_module_simplified(module, list(tensor_inputs), fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                     partition_fn=partition_fn)


def _num_outputs(module: torch.nn.Module) -> int:
    """How many outputs an FX module returns (1 for any other module: only read for output strides)."""
    if not isinstance(module, fx.GraphModule):
        return 1
    output = next(iter(module.graph.find_nodes(op="output")))
    return len(pytree.tree_leaves(output.args[0]))


def state_count(module: torch.nn.Module) -> int:
    """How many joint inputs AOTAutograd lifts from ``module`` (its parameters and buffers)."""
    return len(
        {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    )


def compile_with_remat(gm: fx.GraphModule, inputs: list, remat: RematOptions, state_positions: Sequence[int],
                       compile: GraphCompiler = "eager", overlap: bool = True):
    """AOTAutograd over a captured graph with the rematerialisation partition of ``remat``.

    Non-tensor inputs (flags such as ``use_cache``) are baked in as constants first;
    the parameters/buffers (``gm``'s own index tables, then the inputs at
    ``state_positions``) are state, never activations. Returns a function of the
    tensor inputs, in order, that returns a tuple (also when ``gm`` returns one tensor);
    ``compile`` chooses the forward/backward compiler (``graph_compilers``)."""
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensor_index: dict[int, int] = {}
    for position, (node, value) in enumerate(zip(placeholders, inputs)):
        if isinstance(value, torch.Tensor):
            tensor_index[position] = len(tensor_index)
        else:
            node.replace_all_uses_with(value) if node.users else None
            gm.graph.erase_node(node)
    output = next(iter(gm.graph.find_nodes(op="output")))
    if not isinstance(output.args[0], (tuple, list)):  # AOTAutograd wants tuple outputs
        output.args = ((output.args[0],),)
    gm.recompile()
    own = state_count(gm)
    state = list(range(own)) + [own + tensor_index[p] for p in state_positions if p in tensor_index]
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    return aot_compile(gm, tensors, partition_fn=remat_partition(remat, state_indices=state), compile=compile,
                       overlap=overlap)


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

    def build(self, args: tuple, kwargs: dict, *, modes: Mapping[str, bool] | None = None,
              dtypes: Mapping[str, torch.dtype] | None = None) -> ParallelGraph:
        """The parallel graph of ``args``/``kwargs``, captured with the template's submodules in
        ``modes`` (name -> training) and its parameters/buffers in ``dtypes`` (name -> dtype)."""
        if modes is not None:
            self.template.set_modes(modes)
        if dtypes is not None:
            with maybe_disable_local_tensor_mode():  # fake tensors of one rank, never simulated ones
                self.template.retype(dtypes)
        graph = build_parallel_graph(self.template, args, kwargs, self.options, self.group, self.generators,
                                     self.dp_group, self.device.type)
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
        return compile_with_remat(gm, inputs, remat, state_positions, compile=self.options.compile,
                                  overlap=self.options.overlap is not False)
