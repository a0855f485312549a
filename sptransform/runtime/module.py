"""``ParallelModule``: what ``parallelize`` returns.

It holds the original parameters as DTensors on the tensor-parallel mesh (only
this rank's shard is stored) under the original names, and runs, for each input
signature, a captured and transformed graph on the local shards. The graphs come
from a ``GraphFactory`` (``sptransform.transform``), handed in by ``parallelize``:
the runtime runs graphs and never imports a pass.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from sptransform.capture import CapturedGraph, input_signature
from sptransform.graph.analysis import analyze, find_loss_output
from sptransform.graph.plan import ParallelGraph, ParallelPlan, ParamPlacement
from sptransform.graph.sharding import DimShard
from sptransform.options import ParallelOptions
from sptransform.runtime.params import (
    call_defaults, contiguous_stride, device_of, get_by_path, placement_of, set_by_path, shard_parameter,
)
from sptransform.runtime.explain import explain
from sptransform.torch_internals import local_tensor_mode, pytree


class GraphFactory(Protocol):
    """Builds the parallel graph of an input signature and, with recompute, its partitioned runner."""

    def build(self, args: tuple, kwargs: dict) -> ParallelGraph: ...

    def compile(self, gm: fx.GraphModule, inputs: list, state_positions: Sequence[int]) -> Callable: ...


class ParallelModule(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        *,
        factory: GraphFactory,
        options: ParallelOptions,
        mesh: DeviceMesh | None,
        example_args: tuple,
        example_kwargs: dict,
    ):
        super().__init__()
        self._options = options
        self._mesh = mesh
        self._factory = factory
        self._device = device_of(model)
        self._call_defaults = call_defaults(model)
        example_kwargs = {**self._call_defaults, **example_kwargs}
        first = self._factory.build(example_args, example_kwargs)
        self._placements = first.plan.placements if first.plan else {}
        self._graphs = {input_signature(example_args, example_kwargs): first}
        self._last = first
        self._register_state(model)
        self._rank = self._rank_tensor()
        self.train(model.training)

    # -- construction -------------------------------------------------------

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
            set_by_path(self, name, converted[id(param)], kind="parameter")
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
                set_by_path(self, name, buf, kind="buffer", persistent=persistent)

    def _shard_parameter(self, name: str, param: nn.Parameter) -> nn.Parameter:
        if self._mesh is None:
            return param
        placement = placement_of(self._placements.get(name, ParamPlacement(None, "replicated")).storage)
        return shard_parameter(param, placement, self._mesh, self._device)

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
            graph = self._factory.build(args, kwargs)
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
        if graph.compiled is None:
            if local_tensor_mode() is not None:
                raise ValueError(
                    f"recompute={self._options.recompute!r} needs real ranks: AOTAutograd cannot trace "
                    "LocalTensorMode's simulated ranks; use recompute='none' in simulation"
                )
            graph.compiled = self._factory.compile(graph.gm, inputs, range(len(graph.captured.state_names)))
        return graph.compiled

    def _local_state(self, name: str, captured: CapturedGraph) -> torch.Tensor:
        if name in captured.constants:
            return captured.constants[name]
        value = get_by_path(self, name)
        return value.to_local() if isinstance(value, DTensor) else value

    def _as_dtensor(self, local: torch.Tensor, spec: DimShard, size: int) -> DTensor:
        shape = list(local.shape)
        shape[spec.dim] = size
        return DTensor.from_local(
            local, self._mesh, [Shard(spec.dim)], run_check=False, shape=torch.Size(shape),
            stride=contiguous_stride(shape),
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
        return explain(self._last, self._options)


class SteppedModule(ParallelModule):
    """``ParallelModule`` with ``step()``: pp=1, one forward and backward of the whole batch."""

    def step(self, *args, **kwargs) -> torch.Tensor:
        out = self(*args, **kwargs)
        graph = self._last
        analysis = graph.analysis or analyze(graph.captured, 1)
        loss_node = find_loss_output(graph.captured, analysis)
        outputs = list(graph.captured.gm.graph.find_nodes(op="output")[0].args[0])
        loss = pytree.tree_leaves(out)[outputs.index(loss_node)]
        loss.backward()
        return loss.detach()
