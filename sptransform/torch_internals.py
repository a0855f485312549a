"""Every private torch API sptransform uses, in one place, each with why and what would replace it.

sptransform is tested on one torch minor version (``TESTED_TORCH``); private APIs can change
in any release, so importing sptransform on another version is a clear error here rather
than an ``AttributeError`` deep inside a pass. Set ``SPTRANSFORM_ALLOW_UNTESTED_TORCH=1`` to
import anyway: a warning names the private APIs that torch lacks, and each of them raises an
``ImportError`` naming it when used, so what does not need them runs.

No other module of sptransform imports a private torch name (``torch._*`` modules or
``_``-prefixed attributes); ``tests/test_torch_internals.py`` checks that.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import warnings
import weakref
from typing import NamedTuple

import torch

TESTED_TORCH = (2, 13)
"""The torch minor version sptransform is tested on (``pyproject.toml`` pins ``>=2.13,<2.14``)."""


def _check_version() -> None:
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version == TESTED_TORCH:
        return
    wanted = ".".join(map(str, TESTED_TORCH))
    message = (
        f"sptransform is tested on torch {wanted}.x and relies on private torch APIs that change between "
        f"releases; found torch {torch.__version__}. Install torch=={wanted}.* (e.g. `pip install torch=={wanted}.0`)"
    )
    if os.environ.get("SPTRANSFORM_ALLOW_UNTESTED_TORCH") == "1":
        warnings.warn(message + "; continuing because SPTRANSFORM_ALLOW_UNTESTED_TORCH=1", RuntimeWarning, stacklevel=3)
        return
    raise ImportError(message + ", or set SPTRANSFORM_ALLOW_UNTESTED_TORCH=1 to try anyway")


_check_version()


class _Missing:
    """A private torch API this torch lacks (only with ``SPTRANSFORM_ALLOW_UNTESTED_TORCH=1``):
    using it raises, naming it, so what does not need it still runs on that torch."""

    def __init__(self, name: str, error: Exception):
        self._name, self._error = name, error

    def _fail(self):
        raise ImportError(f"{self._name} is not in torch {torch.__version__} ({self._error}); sptransform needs it "
                          f"here: install torch=={'.'.join(map(str, TESTED_TORCH))}.*")

    def __call__(self, *args, **kwargs):
        self._fail()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        self._fail()


def _import_each() -> list[str]:
    """The module's first ``try`` block again, one imported name at a time: each name this torch
    has is bound, each it lacks becomes a ``_Missing``. Returns the missing names."""
    import ast
    import importlib

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    block = next(node for node in tree.body if isinstance(node, ast.Try))
    missing = []
    for statement in ast.walk(ast.Module(body=block.body, type_ignores=[])):
        if isinstance(statement, ast.ImportFrom):
            pairs = [(statement.module, alias.name, alias.asname or alias.name) for alias in statement.names]
        elif isinstance(statement, ast.Import):
            pairs = [(alias.name, None, alias.asname) for alias in statement.names]
        else:
            continue
        for module, name, bound in pairs:
            label = f"{module}.{name}" if name else module
            try:
                value = importlib.import_module(module)
                if name is not None:  # from module import name: an attribute or a submodule
                    value = getattr(value, name) if hasattr(value, name) else importlib.import_module(label)
                elif bound is None:  # import a.b binds a
                    bound, value = module.split(".")[0], importlib.import_module(module.split(".")[0])
            except (ImportError, AttributeError) as error:
                value = _Missing(label, error)
                missing.append(label)
            bound = bound or name or module.split(".")[0]
            globals()[bound] = value
    return missing


try:
    # -- tracing and fake tensors -------------------------------------------------------
    # FakeTensorMode: a copy of the user's model with storage-less parameters is traced, so one
    # rank of a 175B model traces on a laptop. Public replacement: none (torch.export takes fake
    # inputs only through this mode).
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    # detect_fake_mode: find the fake mode of a graph's example values to make more fake inputs.
    # Public replacement: none.
    from torch._guards import detect_fake_mode

    # pytree: flatten/unflatten the user's (args, kwargs) exactly as torch.export does.
    # Public replacement: torch.utils.pytree (planned public module; not complete in 2.13).
    from torch.utils import _pytree as pytree

    # -- in-process simulation of ranks -----------------------------------------------------
    # LocalTensorMode runs N simulated ranks in one process (tests, verify); graphs must run
    # under it and tracing must step out of it. Public replacement: none yet.
    from torch.distributed._local_tensor import (
        LocalTensor,
        LocalTensorMode,
        local_tensor_mode,
        maybe_disable_local_tensor_mode,
        tensor_map,
    )

    # FakeStore: the store of the "fake" process group, used to trace one rank of a large model
    # without hardware (measure, verify). Public replacement: none (lives in torch.testing._internal).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # -- DTensor ----------------------------------------------------------------------------
    # _StridedShard: the placement of a fused [q|k|v] weight split per head inside each segment.
    # Public replacement: none (DTensor exposes only Shard/Replicate/Partial).
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

    # -- collectives -------------------------------------------------------------------------
    # Functional collectives keep graphs traceable (torch.compile, AOTAutograd). The module is
    # the documented way to use them, though its name is private.
    import torch.distributed._functional_collectives as funcol

    # _resolve_process_group: a group name (what functional collectives take) -> the group, to
    # read this rank's index. Public replacement: dist.get_group_rank on a ProcessGroup object.
    from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group

    # -- AOTAutograd and the partitioners ----------------------------------------------------
    # aot_module_simplified: the joint forward+backward graph and a partition_fn hook; it is what
    # torch.compile's backends call. Public replacement: functorch.compile.aot_module_simplified
    # re-exports it (same object); kept here so every AOTAutograd entry is in one place.
    from torch._functorch.aot_autograd import aot_module_simplified
    from functorch.compile import make_boxed_func

    # TracingContext: what a compiler hands strides back through (see ``stride_reporting``).
    # Public replacement: none.
    from torch._guards import TracingContext, tracing

    # torch's own partitioners (for measuring against them) and the pieces of theirs our
    # partition reuses: node classification, forward/backward extraction, RNG functionalization,
    # the backward reordering that mimics the autograd engine. Public replacement: none.
    from torch._functorch import partitioners as partitioners
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    # functorch config: donated buffers must be off when a stage's backward is split in two
    # (zero-bubble schedules retain the graph); torch's activation budget for comparisons.
    # Public replacement: none.
    from torch._functorch import config as functorch_config

    # rng_prims: the higher-order ops that run a random op with a saved or replayed generator
    # state (what exact dropout replay is made of). Public replacement: none.
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    # -- pipelining -------------------------------------------------------------------------
    # The stage->rank mapping of loop and V placements, and the action order torch's multi-stage
    # schedules execute (so memory and balance follow what runs). Public replacement: none.
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    # -- DTensor's sharding propagator (graph/dtensor_rules/) ----------------------------------
    # The registry of per-op sharding strategies and DTensor's own choice among them, queried
    # without a process group: the propagator object and its strategy types, the expansion of
    # single-dim rules, and the decomposition path. The propagator's methods used there
    # (_wrap_with_op_strategy, propagate_op_sharding_non_cached, decomp_strategy's
    # ensure_schema_info / _get_fake_mesh / _propagate_through_decomp) are listed in that
    # module. Public replacement: a "strategies for (op, input specs, mesh)" query (none in 2.13).
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo, TupleStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _fill_single_dim_strategy_placeholders as fill_single_dim_strategy_placeholders,
        _insert_single_dim_replication_strategy as insert_single_dim_replication_strategy,
    )
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    # Data-dependent shapes (MoE routing, nonzero): recognized to refuse them clearly.
    # Public replacement: none (not in symbolic_shapes' __all__).
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

    # Suspend fake/proxy dispatch modes while building a real (tiny) tensor, e.g. a mesh's rank
    # map, in the middle of tracing. Public replacement: none.
    from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

    # The type of ``node.target`` for an ATen op. Public replacement: none (torch.ops.* objects'
    # type is only reachable through torch._ops).
    from torch._ops import OpOverload

    # preserve_node_ordering: wraps a node in the control_deps higher-order op, which inductor's
    # scheduler orders after the given nodes. Inductor re-sorts a graph by its own estimates (peak
    # memory, locality) and left every wait right behind its collective (the overlap pass had put
    # the independent work between them). torch's own overlap scheduler keeps its order through
    # inductor the same way (``insert_overlap_deps``). CustomGraphPass: how inductor takes a
    # post-grad pass (``config.post_grad_custom_post_pass``) and keys its caches by it.
    # Public replacement: none.
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch._inductor.custom_graph_pass import CustomGraphPass

    # StorageWeakRef: identify a storage (what autograd saves) without keeping it alive.
    # Public replacement: none (torch.multiprocessing.reductions is internal plumbing).
    from torch.multiprocessing.reductions import StorageWeakRef
except (ImportError, AttributeError) as error:  # pragma: no cover - only on an untested torch
    if os.environ.get("SPTRANSFORM_ALLOW_UNTESTED_TORCH") != "1":
        raise ImportError(
            f"sptransform needs a private torch API that torch {torch.__version__} does not have ({error}); "
            f"install torch=={'.'.join(map(str, TESTED_TORCH))}.*, or set SPTRANSFORM_ALLOW_UNTESTED_TORCH=1 to "
            "import anyway (what needs the missing API then fails when used)"
        ) from error
    _MISSING = _import_each()
    warnings.warn(f"torch {torch.__version__} lacks {len(_MISSING)} private API(s) sptransform uses: "
                  f"{', '.join(_MISSING)}; what needs them raises ImportError when used", RuntimeWarning, stacklevel=2)


def sharding_propagator():
    """DTensor's ``ShardingPropagator`` (``DTensor._op_dispatcher.sharding_propagator``)."""
    return _DTensor._op_dispatcher.sharding_propagator


