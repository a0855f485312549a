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

It is a ``runtime.core.ModuleCore``, like ``ParallelModule`` (the original's submodule tree,
names, state dict and input checks), composed with this rank's stage runtimes and their
schedule. It follows the original's train/eval modes: the stages of another
mode combination are the model captured again in that mode and cut at the same stage
starts (same layers, parameters and ranks), with their own torch schedule, built on the
first ``step`` in that mode. ``step`` checks its batch before the schedule runs any
collective (``runtime.checks``; fingerprints are gathered over the tensor-parallel then
the pipeline group). ``pm.rng`` holds every rank's generator state; ``to(dtype)`` is
refused with what to do instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dataclasses import dataclass

from sptransform.capture import input_signature
from sptransform.graph.plan import ParallelGraph
from sptransform.options import ParallelOptions, PipelineOptions
from sptransform.pipeline.plan import PipelinePlan, first_microbatch
from sptransform.runtime.checks import check_call, check_vocab, leaf_names, vocab_checks
from sptransform.runtime.core import Agreement, ModuleCore
from sptransform.runtime.params import get_by_path
from sptransform.pipeline.schedule import fully_stored, schedule_spec
from sptransform.pipeline.stage import StageModule, _FreeingStage, _Stage
from sptransform.torch_internals import functorch_config, pytree


def _loss_dtype(plan: PipelinePlan) -> torch.dtype:
    """The dtype of the loss the last stage returns, read from its graph (every rank holds every
    stage's graph): what a rank that does not compute the loss receives it in."""
    output = plan.stages[-1].gm.graph.find_nodes(op="output")[0]
    value = next((leaf.meta.get("val") for leaf in pytree.tree_leaves(output.args[0]) if isinstance(leaf, fx.Node)), None)
    return value.dtype if isinstance(value, torch.Tensor) else torch.get_default_dtype()


class _MicrobatchMean:
    """``loss_fn`` of the schedule: the last stage already returns the loss; dividing by the
    number of microbatches makes the accumulated gradients those of the batch mean."""

    def __init__(self, n_microbatches: int):
        self.n = n_microbatches

    def __call__(self, output, target):
        return output / self.n


@dataclass
class _Run:
    """What runs a step in one train/eval mode combination: the stage graphs and their schedule."""

    plan: PipelinePlan
    stage_modules: list[StageModule]
    stages: list
    schedule: object


