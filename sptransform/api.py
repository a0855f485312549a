"""``parallelize``: the public entry point. Options are validated here, once (``sptransform.options``)."""

from __future__ import annotations

import dataclasses
import functools
import datetime

from dataclasses import dataclass
from typing import Any, Literal

import inspect
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from sptransform.capture import FakeTemplate
from sptransform.logs import logger
from sptransform.options import DEFAULT_GRAPH_CACHE_SIZE, DEFAULT_PEER_TIMEOUT_S, ParallelOptions, PipelineOptions
from sptransform.pipeline.module import PipelinedModule
from sptransform.pipeline.schedule import check_pipeline_options
from sptransform.runtime.meta import materialize_meta_buffers
from sptransform.passes.expert_parallel import ExpertGroups
from sptransform.runtime.mesh import expert_mesh, resolve_mesh, resolve_pipeline_mesh, resolve_tp_mesh
from sptransform.runtime.module import ONE_STAGE_SCHEDULES, ParallelModule, SteppedModule
from sptransform.pipeline.plan import first_microbatch
from sptransform.runtime.checks import check_call
from sptransform.runtime.params import call_defaults, device_of, held_share
from sptransform.runtime.rendezvous import agree_on_graph, rendezvous, rendezvous_groups
from sptransform.runtime.rng import RankGenerators
from sptransform.torch_internals import local_tensor_mode, set_group_timeout, maybe_disable_local_tensor_mode, pytree
from sptransform.transform import GraphFactory

