"""``ParallelModule``: what ``parallelize`` returns.

It holds the original parameters as DTensors on the tensor-parallel mesh (only
this rank's shard is stored) under the original names, and runs, for each input
signature, a captured and transformed graph on the local shards. The graphs come
from a ``GraphFactory`` (``sptransform.transform``), handed in by ``parallelize``:
the runtime runs graphs and never imports a pass.

It behaves like the original module, not like the moment it was captured (the mirror of
the original, its modes, state dict and input checks are ``runtime.core.ModuleCore``, shared
with the pipelined module):

* **modes**: it mirrors the original's submodule tree (empty containers under the same
  names, holding the parameters), so ``pm.train()``, ``pm.eval()`` and
  ``pm.transformer.h[0].eval()`` act as on the original; the train/eval flag of every
  submodule is part of what selects a graph, and a new combination is captured with the
  template in that mode (dropout acts exactly when the module is training);
* **dtypes**: ``pm.to(torch.float64)`` converts the parameters; the next call captures
  again with the new dtypes (cached graphs are dropped). Moving to another device is an
  error that says what to do (the mesh and process group are tied to the device);
* **inputs**: each call is checked before any collective (``runtime.checks``): ids and
  labels outside the vocabulary raise ``IndexError`` as on one device, and, with
  ``check_inputs``, one small all-gather makes ranks given different inputs fail alike;
* **bounded state**: at most ``graph_cache_size`` graphs are kept (least recently used
  dropped); the dropout generators belong to the module (``pm.rng``, checkpointable).
"""

from __future__ import annotations

import contextlib
import functools

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from sptransform.capture import CapturedGraph, Entry, InputsRejected, input_signature
from sptransform.graph.analysis import find_loss_output
from sptransform.graph.plan import ParallelGraph, ParallelPlan
from sptransform.graph.placement import DimShard
from sptransform.options import ParallelOptions
from sptransform.runtime.checks import (
    VocabCheck, check_call, check_vocab, describe_inputs, differences, leaf_names, signature_fingerprint, vocab_checks,
)
from sptransform.runtime.core import Agreement, ModuleCore, mirror_modules  # noqa: F401  (mirror_modules: re-exported)
from sptransform.runtime.explain import explain
from sptransform.runtime.generate import generate_tokens
from sptransform.runtime.kv_cache import cache_layout
from sptransform.runtime.faults import naming_failures
from sptransform.runtime.ops import take_local
from sptransform.runtime.params import contiguous_stride, get_by_path, held_share
from sptransform.runtime.rng import RankGenerators
from sptransform.runtime.loss_hint import install_loss_hint
from sptransform.runtime.zero import regather_saved
from sptransform.torch_internals import local_tensor_mode, pytree


def _local_shard(value: DTensor) -> torch.Tensor:
    """This rank's shard of a parameter, its gradient a DTensor like the parameter."""
    uneven = any(isinstance(p, Shard) and p.dim > 0 and value.shape[p.dim] % value.device_mesh.size(i)
                 for i, p in enumerate(value.placements))
    return _UnevenLocal.apply(value) if uneven else value.to_local()


class _UnevenLocal(torch.autograd.Function):
    """``to_local`` of a parameter split unevenly along a dim after the first (a vocabulary-parallel
    head stored ``[hidden, vocab]``, 257 columns as 129 + 128). torch's backward of ``to_local``
    derives the gradient's global strides from the local gradient, which differ per rank for such
    a split, and on simulated ranks are a SymInt that DTensor cannot hash (the zoo's
    ``einsum_projections`` raised in backward). The gradient takes the parameter's own shape and
    strides instead."""

    @staticmethod
    def forward(ctx, value: DTensor) -> torch.Tensor:
        ctx.like = (value.device_mesh, value.placements, value.shape, value.stride())
        return value.to_local()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        mesh, placements, shape, stride = ctx.like
        return DTensor.from_local(grad, mesh, placements, shape=shape, stride=stride)


