"""``ParallelModule``: what ``parallelize`` returns.

It holds the original parameters as DTensors on the tensor-parallel mesh (only
this rank's shard is stored) under the original names, and runs, for each input
signature, a captured and transformed graph on the local shards. The pipeline of
passes is ``build_parallel_graph``, read top to bottom.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed._local_tensor import local_tensor_mode, maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from sptransform.graph.analysis import ModelAnalysis, analyze
from sptransform.api import ParallelOptions
from sptransform.runtime.collectives import _resolve
from sptransform.capture import CapturedGraph, FakeTemplate, capture, input_signature
from sptransform.runtime.ops import RankGenerators, register_generators
from sptransform.passes.dropout import shard_dropout
from sptransform.passes.grad_sync import bucket_replicated_grads
from sptransform.passes.sequence_parallel import sequence_parallel
from sptransform.passes.tensor_parallel import insert_tp_collectives, shard_linears
from sptransform.graph.plan import ParallelPlan, ParamPlacement
from sptransform.graph.sharding import DimShard


@dataclass
class ParallelGraph:
    captured: CapturedGraph
    analysis: ModelAnalysis | None
    plan: ParallelPlan | None
    remat: object = None
    """The AOTAutograd-compiled runner when ``recompute`` is not ``"none"`` (made on first call)."""

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm


def build_parallel_graph(
    template: FakeTemplate, args: tuple, kwargs: dict, options: ParallelOptions, group: str | None, generators: int
) -> ParallelGraph:
    """capture -> analyse -> tensor-parallel -> sequence-parallel (or f/f̄) -> dropout -> grad buckets."""
    with maybe_disable_local_tensor_mode():  # tracing sees one rank, never simulated ones
        captured = capture(template, args, kwargs)
    if options.tp == 1:
        return ParallelGraph(captured, None, None)  # nothing to split: the captured graph runs as is
    analysis = analyze(captured, options.tp)
    gm = captured.gm
    # A real rank's graph may be specialized on its rank; one serving simulated ranks may not.
    static_rank = None if local_tensor_mode() is not None else _resolve(group).rank()
    plan = shard_linears(gm, analysis, tp=options.tp, sp=options.sp, group=group, static_rank=static_rank)
    if options.sp:
        if analysis.seq_len is None:
            raise ValueError("sp=True needs an attention to find the sequence dim; none was found: pass sp=False")
        sequence_parallel(gm, plan, seq_len=analysis.seq_len)
    else:
        insert_tp_collectives(gm, plan)
    shard_dropout(gm, plan, mode=options.dropout_rng, generators=generators)
    bucket_replicated_grads(gm, plan, [(r.row.node, r.layer) for r in analysis.regions])
    return ParallelGraph(captured, analysis, plan)


def compile_with_remat(gm: fx.GraphModule, inputs: list, recompute, state_positions: Sequence[int]):
    """AOTAutograd over ``gm`` with the rematerialisation partition of ``recompute``.

    Non-tensor inputs (flags such as ``use_cache``) are baked in as constants first;
    the parameters/buffers (``gm``'s own index tables, then the inputs at
    ``state_positions``) are state, never activations. Returns a function of the
    tensor inputs, in order, that returns a tuple (also when ``gm`` returns one tensor)."""
    import copy

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from sptransform.measure.partitioned import state_count
    from sptransform.passes.remat import RematOptions, remat_partition

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
    policy, budget = (recompute, None) if isinstance(recompute, str) else ("budget", recompute)
    own = state_count(gm)  # AOTAutograd lifts gm's own parameters and buffers in front of the inputs
    state = list(range(own)) + [own + tensor_index[p] for p in state_positions if p in tensor_index]

    def compiler(graph: fx.GraphModule, _inputs):
        return make_boxed_func(graph.forward)

    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    return aot_module_simplified(
        gm, tensors, fw_compiler=compiler, bw_compiler=compiler,
        partition_fn=remat_partition(RematOptions(policy=policy, budget=budget), state_indices=state),
    )


def placement_of(spec: DimShard | None) -> object:
    """``DimShard`` -> DTensor placement (Shard, _StridedShard for k equal segments)."""
    if spec is None:
        return Replicate()
    if len(spec.segments) == 1:
        return Shard(spec.dim)
    lengths = {length for _, length in spec.segments}
    starts = [start for start, _ in spec.segments]
    if len(lengths) == 1 and starts == [i * next(iter(lengths)) for i in range(len(starts))]:
        return _StridedShard(spec.dim, split_factor=len(spec.segments))
    raise ValueError(
        f"a fused weight split into unequal segments {spec.segments} along dim {spec.dim} has no "
        "DTensor placement; split the fused projection into separate linears"
    )


class ParallelModule(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        *,
        options: ParallelOptions,
        mesh: DeviceMesh | None,
        example_args: tuple,
        example_kwargs: dict,
    ):
        super().__init__()
        self._options = options
        self._mesh = mesh
        self._group = mesh.get_group().group_name if mesh is not None else None
        self._device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        with maybe_disable_local_tensor_mode():
            self._template = FakeTemplate(model, self._device)
        self._call_defaults = _call_defaults(model)
        example_kwargs = {**self._call_defaults, **example_kwargs}
        seed = options.seed if options.seed is not None else torch.initial_seed()
        rank = None if mesh is None or _simulated() else mesh.get_local_rank()
        self._generators = register_generators(RankGenerators(seed, options.tp, rank))
        first = self._build(example_args, example_kwargs)
        self._placements = first.plan.placements if first.plan else {}
        self._graphs = {input_signature(example_args, example_kwargs): first}
        self._last = first
        self._register_state(model)
        self._rank = self._rank_tensor()
        self.train(model.training)

    # -- construction -------------------------------------------------------

    def _build(self, args: tuple, kwargs: dict) -> ParallelGraph:
        graph = build_parallel_graph(self._template, args, kwargs, self._options, self._group, self._generators)
        graph.gm.to(self._device)  # index tables the passes added live with the parameters
        return graph

    def _register_state(self, model: nn.Module) -> None:
        converted: dict[int, nn.Parameter] = {}
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) not in converted:
                # A tied parameter is planned under whichever of its names the graph used.
                planned = next((n for n in aliases[id(param)] if n in self._placements), name)
                converted[id(param)] = self._shard_parameter(planned, param)
            _set_by_path(self, name, converted[id(param)], kind="parameter")
        for module_name, module in model.named_modules(remove_duplicate=False):
            for buffer_name, buf in module._buffers.items():
                if buf is None:
                    continue
                name = f"{module_name}.{buffer_name}" if module_name else buffer_name
                if buf.device.type == "meta":
                    raise ValueError(
                        f"buffer {name!r} is on the meta device: only parameters can be left there "
                        "(their shards are allocated here); give buffers their values before parallelize"
                    )
                persistent = buffer_name not in module._non_persistent_buffers_set
                _set_by_path(self, name, buf, kind="buffer", persistent=persistent)

    def _shard_parameter(self, name: str, param: nn.Parameter) -> nn.Parameter:
        if self._mesh is None:
            return param
        placement = placement_of(self._placements.get(name, ParamPlacement(None, "replicated")).spec)
        if param.device.type == "meta":
            tp = self._options.tp

            def make(rank: int) -> torch.Tensor:
                shape = _local_shape(param.shape, placement, tp, rank)
                return torch.empty(shape, dtype=param.dtype, device=self._device)

            mode = local_tensor_mode()
            local = mode.rank_map(make) if mode is not None else make(self._mesh.get_local_rank())
            dtensor = DTensor.from_local(local, self._mesh, [placement], run_check=False, shape=param.shape, stride=param.stride())
        else:
            dtensor = self._distribute(param.detach(), placement)
        return nn.Parameter(dtensor, requires_grad=param.requires_grad)

    def _distribute(self, full: torch.Tensor, placement) -> DTensor:
        mode = local_tensor_mode()
        if mode is None:
            # Rank 0's values are the source of truth; a copy, so the user's module and
            # the parallel one never share storage.
            return distribute_tensor(full.clone(), self._mesh, [placement], src_data_rank=0)
        # Simulated ranks: each gets its own storage (a replicated LocalTensor built from one
        # plain tensor would alias it, and in-place optimizer steps would run once per rank).
        if isinstance(placement, Replicate):
            local = mode.rank_map(lambda r: full.clone())
            return DTensor.from_local(local, self._mesh, [placement], run_check=False)
        return distribute_tensor(full, self._mesh, [placement], src_data_rank=None)

    def _rank_tensor(self) -> torch.Tensor | None:
        if self._mesh is None:
            return None
        ranks = torch.arange(self._options.tp, device=self._device)
        return distribute_tensor(ranks, self._mesh, [Shard(0)], src_data_rank=None).to_local().reshape(())

    # -- running ------------------------------------------------------------

    def forward(self, *args, **kwargs):
        kwargs = {**self._call_defaults, **kwargs}
        key = input_signature(args, kwargs)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._build(args, kwargs)
            if graph.plan is not None and graph.plan.placements != self._placements:
                raise AssertionError("a new input shape changed parameter placement")
            self._graphs[key] = graph
        self._last = graph
        captured = graph.captured
        state = [self._local_state(name, captured) for name in captured.state_names]
        flat_inputs = pytree.tree_leaves((tuple(args), dict(kwargs)))
        extra = [self._rank] if graph.plan is not None else []
        inputs = [*state, *flat_inputs, *extra]
        if self._options.recompute == "none":
            outputs = captured.gm(*inputs)
        else:
            outputs = self._remat_runner(graph, inputs)(*[x for x in inputs if isinstance(x, torch.Tensor)])
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if graph.plan is not None:
            for index, (spec, size) in graph.plan.output_specs.items():
                outputs[index] = self._as_dtensor(outputs[index], spec, size)
        return pytree.tree_unflatten(outputs, captured.out_spec)

    def _remat_runner(self, graph: ParallelGraph, inputs: list):
        if graph.remat is None:
            if _simulated():
                raise ValueError(
                    f"recompute={self._options.recompute!r} needs real ranks: AOTAutograd cannot trace "
                    "LocalTensorMode's simulated ranks; use recompute='none' in simulation"
                )
            graph.remat = compile_with_remat(graph.gm, inputs, self._options.recompute,
                                              range(len(graph.captured.state_names)))
        return graph.remat

    def _local_state(self, name: str, captured: CapturedGraph) -> torch.Tensor:
        if name in captured.constants:
            return captured.constants[name]
        value = _get_by_path(self, name)
        return value.to_local() if isinstance(value, DTensor) else value

    def _as_dtensor(self, local: torch.Tensor, spec: DimShard, size: int) -> DTensor:
        shape = list(local.shape)
        shape[spec.dim] = size
        return DTensor.from_local(
            local, self._mesh, [Shard(spec.dim)], run_check=False, shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )

    # -- inspection ---------------------------------------------------------

    @property
    def code(self) -> str:
        """This rank's graph, as Python, with its collectives (the last signature run)."""
        return self._last.gm.code

    @property
    def plan(self) -> ParallelPlan | None:
        return self._last.plan

    def explain(self) -> str:
        from sptransform.runtime.explain import explain

        return explain(self._last, self._options)


def _call_defaults(model: nn.Module) -> dict:
    """Keyword inputs set unless the caller sets them: ``use_cache=False`` for models that
    take it (HF), since a KV cache of split heads is not something a training step returns."""
    parameters = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in parameters else {}


def _simulated() -> bool:
    return local_tensor_mode() is not None


def _local_shape(shape, placement, tp: int, rank: int) -> list[int]:
    """This rank's shard shape, with torch.chunk's rule for uneven splits (as DTensor)."""
    local = list(shape)
    if isinstance(placement, (Shard, _StridedShard)):
        size = shape[placement.dim]
        chunk = -(-size // tp)
        local[placement.dim] = max(0, min(chunk, size - rank * chunk))
    return local


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _set_by_path(root: nn.Module, path: str, value, *, kind: str, persistent: bool = True) -> None:
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if kind == "parameter":
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value, persistent=persistent)


def _get_by_path(root: nn.Module, path: str):
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        module = module._modules[part]
    return getattr(module, leaf)