log = logger(__name__)


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
    check_inputs: bool = True,
    graph_cache_size: int = DEFAULT_GRAPH_CACHE_SIZE,
    dp: int = 1,
    ep: int = 1,
    zero: int = 0,
    shard_whole: bool = False,
    compile: Literal["inductor", "eager"] = "inductor",
    overlap: bool | None = None,
    dp_loss: Literal["tokens", "replicas"] = "tokens",
    peer_timeout_s: float | None = DEFAULT_PEER_TIMEOUT_S,
) -> "ParallelModule | PipelinedModule":
    """Turn an unmodified single-device ``model`` into one that trains across ``tp`` ranks
    with Megatron tensor parallelism (and sequence parallelism when ``sp``).

    ``example_inputs``: a tuple of positional inputs, a dict of keyword inputs, or a
    ``(args, kwargs)`` pair; it fixes which inputs the model is traced with. Omitted,
    token ids of shape ``[2, 8 * tp]`` (a multiple of tp, below the model's maximum
    length) are built for the model's input embedding and passed as the first input.
    Other shapes are captured again on first use and cached (``graph_cache_size`` of them,
    least recently used dropped); parameter placement never changes. Must be called on
    every rank of an initialized process group (``torchrun`` + ``init_process_group``)
    when ``tp > 1``: it starts by meeting every rank, and a rank whose peers never come
    fails when the process group's timeout ends the wait, saying so.

    Returns a ``ParallelModule`` whose parameters are DTensors on the TP mesh under
    the original names. It follows ``train()``/``eval()`` and ``to(dtype)`` like the
    original, checks each call's inputs (ids and labels inside the vocabulary; with
    ``check_inputs``, the same inputs on every tensor-parallel rank, one small all-gather
    per call) and has ``rng``, its generators' checkpointable state. ``recompute``
    partitions the parallel graph's forward and backward with ``sptransform.passes.remat``
    (compiled on the first call of each input shape; real ranks only: AOTAutograd cannot
    trace LocalTensorMode's simulated ranks); with ``pp`` each pipeline stage is
    partitioned on its first forward. ``compile`` chooses how those partitioned graphs are
    compiled: ``"inductor"`` (default: fused kernels, the partition unchanged) or ``"eager"``
    (op by op, for debugging); it is not used with ``recompute="none"``, where
    ``torch.compile(model)`` compiles the returned module (the input checks and graph selection
    run eagerly around the compiled graph).

    Pipeline parallelism (``pp``, ``schedule``, ``n_microbatches``, ``stages_per_rank``;
    see ``sptransform.pipeline.module``): with ``pp > 1`` returns a model trained by
    ``loss = model.step(*inputs, **kwargs)`` on a ``pp x tp`` mesh (a ``PipelinedModule``).
    ``example_inputs`` is then a global batch, labels included; it is split into
    ``n_microbatches`` (default 1) along dim 0. ``schedule``: ``"gpipe"``, ``"1f1b"``
    (default), ``"interleaved1f1b"``, ``"looped_bfs"``, ``"zbv"`` or ``"dualpipev"`` (DeepSeek-V3's:
    2 stages per rank in a V, at least ``2 * pp`` microbatches).
    ``stored_microbatches=k`` with a ``recompute`` policy is the paper's microbatch-level
    recomputation (its Appendix C): each stage keeps every activation of up to ``k``
    in-flight microbatches (a moving window) and runs the policy on the others. With
    ``pp=1`` (and ``n_microbatches`` or ``schedule`` given) the result is a ``ParallelModule``
    with ``step()``, which accumulates gradients over ``n_microbatches`` microbatches in the
    order of ``schedule`` (``"1f1b"``: forward and backward of each in turn; ``"gpipe"``: all
    forwards, then all backwards); multi-stage schedules, ``stages_per_rank`` and
    ``stored_microbatches`` describe a pipeline of several stages and are refused.

    Data parallelism (``dp``, ``zero``): ``dp`` groups of ``pp x tp`` ranks, each training on its
    own (local) batch; gradients are averaged over them during backward, one bucketed
    all-reduce per layer (``zero=0``), or, with ``zero`` 1 to 3, parameters are stored in 1/dp
    pieces (so are the optimizer's state and the gradients between steps), each layer's parameters
    gathered when it runs; ``zero=1`` and ``2`` keep them for its backward, ``zero=3`` gathers them
    again there; gradients all-reduced whole and this rank's piece kept (``zero=1``) or
    reduce-scattered (``2``, ``3``). Parameters are DTensors on the
    ``("dp", "tp")`` mesh. The mesh is ``mesh=`` (axes named from ``"dp"``, ``"pp"``, ``"tp"``)
    or ``(dp, pp, tp)`` over the whole process group, row-major: consecutive ranks form a
    tensor-parallel group, as in Megatron and torchtitan.

    ``overlap``: the graphs ``recompute`` compiles issue every collective as early and wait on it
    as late as dataflow allows (``passes.overlap``), unless ``False``; eagerly, gradient buckets
    (data-parallel, and replicated parameters' partial gradients) stay in flight through the rest
    of the backward and are waited on when it ends — with ``True``, or by default (``None``) on
    accelerators only (on CPU gloo reduces on the cores that compute: measured slower).
    ``False`` waits on each collective at once.

    Expert parallelism (``ep``, dividing ``dp``): the data-parallel ranks fall into groups of ``ep``
    consecutive data-parallel ranks; each rank of a group stores ``E/ep`` of every routed expert layer's experts
    (found on the graph: expert weights gathered by routing indices, transformers'
    ``experts_implementation="batched_mm"``, or read by a grouped matmul with per-expert offsets,
    its default ``"grouped_mm"``) and applies them to the tokens of the whole group,
    exchanged by an all-gather before the experts and a reduce-scatter after them (no token
    dropped; ``passes.expert_parallel``). Parameters are DTensors on an ``("edp", "ep", "tp")``
    mesh, experts ``Shard(0)`` on ``ep``; expert gradients are averaged over the ``dp / ep`` ranks
    holding the same experts. With ``tp > 1`` the ep groups are formed per tensor-parallel index
    (the ``("edp", "ep", "tp")`` mesh), the experts' hidden dims split over tp as well.

    ``shard_whole`` (``tp > 1``): the parameters tensor parallelism uses whole on every rank (norms,
    routers, weights no rule splits: a fused multi-query QKV, data-dependent experts) are stored in
    1/tp pieces and each layer's all-gathered where it starts (``passes.shard_whole``): their
    weights, gradients and optimizer state split, their computation still whole on every rank.
    ``explain()`` lists them; ``held_share()`` measures what a rank stores. Parameters split in
    the graph in segments no DTensor placement holds (a Mamba-2 ``in_proj``) are stored in 1/tp
    pieces whatever ``shard_whole`` says: gathered where read, their gradient reduce-scattered.

    ``dp_loss`` (``dp > 1``): ``"tokens"`` weights each replica's gradient by its count of
    non-ignored targets where the loss is a token mean found on the graph (single-device
    gradients of the concatenated batch, whatever each replica's ``-100`` count or batch size);
    ``"replicas"`` averages the replicas' gradients. ``peer_timeout_s`` (``dp > 1``): how long a
    rank waits for its data-parallel peers before raising, naming the one missing (README,
    "Faults and timeouts").

    Every argument is validated here; a bad one is a ``TypeError``/``ValueError`` naming the
    value, the rule and the fix.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    _refuse_parallel_input(model)
    options = ParallelOptions(tp=tp, sp=sp, dropout_rng=dropout_rng, seed=seed, recompute=recompute,
                              check_inputs=check_inputs, graph_cache_size=graph_cache_size, dp=dp, ep=ep, zero=zero,
                              shard_whole=shard_whole, compile=compile, overlap=overlap,
                              dp_loss=dp_loss, peer_timeout_s=peer_timeout_s)
    _check_mesh(mesh)
    pipeline = _pipeline_options(options, pp, schedule, n_microbatches, stages_per_rank, stored_microbatches)
    device = device_of(model)
    materialize_meta_buffers(model, device)  # a meta-built model's rotary tables and masks (runtime.meta)
    args, kwargs = normalize_example_inputs(model, example_inputs, tp)
    check_example_inputs(model, args, kwargs)
    groups = rendezvous_groups(mesh)
    rendezvous(groups, {
        "options": (options, pipeline),
        "models": [(name, tuple(t.shape), str(t.dtype)) for name, t in
                   [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]],
        "example input shapes": [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                                 for x in pytree.tree_leaves((args, kwargs))],
    }, device)
    start = time.perf_counter()
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    meshes = _meshes(options, pipeline, mesh, device)
    # Pipeline stages are cut from the graph around its loss output, which the token weighting
    # replaces (passes.token_weighting): pipelines average the replicas' gradients (README).
    graph_options = options if meshes.pipeline is None else dataclasses.replace(options, dp_loss="replicas")
    factory = _factory(model, graph_options, meshes.tp, device, meshes.dp_group, meshes.experts)
    if groups:  # every rank's first graph compared before the module built on it runs any collective
        ranks = list(range(dist.get_world_size())) if mesh is None else mesh.mesh.flatten().tolist()
        factory.check_first = functools.partial(agree_on_graph, groups, ranks, device=device)
    common = dict(factory=factory, options=options, param_mesh=meshes.param)
    if meshes.pipeline is not None:
        module = PipelinedModule(model, pipeline=pipeline, mesh=meshes.pipeline, example_args=args,
                                 example_kwargs=kwargs, full_mesh=meshes.full, **common)
    elif pipeline is not None:  # pp=1 with n_microbatches: a whole step per call, microbatch by microbatch
        mb_args, mb_kwargs, _ = first_microbatch(args, {**call_defaults(model), **kwargs}, pipeline.n_microbatches)
        module = SteppedModule(model, mesh=meshes.tp, example_args=mb_args, example_kwargs=mb_kwargs,
                               n_microbatches=pipeline.n_microbatches, schedule=pipeline.schedule, **common)
    else:
        module = ParallelModule(model, mesh=meshes.tp, example_args=args, example_kwargs=kwargs, **common)
    log.info("parallelize(%s): tp=%d pp=%d dp=%d zero=%d sp=%s recompute=%r; this rank holds %.3f of the parameter "
             "bytes; ready in %.1f s", type(model).__name__, tp, pp, dp, zero, sp, recompute, held_share(module, whole_bytes),
             time.perf_counter() - start)
    return module


@dataclass(frozen=True)
class _Meshes:
    """Where a parallel module works: ``tp`` (its tensor-parallel mesh, None for tp=1 without
    one), ``pipeline`` (the ``(pp, tp)`` mesh of a pipeline, else None), ``param`` (with data
    parallelism, the ``(dp, tp)`` mesh parameters live on), ``full`` (the whole ``(dp, pp, tp)``
    mesh with data parallelism) and ``dp_group`` (the data-parallel process group's name)."""

    tp: DeviceMesh | None
    pipeline: DeviceMesh | None = None
    param: DeviceMesh | None = None
    full: DeviceMesh | None = None
    dp_group: str | None = None
    experts: ExpertGroups | None = None


def _meshes(options: ParallelOptions, pipeline: PipelineOptions | None, mesh, device) -> _Meshes:
    """The meshes of the module to build. With ``dp > 1`` the (dp, pp, tp) mesh: the module's
    tensor-parallel work on its tp axis, its parameters on the (dp, tp) axes, gradients averaged
    (or ZeRO-3 pieces gathered) on dp."""
    pp = pipeline.pp if pipeline is not None else 1
    if options.dp == 1:
        if pp > 1:
            pipeline_mesh = resolve_pipeline_mesh(pp, options.tp, mesh, device)
            return _Meshes(pipeline_mesh["tp"], pipeline_mesh)
        return _Meshes(resolve_tp_mesh(options.tp, mesh, device))
    if local_tensor_mode() is not None:
        raise ValueError("dp > 1 needs real ranks (torchrun, gloo or nccl): simulated ranks run tensor "
                         "parallelism only; use sptransform.verify(model, tp=...) for the tensor-parallel part")
    if options.ep > 1 and mesh is not None:
        raise ValueError(f"ep={options.ep} with mesh=: expert parallelism builds its own (edp, ep, pp, tp) mesh over "
                         "the whole process group so far; leave mesh=None")
    full = resolve_mesh(options.dp, pp, options.tp, mesh, device)
    if mesh is None and options.peer_timeout_s is not None:  # a group of ours: replicas wait peer_timeout_s
        set_group_timeout(full["dp"].get_group(), datetime.timedelta(seconds=options.peer_timeout_s))
    if options.ep > 1:
        ep_mesh = expert_mesh(options.dp, options.ep, pp, options.tp, device)
        groups = ExpertGroups(group=ep_mesh["ep"].get_group().group_name, rank=ep_mesh["ep"].get_local_rank(),
                              replicas=ep_mesh["edp"].get_group().group_name)
        return _Meshes(full["tp"], full["pp", "tp"] if pp > 1 else None, ep_mesh["edp", "ep", "tp"], full,
                       full["dp"].get_group().group_name, groups)
    return _Meshes(full["tp"], full["pp", "tp"] if pp > 1 else None, full["dp", "tp"], full,
                   full["dp"].get_group().group_name)


def _refuse_parallel_input(model: nn.Module) -> None:
    """A module that is already parallel (``parallelize``'s result, or one holding DTensor
    parameters from another tool) cannot be captured again: its parameters are shards."""
    from torch.distributed.tensor import DTensor

    if isinstance(model, (ParallelModule, PipelinedModule)):
        raise TypeError(
            f"parallelize got a {type(model).__name__}, which sptransform.parallelize already returned: "
            "parallelize the original model once, with every option at once (tp=, sp=, pp=, dp=, recompute=...)")
    sharded = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise TypeError(
            f"{len(sharded)} parameter(s) of the model are already DTensors (e.g. {sharded[0]!r}): parallelize "
            "takes an unmodified single-device model; pass the model before any other parallelization")


def _check_mesh(mesh) -> None:
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh (1-D of tp ranks, or 2-D ('pp', 'tp')), got "
            f"{type(mesh).__name__}: build one with init_device_mesh, or leave mesh=None to use the whole process group"
        )


