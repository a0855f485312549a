"""The parallel modules' parameters: DTensors on the tensor-parallel mesh under the original names.

Shared by ``ParallelModule`` and ``PipelinedModule``: how a planned split becomes a DTensor
placement, the local shard's shape, building a parameter's local shard (from real values,
from the meta device, or per simulated rank), and registering tensors under dotted names.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from sptransform.graph.placement import DimShard
from sptransform.runtime.collectives import note_gradient
from sptransform.torch_internals import StridedShard, local_tensor_mode, local_values


def device_of(model: nn.Module) -> torch.device:
    """Where the parallel module's tensors live: the first non-meta parameter's device (CPU if none)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def call_defaults(model: nn.Module) -> dict:
    """Keyword inputs set unless the caller sets them: ``use_cache=False`` for models that
    take it (HF), since a KV cache of split heads is not something a training step returns."""
    parameters = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in parameters else {}


def held_share(module: nn.Module, whole_bytes: int | None = None) -> float:
    """Bytes of parameters this rank stores / bytes of the whole parameters (tied ones once), measured
    on the tensors: a DTensor counts its local shard against its global size, a plain tensor counts
    whole. ``1/tp`` when every weight is split; 1.0 when nothing is (equal, and useless for memory).
    Under simulated ranks, the largest rank's shard. ``whole_bytes``: the whole model's parameter
    bytes, for a module that holds only some of them (a pipeline rank's stages)."""
    held = whole = 0
    for p in module.parameters():
        size = p.element_size()
        whole += p.numel() * size
        if isinstance(p, DTensor):
            values = local_values(p.to_local())  # simulated ranks: each rank's shard
            held += (max(v.numel() for v in values.values()) if values else p.to_local().numel()) * size
        else:
            held += p.numel() * size
    whole = whole if whole_bytes is None else whole_bytes
    return held / whole if whole else 1.0


def placement_of(spec: DimShard | None) -> object:
    """``DimShard`` -> DTensor placement (Shard, _StridedShard for k equal segments)."""
    if spec is None:
        return Replicate()
    if len(spec.segments) == 1:
        return Shard(spec.dim)
    lengths = {length for _, length in spec.segments}
    starts = [start for start, _ in spec.segments]
    if len(lengths) == 1 and starts == [i * next(iter(lengths)) for i in range(len(starts))]:
        return StridedShard(spec.dim, split_factor=len(spec.segments))
    raise ValueError(
        f"a fused weight split into unequal segments {spec.segments} along dim {spec.dim} has no "
        "DTensor placement; split the fused projection into separate linears"
    )