class GraphFactory(Protocol):
    """Builds the parallel graph of an input signature (captured with the template's submodules
    in ``modes`` and its state in ``dtypes``) and, with recompute, its partitioned runner. Owns
    the module's dropout generators (``generators``) and the fake template (``template``)."""

    generators: RankGenerators

    @property
    def template(self) -> Any: ...

    def build(self, args: tuple, kwargs: dict, *, modes: Mapping[str, bool] | None = None,
              dtypes: Mapping[str, torch.dtype] | None = None, entry: Entry | None = None) -> ParallelGraph: ...

    def compile(self, gm: fx.GraphModule, inputs: list, state_positions: Sequence[int]) -> Callable: ...


@dataclass
class _Cached:
    """One input signature's graph and what every call of it needs that depends on the signature
    alone, worked out once: the inputs it reads as token ids or labels, the signature's part of
    the input fingerprint (``runtime.checks.signature_fingerprint``), and where each of the
    graph's state inputs is read from (a lifted constant, or a container and attribute of this
    module; resolved on the first call, as the first graph is built before the parameters are
    registered)."""

    graph: ParallelGraph
    vocab_checks: list[VocabCheck]
    signature_fingerprint: list[int]
    state_sources: list[torch.Tensor | tuple[nn.Module, str]] | None = None


def microbatches(args: tuple, kwargs: dict, n: int) -> list[tuple[tuple, dict]]:
    """``n`` equal slices along dim 0 of every tensor input (other inputs repeated)."""
    if n == 1:
        return [(args, kwargs)]
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim()}
    if len(sizes) != 1 or next(iter(sizes)) % n:
        raise ValueError(
            f"step() splits every tensor input into n_microbatches={n} slices along dim 0; got batch sizes "
            f"{sorted(sizes)}: pass inputs with one batch size that is a multiple of {n}"
        )
    size = next(iter(sizes)) // n
    out = []
    for i in range(n):
        sliced = [x[i * size : (i + 1) * size] if isinstance(x, torch.Tensor) and x.dim() else x for x in leaves]
        out.append(pytree.tree_unflatten(sliced, spec))
    return out


ENTRY_GRAPHS = 4
"""Graphs of other forwards kept (``_run_entry``: a prefill and a decode step per prompt shape)."""


