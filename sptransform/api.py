"""``parallelize``: the public entry point, and its options, validated once here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    tp: int
    """Tensor-parallel degree: ranks that split every linear."""
    sp: bool = True
    """Sequence parallelism: norms, dropouts and residuals split along the sequence."""
    dropout_rng: Literal["independent", "reference"] = "independent"
    """``independent``: split activations draw masks from a per-rank generator;
    ``reference``: masks equal the single-device model's bit for bit (tests)."""
    seed: int | None = None
    """Seed of the per-rank dropout generators; default ``torch.initial_seed()``."""
    recompute: str | float | int = "none"
    """Rematerialisation of the parallel graph (``sptransform.passes.remat``): ``"none"``,
    ``"selective"`` (attention internals), ``"full"`` (all but each layer's input),
    ``"norm_upproj"``, or a memory budget: bytes per rank (int > 1) or a fraction of
    ``"none"`` (float in (0, 1])."""

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int):
            raise TypeError(f"tp must be an int, got {self.tp!r} ({type(self.tp).__name__})")
        if self.tp < 1:
            raise ValueError(f"tp={self.tp} must be at least 1")
        if not isinstance(self.sp, bool):
            raise TypeError(f"sp must be True or False, got {self.sp!r}")
        if self.dropout_rng not in ("independent", "reference"):
            raise ValueError(f"dropout_rng={self.dropout_rng!r}: use 'independent' or 'reference'")
        if isinstance(self.recompute, str):
            if self.recompute not in RECOMPUTE_POLICIES:
                raise ValueError(
                    f"recompute={self.recompute!r} is not a policy: use one of {list(RECOMPUTE_POLICIES)} "
                    "or a memory budget (bytes per rank, or a fraction of 'none' in (0, 1])"
                )
        elif isinstance(self.recompute, bool) or not isinstance(self.recompute, (int, float)) or self.recompute <= 0:
            raise ValueError(f"recompute={self.recompute!r}: a budget must be a positive number of bytes or a fraction")


RECOMPUTE_POLICIES = ("none", "selective", "full", "norm_upproj")


def parallelize(
    model: nn.Module,
    *,
    tp: int,
    sp: bool = True,
    example_inputs: Any = None,
    mesh: DeviceMesh | None = None,
    dropout_rng: Literal["independent", "reference"] = "independent",
    seed: int | None = None,
    recompute: str | float | int = "none",
    pp: int = 1,
    schedule: str | None = None,
    n_microbatches: int | None = None,
    stages_per_rank: int | None = None,
    stored_microbatches: int | None = None,
) -> "nn.Module":
    """Turn an unmodified single-device ``model`` into one that trains across ``tp`` ranks
    with Megatron tensor parallelism (and sequence parallelism when ``sp``).

    ``example_inputs``: a tuple of positional inputs, a dict of keyword inputs, or a
    ``(args, kwargs)`` pair; it fixes which inputs the model is traced with. Omitted,
    token ids of shape ``[2, 8 * tp]`` (a multiple of tp, below the model's maximum
    length) are built for the model's input embedding and passed as the first input.
    Other shapes are captured again on first use and cached; parameter placement
    never changes. Must be called on every rank of an initialized process group
    (``torchrun`` + ``init_process_group``) when ``tp > 1``.

    Returns a ``ParallelModule`` whose parameters are DTensors on the TP mesh under
    the original names. ``recompute`` partitions the parallel graph's forward and backward
    with ``sptransform.passes.remat`` (compiled on the first call of each input shape;
    real ranks only: AOTAutograd cannot trace LocalTensorMode's simulated ranks); with
    ``pp`` each pipeline stage is partitioned on its first forward.

    Pipeline parallelism (``pp``, ``schedule``, ``n_microbatches``, ``stages_per_rank``;
    see ``sptransform.pipeline.module``): with ``pp > 1``, or any of the others given, returns a
    model trained by ``loss = model.step(*inputs, **kwargs)`` on a ``pp x tp`` mesh (a
    ``PipelinedModule``; for ``pp=1`` a ``ParallelModule`` with ``step``). ``example_inputs``
    is then a global batch, labels included; it is split into ``n_microbatches``
    (default 1) along dim 0. ``schedule``: ``"gpipe"``, ``"1f1b"`` (default),
    ``"interleaved1f1b"``, ``"looped_bfs"`` or ``"zbv"``. ``stored_microbatches=k`` with a
    ``recompute`` policy is the paper's microbatch-level recomputation (its Appendix C): each
    stage keeps every activation of up to ``k`` in-flight microbatches (a moving window) and
    runs the policy on the others.
    """
    from sptransform.runtime.module import ParallelModule

    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    options = ParallelOptions(tp=tp, sp=sp, dropout_rng=dropout_rng, seed=seed, recompute=recompute)
    pipelined = (pp, schedule, n_microbatches, stages_per_rank, stored_microbatches) != (1, None, None, None, None)
    if stored_microbatches is not None and recompute == "none":
        raise ValueError(
            f"stored_microbatches={stored_microbatches} keeps every activation of that many microbatches and "
            "recomputes the others, but recompute='none' recomputes nothing: pass recompute='selective' or 'full'"
        )
    if pipelined:
        from sptransform.pipeline.module import PipelineOptions, pipeline_parallelize

        pipeline = PipelineOptions(pp=pp, schedule=schedule or "1f1b", n_microbatches=n_microbatches or 1,
                                   stages_per_rank=stages_per_rank, stored_microbatches=stored_microbatches)
        args, kwargs = normalize_example_inputs(model, example_inputs, tp)
        return pipeline_parallelize(model, options=options, pipeline=pipeline, mesh=mesh,
                                    example_args=args, example_kwargs=kwargs)
    mesh = _resolve_mesh(options, mesh, model)
    args, kwargs = normalize_example_inputs(model, example_inputs, tp)
    return ParallelModule(model, options=options, mesh=mesh, example_args=args, example_kwargs=kwargs)


def _resolve_mesh(options: ParallelOptions, mesh: DeviceMesh | None, model: nn.Module) -> DeviceMesh | None:
    tp = options.tp
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
    device = _device_of(model)
    device_type = "cuda" if device.type == "cuda" else "cpu"
    return init_device_mesh(device_type, (tp,), mesh_dim_names=("tp",))


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device if p.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")


def normalize_example_inputs(model: nn.Module, example_inputs: Any, tp: int) -> tuple[tuple, dict]:
    if example_inputs is None:
        return (default_token_ids(model, tp),), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], tuple)
        and isinstance(example_inputs[1], dict)
    ):
        return example_inputs[0], example_inputs[1]
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple of positional inputs, a dict of keyword inputs or "
        f"(args, kwargs); got {type(example_inputs).__name__}"
    )


def default_token_ids(model: nn.Module, tp: int) -> torch.Tensor:
    """Token ids ``[2, 8*tp]`` drawn below the input embedding's vocabulary.

    The rule: the vocabulary is the row count of ``model.get_input_embeddings()``
    when the model has that (HF), else of the first ``nn.Embedding`` in module order."""
    embedding = None
    getter = getattr(type(model), "get_input_embeddings", None)
    if callable(getter):
        embedding = model.get_input_embeddings()
    if embedding is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            "example_inputs was omitted and the model has no nn.Embedding to build token ids "
            "from: pass example_inputs="
        )
    device = _device_of(model)
    return torch.randint(0, embedding.num_embeddings, (2, 8 * tp), device=device)