def abstract_device_mesh(device_type: str, tp: int):
    """A 1-D DeviceMesh of ``tp`` ranks with no process group behind it, as DTensor builds its
    own decomposition mesh (``_init_backend=False``, this process as rank 0). Public
    replacement: none (``init_device_mesh`` always creates process groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, list(range(tp)), _init_backend=False, _rank=0)


def register_lazy_dtensor_strategies() -> None:
    """DTensor registers one strategy lazily in 2.13 (``prims.fma``, when inductor's prims
    are imported); importing them registers it. Public replacement: eager registration."""
    import torch._inductor.inductor_prims  # noqa: F401


def dynamo_static_input(x) -> bool:
    """Dynamo's mark on inlined nn.Module buffers (``_dynamo_static_input_type``, set in
    torch/_dynamo/variables/builder.py): the backend treats them as state. Public replacement:
    none (dynamo does not expose which graph inputs are module state)."""
    return getattr(x, "_dynamo_static_input_type", None) is not None


def local_values(t) -> "dict[int, torch.Tensor] | None":
    """Each simulated rank's tensor of a ``LocalTensor`` (``LocalTensor._local_tensors``), else None:
    input checks and ``pm.rng`` read every simulated rank's value without a collective.
    Public replacement: none (LocalTensor is itself private)."""
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return None


def dtensor_as(cls, dtensor):
    """A DTensor of subclass ``cls`` sharing ``dtensor``'s local tensor and spec (no copy): the
    checkpoint view (``runtime.checkpoint.ChunkedDTensor``) that tells DCP which boxes a
    ``_StridedShard`` holds. Reads ``DTensor._local_tensor``/``_spec``. Public replacement: none
    (``DTensor.from_local`` makes a new local view and a plain DTensor)."""
    return cls(dtensor._local_tensor, dtensor._spec, requires_grad=False)


def plain_dtensor(dtensor):
    """``dtensor`` (a DTensor subclass) as a plain ``DTensor`` on the same local tensor and spec, to
    pickle and deep-copy as torch does (``torch.load(weights_only=True)`` accepts DTensor only)."""
    return _DTensor(dtensor._local_tensor, dtensor._spec, requires_grad=dtensor.requires_grad)


_RNG_REPLAY = (run_and_save_rng_state, run_with_rng_state)


def inductor_decomposed(gm, example_inputs):
    """``gm`` re-traced on ``example_inputs`` with inductor's decomposition table (``make_fx``,
    under the inputs' fake mode, so that constants a decomposition makes are fake too): the
    graph inductor compiles. Its values may be laid out otherwise than ``gm``'s: a decomposition
    need not return the strides of the ATen kernel it replaces. Public replacement: none."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(example_inputs)
    with mode if mode is not None else contextlib.nullcontext():
        return make_fx(gm, decomposition_table=select_decomp_table())(*example_inputs)


