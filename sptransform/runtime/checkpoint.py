"""Checkpoints of parallel modules: ``torch.distributed.checkpoint`` (DCP) across layouts, HF weights.

**Why a view.** DCP describes the part of a DTensor a rank holds as *one* box of the global
tensor (``compute_local_shape_and_global_offset``: one offset, one size). That is true of
``Shard`` and ``Replicate``, but not of ``_StridedShard``: a fused ``[q|k|v]`` weight split per
head leaves rank ``r`` holding ``q_r``, ``k_r`` and ``v_r``, three disjoint boxes of the global
tensor stored side by side. DCP then reports one contiguous box of the local size at the wrong
offset, so ``dcp.save`` fails with "overlapping chunks" and ``dcp.load`` from a checkpoint of
another layout (a single-device one) reads the wrong columns *silently*.

What sptransform does about it: the parameters stay as they are (plain DTensors, ``_StridedShard``,
so that ``full_tensor()``, optimizers and the graphs are untouched); what ``pm.state_dict()``
returns for such a parameter is a ``ChunkedDTensor``: the same local tensor (no copy, same
storage), mesh, placements and global value, a DTensor in every respect, that also implements
DCP's extension protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, the protocol torch's own ``LocalShardsWrapper`` uses) and tells DCP the
true boxes: one write/read item per box, each a view of the local tensor. A checkpoint written
this way is an ordinary DCP checkpoint keyed by the original names with full-tensor values, so
it loads into one device, any tp, or a pipeline, and DCP's resharding does the rest.

The boxes are derived from DTensor's own semantics, not re-implemented: for each tensor dim,
``distribute_tensor(arange(size), mesh, placements, src_data_rank=None)`` (purely local, no
communication) gives which global indices along that dim the local tensor holds, in local
order; runs of consecutive indices are the boxes' extents along that dim, and the boxes are
their products. This holds for any mesh and any mix of ``Shard``/``_StridedShard``/``Replicate``.

Other ways considered: storing fused weights replicated (DCP handles it, but every rank would
hold the whole ``[q|k|v]``: a quarter of a layer's weights, tp times over); per-segment keys
(``c_attn.weight.q``: breaks the original names); a tensor subclass as the *parameter* (lost on
every op that makes a new tensor: ``to(dtype)``, optimizer states). The view costs nothing until a
checkpoint is written or read.

``pm.state_dict()`` returns views for the module's own parameters (a state-dict post-hook on every
submodule holding a DTensor parameter, so ``pm.transformer.state_dict()`` too; not with
``keep_vars=True``, which returns the parameters themselves). An optimizer's state (``exp_avg`` of a
fused weight has the parameter's placement) gets views too: ``opt.state_dict()`` of any optimizer
that has stepped the module (``_OptimizerWatch``), so torch's ``get_state_dict`` and the plain
``{"optim": opt.state_dict()}`` save and load it; ``checkpointable(opt)`` also creates the state of
an optimizer that has not stepped, which ``dcp.load`` could otherwise not fill.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from sptransform.logs import logger, progress
from sptransform.torch_internals import StridedShard, dtensor_as, plain_dtensor

log = logger(__name__)

LOAD_PIECE = 64
"""Tensors per ``dcp.load`` call of ``load_hf_weights`` (one step of its progress bar)."""


# -- the boxes a rank's local tensor holds ---------------------------------------------------


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """``(global start, local start, length)`` of each run of consecutive global indices."""
    runs: list[tuple[int, int, int]] = []
    for local, index in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == index:
            start, local_start, length = runs[-1]
            runs[-1] = (start, local_start, length + 1)
        else:
            runs.append((index, local, 1))
    return runs


def _dim_runs(size: int, dim: int, ndim: int, placements: tuple, mesh: DeviceMesh) -> tuple[tuple[int, int, int], ...]:
    """The runs of global indices along ``dim`` this rank holds, by DTensor's own split (local only)."""
    shape = [1] * ndim
    shape[dim] = size
    index = torch.arange(size, device=mesh.device_type).reshape(shape)
    acting = [p if isinstance(p, (Shard, StridedShard)) and p.dim == dim else Replicate() for p in placements]
    local = distribute_tensor(index, mesh, acting, src_data_rank=None).to_local()
    return tuple(_runs(local.reshape(-1).tolist()))


