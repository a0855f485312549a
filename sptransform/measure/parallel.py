"""One rank's forward graph of a tensor-(and sequence-)parallel model, built without hardware.

``rank_graph(model, args, tp=8, sp=True)``, inside ``fake_process_group(tp)``, joins a fake process group of ``tp``
ranks (this process is rank 0; nothing is sent), runs sptransform's parallel
pipeline (``transform.build_parallel_graph``: capture, analyse, tensor-parallel,
sequence-parallel, dropout) on a fake copy of ``model``, and returns rank 0's
forward graph with fake inputs of the local shapes: parameters are shards,
collectives are ``_c10d_functional`` ops. ``partition_module`` then partitions and
measures it like any other graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from torch.distributed.device_mesh import init_device_mesh

from sptransform.capture import FakeTemplate
from sptransform.options import ParallelOptions
from sptransform.runtime.rng import RankGenerators
from sptransform.torch_internals import FakeStore, detect_fake_mode
from sptransform.transform import build_parallel_graph


@dataclass
class RankGraph:
    gm: fx.GraphModule
    inputs: list[torch.Tensor]
    """Fake tensors for every placeholder: local parameter shards, user inputs, the rank."""
    state_inputs: list[int]
    """Positions of parameters and buffers among ``inputs``."""
    notes: list[str]
    generators: RankGenerators | None = None
    """The dropout generators whose methods the graph's dropout ops are."""


@contextlib.contextmanager
def fake_process_group(world: int):
    """A fake process group of ``world`` ranks for the body (this process is rank 0; nothing is
    sent), destroyed on exit when this call made it: measuring leaves no group behind."""
    made = not (dist.is_initialized() and dist.get_backend() == "fake" and dist.get_world_size() == world)
    group = join_fake_group(world)
    try:
        yield group
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def join_fake_group(world: int) -> str:
    """Initialize (or reuse) a fake process group of ``world`` ranks; returns the TP mesh's group name.
    Prefer ``fake_process_group``, which removes it afterwards."""
    if dist.is_initialized():
        if dist.get_world_size() != world:
            if dist.get_backend() != "fake":
                raise ValueError(
                    f"a real process group of {dist.get_world_size()} ranks is initialized; "
                    f"measuring tp={world} needs a fake one of {world} ranks (run in a fresh process)"
                )
            dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return mesh.get_group().group_name


def rank_graph(model: nn.Module, args: tuple, *, tp: int, sp: bool) -> RankGraph:
    """Rank 0's forward graph of ``parallelize(model, tp=tp, sp=sp)`` on inputs shaped like ``args``."""
    group = join_fake_group(tp)
    template = FakeTemplate(model, torch.device("cpu"))
    generators = RankGenerators(0, tp, 0)
    graph = build_parallel_graph(template, tuple(args), {}, ParallelOptions(tp=tp, sp=sp), group, generators)
    captured, plan = graph.captured, graph.plan
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    fake_mode = detect_fake_mode([p.meta["val"] for p in placeholders if "val" in p.meta])
    inputs = []
    with fake_mode:
        for i, node in enumerate(placeholders):
            value = node.meta.get("val")
            if value is None:  # the rank index ParallelModule appends
                inputs.append(torch.zeros((), dtype=torch.long))
                continue
            shape = list(value.shape)
            if i < len(captured.state_names):
                name = captured.state_names[i]
                placement = plan.placements.get(name) if plan is not None else None
                if placement is not None and placement.storage is not None:
                    shape[placement.storage.dim] = -(-shape[placement.storage.dim] // tp)
                local = torch.empty(shape, dtype=value.dtype)
                inputs.append(local.requires_grad_(name in captured.param_names))
            else:
                inputs.append(torch.empty(shape, dtype=value.dtype))
    notes = list(plan.notes) if plan is not None else []
    return RankGraph(captured.gm, inputs, list(range(len(captured.state_names))), notes, generators)
