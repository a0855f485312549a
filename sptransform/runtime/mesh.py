"""The device meshes sptransform runs on, resolved from the user's ``mesh`` or the process group.

A mesh built here holds its process groups weakly (``torch_internals.hold_mesh_groups_weakly``):
the parallel module keeps its mesh, and DTensor's caches keep every mesh until the interpreter
ends, so a mesh that owned its groups would keep them, and gloo's threads, alive after
``destroy_process_group`` (an abort at exit). A mesh passed in is the caller's and is left as
it is."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sptransform.torch_internals import hold_mesh_groups_weakly


def _device_type(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def _new_mesh(device: torch.device, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A mesh over the whole process group that does not keep its groups alive (module docstring)."""
    mesh = init_device_mesh(_device_type(device), shape, mesh_dim_names=names)
    hold_mesh_groups_weakly(mesh)
    return mesh


def resolve_tp_mesh(tp: int, mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh | None:
    """The 1-D tensor-parallel mesh: the one given, or one over the whole process group
    (None for tp=1 without a process group)."""
    if mesh is not None:
        if mesh.ndim != 1 or mesh.size() != tp:
            raise ValueError(f"mesh has shape {tuple(mesh.shape)} but tp={tp}: pass a 1-D mesh of {tp} ranks")
        return mesh
    if not dist.is_available() or not dist.is_initialized():
        if tp == 1:
            return None
        raise ValueError(
            f"tp={tp} needs a process group, and none is initialized: launch with "
            f"`torchrun --nproc-per-node {tp} ...` and call torch.distributed.init_process_group() "
            "(gloo on CPU, nccl on GPU) before parallelize"
        )
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(
            f"tp={tp} differs from the process group's size {world}: use tp={world}, "
            "or pass mesh= a 1-D DeviceMesh of tp ranks"
        )
    return _new_mesh(device, (tp,), ("tp",))


def resolve_pipeline_mesh(pp: int, tp: int, mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh:
    """The ``pp x tp`` mesh: the one given, or one over the initialized process group."""
    if mesh is not None:
        if mesh.ndim != 2 or tuple(mesh.shape) != (pp, tp) or tuple(mesh.mesh_dim_names or ()) != ("pp", "tp"):
            raise ValueError(
                f"mesh has shape {tuple(mesh.shape)} (axes {mesh.mesh_dim_names}) but pp={pp}, tp={tp}: pass a 2-D "
                f"DeviceMesh of shape ({pp}, {tp}) with mesh_dim_names=('pp', 'tp')"
            )
        return mesh
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"pp={pp} x tp={tp} needs a process group of {pp * tp} ranks, and none is initialized: launch with "
            f"`torchrun --nproc-per-node {pp * tp} ...` and call torch.distributed.init_process_group() first"
        )
    world = dist.get_world_size()
    if world != pp * tp:
        raise ValueError(
            f"pp={pp} x tp={tp} = {pp * tp} ranks, but the process group has {world}: "
            f"choose pp and tp with pp * tp == {world}, or pass mesh= a ({pp}, {tp}) DeviceMesh"
        )
    return _new_mesh(device, (pp, tp), ("pp", "tp"))


MESH_AXES = ("dp", "pp", "tp")


def resolve_mesh(dp: int, pp: int, tp: int, mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh:
    """The ``(dp, pp, tp)`` mesh (axes of size 1 left out, ``tp`` always present): the one given,
    whose axis names must come from ``dp``, ``pp``, ``tp`` with those sizes, or one over the whole
    process group, row-major with tp innermost (consecutive ranks form a tensor-parallel group)."""
    wanted = [(name, size) for name, size in zip(MESH_AXES, (dp, pp, tp)) if size > 1 or name == "tp"]
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in MESH_AXES]
        given = dict(zip(names, mesh.shape))
        wrong = [f"{name}={given.get(name, 1)} (want {size})" for name, size in zip(MESH_AXES, (dp, pp, tp))
                 if given.get(name, 1) != size]
        if unknown or len(names) != mesh.ndim or wrong:
            raise ValueError(
                f"mesh has shape {tuple(mesh.shape)} and axes {names or None}, but dp={dp}, pp={pp}, tp={tp}: "
                f"pass a DeviceMesh whose axes are named from {MESH_AXES} with those sizes"
                + (f" (differs: {', '.join(wrong)})" if wrong else "") + (f" (unknown axes {unknown})" if unknown else "")
            )
        return mesh
    world = dp * pp * tp
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"dp={dp} x pp={pp} x tp={tp} = {world} ranks need a process group, and none is initialized: launch with "
            f"`torchrun --nproc-per-node {world} ...` and call torch.distributed.init_process_group() first"
        )
    if dist.get_world_size() != world:
        raise ValueError(
            f"dp={dp} x pp={pp} x tp={tp} = {world} ranks, but the process group has {dist.get_world_size()}: "
            f"choose sizes whose product is {dist.get_world_size()}, or pass mesh="
        )
    return _new_mesh(device, tuple(size for _, size in wanted), tuple(name for name, _ in wanted))


def expert_mesh(dp: int, ep: int, pp: int, tp: int, device: torch.device) -> DeviceMesh:
    """The ``("edp", "ep", "pp", "tp")`` mesh of expert parallelism over the whole process group:
    groups of ``ep`` data-parallel ranks (of one pipeline stage and one tensor-parallel index) split
    the experts, and ``edp`` joins the ``dp / ep`` ranks holding the same experts. Row-major like
    ``resolve_mesh``'s ``(dp, pp, tp)``, so rank ``r`` is data-parallel rank ``i * ep + j`` there
    when it is ``(i, j)`` here: a parameter replicated on both axes is what data parallelism keeps."""
    return _new_mesh(device, (dp // ep, ep, pp, tp), ("edp", "ep", "pp", "tp"))
