"""``parallelize``: the public entry point. Options are validated here, once (``sptransform.options``)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from sptransform.capture import FakeTemplate
from sptransform.options import ParallelOptions, PipelineOptions
from sptransform.pipeline.module import PipelinedModule
from sptransform.pipeline.schedule import check_pipeline_options
from sptransform.runtime.mesh import resolve_pipeline_mesh, resolve_tp_mesh
from sptransform.runtime.module import ParallelModule, SteppedModule
from sptransform.runtime.ops import RankGenerators, register_generators
from sptransform.runtime.params import device_of
from sptransform.torch_internals import local_tensor_mode, maybe_disable_local_tensor_mode
from sptransform.transform import GraphFactory


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
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    options = ParallelOptions(tp=tp, sp=sp, dropout_rng=dropout_rng, seed=seed, recompute=recompute)
    pipelined = (pp, schedule, n_microbatches, stages_per_rank, stored_microbatches) != (1, None, None, None, None)
    if stored_microbatches is not None and recompute == "none":
        raise ValueError(
            f"stored_microbatches={stored_microbatches} keeps every activation of that many microbatches and "
            "recomputes the others, but recompute='none' recomputes nothing: pass recompute='selective' or 'full'"
        )
    device = device_of(model)
    if pipelined:
        pipeline = PipelineOptions(pp=pp, schedule=schedule or "1f1b", n_microbatches=n_microbatches or 1,
                                   stages_per_rank=stages_per_rank, stored_microbatches=stored_microbatches)
        check_pipeline_options(pipeline)
        args, kwargs = normalize_example_inputs(model, example_inputs, tp)
        if pipeline.pp == 1:
            tp_mesh = resolve_tp_mesh(tp, mesh, device)
            return SteppedModule(model, factory=_factory(model, options, tp_mesh, device), options=options,
                                 mesh=tp_mesh, example_args=args, example_kwargs=kwargs)
        mesh = resolve_pipeline_mesh(pipeline.pp, tp, mesh, device)
        return PipelinedModule(model, factory=_factory(model, options, mesh["tp"], device), options=options,
                               pipeline=pipeline, mesh=mesh, example_args=args, example_kwargs=kwargs)
    mesh = resolve_tp_mesh(tp, mesh, device)
    args, kwargs = normalize_example_inputs(model, example_inputs, tp)
    return ParallelModule(model, factory=_factory(model, options, mesh, device), options=options, mesh=mesh,
                          example_args=args, example_kwargs=kwargs)


def _factory(model: nn.Module, options: ParallelOptions, tp_mesh: DeviceMesh | None, device: torch.device) -> GraphFactory:
    """The graph factory of one parallel module: a fake copy of ``model`` to trace, and this
    rank's dropout generators (one per simulated rank under LocalTensorMode)."""
    with maybe_disable_local_tensor_mode():
        template = FakeTemplate(model, device)
    seed = options.seed if options.seed is not None else torch.initial_seed()
    rank = None if tp_mesh is None or local_tensor_mode() is not None else tp_mesh.get_local_rank()
    generators = register_generators(RankGenerators(seed, options.tp, rank))
    group = tp_mesh.get_group().group_name if tp_mesh is not None else None
    return GraphFactory(template, options, group, generators, device)


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
    device = device_of(model)
    return torch.randint(0, embedding.num_embeddings, (2, 8 * tp), device=device)