class ParallelModule(ModuleCore):
    def __init__(
        self,
        model: nn.Module,
        *,
        factory: GraphFactory,
        options: ParallelOptions,
        mesh: DeviceMesh | None,
        example_args: tuple,
        example_kwargs: dict,
        param_mesh: DeviceMesh | None = None,
    ):
        """``mesh``: the tensor-parallel mesh; ``param_mesh``: the (dp, tp) mesh parameters live on
        with data parallelism (None without)."""
        super().__init__(model, factory=factory, options=options, tp_mesh=mesh, param_mesh=param_mesh)
        self._state_names = [name for name, _ in model.named_parameters(remove_duplicate=False)] + [
            name for name, buf in model.named_buffers(remove_duplicate=False)]
        self._dtypes = tuple(get_by_path(model, name).dtype for name in self._state_names)
        self._state_owners: list[tuple[nn.Module, str]] | None = None  # see _check_state
        self._graphs: OrderedDict[tuple, _Cached] = OrderedDict()
        self._entry_graphs: OrderedDict[tuple, _Cached] = OrderedDict()  # see _run_entry
        self._cache_layouts: dict[tuple, list[torch.Tensor]] = {}  # see _cache_layout
        example_kwargs = {**self._call_defaults, **example_kwargs}
        check_call(example_args, example_kwargs, self._call_defaults, example=True)
        self._example_inputs = describe_inputs(example_args, example_kwargs)
        first = self._factory.build(example_args, example_kwargs, modes=self._modes(), dtypes=self._dtype_map(self._dtypes))
        self._placements = first.plan.placements if first.plan else {}
        self._data_parallel = first.data_parallel
        self._graphs[self._cache_key(example_args, example_kwargs)] = self._cached(first, example_args, example_kwargs)
        self._last = first
        self._register_state(model)
        self._rank = self._rank_tensor()
        self._finish_state(mesh)

    def _rank_tensor(self) -> torch.Tensor | None:
        if self._tp_mesh is None:
            return None
        ranks = torch.arange(self._options.tp, device=self._device)
        return distribute_tensor(ranks, self._tp_mesh, [Shard(0)], src_data_rank=None).to_local().reshape(())

    # -- what selects a graph: modes (``ModuleCore``), dtypes, inputs ----------

    def _cache_key(self, args: tuple, kwargs: dict) -> tuple:
        return (self._mode_key(), input_signature(args, kwargs))

    def _dtype_map(self, dtypes: tuple) -> dict[str, torch.dtype]:
        return dict(zip(self._state_names, dtypes))

    def _check_state(self) -> None:
        """Check that the parameters and buffers, as they are now, are where the graphs run; a
        dtype change (``pm.to(torch.float64)``) drops the cached graphs."""
        if self._state_owners is None:
            # (container, attribute) of each name, resolved once: the mirrored containers are
            # made at construction and never replaced, while the tensors in them may be (a
            # load with assign=True), so the tensors are read afresh every call. Walking the
            # dotted paths each call was most of this check's time (53 lookups per call on GPT-2).
            self._state_owners = [(self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                                  for name in self._state_names]
        dtypes = []
        for name, (owner, leaf) in zip(self._state_names, self._state_owners):
            value = getattr(owner, leaf)
            if value.device != self._device:
                raise ValueError(
                    f"{name!r} is on {value.device}, but this parallel module was built for {self._device} (its "
                    "device mesh and process group are tied to that device): moving a parallelized module to another "
                    "device is not supported; move the original model first (model.to(device)) and parallelize it there"
                )
            dtypes.append(value.dtype)
        if tuple(dtypes) != self._dtypes:
            self._graphs.clear()  # captured with the old dtypes (the template follows on the next build)
            self._dtypes = tuple(dtypes)

    def _cached(self, graph: ParallelGraph, args: tuple, kwargs: dict) -> _Cached:
        captured = graph.captured
        vocab = graph.plan.vocab if graph.plan is not None else None
        return _Cached(graph, vocab_checks(captured.gm, len(captured.state_names), captured.num_user_inputs, vocab),
                       signature_fingerprint(args, kwargs))

    def _state_sources(self, captured: CapturedGraph) -> list[torch.Tensor | tuple[nn.Module, str]]:
        """Where each state input of ``captured`` is read from: a lifted constant, or the
        (container, attribute) of a parameter or buffer of this module."""
        return [captured.constants[name] if name in captured.constants
                else (self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                for name in captured.state_names]

    def _graph_for(self, args: tuple, kwargs: dict) -> _Cached:
        self._check_state()
        key = self._cache_key(args, kwargs)
        cached = self._graphs.get(key)
        if cached is not None:
            if not torch.compiler.is_compiling():  # LRU bookkeeping stays out of traced code
                self._graphs.move_to_end(key)
            return cached
        try:
            graph = self._factory.build(args, kwargs, modes=self._modes(), dtypes=self._dtype_map(self._dtypes))
        except InputsRejected as err:  # name what differs from the inputs it was built with
            changed = differences(self._example_inputs, args, kwargs)
            if not changed:
                raise
            raise InputsRejected(f"{err}; compared with the example inputs: {'; '.join(changed)}") from err
        self._check_placements(graph)
        self._check_split_inputs(graph, args, kwargs)
        cached = self._graphs[key] = self._cached(graph, args, kwargs)
        while len(self._graphs) > self._options.graph_cache_size:
            self._graphs.popitem(last=False)  # least recently used
        return cached

    def _check_placements(self, graph: ParallelGraph) -> None:
        """A new signature may not need another split of a parameter it reads (parameters it
        does not read, e.g. the token embedding under ``inputs_embeds=``, do not matter)."""
        if graph.plan is None:
            return
        captured = graph.captured
        read = [name for node, name in zip(captured.state_placeholders, captured.state_names)
                if node.users and name in captured.param_names]
        for name in read:
            old, new = self._placements.get(name), graph.plan.placements.get(name)
            old_split = (old.spec, old.padded_rows, old.storage) if old is not None else (None, None, None)
            new_split = (new.spec, new.padded_rows, new.storage) if new is not None else (None, None, None)
            if old_split != new_split:
                raise ValueError(
                    f"these inputs need parameter {name!r} split as {new.role if new else 'replicated'} "
                    f"({new_split[0]}), but the module was built, from example_inputs=, with it "
                    f"{old.role if old else 'replicated'} ({old_split[0]}); a parameter keeps one placement: "
                    "parallelize with example_inputs= of this kind (e.g. input_ids rather than inputs_embeds)"
                )

    def _check_split_inputs(self, graph: ParallelGraph, args: tuple, kwargs: dict) -> None:
        """A float input that requires grad and is cut to this rank's part of the sequence (it,
        or a tensor computed from it, joins the sequence-split stream) would get only this
        rank's part of its gradient: refuse (``sp=False`` gives the full gradient)."""
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        placeholders = graph.captured.user_placeholders[: graph.captured.num_user_inputs]  # not the rank
        users = {node: i for i, node in enumerate(placeholders)
                 if isinstance(leaves[i], torch.Tensor) and leaves[i].requires_grad}
        if not users:
            return
        cuts = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target is take_local]
        seen, stack = set(), [c.args[0] for c in cuts]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in users:
                name = leaf_names(args, kwargs)[users[node]]
                raise ValueError(
                    f"{name} requires grad and is split along the sequence here, so each rank would get only "
                    "its part of its gradient: detach it, or pass sp=False"
                )
            stack.extend(node.all_input_nodes)

    # -- running ------------------------------------------------------------

    def forward(self, *args, **kwargs):
        # Three layers, so that torch.compile(pm) compiles the arithmetic and nothing else:
        # choosing the graph and checking the inputs reads values, may capture a new graph and
        # runs a collective (eager, every call); the graph itself is traced; the DTensor outputs
        # are built outside the compiled region (see ``_finish``).
        kwargs = {**self._call_defaults, **kwargs}
        cached = self._dispatch(args, kwargs)
        outputs = self._compute(cached, args, kwargs)
        return self._finish(cached, outputs)

    @torch.compiler.disable
    def _dispatch(self, args: tuple, kwargs: dict) -> _Cached:
        """The graph of this call's signature and mode, with what its calls need (``_Cached``),
        after the input checks. Runs eagerly under ``torch.compile`` (one graph break before the
        compiled region): it hashes the input signature, may capture and transform a new graph,
        reads input values and all-gathers their fingerprint, none of which belongs in a
        compiled graph; the entry it returns is what the compiled region is specialized on (a
        new signature or mode returns another entry and dynamo recompiles)."""
        return self._prepare(args, kwargs)

    def _prepare(self, args: tuple, kwargs: dict) -> _Cached:
        """The graph of this call, after the checks of both phases (``ModuleCore._checked``)."""
        return self._checked(args, kwargs, lambda: self._local_checks(args, kwargs))

    def _local_checks(self, args: tuple, kwargs: dict) -> _Cached:
        self._check_loaded()
        cached = self._graph_for(args, kwargs)
        if cached.state_sources is None:
            cached.state_sources = self._state_sources(cached.graph.captured)
        if cached.vocab_checks:
            check_vocab(cached.vocab_checks, pytree.tree_leaves((tuple(args), dict(kwargs))),
                        lambda: leaf_names(args, kwargs))
        return cached

    def _graph_digest(self, checked: _Cached) -> int:
        printed = checked.graph.fingerprint
        return printed.digest if printed is not None else 0

    def _signature_fingerprint(self, checked: _Cached) -> list[int]:
        """Worked out when the graph was cached: the fingerprint's structure and shape hashes."""
        return checked.signature_fingerprint

    def _agreement(self) -> Agreement | None:
        """Phase 2 runs with ``check_inputs``, more than one rank, and ranks that exist (real
        ones, or LocalTensorMode's simulated ones; a bare fake group has none)."""
        if not self._options.check_inputs or self._tp_mesh is None or self._options.tp == 1:
            return None
        simulated = local_tensor_mode() is not None
        if not simulated and self._fake_group:
            return None
        if simulated:
            return Agreement([self._tp_mesh.get_group()], True, 0, lambda r: f"simulated rank {r}")
        return Agreement([self._tp_mesh.get_group()], False, self._tp_mesh.get_local_rank(), lambda r: f"rank {r}")

    @functools.cached_property
    def _fake_group(self) -> bool:
        """Whether the tensor-parallel group is a fake one (no peers; its backend never changes)."""
        return dist.get_backend(self._tp_mesh.get_group()) == "fake"

    def _graph_inputs(self, cached: _Cached, args: tuple, kwargs: dict) -> list:
        """The graph's inputs: local shards of the state, the flat user inputs, the rank."""
        state = []
        for source in cached.state_sources:
            value = source if isinstance(source, torch.Tensor) else getattr(*source)
            state.append(_local_shard(value) if isinstance(value, DTensor) else value)
        flat_inputs = pytree.tree_leaves((tuple(args), dict(kwargs)))
        extra = [self._rank] if cached.graph.plan is not None else []
        return [*state, *flat_inputs, *extra]

    def _compute(self, cached: _Cached, args: tuple, kwargs: dict) -> list:
        """Run ``graph`` on this call's inputs; the flat outputs, local tensors (traced by
        ``torch.compile``; with an AOTAutograd runner, that runner is called eagerly). With
        ZeRO-3 the parameters gathered for the forward are not kept for backward but gathered
        again (``runtime.zero.regather_saved``)."""
        with regather_saved() if self._options.zero == 3 else contextlib.nullcontext():
            if self._runner_compiles:
                return self._compute_with_runner(cached, args, kwargs)
            named = self._replicas is not None and not torch.compiler.is_compiling()
            with naming_failures(lambda: f"a collective in the forward of call {self._replicas.calls}",
                                 lambda: self._param_mesh.mesh.flatten().tolist()) if named else contextlib.nullcontext():
                outputs = cached.graph.captured.gm(*self._graph_inputs(cached, args, kwargs))
        return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]

    @torch.compiler.disable
    def _compute_with_runner(self, cached: _Cached, args: tuple, kwargs: dict) -> list:
        """The partitioned runner (``recompute``/``compile``): already AOTAutograd-compiled by
        sptransform, so ``torch.compile(pm)`` calls it as is instead of tracing it again."""
        inputs = self._graph_inputs(cached, args, kwargs)
        outputs = self._remat_runner(cached.graph, inputs)(*[x for x in inputs if isinstance(x, torch.Tensor)])
        return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]

    @property
    def _runner_compiles(self) -> bool:
        """Whether graphs run through sptransform's own AOTAutograd runner (``recompute``)."""
        return self._options.recompute != "none"

    @torch.compiler.disable
    def _finish(self, cached: _Cached, outputs: list):
        """The user's output structure, vocabulary-split outputs as DTensors. Eager under
        ``torch.compile``: a DTensor output of a compiled region that requires grad gets a
        *plain* zero tangent from autograd when the loss does not use it (logits beside the
        loss), which AOTAutograd, having guessed a DTensor tangent, refuses
        (pytorch/pytorch#173123). Built here, outside the region, the compiled graph returns
        the local logits, and ``DTensor.from_local``'s own backward takes either kind."""
        graph = self._last = cached.graph
        outputs = list(outputs)
        if self._replicas is not None:  # which call's backward ran last: the replica check reports it
            needing = [x for x in outputs if isinstance(x, torch.Tensor) and x.requires_grad]
            if needing:
                call, replicas = self._replicas.calls, self._replicas
                torch.autograd.graph.register_multi_grad_hook(
                    needing, lambda _: setattr(replicas, "backward_of", call), mode="any")
        if graph.plan is not None and graph.plan.output_specs:
            install_loss_hint()  # a loss on these without loss_parallel() names its fixes
            for index, (spec, size) in graph.plan.output_specs.items():
                outputs[index] = self._as_dtensor(outputs[index], spec, size)
        return pytree.tree_unflatten(outputs, graph.captured.out_spec)

    def _remat_runner(self, graph: ParallelGraph, inputs: list):
        if graph.compiled is None:
            if local_tensor_mode() is not None:
                raise ValueError(
                    f"recompute={self._options.recompute!r} needs real ranks: AOTAutograd cannot trace "
                    "LocalTensorMode's simulated ranks; use recompute='none' in simulation"
                )
            graph.compiled = self._factory.compile(graph.gm, inputs, range(len(graph.captured.state_names)))
        return graph.compiled

    def _as_dtensor(self, local: torch.Tensor, spec: DimShard, size: int) -> DTensor:
        shape = list(local.shape)
        shape[spec.dim] = size
        return DTensor.from_local(
            local, self._tp_mesh, [Shard(spec.dim)], run_check=False, shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )

    # -- other forwards of the module: generate's KV-cache steps ---------------

    def _run_entry(self, entry: Entry, args: Sequence, whole: Sequence, local: Container[int] = ()) -> list:
        """Run another forward of the module (``entry``) on the flat inputs ``args``, its split
        inputs as this rank's parts (or whole, and cut here); ``whole``: the same inputs at their
        whole shapes (meta tensors will do), for the capture and the cache key. Returns the flat outputs, the split ones
        (``entry.split_outputs``, vocabulary-split logits) as DTensors but those at the positions
        ``local``, which stay this rank's part (no DTensor to build per call). No input checks: only
        ``generate`` calls this, with inputs it built (every rank the same tokens)."""
        self._check_state()  # where and in which dtypes the state is
        key = (entry.name, self._mode_key(), self._dtypes, input_signature(tuple(whole), {}))
        cached = self._entry_graphs.get(key)
        if cached is None:
            graph = self._factory.build(tuple(whole), {}, modes=self._modes(), dtypes=self._dtype_map(self._dtypes),
                                        entry=entry)
            self._check_placements(graph)
            cached = self._entry_graphs[key] = _Cached(graph, [], [], self._state_sources(graph.captured))
            while len(self._entry_graphs) > ENTRY_GRAPHS:
                self._entry_graphs.popitem(last=False)
        graph = cached.graph
        args = list(args)
        for index, spec in (graph.plan.input_specs if graph.plan is not None else {}).items():
            if tuple(args[index].shape) == tuple(whole[index].shape):  # given whole: this rank's part
                tp = self._options.tp
                table = torch.tensor([spec.indices(r, tp) for r in range(tp)], device=args[index].device)
                args[index] = take_local(args[index], spec.dim, table, self._rank)
        outputs = graph.gm(*self._graph_inputs(cached, tuple(args), {}))
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        if graph.plan is not None:
            for index, (spec, size) in graph.plan.output_specs.items():
                if index not in local:
                    outputs[index] = self._as_dtensor(outputs[index], spec, size)
        return outputs

    # -- generation -----------------------------------------------------------

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """HF-style ``generate`` (greedy or sampled; ``runtime.generate``, with a KV cache split by
        heads where ``runtime.kv_cache`` applies): the prompt followed by the new tokens, equal on
        every rank (tensor-parallel rank 0's choice)."""
        if self._options.dp > 1:
            raise ValueError(
                f"generate() runs on tensor-parallel ranks only, and this module has dp={self._options.dp}: "
                "parallelize a copy with dp=1 to generate"
            )
        multiple = self._options.tp if self._options.sp else 1
        template = self._factory.template
        return generate_tokens(self, input_ids, source=template.module, multiple=multiple, agree=self._agree_tokens,
                               run=self._run_entry, layout=self._cache_layout, **kwargs)

    def _cache_layout(self, batch: int) -> list[torch.Tensor]:
        """The model's empty KV cache for ``batch`` rows (``kv_cache.cache_layout``: a fake forward,
        over a second for a small model, so kept per batch size and dtypes)."""
        key = (batch, self._dtypes)
        if key not in self._cache_layouts:
            template = self._factory.template
            self._cache_layouts[key] = cache_layout(template.module, template.fake_mode, template.device, batch)
        return self._cache_layouts[key]

    def _agree_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel rank 0's tokens on every rank (a broadcast): ranks whose default
        generators differ would otherwise feed the next step different tokens."""
        if self._tp_mesh is None:
            return tokens
        return DTensor.from_local(tokens, self._tp_mesh, [Replicate()], run_check=True).to_local()

    # -- state and inspection -------------------------------------------------

    @property
    def cached_graphs(self) -> int:
        """How many input signatures' graphs are cached (at most ``graph_cache_size``)."""
        return len(self._graphs)

    @property
    def code(self) -> str:
        """This rank's graph, as Python, with its collectives (the last signature run)."""
        return self._last.gm.code

    @property
    def plan(self) -> ParallelPlan | None:
        return self._last.plan

    def explain(self) -> str:
        return explain(self._last, self._options)

    def held_share(self) -> float:
        """Share of the model's parameter bytes this rank stores (``runtime.params.held_share``):
        ~1/tp when the big weights are split, 1.0 when nothing is."""
        return held_share(self)