def local_shape(shape, placement, tp: int, rank: int) -> list[int]:
    """This rank's shard shape, with torch.chunk's rule for uneven splits (as DTensor)."""
    local = list(shape)
    if isinstance(placement, (Shard, StridedShard)):
        size = shape[placement.dim]
        chunk = -(-size // tp)
        local[placement.dim] = max(0, min(chunk, size - rank * chunk))
    return local


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def shard_parameter(param: nn.Parameter, placement, mesh: DeviceMesh, device: torch.device) -> nn.Parameter:
    """``param`` as a DTensor on ``mesh`` holding only this rank's shard: ``placement`` on a 1-D
    mesh, or a list of one placement per axis.

    A meta parameter gets a local shard of placeholders (``placeholder``: NaN; values come from a
    checkpoint, and ``unloaded_parameters`` refuses to run while they are still there);
    otherwise rank 0's values are the source of truth. Under LocalTensorMode each simulated
    rank gets its own storage."""
    if isinstance(placement, (list, tuple)):
        return _shard_on_mesh(param, list(placement), mesh, device)
    tp = mesh.size()
    if param.device.type == "meta":
        def make(rank: int) -> torch.Tensor:
            return placeholder(local_shape(param.shape, placement, tp, rank), param.dtype, device)

        mode = local_tensor_mode()
        local = mode.rank_map(make) if mode is not None else make(mesh.get_local_rank())
        dtensor = DTensor.from_local(local, mesh, [placement], run_check=False, shape=param.shape, stride=param.stride())
    else:
        dtensor = _distribute(param.detach(), placement, mesh)
    return _with_gradient_hook(nn.Parameter(dtensor, requires_grad=param.requires_grad))


def placeholder(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Storage for a parameter built on the meta device, before its values are loaded: NaN (0 for
    integer dtypes), never ``torch.empty``. Uninitialised memory differs from rank to rank, so the
    replicated copies of a weight nobody loaded would silently disagree; NaN is the same on every
    rank, and ``unloaded_parameters`` can tell that nothing was written."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full(tuple(shape), fill, dtype=dtype, device=device)


def unloaded_parameters(module: nn.Module, pending: set[str]) -> list[str]:
    """The names in ``pending`` (parameters built on the meta device) whose local values in
    ``module`` are still all placeholders: nothing loaded them (``load_hf_weights``,
    ``load_state_dict``, ``dcp.load``, an in-place init). Names found loaded leave ``pending``, so
    a module pays for this scan until its weights are in, then never again. Looked up by name, so
    a parameter replaced since (``load_state_dict(assign=True)``) is judged by its new value. A
    shard with no elements (a split that leaves this rank nothing) counts as loaded."""
    missing = []
    for name in sorted(pending):
        data = get_by_path(module, name).detach()
        local = data.to_local() if isinstance(data, DTensor) else data
        per_rank = local_values(local)
        values = per_rank.values() if per_rank is not None else [local]
        floating = local.dtype.is_floating_point or local.dtype.is_complex
        if floating and any(v.numel() and bool(torch.isnan(v).all()) for v in values):
            missing.append(name)
        else:
            pending.discard(name)
    return missing


def unloaded_error(missing: list[str]) -> ValueError:
    shown = ", ".join(repr(n) for n in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return ValueError(
        f"{len(missing)} parameter(s) were built on the meta device and never given values: {shown}. "
        "Their shards hold NaN placeholders, so training would run on nothing. Load the weights into "
        "the parallel module before the first call (sptransform.load_hf_weights(pm, folder), "
        "pm.load_state_dict(...), or torch.distributed.checkpoint.load({'model': pm.state_dict()}, ...)), "
        "or initialise them in place (e.g. p.to_local().normal_() under torch.no_grad())")


def _with_gradient_hook(param: nn.Parameter) -> nn.Parameter:
    """Gradients that arrive from a bucket still in flight become plain tensors when the
    backward ends (``runtime.collectives.note_gradient``)."""
    if param.requires_grad:
        param.register_post_accumulate_grad_hook(note_gradient)
    return param


def _shard_on_mesh(param: nn.Parameter, placements: list, mesh: DeviceMesh, device: torch.device) -> nn.Parameter:
    """An N-D mesh (data x tensor parallel): one placement per axis."""
    if param.device.type == "meta":
        shape = list(param.shape)
        for axis, placement in enumerate(placements):
            if isinstance(placement, (Shard, StridedShard)):
                size, parts = shape[placement.dim], mesh.size(axis)
                chunk = -(-size // parts)
                coordinate = mesh.get_local_rank(axis)
                shape[placement.dim] = max(0, min(chunk, size - coordinate * chunk))
        local = placeholder(shape, param.dtype, device)
        dtensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
    else:
        dtensor = distribute_tensor(param.detach().clone(), mesh, placements, src_data_rank=0)
    return _with_gradient_hook(nn.Parameter(dtensor, requires_grad=param.requires_grad))


def _distribute(full: torch.Tensor, placement, mesh: DeviceMesh) -> DTensor:
    mode = local_tensor_mode()
    if mode is None:
        # A copy, so the user's module and the parallel one never share storage.
        return distribute_tensor(full.clone(), mesh, [placement], src_data_rank=0)
    # Simulated ranks: each gets its own storage (a replicated LocalTensor built from one
    # plain tensor would alias it, and in-place optimizer steps would run once per rank).
    if isinstance(placement, Replicate):
        local = mode.rank_map(lambda r: full.clone())
        return DTensor.from_local(local, mesh, [placement], run_check=False)
    return distribute_tensor(full, mesh, [placement], src_data_rank=None)


def set_by_path(root: nn.Module, path: str, value, *, kind: str, persistent: bool = True) -> None:
    """Register ``value`` as parameter or buffer ``path`` (dotted) of ``root``, making empty
    submodules on the way so that names match the original model's."""
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        child = dict(module.named_children()).get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if kind == "parameter":
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value, persistent=persistent)


def get_by_path(root: nn.Module, path: str):
    *parents, leaf = path.split(".")
    return getattr(root.get_submodule(".".join(parents)), leaf)