def _pipeline_options(options: ParallelOptions, pp, schedule, n_microbatches, stages_per_rank,
                      stored_microbatches) -> PipelineOptions | None:
    """The pipeline options, validated, or None when none was given. With ``pp=1`` only
    ``n_microbatches`` means something (gradient accumulation in ``step()``); the others
    describe a pipeline and are refused rather than ignored."""
    if (pp, schedule, n_microbatches, stages_per_rank, stored_microbatches) == (1, None, None, None, None):
        return None
    pipeline = PipelineOptions(pp=pp, schedule=schedule if schedule is not None else "1f1b",
                               n_microbatches=1 if n_microbatches is None else n_microbatches,
                               stages_per_rank=stages_per_rank, stored_microbatches=stored_microbatches)
    if stored_microbatches is not None and options.recompute == "none":
        raise ValueError(
            f"stored_microbatches={stored_microbatches} keeps every activation of that many microbatches and "
            "recomputes the others, but recompute='none' recomputes nothing: pass recompute='selective' or 'full'"
        )
    if pipeline.pp == 1:
        refused = [f"{name}={value!r}" for name, value in (("stages_per_rank", stages_per_rank),
                                                           ("stored_microbatches", stored_microbatches))
                   if value is not None]
        if schedule is not None and pipeline.schedule not in ONE_STAGE_SCHEDULES:
            refused.insert(0, f"schedule={schedule!r}")
        if refused:
            raise ValueError(
                f"{', '.join(refused)} describe{'s' if len(refused) == 1 else ''} a pipeline of several stages, and "
                "pp=1 has one: pass pp > 1, or drop them (with pp=1, step() runs n_microbatches= microbatches in "
                "the order of schedule='1f1b' (default) or 'gpipe')"
            )
        return pipeline
    check_pipeline_options(pipeline)
    return pipeline


