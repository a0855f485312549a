"""Pipeline parallelism: the tensor/sequence-parallel graph cut into stages, run by torch's schedules.

``parallelize(model, tp=2, pp=2, schedule="1f1b", n_microbatches=4, example_inputs=batch)``
returns a ``PipelinedModule`` on a 2-D mesh ``pp x tp``. Its journey:

    capture -> analyse -> tensor-parallel -> sequence-parallel -> dropout -> grad buckets
            (``transform.build_parallel_graph``, on one microbatch)
    -> find layer boundaries -> measure layer costs -> balance -> split      (``transform.plan_pipeline``)
    -> one ``PipelineStage`` per stage of this rank, one torch schedule      (``PipelinedModule``)

The graph and the split come from the ``GraphFactory`` that ``parallelize`` hands in.
Each stage is a ``StageModule`` (``pipeline.stage``): its graph runs on the local shards of the
parameters it reads, which stay DTensors on the ``tp`` sub-mesh under their
original names; a rank holds only its stages' parameters. Every stage receives
the user's (microbatch) inputs as keyword inputs ``input_<i>`` and the previous
stage's activations as positional ones; the last stage returns the loss, which
the schedule's ``loss_fn`` divides by the number of microbatches (so gradients
are those of the batch mean, and the schedule does not rescale them).

Tied weights (an embedding and a head sharing one parameter) are never silently
untied: when the schedule places the first and last stage on one rank (V-shaped,
``schedule="zbv"``) both stages read the same ``nn.Parameter`` and its gradient
accumulates; otherwise each holding rank keeps a copy and ``step`` sums their
gradients every step (copies start equal and receive equal updates).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from sptransform.capture import CapturedGraph, input_signature
from sptransform.options import ParallelOptions, PipelineOptions
from sptransform.pipeline.plan import PipelinePlan, first_microbatch
from sptransform.runtime.params import call_defaults, device_of, placement_of, set_by_path, shard_parameter
from sptransform.pipeline.schedule import fully_stored, schedule_spec
from sptransform.pipeline.stage import StageModule, _FreeingStage, _Stage
from sptransform.torch_internals import functorch_config, pytree


class _MicrobatchMean:
    """``loss_fn`` of the schedule: the last stage already returns the loss; dividing by the
    number of microbatches makes the accumulated gradients those of the batch mean."""

    def __init__(self, n_microbatches: int):
        self.n = n_microbatches

    def __call__(self, output, target):
        return output / self.n


class PipelinedModule(nn.Module):
    def __init__(self, model: nn.Module, *, factory, options: ParallelOptions, pipeline: PipelineOptions,
                 mesh: DeviceMesh, example_args: tuple, example_kwargs: dict):
        """``factory``: a ``transform.GraphFactory`` for the ``tp`` sub-mesh (builds the graph of
        one microbatch, splits it, compiles stages under ``recompute``)."""
        super().__init__()
        self._options, self._pipeline, self._mesh = options, pipeline, mesh
        tp_mesh, pp_mesh = mesh["tp"], mesh["pp"]
        self._tp_mesh, self._pp_group = tp_mesh, pp_mesh.get_group()
        self._pp_rank, tp_rank = pp_mesh.get_local_rank(), tp_mesh.get_local_rank()
        self._device = device_of(model)
        self._call_defaults = call_defaults(model)
        kwargs = {**self._call_defaults, **example_kwargs}
        self._signature = input_signature(example_args, kwargs)
        mb_args, mb_kwargs, self._batch = first_microbatch(example_args, kwargs, pipeline.n_microbatches)
        graph = factory.build(mb_args, mb_kwargs)
        self._graph = graph
        self.pipeline_plan: PipelinePlan = factory.plan_pipeline(graph, mb_args, mb_kwargs, pipeline)
        self._placements = graph.plan.placements if graph.plan is not None else {}
        self._rank = torch.tensor(tp_rank, device=self._device)
        local = self.pipeline_plan.stages_of(self._pp_rank)
        state = self._register_state(model, {n for s in local for n in s.state_names}, graph.captured)
        fixed = {i: x for i, x in enumerate(pytree.tree_leaves((tuple(mb_args), dict(mb_kwargs))))
                 if not isinstance(x, torch.Tensor)}
        stored = fully_stored(pipeline)
        compile_stage = factory.compile if options.remat is not None else None
        self._stage_modules = [StageModule(s, state, fixed, self._rank, compile_stage, stored[s.index])
                               for s in local]
        self._tied_groups = self._tied_gradient_groups()
        self._schedule = self._build_schedule()
        self._target = torch.zeros(pipeline.n_microbatches, device=self._device)
        self.train(model.training)

    # -- construction -------------------------------------------------------

    def _register_state(self, model: nn.Module, names: set[str], captured: CapturedGraph) -> dict[str, torch.Tensor]:
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        state: dict[str, torch.Tensor] = {}
        for name in sorted(names, key=captured.state_names.index):
            if name in captured.constants:
                state[name] = captured.constants[name]
            elif name in params:
                param = self._shard_parameter(name, params[name])
                for alias in aliases[id(params[name])]:
                    set_by_path(self, alias, param, kind="parameter")
                    state[alias] = param
            else:
                set_by_path(self, name, buffers[name], kind="buffer")
                state[name] = buffers[name]
        return state

    def _shard_parameter(self, name: str, param: nn.Parameter) -> nn.Parameter:
        placement = self._placements.get(name)
        placement = placement_of(placement.storage) if placement is not None else Replicate()
        return shard_parameter(param, placement, self._tp_mesh, self._device)

    def _tied_gradient_groups(self) -> list[tuple[str, dist.ProcessGroup]]:
        """For each tied parameter held on several pipeline ranks, the group that sums its
        gradient (one per tp coordinate). Every rank creates every group, in one order."""
        plan, mesh = self.pipeline_plan, self._mesh.mesh
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        mine = []
        tp_rank = self._tp_mesh.get_local_rank()
        for tied in plan.tied:
            if tied.colocated:
                continue
            key = tuple(tied.ranks)
            if key not in groups:
                groups[key] = None
                if list(key) == list(range(self._pipeline.pp)):
                    groups[key] = self._pp_group
                else:
                    for t in range(self._options.tp):
                        group = dist.new_group([int(mesh[r, t]) for r in key])
                        if t == tp_rank and self._pp_rank in key:
                            groups[key] = group
            if self._pp_rank in key:
                mine.append((tied.name, groups[key]))
        return mine

    def _build_schedule(self):
        spec = schedule_spec(self._pipeline.schedule)
        stage_class = _FreeingStage if spec.waits_each_send else _Stage
        stages = [
            stage_class(module, module.index, self._pipeline.num_stages, self._device, group=self._pp_group)
            for module in self._stage_modules
        ]
        self._stages = stages
        loss_fn = _MicrobatchMean(self._pipeline.n_microbatches)
        n = self._pipeline.n_microbatches
        if spec.multi:
            return spec.torch_class(stages, n, loss_fn=loss_fn, scale_grads=False)
        return spec.torch_class(stages[0], n, loss_fn=loss_fn, scale_grads=False)

    # -- running ------------------------------------------------------------

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch over the pipeline; returns the batch's
        mean loss on every rank. Gradients accumulate into ``.grad`` as with ``loss.backward()``."""
        kwargs = {**self._call_defaults, **kwargs}
        if input_signature(args, kwargs) != self._signature:
            raise ValueError(
                "step() got inputs of other shapes, types or structure than the example_inputs this pipeline "
                "was built for (shapes are fixed by the capture): pass example_inputs= shaped like your batches"
            )
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        named = {f"input_{i}": x for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        losses: list[torch.Tensor] = []
        # Zero-bubble schedules split a stage's backward with retain_graph, which AOTAutograd's
        # donated buffers forbid (recompute=); the graphs run eagerly, so donation saves nothing.
        with functorch_config.patch(donated_buffer=False):
            self._schedule.step(target=self._target, losses=losses, return_outputs=False, **named)
        self._sum_tied_gradients()
        return self._broadcast_loss(losses)

    def _sum_tied_gradients(self) -> None:
        with torch.no_grad():
            for name, group in self._tied_groups:
                param = self.get_parameter(name)
                if param.grad is None:
                    param.grad = DTensor.from_local(torch.zeros_like(param.to_local()), self._tp_mesh,
                                                    param.placements, run_check=False, shape=param.shape,
                                                    stride=param.stride())
                dist.all_reduce(param.grad.to_local(), group=group)

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        last_rank = self.pipeline_plan.stage_rank[-1]
        if self._pp_rank == last_rank:
            loss = torch.stack([l.detach() for l in losses]).sum()
        else:
            loss = torch.zeros((), device=self._device)
        dist.broadcast(loss, src=dist.get_global_rank(self._pp_group, last_rank), group=self._pp_group)
        return loss

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined model runs whole training steps: call .step(*inputs, **kwargs), "
                        "which returns the loss, then optimizer.step()")

    # -- inspection ---------------------------------------------------------

    @property
    def stage_modules(self) -> list[StageModule]:
        """This rank's stages."""
        return list(self._stage_modules)

    def explain(self) -> str:
        from sptransform.pipeline.explain import explain_pipeline

        return explain_pipeline(self.pipeline_plan, self._options, self._pp_rank)


__all__ = ["PipelineOptions", "PipelinePlan", "PipelinedModule", "StageModule"]