def inductor_rewrites(gm):
    """Inductor's joint-graph rewrites (``joint_graph_passes``: no-op removal, uniform-constant
    folding, its pattern library), run on a forward or backward graph partitioned outside
    inductor, which ``compile_fx_forward``/``_backward`` would otherwise compile without them.
    The one that matters most: a decomposed ``nll_loss_backward`` is a ``scatter`` into a
    zero-filled tensor, which inductor materialises as a whole (tokens x vocabulary, float32:
    1000 MiB at 8192 tokens and a 32000 vocabulary, measured on an H200) unless the rewrite makes
    it the pointwise ``where(iota == target, ...)`` it fuses into the softmax's backward.
    Random ops are not replaced (``fallback_random`` is set around every call; see
    ``inductor_graph_compilers``). Public replacement: none (``torch.compile`` runs them only
    on the joint graph it partitions itself)."""
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V

    placeholders = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(placeholders)
    with V.set_fake_mode(mode) if mode is not None else contextlib.nullcontext():
        return joint_graph_passes(gm)


def statistics_decompositions() -> dict:
    """The composite ops whose reductions yield small per-row statistics, as their primitives,
    with their backwards: ``_log_softmax`` (``amax``, ``sub``, ``exp``, ``sum``, ``log``) and
    ``native_layer_norm`` (``var_mean``, ``rsqrt``, then pointwise). Traced so, a partition can
    save the statistics and recompute only the pointwise rest in the backward, where the one
    composite op could only be saved whole (a loss's log-softmax: tokens x vocabulary, float32)
    or recomputed whole, its reduction a second pass over its input (a layer norm's output,
    which the next matmul's backward reads, was recomputed so). Public replacement: none
    (``torch._decomp`` is the table torch.export and AOTAutograd read)."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    return get_decompositions([aten._log_softmax, aten._log_softmax_backward_data, aten.native_layer_norm,
                               aten.native_layer_norm_backward])


def inductor_decompositions() -> dict:
    """Inductor's decomposition table: what ``torch.compile``'s AOTAutograd traces the joint graph
    with (``partition_module`` measures torch's partitions on such graphs, as torch.compile makes
    them). Public replacement: none."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_partition(joint, joint_inputs, **kwargs):
    """``torch.compile``'s own partition of a joint graph traced with ``inductor_decompositions``:
    inductor's joint-graph passes (its random ops replaced, patterns fused), then
    ``min_cut_rematerialization_partition(compiler="inductor")``, under the inputs' fake mode as
    inductor runs them. What plain ``torch.compile(model)`` saves for backward, to measure against
    (``activation_memory_budget`` in ``functorch_config`` applies). Public replacement: none."""
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)):
        return compile_fx.partition_fn(joint, joint_inputs, **kwargs)


