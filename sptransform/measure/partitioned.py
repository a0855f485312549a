"""Trace a module to its joint graph, partition it, and keep the graphs for measuring.

``partition_module(module, inputs, options=...)`` runs AOTAutograd with the
rematerialisation partition (or any torch partitioner, for comparison) and hands
back the joint, forward and backward graph modules. With fake inputs and a module
holding fake parameters nothing is allocated: this is how one layer of a 175B
model is measured on a laptop. ``module`` may be any ``nn.Module`` or forward FX
graph module, including one that holds functional collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from sptransform.passes.remat import (
    CutSolution,
    JointAnalysis,
    RematOptions,
    RematPlan,
    apply_plan,
    plan_remat,
    remat_partition,
    tag_forward,
)

from sptransform.graph.nodes import number_joint_nodes
from sptransform.measure.flops import FlopsReport, flops_report
from sptransform.torch_internals import (
    default_partition, functorch_config, inductor_decompositions, inductor_partition, statistics_decompositions,
    min_cut_rematerialization_partition,
)
from sptransform.compile_graphs import aot_compile, state_count
from sptransform.measure.memory import MemoryReport, memory_report


@dataclass
class Partitioned:
    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int
    state_indices: list[int]
    analysis: JointAnalysis | None = None
    plan: RematPlan | None = None
    """``None`` when a torch partitioner made the split."""
    compiled: Callable | None = None
    """Runs the partitioned graphs (with autograd) on real inputs: ``compiled(*inputs)``."""

    def memory(self) -> MemoryReport:
        notes = self.plan.notes if self.plan is not None else []
        return memory_report(
            self.forward, self.backward, num_fwd_outputs=self.num_fwd_outputs,
            state_indices=self.state_indices, notes=notes,
        )

    def flops(self) -> FlopsReport:
        return flops_report(self.joint, self.forward, self.backward)

    def replan(self, options: RematOptions | None = None, *, solution: CutSolution | None = None) -> "Partitioned":
        """The same joint graph partitioned again, with other options or a given cut (no new trace).
        ``compiled`` is ``None`` on the result: it is for measuring."""
        if self.analysis is None:
            raise ValueError("replan needs a graph partitioned by sptransform (options=), not by torch")
        if solution is not None:
            plan = RematPlan("budget", solution)
        else:
            plan = plan_remat(self.analysis, options)
        fw, bw = apply_plan(self.analysis, plan)
        return replace(self, forward=fw, backward=bw, plan=plan, compiled=None)


class _TupleOutput(nn.Module):
    """AOTAutograd wants a tuple out; models return a tensor or (logits, loss)."""

    def __init__(self, module: nn.Module, select: Callable | None):
        super().__init__()
        self.module, self.select = module, select

    def forward(self, *args):
        out = self.module(*args)
        if self.select is not None:
            out = self.select(out)
        return out if isinstance(out, tuple) else (out,)


TORCH_PARTITIONERS = {
    "torch-default": default_partition,
    "torch-mincut": min_cut_rematerialization_partition,
    "torch-inductor": inductor_partition,
}
"""Torch's partitioners, for comparison. ``"torch-inductor"`` is what ``torch.compile(model)`` does:
the joint graph traced with inductor's decompositions, inductor's joint-graph passes, then the
min cut; the other two partition sptransform's joint graph (the model's own ops)."""


def partition_module(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    options: RematOptions | None = None,
    torch_partitioner: str | None = None,
    select_output: Callable | None = None,
    activation_memory_budget: float | None = None,
    state_inputs: Sequence[int] = (),
) -> Partitioned:
    """Partition ``module(*example_inputs)``'s joint graph and return the graphs.

    Exactly one of ``options`` (sptransform's pass) or ``torch_partitioner`` (one of
    ``TORCH_PARTITIONERS``, for comparison; ``activation_memory_budget`` sets torch's
    knapsack budget for ``"torch-mincut"`` and ``"torch-inductor"``). ``select_output`` picks what to
    differentiate from the module's output (e.g. the loss of ``(logits, loss)``).
    ``state_inputs``: positions in ``example_inputs`` that hold parameters or buffers
    (a captured graph takes its state as inputs); the module's own parameters and
    buffers always count as state."""
    if (options is None) == (torch_partitioner is None):
        raise ValueError("pass exactly one of options= (sptransform) or torch_partitioner=")
    wrapped = _TupleOutput(module, select_output)
    own = state_count(wrapped)  # AOTAutograd lifts these in front of the inputs
    state_indices = list(range(own)) + [own + i for i in state_inputs]
    captured: dict = {}

    def keep(analysis, plan, fw, bw):
        captured.update(analysis=analysis, plan=plan)

    if options is not None:
        inner = remat_partition(options, state_indices=state_indices, on_partition=keep)
    else:
        inner = _torch_partition(torch_partitioner, activation_memory_budget)

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        captured.update(joint=joint, num_fwd_outputs=num_fwd_outputs)
        fw, bw = inner(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        captured.update(forward=fw, backward=bw)
        return fw, bw

    # the joint graph inductor compiles: torch.compile's, or ours as compile="inductor" traces it
    decompositions = inductor_decompositions() if torch_partitioner == "torch-inductor" else statistics_decompositions()
    compiled = aot_compile(wrapped, example_inputs, partition_fn=partition, decompositions=decompositions)
    if "backward" not in captured:
        raise ValueError("nothing requires grad: the module has no backward to partition")
    return Partitioned(
        joint=captured["joint"],
        forward=captured["forward"],
        backward=captured["backward"],
        num_fwd_outputs=captured["num_fwd_outputs"],
        state_indices=state_indices,
        analysis=captured.get("analysis"),
        plan=captured.get("plan"),
        compiled=compiled,
    )


def _torch_partition(name: str, budget: float | None) -> Callable:
    if name not in TORCH_PARTITIONERS:
        raise ValueError(f"unknown torch partitioner {name!r}; use one of {sorted(TORCH_PARTITIONERS)}")
    partitioner = TORCH_PARTITIONERS[name]

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        number_joint_nodes(joint.graph, joint_inputs)  # so the report can pair forward and backward copies
        tag_forward(joint, num_fwd_outputs=num_fwd_outputs)
        if budget is None:
            return partitioner(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        with functorch_config.patch(activation_memory_budget=budget):
            return partitioner(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    return partition
