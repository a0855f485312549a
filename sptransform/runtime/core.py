"""``ModuleCore``: what every module ``parallelize`` returns shares — it stands in for the original.

The two parallel modules differ in how they run (``runtime.module.ParallelModule`` runs one
graph per input signature; ``pipeline.module.PipelinedModule`` composes stage runtimes under a
torch schedule), not in how they mirror the original. That part is here, once:

* **the submodule tree and names**: an empty container for every submodule of the original,
  under the same name, holding the parameters (DTensor shards on the mesh) and buffers under
  their original names, tied parameters still one ``nn.Parameter``;
* **modes**: each container's train/eval flag is read when a graph is chosen, so ``pm.eval()``
  and ``pm.transformer.h[0].eval()`` act as on the original;
* **state dicts**: entries DCP can save and load, whole tensors accepted on load
  (``runtime.checkpoint``); parameters built on meta are refused until loaded;
* **inputs**: every call's checks run before any collective, and an error found on one rank is
  raised on every rank (``runtime.checks``); with data parallelism the replicas also meet, and
  a grad-mode difference or a missing replica is raised on every one (``runtime.faults``);
* **generators**: ``pm.rng``, the module's dropout generators and default generator state.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from sptransform.graph.plan import ParamPlacement
from sptransform.options import ParallelOptions
from sptransform.runtime.checkpoint import install_checkpoint_views
from sptransform.runtime.checks import (
    check_call, fingerprint, gather_fingerprints, leaf_names, raise_if_disagree, stable_hash,
)
from sptransform.runtime.faults import ReplicaCheck
from sptransform.runtime.generate import original_class_error
from sptransform.torch_internals import non_persistent_buffer_names, pytree, resolve_process_group
from sptransform.runtime.params import (
    call_defaults, device_of, placeholder, placement_of, set_by_path, shard_parameter, unloaded_error,
    unloaded_parameters,
)
from sptransform.runtime.rng import RngState
from sptransform.runtime.zero import data_parallel_placement

T = TypeVar("T")


def mirror_modules(root: nn.Module, model: nn.Module) -> list[nn.Module]:
    """Give ``root`` an empty container for every submodule of ``model`` (same names, same
    train/eval flags; ``nn.ModuleList``/``nn.ModuleDict`` for those) and return them in ``model.named_modules()`` order, root first: the
    parameters are registered into these, and their flags say which mode each submodule of
    the fake template is captured in."""
    mirrored = []
    for name, module in model.named_modules():
        target = root
        for part in name.split(".") if name else []:
            child = dict(target.named_children()).get(part)
            if child is None:
                # Lists and dicts of modules stay indexable: pm.transformer.h[0].eval() works.
                child = nn.ModuleList() if isinstance(module, nn.ModuleList) else \
                    nn.ModuleDict() if isinstance(module, nn.ModuleDict) else nn.Module()
                target.add_module(part, child)
            target = child
        target.training = module.training
        mirrored.append(target)
    return mirrored


class Agreement(NamedTuple):
    """How the ranks compare their inputs before a call's first collective (``runtime.checks``):
    the groups the fingerprints are gathered over, in order, and how a rank is named."""

    groups: list[dist.ProcessGroup]
    simulated: bool
    this: int
    label: Callable[[int], str]


class ModuleCore(nn.Module):
    """The original's stand-in. A subclass calls ``__init__`` first (modes, call defaults), then,
    once it knows the placements, ``_register_state`` and ``_finish_state``."""

    def __init__(self, model: nn.Module, *, factory, options: ParallelOptions, tp_mesh: DeviceMesh | None,
                 param_mesh: DeviceMesh | None):
        """``factory``: the module's ``transform.GraphFactory`` (owns the fake template and the
        dropout generators); ``tp_mesh``: where parameters are split by the tensor-parallel plan
        (None for tp=1 without a mesh); ``param_mesh``: the (dp, tp) mesh parameters live on with
        data parallelism (None without)."""
        super().__init__()
        self._options = options
        self._factory = factory
        self._tp_mesh = tp_mesh
        self._param_mesh = param_mesh
        self._device = device_of(model)
        self._original_class = type(model)
        self._call_defaults = call_defaults(model)
        self._mode_names = [name for name, _ in model.named_modules()]
        self._mode_modules = mirror_modules(self, model)
        self._placements: dict[str, ParamPlacement] = {}
        self._data_parallel = None  # the graph's data-parallel plan (ZeRO-3 dims), set with the placements
        self._unloaded: set[str] = set()  # built on meta, not yet loaded (runtime.params)
        # With data parallelism and check_inputs, the replicas meet at every call (runtime.faults).
        # A fake process group (tracing one rank of a large job) has no peers and no store to meet in.
        dp_group = resolve_process_group(factory.dp_group) if param_mesh is not None else None
        self._replicas = ReplicaCheck(dp_group, options.peer_timeout_s) \
            if dp_group is not None and options.check_inputs and dist.get_backend(dp_group) != "fake" else None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_class")
            error = None if original is None else original_class_error(original, type(self).__name__, name)
            if error is None:
                raise
            raise error from None

    # -- the original's state, mirrored -----------------------------------------

    def _register_state(self, model: nn.Module, only: set[str] | None = None) -> None:
        """Register ``model``'s parameters (sharded by ``self._placements``) and buffers under
        their original names; with ``only``, those named there (a parameter with all its tied
        names, when any of them is there). A tied parameter stays one ``nn.Parameter``."""
        converted: dict[int, nn.Parameter] = {}
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        for name, param in model.named_parameters(remove_duplicate=False):
            if only is not None and not only.intersection(aliases[id(param)]):
                continue
            if id(param) not in converted:
                # A tied parameter is planned under whichever of its names the graph used.
                planned = next((n for n in aliases[id(param)] if n in self._placements), name)
                converted[id(param)] = self._shard_parameter(planned, param)
                if param.device.type == "meta":
                    self._unloaded.add(name)
            set_by_path(self, name, converted[id(param)], kind="parameter")
        for module_name, module in model.named_modules(remove_duplicate=False):
            non_persistent = non_persistent_buffer_names(module)
            for buffer_name, buf in module.named_buffers(recurse=False, remove_duplicate=False):
                name = f"{module_name}.{buffer_name}" if module_name else buffer_name
                if buf is None or (only is not None and name not in only):
                    continue
                if buf.device.type == "meta":
                    raise ValueError(
                        f"buffer {name!r} is on the meta device: only parameters can be left there "
                        "(their shards are allocated here); give buffers their values before parallelize"
                    )
                persistent = buffer_name not in non_persistent
                set_by_path(self, name, buf, kind="buffer", persistent=persistent)

    def _shard_parameter(self, name: str, param: nn.Parameter) -> nn.Parameter:
        if self._tp_mesh is None:
            if param.device.type == "meta":  # tp=1: the whole parameter, placeholders until loaded
                return nn.Parameter(placeholder(param.shape, param.dtype, self._device), param.requires_grad)
            return param
        placement = placement_of(self._placements.get(name, ParamPlacement(None, "replicated")).storage)
        if self._param_mesh is not None:
            placements = [data_parallel_placement(self._data_parallel, name), placement]
            if self._options.ep > 1:
                # The ("edp", "ep", "tp") mesh: experts split over ep (passes.expert_parallel), their ZeRO
                # pieces over edp; anything else's ZeRO pieces over both, edp outer: rank (i, j) holds
                # piece i * ep + j, its data-parallel rank's (runtime.mesh.expert_mesh).
                experts = self._data_parallel.experts if self._data_parallel is not None else frozenset()
                placements.insert(1, Shard(0) if name in experts else placements[0])
            return shard_parameter(param, placements, self._param_mesh, self._device)
        return shard_parameter(param, placement, self._tp_mesh, self._device)

    def _finish_state(self, rng_mesh: DeviceMesh | None) -> None:
        """The last step of construction, once every parameter is registered: the generators'
        checkpointable state over ``rng_mesh`` and the state-dict views."""
        self._rng = RngState(self._factory.generators, rng_mesh, self._device)
        install_checkpoint_views(self)  # state_dict(): entries DCP can save and load (runtime.checkpoint)

    def _check_loaded(self) -> None:
        """Refuse to run on parameters built on meta and never loaded (NaN placeholders)."""
        missing = unloaded_parameters(self, self._unloaded) if self._unloaded else []
        if missing:
            raise unloaded_error(missing)

    # -- what selects a graph: modes ----------------------------------------------

    def _modes(self) -> dict[str, bool]:
        """Each template submodule's train/eval flag, read from the mirrored containers."""
        return {name: module.training for name, module in zip(self._mode_names, self._mode_modules)}

    def _mode_key(self) -> tuple[bool, ...]:
        return tuple(module.training for module in self._mode_modules)

    # -- every call -----------------------------------------------------------------

    def _checked(self, args: tuple, kwargs: dict, local: Callable[[], T]) -> T:
        """Phase 1 (``check_call``, then ``local()``: this module's own checks, which may choose
        or build what runs), then phase 2 (ranks agree, see ``_agreement``) — ``runtime.checks``.
        An error of phase 1 is raised after phase 2, on every rank."""
        error, result = None, None
        try:
            check_call(args, kwargs, self._call_defaults)
            result = local()
        except Exception as err:  # held: raised below, after the ranks have compared notes
            error = err
        if self._replicas is not None:  # the data-parallel replicas meet (runtime.faults)
            try:
                shapes = stable_hash(*[(tuple(x.shape), str(x.dtype)) for x in pytree.tree_leaves((args, kwargs))
                                       if isinstance(x, torch.Tensor)]) if self._options.ep > 1 else 0
                self._replicas.arrive(stable_hash(self._mode_key()), error is not None, shapes)
            except (ValueError, RuntimeError) as err:  # held, so that the tensor-parallel peers hear of it
                error = error or err
        agreement = self._agreement()
        if agreement is not None:
            signature = self._signature_fingerprint(result) if error is None else None
            rows = fingerprint(args, kwargs, self._mode_key(), error is not None, self._device, signature,
                               self._graph_digest(result) if error is None else 0)
            table = gather_fingerprints(rows, agreement.groups, agreement.simulated)
            raise_if_disagree(table, error, lambda: leaf_names(args, kwargs), agreement.label, agreement.this)
        if error is not None:
            raise error
        return result

    def _agreement(self) -> Agreement | None:
        """How this module's ranks compare inputs, or None when a call skips phase 2."""
        raise NotImplementedError

    def _graph_digest(self, checked) -> int:
        """The digest of the captured graph this call runs (``graph.fingerprint``), if ``checked``
        (what ``local()`` returned) says which; 0: not compared."""
        return 0

    def _signature_fingerprint(self, checked) -> list[int] | None:
        """The ``signature_fingerprint`` of this call's inputs, if ``checked`` (what ``local()``
        returned) holds it already; None: ``fingerprint`` works it out."""
        return None

    # -- state and inspection ---------------------------------------------------------

    @property
    def rng(self) -> RngState:
        """Every rank's dropout generator and default generator state, a DCP ``Stateful``:
        ``dcp.save({"model": pm.state_dict(), "optim": opt.state_dict(), "rng": pm.rng}, ...)``."""
        return self._rng