def keep_order(graph, after: dict) -> None:
    """Make inductor run each node of ``after`` (a dict in graph order: node -> the nodes it must
    follow) after those nodes, whatever its scheduler would choose (``preserve_node_ordering``:
    each such node becomes a ``control_deps`` call of a one-node subgraph, under its name)."""
    from torch.utils._ordered_set import OrderedSet

    if after:
        preserve_node_ordering(graph, {node: OrderedSet(deps) for node, deps in after.items()})


class _PostGradPass(CustomGraphPass):
    """A post-grad graph pass for inductor's ``post_grad_custom_post_pass``, keyed in its caches
    by ``key`` (the pass's name and version)."""

    def __init__(self, fn, key: str):
        self.fn, self.key = fn, key

    def __call__(self, graph) -> None:
        self.fn(graph)

    def uuid(self) -> str:
        return self.key


def inductor_graph_compilers(num_user_outputs: int, model=None, post_grad_pass=None):
    """Inductor's compilers for a forward and a backward graph partitioned by someone else:
    ``(fw_compiler, bw_compiler)`` for AOTAutograd, what ``compile_fx`` builds around its own
    partitioner (``compile_fx_forward`` / ``compile_fx_backward`` sharing one
    ``CompilerConfigExtra``: inductor's post-grad passes, codegen, cudagraph bookkeeping).
    Each graph is first re-traced with inductor's decomposition table (``inductor_decomposed``):
    the joint graph was traced without it, so that the partition reads the model's own ops
    (``native_layer_norm``, ``_softmax``, SDPA), and re-tracing a partitioned graph keeps its
    inputs and outputs, so the saved tensors stay the partition's (not their strides: the
    forward reports its own, see ``stride_reporting``). ``num_user_outputs``: the forward outputs that are the
    module's own (the rest are saved tensors). Public replacement: none (``torch.compile`` takes
    a partitioner only as inductor's ``config.custom_partitioner_fn``, which partitions the
    joint graph after inductor's decompositions and joint-graph passes). ``post_grad_pass``:
    ``(graph_pass, key)``, run on each graph after inductor's own post-grad passes (where its
    decompositions are in the graph and its scheduler comes next), keyed in its caches by ``key``."""
    from torch._inductor import compile_fx as inductor
    from torch._inductor import config as inductor_config

    # torch 2.13 reads the model's cudagraph annotation; torch 2.11 took inductor's config module
    # (only reached with SPTRANSFORM_ALLOW_UNTESTED_TORCH=1, to measure on an older torch).
    takes_config = next(iter(inspect.signature(inductor.create_compiler_config_extra).parameters)) == "config"
    extra = inductor.create_compiler_config_extra(inductor_config if takes_config else model)

    # fallback_random: the random ops (dropout masks, drawn from the generators that
    # ``passes.dropout`` and the remat replay set) run as ATen's, so the masks are eager's;
    # inductor's own RNG would draw others (and its lowering expects the joint-graph pass that
    # replaces them, which a graph partitioned outside inductor has not been through).
    # No reordering where the remat replays RNG: the post-grad locality pass keeps random
    # OpOverloads in order but moves the higher-order run_and_save_rng_state/run_with_rng_state
    # past them, and so does the scheduler's peak-memory pass, which changes the draws each
    # dropout gets (seen on HF GPT-2 with recompute="selective").
    extra_passes = {} if post_grad_pass is None else {"post_grad_custom_post_pass": _PostGradPass(*post_grad_pass)}

    def settings(gm):
        if any(n.op == "call_function" and n.target in _RNG_REPLAY for n in gm.graph.nodes):
            return inductor_config.patch(fallback_random=True, reorder_for_locality=False, reorder_for_peak_memory=False,
                                         **extra_passes)
        return inductor_config.patch(fallback_random=True, **extra_passes)

    def fw_compiler(gm, example_inputs):
        with settings(gm):
            return inductor.compile_fx_forward(
                inductor_rewrites(inductor_decomposed(gm, example_inputs)), example_inputs,
                num_orig_model_outputs=num_user_outputs,
                num_example_inputs=len(example_inputs), compiler_config_extra=extra,
            )

    def bw_compiler(gm, example_inputs):
        with settings(gm):
            return inductor.compile_fx_backward(inductor_rewrites(inductor_decomposed(gm, example_inputs)), example_inputs,
                                                compiler_config_extra=extra)

    return fw_compiler, bw_compiler