def _factory(model: nn.Module, options: ParallelOptions, tp_mesh: DeviceMesh | None, device: torch.device,
             dp_group: str | None = None, experts: ExpertGroups | None = None) -> GraphFactory:
    """The graph factory of one parallel module: a fake copy of ``model`` to trace, and this
    rank's dropout generators (one per simulated rank under LocalTensorMode), owned by the
    module through the factory (graphs call their methods, so they live as long as the module)."""
    with maybe_disable_local_tensor_mode():
        template = FakeTemplate(model, device)
    seed = options.seed if options.seed is not None else torch.initial_seed()
    rank = None if tp_mesh is None or local_tensor_mode() is not None else tp_mesh.get_local_rank()
    generators = RankGenerators(seed, options.tp, rank)
    group = tp_mesh.get_group().group_name if tp_mesh is not None else None
    return GraphFactory(template, options, group, generators, device, dp_group, experts)


def check_example_inputs(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """``example_inputs`` must bind to ``model.forward`` and hold tensors and plain values only."""
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None))):
            raise TypeError(
                f"example_inputs holds a {type(leaf).__name__} ({leaf!r:.80}); sptransform captures tensors and plain "
                "values (int, float, bool, str, None) in tuples, lists and dicts: pass those"
            )
    for key in kwargs:
        if not isinstance(key, str):
            raise TypeError(f"example_inputs keyword names must be str, got {key!r}")
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return  # a forward without a readable signature: capture will tell
    try:
        signature.bind(*args, **{**call_defaults(model), **kwargs})
    except TypeError as err:
        raise TypeError(
            f"example_inputs do not fit {type(model).__name__}.forward{signature}: {err}; pass a tuple of positional "
            "inputs, a dict of keyword inputs, or (args, kwargs), as you would call the model"
        ) from None
    check_call(args, {**call_defaults(model), **kwargs}, call_defaults(model), example=True)


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
