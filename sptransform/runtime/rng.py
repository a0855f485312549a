"""Dropout generators of a parallel module, owned by that module, and their checkpointable state.

``RankGenerators`` holds one ``torch.Generator`` per (rank, device), seeded ``seed + 1 + rank``:
masks of split activations differ across ranks and repeat run after run. A graph's dropout op
is a ``GeneratorOp``: a method of the module's ``RankGenerators``, bound weakly. The module owns
the generators (through its ``GraphFactory``) and they are freed with it; nothing is registered
outside the module. (Weakly, because torch.export keeps the last capture's graph nodes in a
global map of its own, ``_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``, until the next export: a
strong reference there would keep a dropped module's generators alive.)

``RngState`` is ``pm.rng``: a ``torch.distributed.checkpoint.stateful.Stateful`` whose state is
every rank's dropout generator and default torch generator, as DTensors sharded over the mesh
(one row per rank), so ``dcp.save({..., "rng": pm.rng})`` / ``dcp.load`` continue a run bit for
bit, also in a module built with another seed.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from sptransform.torch_internals import local_tensor_mode, local_values, tensor_map


class RankGenerators:
    """One torch.Generator per rank and device, seeded ``seed + 1 + rank``.

    ``rank``: this process's rank in the tensor-parallel group, or None when the graphs
    serve LocalTensorMode's simulated ranks (each then draws from its own generator).
    Graphs call ``dropout_op`` / ``native_dropout_op``: its ``independent_dropout`` /
    ``independent_native_dropout``, weakly bound (``GeneratorOp``)."""

    def __init__(self, seed: int, group_size: int, rank: int | None):
        self.seed = seed
        self.group_size = group_size
        self.rank = rank
        self._generators: dict[tuple[int, torch.device], torch.Generator] = {}
        self.dropout_op = GeneratorOp(self, RankGenerators.independent_dropout)
        self.native_dropout_op = GeneratorOp(self, RankGenerators.independent_native_dropout)

    def get(self, rank: int, device: torch.device) -> torch.Generator:
        key = (rank, torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed + 1 + rank)
        return self._generators[key]

    def ranks(self) -> list[int]:
        """The ranks this process draws for: its own, or every simulated one."""
        return list(range(self.group_size)) if self.rank is None else [self.rank]

    # -- the graph ops (``passes.dropout`` puts them in place of ATen's dropout) --

    def independent_dropout(self, x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        """Dropout of a sharded activation with this rank's own generator."""
        if not train or p == 0:
            return x
        return x * self._noise(x, p)

    def independent_native_dropout(self, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``independent_dropout`` for ``aten.native_dropout``: ``(output, bool mask)``; ``train=None``
        means training, as in ATen."""
        if train is False or p == 0:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        noise = self._noise(x, p)
        return x * noise, noise != 0

    def _noise(self, x: torch.Tensor, p: float) -> torch.Tensor:
        def draw(r: int, t: torch.Tensor) -> torch.Tensor:
            keep = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            keep.bernoulli_(1 - p, generator=self.get(r, t.device))
            return keep if p == 1 else keep.div_(1 - p)  # p == 1: zeros, as ATen (no 0 / 0)

        if local_tensor_mode() is not None:
            return tensor_map(x, draw)
        return draw(self.rank if self.rank is not None else dist.get_rank(), x)


class GeneratorOp:
    """A graph op that draws from a module's generators: ``method`` bound to ``generators``
    weakly. FX calls it like a function and names it by ``__name__`` (graphs stay printable);
    ``__func__`` is the method, as for a bound method."""

    def __init__(self, generators: RankGenerators, method: Callable):
        self._generators = weakref.ref(generators)
        self.__func__ = method
        self.__name__, self.__qualname__, self.__module__ = method.__name__, method.__qualname__, method.__module__

    def __call__(self, *args):
        generators = self._generators()
        if generators is None:
            raise RuntimeError(
                "the dropout generators of this graph's parallel module were freed: the graph outlived the "
                "module that parallelize returned; keep that module alive while its graphs run")
        return self.__func__(generators, *args)

    def __repr__(self) -> str:
        return f"<GeneratorOp {self.__qualname__}>"


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


__all__ = ["GeneratorOp", "RankGenerators", "RngState"]