def stride_reporting(example_inputs):
    """A ``TracingContext`` around an AOTAutograd call made outside ``torch.compile`` (where dynamo
    installs none; a context already installed is kept). Through it inductor reports the strides
    it chose for the forward graph's outputs, and AOTAutograd re-strides the backward graph's
    inputs for the saved tensors to match before compiling it (``_aot_stage2b_bw_compile``).
    Without one, the backward is compiled for the joint trace's strides while inductor's forward
    lays a saved tensor out otherwise (its ``cat`` decomposition keeps the layout of the one
    non-empty input, where ATen's ``cat`` returns it contiguous), and inductor's size/stride
    assertion on the backward's input fails. Its fake mode is the inputs' (fake inputs) or a
    new one, as AOTAutograd would make. Public replacement: none."""
    if TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    return tracing(TracingContext(detect_fake_mode(list(example_inputs)) or FakeTensorMode()))


def queue_backward_callback(callback) -> None:
    """Run ``callback`` once the running backward pass has finished
    (``Variable._execution_engine.queue_callback``, as DDP's reducer and FSDP2 use): the
    gradient buckets issued during backward are waited on there. Callable only from inside a
    backward. Public replacement: none (``register_multi_grad_hook`` fires per tensor, not at
    the end of the pass)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def hold_mesh_groups_weakly(mesh) -> None:
    """Make ``mesh`` (a root DeviceMesh) hold its process groups by weak reference.

    ``init_device_mesh`` keeps every group it creates in ``DeviceMesh._pg_registry`` (a dict
    name -> ProcessGroup, read only while torch.compile traces ``get_group``; eagerly a group is
    resolved by name through c10d's registry, which ``destroy_process_group`` empties). DTensor's
    sharding caches keep every mesh they have seen until the interpreter ends, so a strong
    registry keeps the groups alive after ``destroy_process_group``: gloo's worker threads then
    still run while Python finalizes, and a worker that releases a finished collective's tensors
    takes the GIL there, which ends the thread inside a C++ destructor (``terminate called
    without an active exception``). Held weakly, a group lives exactly as long as c10d keeps it
    (``_world`` holds the same Python object until ``destroy_process_group``), and compiled
    lookups work while it does. Slices of the mesh register their groups in the root's registry,
    so they inherit this. Public replacement: none (torch has no option for a mesh that names its
    groups without owning them)."""
    mesh._pg_registry = weakref.WeakValueDictionary(mesh._pg_registry)


def stage_forward_cache(stage) -> dict:
    """``PipelineStage.fwd_cache``: the outputs a stage keeps until that microbatch's backward,
    which ``_FreeingStage`` releases early. Public replacement: none."""
    return stage.fwd_cache


@contextlib.contextmanager
def quiet_fake_tensor_meta_failures():
    """Drop, for the duration, the ERROR records of ``torch._subclasses.fake_tensor``'s logger
    that say ``failed while attempting to run meta for <op>``: fake-tensor propagation tries an
    op's meta kernel, logs its exception with a traceback, and then falls back (e.g.
    ``aten._grouped_mm``'s meta refuses float32, "Expected inputs of BF16 type", in MoE experts
    on CPU), so the log is noise that ends in a result. Other records pass. A filter on that
    logger (the logging API, removed on exit), not a change of torch's logging configuration.
    Public replacement: none (the message is logged at ERROR before the fallback)."""

    def drop(record) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta for")

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def tracing_limit_errors() -> tuple[type[BaseException], ...]:
    """Exception types by which ``torch.export`` says it cannot trace a forward (data-dependent
    shapes or control flow, unsupported Python) as opposed to the model's own error on its inputs:
    ``capture`` words its message by this. Reads ``torch._dynamo.exc`` and
    ``torch._subclasses.fake_tensor``. Public replacement: none (export raises these types)."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (TorchDynamoException, DataDependentOutputException, DynamicOutputShapeException,
            UnsupportedOperatorException, GuardOnDataDependentSymNode)


