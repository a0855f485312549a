"""Dropout generators of a parallel module, owned by that module, and their checkpointable state.

``RankGenerators`` holds one ``torch.Generator`` per (rank, device), seeded ``seed + 1 + rank``:
masks of split activations differ across ranks and repeat run after run. A graph's dropout op
reaches its generators through an int key in a *weak* registry: the module that owns the
``RankGenerators`` (through its ``GraphFactory``) keeps it alive, and when the module is freed
the entry disappears. Nothing global grows with the number of ``parallelize`` calls.

``RngState`` is ``pm.rng``: a ``torch.distributed.checkpoint.stateful.Stateful`` whose state is
every rank's dropout generator and default torch generator, as DTensors sharded over the mesh
(one row per rank), so ``dcp.save({..., "rng": pm.rng})`` / ``dcp.load`` continue a run bit for
bit, also in a module built with another seed.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from sptransform.torch_internals import local_tensor_mode, local_values

_REGISTRY: "weakref.WeakValueDictionary[int, RankGenerators]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class RankGenerators:
    """One torch.Generator per rank and device, seeded ``seed + 1 + rank``.

    ``rank``: this process's rank in the tensor-parallel group, or None when the graphs
    serve LocalTensorMode's simulated ranks (each then draws from its own generator).
    ``key`` is what graphs carry (an int keeps graphs printable, deep-copyable and free of
    references to the module)."""

    def __init__(self, seed: int, group_size: int, rank: int | None):
        self.seed = seed
        self.group_size = group_size
        self.rank = rank
        self._generators: dict[tuple[int, torch.device], torch.Generator] = {}
        self.key = next(_KEYS)
        _REGISTRY[self.key] = self

    def get(self, rank: int, device: torch.device) -> torch.Generator:
        key = (rank, torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed + 1 + rank)
        return self._generators[key]

    def ranks(self) -> list[int]:
        """The ranks this process draws for: its own, or every simulated one."""
        return list(range(self.group_size)) if self.rank is None else [self.rank]


def generators_of(key: int) -> RankGenerators:
    gens = _REGISTRY.get(key)
    if gens is None:
        raise RuntimeError(
            f"the dropout generators (key {key}) of this graph's parallel module were freed: the graph outlived "
            "the module that parallelize returned; keep that module alive while its graphs run"
        )
    return gens


def live_generator_count() -> int:
    """How many ``RankGenerators`` are alive (one per parallel module that exists)."""
    return len(_REGISTRY)


def _default_generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_default_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state.cpu(), device)
    else:
        torch.set_rng_state(state.cpu())


class RngState:
    """``pm.rng``: every rank's dropout generator and default torch generator, checkpointable.

    ``state_dict()`` returns ``{"dropout": T, "default": T}``; each ``T`` is a uint8 DTensor
    of shape ``[*mesh.shape, n]`` sharded over every mesh dim, row ``r`` holding rank ``r``'s
    generator state (a plain ``[1, n]`` tensor without a mesh). ``torch.distributed.checkpoint``
    saves each rank's row, and ``load_state_dict`` sets the generators from this rank's row, so
    a resumed run draws exactly the masks the uninterrupted run would have drawn. The default
    generator is included because replicated activations (and ``dropout_rng="reference"``,
    tp=1 graphs and fused attention dropout) draw from it; loading sets it, as
    ``torch.set_rng_state`` would. Under LocalTensorMode each simulated rank has its own row
    (the default generator is shared by the simulated ranks: one process)."""

    def __init__(self, generators: RankGenerators, mesh: DeviceMesh | None, device: torch.device):
        self._generators = generators
        self._mesh = mesh
        self._device = torch.device(device)

    # -- the states --------------------------------------------------------

    def _dropout_state(self, rank: int) -> torch.Tensor:
        return self._generators.get(rank, self._device).get_state()

    def _as_tensor(self, state_of) -> torch.Tensor:
        """One row per rank: a DTensor sharded over every mesh dim (plain without a mesh)."""
        if self._mesh is None:
            return state_of(0).unsqueeze(0)
        mode = local_tensor_mode()
        if mode is not None:
            local = mode.rank_map(lambda r: state_of(self._simulated_rank(r)).reshape([1] * self._mesh.ndim + [-1]))
            length = state_of(0).numel()
        else:
            row = state_of(self._generators.rank if self._generators.rank is not None else 0)
            local = row.reshape([1] * self._mesh.ndim + [-1])
            length = row.numel()
        shape = (*self._mesh.shape, length)
        stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
        return DTensor.from_local(local, self._mesh, [Shard(d) for d in range(self._mesh.ndim)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def _simulated_rank(self, global_rank: int) -> int:
        """The tensor-parallel rank of a simulated (global) rank: its coordinate on the last mesh dim."""
        return global_rank % self._mesh.shape[-1]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "dropout": self._as_tensor(self._dropout_state),
            "default": self._as_tensor(lambda r: _default_generator_state(self._device)),
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        missing = {"dropout", "default"} - set(state_dict)
        if missing:
            raise ValueError(f"pm.rng.load_state_dict: the state lacks {sorted(missing)}; pass what pm.rng.state_dict() returns")
        rows = {key: self._rows(state_dict[key]) for key in ("dropout", "default")}
        for rank, row in rows["dropout"].items():
            self._generators.get(rank, self._device).set_state(row.contiguous().cpu())
        if rows["default"]:
            _set_default_generator_state(self._device, next(iter(rows["default"].values())).contiguous())

    def _rows(self, value: torch.Tensor) -> dict[int, torch.Tensor]:
        """This process's row(s) of a saved state: ``{tp rank: state}``."""
        if isinstance(value, DTensor):
            value = value.to_local()
        per_rank = local_values(value)
        if per_rank is not None:  # simulated ranks
            return {self._simulated_rank(r): t.reshape(-1) for r, t in sorted(per_rank.items())}
        flat = value.reshape(-1, value.shape[-1])
        if flat.shape[0] != 1:
            raise ValueError(f"pm.rng: expected this rank's single row of generator state, got shape {tuple(value.shape)}")
        return {self._generators.rank if self._generators.rank is not None else 0: flat[0]}


__all__ = ["RankGenerators", "RngState", "generators_of", "live_generator_count"]