def _boxes(tensor: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``(global offsets, local offsets, sizes)`` of every box of the global tensor held here."""
    if tensor.device_mesh.get_coordinate() is None:
        return []
    ndim, placements = tensor.dim(), tuple(tensor.placements)
    per_dim = [_dim_runs(tensor.shape[d], d, ndim, placements, tensor.device_mesh) for d in range(ndim)]
    boxes = []
    for combo in itertools.product(*per_dim):
        boxes.append((tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo)))
    return boxes


def needs_view(value: Any) -> bool:
    """A DTensor whose local tensor is not one box of the global tensor (a ``_StridedShard``)."""
    return isinstance(value, DTensor) and not isinstance(value, ChunkedDTensor) and any(
        isinstance(p, StridedShard) for p in value.placements)


# -- the view ----------------------------------------------------------------------------------


class ChunkedDTensor(DTensor):
    """A DTensor that tells ``torch.distributed.checkpoint`` every box of the global tensor its
    local tensor holds (one write/read item each), instead of DTensor's single box.

    Shares the local tensor of the DTensor it views: ``dcp.load`` into it writes into that
    tensor. Any op on it returns a plain DTensor; pickling and ``deepcopy`` give a plain DTensor
    (``torch.load(weights_only=True)`` knows DTensor, not this class)."""

    def _boxes(self):
        boxes = self.__dict__.get("_sptransform_boxes")
        if boxes is None:
            boxes = self.__dict__["_sptransform_boxes"] = _boxes(self)
        return boxes

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.to_local())
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for offsets, _, sizes in self._boxes()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, _, sizes in self._boxes()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        local = self.to_local()
        for offsets, local_offsets, sizes in self._boxes():
            if torch.Size(offsets) == index.offset:
                return local[tuple(slice(o, o + n) for o, n in zip(local_offsets, sizes))]
        raise ValueError(
            f"sptransform checkpoint: this rank holds no box of {index.fqn!r} at offset {tuple(index.offset or ())} "
            f"(its boxes start at {[o for o, _, _ in self._boxes()]})"
        )

    def __reduce_ex__(self, protocol):
        return plain_dtensor(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        copied = plain_dtensor(self).__deepcopy__(memo)
        memo[id(self)] = copied
        return copied


def checkpoint_view(value: Any) -> Any:
    """``value`` as a ``ChunkedDTensor`` when DCP cannot describe it as one box, else unchanged."""
    return dtensor_as(ChunkedDTensor, value) if needs_view(value) else value


def checkpointable(state: Any) -> Any:
    """``state`` (nested dicts, lists, tuples) with every DTensor that DCP cannot describe as one
    box replaced by its view. Given an optimizer, its ``state_dict()`` so, after creating its
    state if it has not stepped (``create_optimizer_state``: a fresh optimizer has none, and
    ``dcp.load`` would restore nothing into it). To save:
    ``dcp.save({"optim": sptransform.checkpointable(opt)}, ...)``; to load (a fresh optimizer or
    one that has stepped): ``state = {"optim": sptransform.checkpointable(opt)}``,
    ``dcp.load(state, ...)``, ``opt.load_state_dict(state["optim"])`` (the views share the
    optimizer's tensors)."""
    if isinstance(state, torch.optim.Optimizer):
        create_optimizer_state(state)
        return checkpointable(state.state_dict())
    if isinstance(state, dict):
        items = [(k, checkpointable(v)) for k, v in state.items()]
        return type(state)(items) if type(state) in (dict, OrderedDict) else dict(items)
    if isinstance(state, list):
        return [checkpointable(v) for v in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(checkpointable(v) for v in state)
    return checkpoint_view(state)


class _ViewEntries:
    """State-dict post-hook of one submodule: its DTensor parameters' entries become views.
    (A callable object: ``register_state_dict_post_hook`` marks the hook with an attribute.)"""

    def __init__(self, names: Iterable[str]):
        self.names = tuple(names)

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for name in self.names:
            key = prefix + name
            value = state_dict.get(key)
            if value is not None and not isinstance(value, nn.Parameter):  # keep_vars=True: the parameters
                state_dict[key] = checkpoint_view(value)


class _ShardWholeEntries:
    """Load-state-dict pre-hook of one submodule: an entry that is a whole plain tensor (the
    original model's ``state_dict()``, or ``torch.load`` of one) for a DTensor parameter becomes
    this rank's shard of it, so ``pm.load_state_dict(model.state_dict())`` works as on the
    original (``copy_`` of a plain tensor into a DTensor is an error in torch). Each rank cuts its
    own shard from the tensor it was given, without communication: every rank must pass the same
    values, as it does when all ranks read one file. An entry that is a DTensor (a distributed
    checkpoint's) tells ``watch`` that the module was restored (``_OptimizerWatch``)."""

    def __init__(self, names: Iterable[str], watch: "_OptimizerWatch"):
        self.names = tuple(names)
        self.watch = watch

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
        for name in self.names:
            key, param = prefix + name, dict(module.named_parameters(recurse=False, remove_duplicate=False)).get(name)
            value = state_dict.get(key)
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                    and value.shape == param.shape:
                state_dict[key] = distribute_tensor(value.detach().to(param.device), param.device_mesh,
                                                    param.placements, src_data_rank=None)
            elif isinstance(value, DTensor):
                self.watch.restored = True


def install_checkpoint_views(root: nn.Module) -> None:
    """Make ``root.state_dict()`` (and every submodule's) return DCP-describable entries,
    ``root.load_state_dict`` accept whole tensors (``_ShardWholeEntries``), and the state of any
    optimizer stepping ``root``'s parameters describable too (``_OptimizerWatch``)."""
    watch = _OptimizerWatch(root)
    for module in root.modules():
        names = [name for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
        if names:
            module.register_state_dict_post_hook(_ViewEntries(names))
            module.register_load_state_dict_pre_hook(_ShardWholeEntries(names, watch))
    handle = register_optimizer_step_pre_hook(watch)
    weakref.finalize(root, handle.remove)  # the hook goes with the module
    root._checkpoint_watch = watch  # the module owns it (``load_hf_weights`` clears ``restored``)


# -- optimizers ------------------------------------------------------------------------------


def _view_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer state-dict post-hook: every ``_StridedShard`` entry as its checkpoint view."""
    return checkpointable(state_dict)


class _OptimizerWatch:
    """Global optimizer step pre-hook owned by one parallel module (removed with it): the first
    time an optimizer holding the module's parameters steps, and the module has a fused
    ``_StridedShard`` parameter, its ``state_dict()`` gets ``_view_optimizer_state`` (AdamW's
    ``exp_avg`` of a fused weight has the weight's placement, which DCP alone cannot save: the
    issue's "overlapping chunks"). Views share the optimizer's tensors, so the plain recipe
    ``dcp.load({"optim": opt.state_dict()})`` + ``opt.load_state_dict`` reads into them in place.

    An optimizer's state is created by its first step, so ``opt.state_dict()`` of an optimizer that
    has not stepped is empty and ``dcp.load`` restores nothing into it. When the module was just
    restored from DTensors (a distributed checkpoint: ``restored``, set by ``_ShardWholeEntries``)
    and the first optimizer step that follows finds no state for its parameters, this warns,
    naming the recipes that restore it (``get_state_dict``/``set_state_dict``,
    ``sptransform.checkpointable(opt)``). Holds the module weakly."""

    def __init__(self, root: nn.Module):
        self._root = weakref.ref(root)
        self._strided = any(needs_view(p) for p in root.parameters())
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> holds our params
        self.restored = False

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = self._holds[optimizer] = self._first_sight(optimizer)
        if holds and self.restored:
            self.restored = False
            root = self._root()
            mine = {id(p) for p in root.parameters()} if root is not None else set()
            ours = [p for group in optimizer.param_groups for p in group["params"] if id(p) in mine]
            if ours and not any(optimizer.state.get(p) for p in ours):
                warnings.warn(
                    f"{type(optimizer).__name__} steps {len(ours)} parameters of a parallel module restored from a "
                    "distributed checkpoint, but it has no state for them: if the checkpoint held optimizer state "
                    "(AdamW's moments), none of it was restored, because opt.state_dict() of an optimizer that has "
                    "not stepped is empty and dcp.load fills only what it is given. Load with torch's "
                    "get_state_dict(pm, opt) / set_state_dict(...) (torch.distributed.checkpoint.state_dict), or "
                    "sptransform.checkpointable(opt), which create the state first; to start a new optimizer "
                    "deliberately, ignore this warning",
                    UserWarning, stacklevel=3)

    def _first_sight(self, optimizer: torch.optim.Optimizer) -> bool:
        root = self._root()
        if root is None:
            return False
        mine = {id(p) for p in root.parameters()}
        if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            return False
        if self._strided:
            optimizer.register_state_dict_post_hook(_view_optimizer_state)
        return True


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state, as its first step would, without moving
    anything: one step with zero gradients at ``lr=0``, after which the step counts are set back
    to zero (so training from here is that of the untouched optimizer). The same as torch's
    ``get_state_dict`` does for a fresh optimizer (its ``_init_optim_state``), which leaves the
    counts at one. Gradients the parameters hold are kept."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = type(step)(0)


# -- Hugging Face weights --------------------------------------------------------------------


def load_hf_weights(module: nn.Module, path: str | os.PathLike, *,
                    key_map: Callable[[str], str] | None = None) -> list[str]:
    """Load a Hugging Face safetensors checkpoint (a ``save_pretrained`` folder: ``model.safetensors``
    or its shards) into ``module``: a parallel module from ``sptransform.parallelize`` (each rank
    reads only its boxes, through DCP's ``HuggingFaceStorageReader``) or a plain one. Collective
    on the module's process group: call it on every rank.

    Keys are the module's parameter and buffer names (``key_map(name)`` gives the checkpoint's key
    when they differ, e.g. ``lambda n: n.removeprefix("model.")``). A tied weight missing from the
    file (GPT-2's ``lm_head.weight``, which ``save_pretrained`` leaves out) is loaded through the
    name that is there, and buffers missing from it keep their values (non-persistent ones are
    never in a checkpoint). Any other missing parameter is a ``KeyError`` naming it. Returns the
    names loaded."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"load_hf_weights: {path!r} is not a folder; pass the folder save_pretrained wrote (with model.safetensors)")
    key_of = key_map or (lambda name: name)
    reader = HuggingFaceStorageReader(path)
    saved = set(reader.read_metadata().state_dict_metadata)
    state = module.state_dict()
    params = dict(module.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, param in params.items():
        aliases.setdefault(id(param), []).append(name)
    wanted, missing = {}, []
    for name, value in state.items():
        key = key_of(name)
        if key in saved:
            wanted[key] = (name, value)
        elif name in params:
            if not any(key_of(alias) in saved for alias in aliases[id(params[name])] if alias != name):
                missing.append(f"{name!r}" + (f" (looked up as {key!r})" if key != name else ""))
        # a buffer the file lacks keeps its value
    if missing:
        raise KeyError(
            f"load_hf_weights: {path} has no weights for parameter(s) {', '.join(missing)} "
            f"(it has {len(saved)} tensors, e.g. {sorted(saved)[:3]}); pass key_map= to map names to the file's keys"
        )
    to_load = {key: value for key, (_, value) in wanted.items()}
    distributed = dist.is_available() and dist.is_initialized()
    start = time.perf_counter()
    # in pieces, for a progress bar on a checkpoint of many tensors (each piece is one collective
    # dcp.load of the same keys on every rank: the keys are sorted)
    keys = sorted(to_load)
    pieces = [keys[i:i + LOAD_PIECE] for i in range(0, len(keys), LOAD_PIECE)]
    for piece in progress(pieces, desc="load_hf_weights"):
        part = {key: to_load[key] for key in piece}
        dcp.load(part, storage_reader=reader, no_dist=not distributed)
        to_load.update(part)  # what DCP replaced rather than filled
    log.info("load_hf_weights: %d tensors from %s in %.1f s", len(to_load), path, time.perf_counter() - start)
    # DCP wrote into the tensors' storage; load_state_dict keeps the module's own bookkeeping honest
    # (and copies anything DCP had to replace rather than fill).
    module.load_state_dict({wanted[key][0]: value for key, value in to_load.items()}, strict=False)
    watch = getattr(module, "_checkpoint_watch", None)
    if watch is not None:
        watch.restored = False  # weights, not a run to resume: a new optimizer is expected
    return sorted(name for name, _ in wanted.values())


__all__ = ["ChunkedDTensor", "checkpoint_view", "checkpointable", "create_optimizer_state", "install_checkpoint_views",
           "load_hf_weights", "needs_view"]