ONE_STAGE_SCHEDULES = ("1f1b", "gpipe")
"""The schedules ``SteppedModule`` (pp=1) runs: the order of one pipeline stage's microbatches."""


class SteppedModule(ParallelModule):
    """``ParallelModule`` with ``step()``: pp=1, forward and backward of a whole batch.

    ``n_microbatches`` (from ``parallelize``) splits each batch along dim 0 and accumulates the
    gradients of the microbatch losses divided by their number, as a pipeline does; ``step``
    returns the mean of the microbatch losses. ``schedule`` orders them as on one pipeline
    stage: ``"1f1b"`` runs each microbatch's forward and backward in turn (one microbatch's
    activations alive), ``"gpipe"`` all forwards, then all backwards."""

    def __init__(self, model: nn.Module, *, n_microbatches: int = 1, schedule: str = "1f1b", **kwargs):
        super().__init__(model, **kwargs)
        if schedule not in ONE_STAGE_SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: with pp=1, step() runs one of {ONE_STAGE_SCHEDULES}")
        self._n_microbatches = n_microbatches
        self._schedule = schedule

    def step(self, *args, **kwargs) -> torch.Tensor:
        kwargs = {**self._call_defaults, **kwargs}
        n = self._n_microbatches
        losses, pending = [], []
        for mb_args, mb_kwargs in microbatches(args, kwargs, n):
            loss = self._loss_of(self(*mb_args, **mb_kwargs))
            losses.append(loss.detach())
            if self._schedule == "gpipe":
                pending.append(loss)
            else:
                (loss / n if n > 1 else loss).backward()
        if pending:
            (torch.stack(pending).sum() / n if n > 1 else pending[0]).backward()
        return torch.stack(losses).sum() / n if n > 1 else losses[0]

    def _loss_of(self, out) -> torch.Tensor:
        graph = self._last
        analysis = graph.model_analysis()
        loss_node = find_loss_output(graph.captured, analysis)
        outputs = list(graph.captured.gm.graph.find_nodes(op="output")[0].args[0])
        return pytree.tree_leaves(out)[outputs.index(loss_node)]