# -- private attributes of public objects ------------------------------------------------------
# ``tests/test_torch_internals.py`` finds any ``x._name`` read outside this module whose
# ``_name`` sptransform does not define itself, however ``x`` is spelled: each such read lives here.


def op_schema(target):
    """The ``FunctionSchema`` of an ATen ``OpOverload`` (``OpOverload._schema``), or None for any
    other callable: graph passes read argument names, defaults and aliasing from it. Public
    replacement: none in 2.13 (``torch._C._get_schema`` is private too)."""
    return getattr(target, "_schema", None)


def op_qualified_name(target) -> str:
    """``"aten.<op>.<overload>"`` of an ATen ``OpOverload`` (``_opname``, ``_overloadname``).
    Public replacement: ``str(target)`` spells it with namespace prefixes that differ by op kind."""
    return f"aten.{target._opname}.{target._overloadname}"


def autograd_function_class(backward_fn):
    """The ``torch.autograd.Function`` subclass behind a backward node (``_forward_cls``), or
    None for a built-in op's node: capture names custom functions whose backward it cannot
    trace. Public replacement: none."""
    return getattr(backward_fn, "_forward_cls", None)


def extract_fwd_bwd_modules(joint, saved_values, *, saved_sym_nodes, num_fwd_outputs):
    """Split a joint graph into forward and backward modules around the tensors the forward
    saves (``partitioners._extract_fwd_bwd_modules``): our remat plan chooses what is saved,
    torch's extraction builds the two graphs exactly as its own partitioners do. Public
    replacement: none (the partitioners' public entry points choose the saved set themselves)."""
    return partitioners._extract_fwd_bwd_modules(joint, saved_values, saved_sym_nodes=saved_sym_nodes,
                                                 num_fwd_outputs=num_fwd_outputs)


def wrap_with_op_strategy(propagator, schema):
    """DTensor's ``ShardingPropagator._wrap_with_op_strategy``: an ``OpSchema`` of specs turned
    into the schema of strategies that strategy functions take, so we can enumerate every
    strategy of an op (DTensor itself only picks one at dispatch). Public replacement: none."""
    return propagator._wrap_with_op_strategy(schema)


def propagate_through_decomposition(decomp_strategy, schema, placements, device_type: str):
    """DTensor's ``DecompShardingStrategy``: the output placements of an op without a rule of its
    own, found by running its decomposition on a fake mesh (``_get_fake_mesh``,
    ``_propagate_through_decomp``). Public replacement: none (DTensor runs it only at dispatch)."""
    fake_mesh = decomp_strategy._get_fake_mesh(device_type)
    return decomp_strategy._propagate_through_decomp(schema, placements, fake_mesh)


def deepcopy_dispatch_table() -> dict:
    """``copy._deepcopy_dispatch`` (the standard library's, not torch's; here so that every private
    API the package reads sits in one module): ``copy.deepcopy`` looks a function's type up there
    before ``__deepcopy__`` or ``__reduce_ex__``, and a function object cannot carry a hook of its
    own, so ``faithful_deepcopy`` installs one there while it copies. Public replacement: none."""
    import copy

    return copy._deepcopy_dispatch


def dtensor_op_handlers() -> dict:
    """DTensor's table of ops handed to a Python handler instead of its sharding rules
    (``DTensor._op_dispatcher._custom_op_handlers``): torch's ``loss_parallel`` puts its loss ops
    there for the length of its context and pops them after. ``runtime.loss_hint`` adds one for
    the NLL-loss ops while no other is there, only to replace DTensor's "got mixed torch.Tensor
    and DTensor" error on a parallel module's logits by one that names the fixes. Public
    replacement: none."""
    return _DTensor._op_dispatcher._custom_op_handlers


def non_persistent_buffer_names(module) -> set:
    """Names of ``module``'s own buffers registered with ``persistent=False``
    (``nn.Module._non_persistent_buffers_set``): the parallel module registers each buffer as
    the original did, so its state dict has the original's keys. Public replacement: none
    (``state_dict`` omits them, but also omits what a state-dict hook drops)."""
    return set(module._non_persistent_buffers_set)