class PipelinedModule(ModuleCore):
    def __init__(self, model: nn.Module, *, factory, options: ParallelOptions, pipeline: PipelineOptions,
                 mesh: DeviceMesh, example_args: tuple, example_kwargs: dict,
                 param_mesh: DeviceMesh | None = None, full_mesh: DeviceMesh | None = None):
        """``factory``: a ``transform.GraphFactory`` for the ``tp`` sub-mesh (builds the graph of
        one microbatch, splits it, compiles stages under ``recompute``; owns the dropout generators).
        ``mesh``: this data-parallel replica's ``(pp, tp)`` mesh; with data parallelism,
        ``param_mesh`` the ``(dp, tp)`` mesh parameters live on and ``full_mesh`` the whole
        ``(dp, pp, tp)`` one (every rank creates every replica's tied-gradient groups)."""
        super().__init__(model, factory=factory, options=options, tp_mesh=mesh["tp"], param_mesh=param_mesh)
        self._full_mesh = full_mesh
        self._pipeline, self._mesh = pipeline, mesh
        pp_mesh = mesh["pp"]
        self._pp_group = pp_mesh.get_group()
        self._pp_rank, tp_rank = pp_mesh.get_local_rank(), self._tp_mesh.get_local_rank()
        kwargs = {**self._call_defaults, **example_kwargs}
        check_call(example_args, kwargs, self._call_defaults, example=True)
        self._signature = input_signature(example_args, kwargs)
        mb_args, mb_kwargs, self._batch = first_microbatch(example_args, kwargs, pipeline.n_microbatches)
        self._microbatch = (mb_args, mb_kwargs)
        graph = factory.build(mb_args, mb_kwargs, modes=self._modes())
        self._graph = graph
        self.pipeline_plan: PipelinePlan = factory.plan_pipeline(graph, mb_args, mb_kwargs, pipeline)
        self._placements = graph.plan.placements if graph.plan is not None else {}
        self._data_parallel = graph.data_parallel
        self._rank = torch.tensor(tp_rank, device=self._device)
        captured = graph.captured
        local = {name for stage in self.pipeline_plan.stages_of(self._pp_rank) for name in stage.state_names}
        self._register_state(model, only=local - set(captured.constants))  # a rank holds its stages' state
        self._state = {name: captured.constants[name] if name in captured.constants else get_by_path(self, name)
                       for name in sorted(local, key=captured.state_names.index)}
        self._fixed = {i: x for i, x in enumerate(pytree.tree_leaves((tuple(mb_args), dict(mb_kwargs))))
                       if not isinstance(x, torch.Tensor)}
        self._runs = {self._mode_key(): self._make_run(self.pipeline_plan)}
        self._tied_groups = self._tied_gradient_groups()
        self._target = torch.zeros(pipeline.n_microbatches, device=self._device)
        self._loss_dtype = _loss_dtype(self.pipeline_plan)
        self._state_dtypes = self._dtypes()
        self._vocab_checks = vocab_checks(captured.gm, len(captured.state_names), captured.num_user_inputs,
                                          graph.plan.vocab if graph.plan is not None else None)
        self._finish_state(mesh)

    # -- construction -------------------------------------------------------

    def _tied_gradient_groups(self) -> list[tuple[str, dist.ProcessGroup]]:
        """For each tied parameter held on several pipeline ranks, the group that sums its
        gradient (one per tp coordinate). Every rank creates every group, in one order."""
        plan = self.pipeline_plan
        # every data-parallel replica's (pp, tp) rank grid, this rank's first
        grids = [self._mesh.mesh] if self._full_mesh is None else list(self._full_mesh.mesh)
        mine_grid = 0 if self._full_mesh is None else self._full_mesh.get_local_rank("dp")
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
                    for d, grid in enumerate(grids):
                        for t in range(self._options.tp):
                            group = dist.new_group([int(grid[r, t]) for r in key])
                            if d == mine_grid and t == tp_rank and self._pp_rank in key:
                                groups[key] = group
            if self._pp_rank in key:
                mine.append((tied.name, groups[key]))
        return mine

    def _make_run(self, plan: PipelinePlan) -> _Run:
        """This rank's stage modules of ``plan`` and a torch schedule over them."""
        stored = fully_stored(self._pipeline)
        compile_stage = self._factory.compile if self._options.remat is not None else None
        zero3 = self._options.zero == 3
        modules = [StageModule(s, self._state, self._fixed, self._rank, compile_stage, stored[s.index], zero3=zero3)
                   for s in plan.stages_of(self._pp_rank)]
        spec = schedule_spec(self._pipeline.schedule)
        stage_class = _FreeingStage if spec.waits_each_send else _Stage
        stages = [
            stage_class(module, module.index, self._pipeline.num_stages, self._device, group=self._pp_group)
            for module in modules
        ]
        loss_fn = _MicrobatchMean(self._pipeline.n_microbatches)
        n = self._pipeline.n_microbatches
        if spec.multi:
            schedule = spec.torch_class(stages, n, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = spec.torch_class(stages[0], n, loss_fn=loss_fn, scale_grads=False)
        return _Run(plan, modules, stages, schedule)

    def _run_for_mode(self) -> _Run:
        """The stages of the current train/eval modes, captured and split on first use."""
        key = self._mode_key()
        run = self._runs.get(key)
        if run is None:
            mb_args, mb_kwargs = self._microbatch
            graph: ParallelGraph = self._factory.build(mb_args, mb_kwargs, modes=self._modes())
            if graph.plan is not None:
                captured = graph.captured
                read = {name for node, name in zip(captured.state_placeholders, captured.state_names) if node.users}
                for name in captured.param_names:
                    old, new = self._placements.get(name), graph.plan.placements.get(name)
                    # how a parameter this graph reads is stored (shard_whole) must agree too
                    stored = [(p.storage if p else None) if name in read else None for p in (old, new)]
                    if (old.spec if old else None) != (new.spec if new else None) or stored[0] != stored[1]:
                        raise ValueError(
                            f"in this train/eval mode parameter {name!r} would need another split "
                            f"({new.spec if new else None} instead of {old.spec if old else None}): build the pipeline "
                            "in the mode you train in"
                        )
            run = self._runs[key] = self._make_run(self._factory.split_like(graph, self.pipeline_plan))
        return run

    def _dtypes(self) -> tuple:
        return tuple((name, t.dtype, t.device) for name, t in
                     [*self.named_parameters(remove_duplicate=False), *self.named_buffers(remove_duplicate=False)])

    # -- running ------------------------------------------------------------

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one global batch over the pipeline; returns the batch's
        mean loss on every rank. Gradients accumulate into ``.grad`` as with ``loss.backward()``.
        Dropout acts when the module is training (``pm.train()`` / ``pm.eval()``)."""
        kwargs = {**self._call_defaults, **kwargs}
        run = self._prepare(args, kwargs)
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        named = {f"input_{i}": x for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        losses: list[torch.Tensor] = []
        # Zero-bubble schedules split a stage's backward with retain_graph, which AOTAutograd's
        # donated buffers forbid (recompute=); the graphs run eagerly, so donation saves nothing.
        with functorch_config.patch(donated_buffer=False):
            run.schedule.step(target=self._target, losses=losses, return_outputs=False, **named)
        self._sum_tied_gradients()
        if self._replicas is not None:  # a step runs its backward (what the replica check reports)
            self._replicas.backward_of = self._replicas.calls
        return self._broadcast_loss(losses)

    def _prepare(self, args: tuple, kwargs: dict) -> _Run:
        """The run of this call's modes after the local checks, then one fingerprint gathered over
        tensor- and pipeline-parallel ranks (``check_inputs``), before the schedule's first
        collective (``ModuleCore._checked``)."""
        return self._checked(args, kwargs, lambda: self._local_checks(args, kwargs))

    def _local_checks(self, args: tuple, kwargs: dict) -> _Run:
        if self._dtypes() != self._state_dtypes:
            raise ValueError(
                "the parameters' or buffers' dtypes or devices changed after parallelize (pm.to(...)): a pipelined "
                "module's stages are built for the dtypes it was made with; convert the original model first "
                "(model.to(dtype)) and parallelize it, or use pp=1, whose module follows .to(dtype)"
            )
        self._check_loaded()
        if input_signature(args, kwargs) != self._signature:
            raise ValueError(
                "step() got inputs of other shapes, types or structure than the example_inputs this pipeline "
                "was built for (shapes are fixed by the capture): pass example_inputs= shaped like your batches"
            )
        if self._vocab_checks:
            check_vocab(self._vocab_checks, pytree.tree_leaves((tuple(args), dict(kwargs))),
                        lambda: leaf_names(args, kwargs))
        return self._run_for_mode()

    def _agreement(self) -> Agreement | None:
        """With ``check_inputs``: over the tensor-parallel group, then the pipeline group; rank
        ``pp * tp + tp_rank`` named by its coordinates."""
        if not self._options.check_inputs:
            return None
        tp = self._options.tp
        this = self._pp_rank * tp + self._tp_mesh.get_local_rank()
        return Agreement([self._tp_mesh.get_group(), self._pp_group], False, this,
                         lambda r: f"(pp {r // tp}, tp {r % tp})")

    def _sum_tied_gradients(self) -> None:
        with torch.no_grad():
            for name, group in self._tied_groups:
                param = self.get_parameter(name)
                if param.grad is None:
                    param.grad = DTensor.from_local(torch.zeros_like(param.to_local()), param.device_mesh,
                                                    param.placements, run_check=False, shape=param.shape,
                                                    stride=param.stride())
                dist.all_reduce(param.grad.to_local(), group=group)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole pipeline. Torch's own, given this
        module's parameters, sees only this rank's stages, so each stage would scale its gradients
        by a norm of its own; here the norm is over every stage's gradients (on the ``(dp, tp)``
        mesh through DTensor, then over the pipeline ranks; a tied parameter held by several
        stages counted once), the same on every rank. Every gradient is scaled by
        ``min(1, max_norm / (norm + 1e-6))``, as torch does. Returns the total norm."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {max_norm!r}")
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type={norm_type}: use a p-norm with p > 0, or float('inf')")
        elsewhere = {t.name for t in self.pipeline_plan.tied if not t.colocated and self._pp_rank != t.ranks[0]}
        names: dict[nn.Parameter, set[str]] = {}  # a tied parameter has several names (wte, lm_head)
        for name, param in self.named_parameters(remove_duplicate=False):
            names.setdefault(param, set()).add(name)
        grads = [p.grad for p in names if p.grad is not None]
        counted = [p.grad for p, aliases in names.items() if p.grad is not None and not aliases & elsewhere]
        local = torch.nn.utils.get_total_norm(counted, norm_type) if counted else torch.zeros((), device=self._device)
        local = local.full_tensor() if isinstance(local, DTensor) else local
        infinite = norm_type == float("inf")
        combined = local.clone() if infinite else local.double() ** norm_type
        dist.all_reduce(combined, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=self._pp_group)
        total = (combined if infinite else combined ** (1.0 / norm_type)).to(local.dtype)
        scale = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale.to(grad.dtype))
        return total

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        last_rank = self.pipeline_plan.stage_rank[-1]
        if self._pp_rank == last_rank:
            loss = torch.stack([l.detach() for l in losses]).sum()
        else:  # the loss's dtype as the last stage's graph computes it (a float64 model's loss is float64)
            loss = torch.zeros((), dtype=self._loss_dtype, device=self._device)
        dist.broadcast(loss, src=dist.get_global_rank(self._pp_group, last_rank), group=self._pp_group)
        return loss

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined model runs whole training steps: call .step(*inputs, **kwargs), "
                        "which returns the loss, then optimizer.step()")

    # -- state and inspection -------------------------------------------------

    @property
    def stage_modules(self) -> list[StageModule]:
        """This rank's stages (of the current train/eval mode, once it has run)."""
        return list(self._runs.get(self._mode_key(), next(iter(self._runs.values()))).stage_modules)

    @property
    def _stages(self) -> list:
        return self._runs.get(self._mode_key(), next(iter(self._runs.values()))).stages

    def explain(self) -> str:
        from sptransform.pipeline.explain import explain_pipeline

        return explain_pipeline(self.pipeline_plan, self._options, self._pp_rank)


__all__ = ["PipelineOptions", "PipelinePlan", "PipelinedModule", "StageModule"]