__all__ = [
    "DTensorSpec", "DecompShardingStrategy", "GuardOnDataDependentSymNode", "OpOverload", "OpSchema",
    "RuntimeSchemaInfo", "TensorMeta", "TupleStrategy", "abstract_device_mesh", "disable_current_modes",
    "fill_single_dim_strategy_placeholders", "free_unbacked_symbols", "insert_single_dim_replication_strategy",
    "register_lazy_dtensor_strategies", "sharding_propagator",
    "FakeStore", "FakeTensor", "FakeTensorMode", "LocalTensor", "LocalTensorMode", "StorageWeakRef", "StridedShard",
    "TESTED_TORCH", "aot_module_simplified", "default_partition", "detect_fake_mode", "dtensor_as", "dynamo_static_input",
    "funcol", "plain_dtensor",
    "functorch_config", "generate_stage_to_rank_mapping", "get_schedule_ops", "hold_mesh_groups_weakly", "inductor_decomposed", "inductor_rewrites", "statistics_decompositions",
    "inductor_graph_compilers", "local_tensor_mode", "INDUCTOR_MENDED", "mend_inductor_mutation_renames",
    "INDUCTOR_GUARDED", "guard_inductor_collective_reads", "Kernel", "kernel_order", "reads_in_flight",
    "local_values",
    "make_boxed_func",
    "maybe_disable_local_tensor_mode", "min_cut_rematerialization_partition", "partitioners", "pytree",
    "queue_backward_callback", "quiet_fake_tensor_meta_failures", "resolve_process_group", "run_and_save_rng_state",
    "run_with_rng_state", "stage_forward_cache", "stride_reporting", "tensor_map", "tracing_limit_errors",
    "autograd_function_class", "deepcopy_dispatch_table", "dtensor_op_handlers", "non_persistent_buffer_names", "extract_fwd_bwd_modules", "op_qualified_name", "op_schema",
    "propagate_through_decomposition", "wrap_with_op_strategy",
]



def mend_inductor_mutation_renames() -> bool:
    """Mend a torch 2.13 inductor defect that reads a collective's result before its wait.

    Inductor lowers a functional collective in place on a buffer (``all_reduce_(buf)``) and its
    ``wait_tensor`` as a mutation of that buffer; a kernel reading the result depends on the wait
    through the buffer's renamed name (``mutation_renames``). The CPU backend, fusing two nodes
    whose loops have different shapes (``CppScheduling``), re-derives a node's reads from its
    loop body (``SchedulerNode.recompute_size_and_body``), which re-applies the renames only when
    the node also has a fake dependency: otherwise the read is of the buffer's original name,
    the dependency on the wait is gone, and a fused kernel may run between the collective and
    its wait, reading the unreduced local values. Seen on real gloo ranks: HF DeepSeek-V4 at
    tp=2 with SP compiled by inductor, a sigmoid computed before an ``all_reduce``'s wait fused
    with the reader of its result (gradients off by up to 100%). The mend re-applies the node's
    renames after every such recompute (what its sibling ``refresh_dependencies`` always does;
    renaming twice is a no-op). Installed once, at import; idempotent; returns whether it is
    installed. Public replacement: none (the fix belongs in torch)."""
    try:
        from torch._inductor.scheduler import SchedulerNode
    except ImportError:  # pragma: no cover - a torch without inductor
        return False
    original = getattr(SchedulerNode, "recompute_size_and_body", None)
    if original is None:  # pragma: no cover - an untested torch without the method
        return False
    if getattr(original, "_sptransform_mended", False):
        return True

    @functools.wraps(original)
    def recompute_size_and_body(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.mutation_renames:
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    recompute_size_and_body._sptransform_mended = True
    SchedulerNode.recompute_size_and_body = recompute_size_and_body
    return True


INDUCTOR_MENDED = mend_inductor_mutation_renames()
"""Whether ``mend_inductor_mutation_renames`` is installed (it is wherever torch has inductor)."""


class Kernel(NamedTuple):
    """One kernel in the order inductor will run them, buffer names resolved to the buffers they
    alias: what it defines (writes), reads, whether it launches a collective, and for a
    ``wait_tensor`` the buffers it waits on."""

    name: str
    defines: frozenset[str]
    reads: frozenset[str]
    collective: bool = False
    waits_on: frozenset[str] = frozenset()


def reads_in_flight(order: list[Kernel]) -> list[str]:
    """The accesses of a collective's result between the collective and its wait, in a kernel order.

    Each wait's buffer is in flight from the last collective before it that defines the buffer
    (out of place, or in place on it) to the wait; every kernel in between that reads or writes
    it is listed. A collective's *inputs* may be read while it runs (inductor's own rule for
    out-of-place collectives): not listed."""
    found = []
    for w, wait in enumerate(order):
        for buffer in sorted(wait.waits_on):
            start = next((i for i in range(w - 1, -1, -1) if order[i].collective and buffer in order[i].defines), None)
            if start is None:  # nothing launched into it here (a graph input)
                continue
            for kernel in order[start + 1: w]:
                if buffer in kernel.reads or buffer in kernel.defines:
                    found.append(f"{kernel.name} reads {buffer} after {order[start].name} and before its wait {wait.name}")
    return found


def kernel_order(scheduler) -> list[Kernel]:
    """The kernels of an inductor ``Scheduler`` in the order their code will run (fused nodes
    flattened in place), as ``Kernel`` records with buffer names resolved through the
    scheduler's mutation renames; fake (ordering-only) dependencies are not reads."""
    from torch._inductor import ir
    from torch._inductor.dependencies import WeakDep

    real = scheduler.mutation_real_name  # a mutation's output -> the buffer it mutates, already transitive

    def resolve(name: str) -> str:
        return real.get(name, name)

    order = []
    for outer in scheduler.nodes:
        for node in outer.get_nodes():
            ir_node = getattr(node, "node", None)
            defines = {resolve(buf.get_name()) for buf in node.get_outputs()}  # an in-place write: its buffer
            reads = {resolve(dep.name) for dep in node.read_writes.reads if not isinstance(dep, WeakDep)}
            waits_on = set()
            if isinstance(ir_node, ir._WaitKernel):  # a wait mutates what it waits on
                waits_on = {resolve(m) for buf in node.get_outputs() for m in buf.get_mutations()}
                defines -= waits_on
            origins = sorted(o.name for o in getattr(ir_node, "origins", ()) or ())
            label = node.get_name() + (f" (from {', '.join(origins[:3])})" if origins else "")
            collective = isinstance(ir_node, ir._CollectiveKernel) and not isinstance(ir_node, ir._WaitKernel)
            order.append(Kernel(label, frozenset(defines), frozenset(reads), collective, frozenset(waits_on)))
    return order


def guard_inductor_collective_reads() -> bool:
    """Make inductor refuse to generate code that reads a collective's result before its wait.

    The check behind ``mend_inductor_mutation_renames``: that mend repairs the one defect known
    (torch 2.13's CPU fusion losing the dependency of a reader on a wait), and this check, on
    the kernel order inductor is about to generate (``Scheduler.codegen``: after fusion and every
    reordering), fails the compile if any kernel reads or writes a collective's output between
    the collective and its ``wait_tensor`` (``reads_in_flight``), so that a variant of that
    defect on another torch, or another fusion path, raises instead of computing with values
    still in flight. Inductor's own rule (its note on out-of-place collective safety) is the
    one checked. Applies to every inductor compile in the process; costs a pass over the
    kernels of graphs that have waits. Installed once, at import; returns whether it is.
    Public replacement: none."""
    try:
        from torch._inductor import ir
        from torch._inductor.scheduler import Scheduler
    except ImportError:  # pragma: no cover - a torch without inductor
        return False
    original = getattr(Scheduler, "codegen", None)
    wait_kernel, collective_kernel = getattr(ir, "_WaitKernel", None), getattr(ir, "_CollectiveKernel", None)
    if original is None or wait_kernel is None or collective_kernel is None:  # pragma: no cover - an untested torch
        return False
    if getattr(original, "_sptransform_guarded", False):
        return True

    @functools.wraps(original)
    def codegen(self, *args, **kwargs):
        if any(isinstance(getattr(n, "node", None), wait_kernel) for outer in self.nodes for n in outer.get_nodes()):
            found = reads_in_flight(kernel_order(self))
            if found:
                raise RuntimeError(
                    "inductor scheduled kernels that read a collective's result before its wait_tensor, which "
                    "would compute with values still in flight (a defect of this torch's inductor, caught before "
                    "any code ran): " + "; ".join(found) + ". With sptransform, compile='eager' avoids inductor; "
                    "please report it with your torch version")
        return original(self, *args, **kwargs)

    codegen._sptransform_guarded = True
    Scheduler.codegen = codegen
    return True


INDUCTOR_GUARDED = guard_inductor_collective_reads()
"""Whether ``guard_inductor_collective_reads`` is installed (it is wherever torch has inductor)."""


def default_store():
    """The key-value store of the default process group (``distributed_c10d._get_default_store``):
    the TCPStore every rank already reaches, through which data-parallel replicas meet at each
    call and leave records of where they are (``runtime.faults``), outside the process groups'
    collectives (which a mismatched peer could pair with). Public replacement: none (the store is
    only public when the user creates it and passes it to ``init_process_group``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def set_group_timeout(group, timeout) -> None:
    """Set how long ``group``'s collectives wait for their peers
    (``distributed_c10d._set_pg_timeout``): the data-parallel group sptransform creates waits
    ``peer_timeout_s``, not the process group's 30-minute default. Public replacement: none
    (``new_group(timeout=)`` only at creation, and ``init_device_mesh`` takes no timeout)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)
