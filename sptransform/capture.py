"""Capture: an unmodified ``nn.Module`` and example inputs become an ATen-level FX graph.

The module is never run on real data here: a copy whose parameters and buffers are
fake tensors (no storage) is traced by ``torch.export`` (non-strict, training IR,
so ``linear``, ``layer_norm``, ``dropout``, ``scaled_dot_product_attention`` and
``cross_entropy_loss`` stay whole). The graph's placeholders are, in order, the
parameters, buffers and lifted constants (named by their FQNs) and then the
flattened user inputs. Shapes are static: a new input shape is a new capture,
which ``ParallelModule`` caches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import re
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind

from sptransform.capture_watches import (
    CustomFunctionWatch, PythonRandomWatch, StateWatch, refuse_custom_autograd_functions, refuse_python_random,
    refuse_state_written_every_call,
)
from sptransform.copying import faithful_deepcopy
from sptransform.graph.nodes import describe
from sptransform.torch_internals import op_schema
from sptransform.torch_internals import (
    FakeTensor, FakeTensorMode, GuardOnDataDependentSymNode, OpOverload, StorageWeakRef, disable_current_modes, maybe_disable_local_tensor_mode, pytree,
    quiet_fake_tensor_meta_failures, tracing_limit_errors,
)


@dataclass
class CapturedGraph:
    gm: fx.GraphModule
    state_names: list[str]
    """FQN of each parameter/buffer/constant placeholder, in placeholder order."""
    param_names: set[str]
    num_user_inputs: int
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Parameter name -> every name of the one tensor it shares with others (a tied embedding and head)."""
    lost_draws: int = 0
    """Random draws (dropout, ...) of the forward that functionalization erased because no output
    reads them: the single device still draws them, so every later draw of the graph comes
    from another point of the generator's stream (``dropout_rng='reference'`` refuses). 0 where
    the graph draws nothing else (an eval() graph: erased draws shift nothing)."""

    @property
    def state_placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"][: len(self.state_names)]

    @property
    def user_placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"][len(self.state_names) :]

    def param_of(self, node: fx.Node) -> str | None:
        """The FQN of the parameter this placeholder holds, else None."""
        names = dict(zip(self.state_placeholders, self.state_names))
        name = names.get(node)
        return name if name in self.param_names else None


class FakeTemplate:
    """A copy of the user's module with fake parameters and buffers, made once."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.device = device
        memo: dict[int, Any] = {}
        # Plain fakes of one rank, also under simulated ranks (LocalTensorMode would wrap them
        # in LocalTensors, which export accepts but functionalization does not).
        with maybe_disable_local_tensor_mode(), self.fake_mode:
            for t in list(model.parameters()) + list(model.buffers()):
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
        # Closures rebound too: a lambda head reading ``self.emb.weight`` must read the fake copy's
        # weight (a parameter of the graph), not the real one (a frozen constant, no gradient).
        self.module = faithful_deepcopy(model, memo)  # keeps every submodule's own train/eval flag
        self.param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.own_storage: dict[tuple, str] = {}
        for name, t in _named_state(model):
            key = _storage_key(t)
            if key is not None:
                self.own_storage.setdefault(key, name)
        self.foreign_storage = _foreign_parameters(self.module)

    # -- what a capture depends on besides the inputs: modes and dtypes ---------------

    def set_modes(self, modes: Mapping[str, bool]) -> None:
        """Set each named submodule's ``training`` flag (not recursively): a capture bakes
        ``self.training`` reads (dropout, HF's attention dropout) into the graph, so the
        template is put in the mode the caller runs in before each capture."""
        modules = dict(self.module.named_modules())
        for name, training in modes.items():
            modules[name].training = bool(training)

    def state_dtypes(self) -> dict[str, torch.dtype]:
        """dtype of every parameter and buffer, by name (tied ones under each name)."""
        named = {**dict(self.module.named_parameters(remove_duplicate=False)),
                 **dict(self.module.named_buffers(remove_duplicate=False))}
        return {name: t.dtype for name, t in named.items()}

    def retype(self, dtypes: Mapping[str, torch.dtype]) -> None:
        """Give the named parameters and buffers new dtypes (``pm.to(torch.float64)`` converted
        the real ones; the next capture must see the same dtypes). Tied tensors stay tied."""
        current = self.state_dtypes()
        replaced: dict[int, torch.Tensor] = {}
        for name, dtype in dtypes.items():
            if current.get(name, dtype) == dtype:
                continue
            *parents, leaf = name.split(".")
            owner = self.module.get_submodule(".".join(parents))
            old = getattr(owner, leaf)
            if id(old) not in replaced:
                with self.fake_mode:
                    fake = torch.empty_strided(old.shape, old.stride(), dtype=dtype, device=old.device)
                replaced[id(old)] = (nn.Parameter(fake, requires_grad=old.requires_grad)
                                     if isinstance(old, nn.Parameter) else fake)
            setattr(owner, leaf, replaced[id(old)])

    def fake_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def convert(x):
            if isinstance(x, torch.Tensor):
                # A fresh fake per input: export would merge one object passed twice.
                fake = torch.empty(x.shape, dtype=x.dtype, device=self.device)
                return fake.requires_grad_(x.requires_grad)
            return x

        with maybe_disable_local_tensor_mode(), self.fake_mode:
            return pytree.tree_map(convert, (tuple(args), dict(kwargs)))


def _named_state(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where a plain tensor's memory starts; None for tensors without memory of their own to compare
    (meta tensors, wrapper subclasses such as a simulated rank's LocalTensor or a DTensor)."""
    if t.device.type == "meta" or isinstance(t, FakeTensor) or type(t) not in (torch.Tensor, nn.Parameter):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a storage torch cannot read from Python
        return None


def _storage_key(t: torch.Tensor) -> tuple | None:
    """Identity of the memory a tensor reads: export lifts a tensor that forward reaches outside the
    module's attributes as a detached alias, which shares this key with its source."""
    ptr = _storage_ptr(t)
    return None if ptr is None else (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _foreign_parameters(module: nn.Module) -> dict[int, str]:
    """Parameters of modules *outside* ``module`` that its functions reach through closures,
    ``functools.partial`` or bound methods (``copy.deepcopy`` of a model whose lambda head reads
    ``self.emb.weight`` leaves the copy reading the original's weight): storage pointer -> a name
    for the error message. Forward reading one computes with a weight whose gradient never reaches
    the model."""
    own = {id(m) for m in module.modules()}
    found: dict[int, str] = {}
    seen: set[int] = set()

    def visit(obj, where: str, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            if id(obj) not in own:
                for name, p in obj.named_parameters():
                    if _storage_ptr(p) is not None:
                        found.setdefault(_storage_ptr(p), f"{name} of {type(obj).__name__} ({where})")
            return
        if isinstance(obj, nn.Parameter) and _storage_ptr(obj) is not None:
            found.setdefault(_storage_ptr(obj), f"a parameter of shape {tuple(obj.shape)} ({where})")
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, f"closure of {obj.__qualname__}", depth + 1)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, f"bound method {obj.__qualname__}", depth + 1)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                visit(item, where, depth + 1)
        elif isinstance(obj, (list, tuple, dict)):
            for item in obj.values() if isinstance(obj, dict) else obj:
                visit(item, where, depth + 1)

    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if not attr.startswith("_"):
                visit(value, f"{name + '.' if name else ''}{attr}", 0)
    return found


@dataclass(frozen=True)
class Entry:
    """Another forward of the same module, captured as a graph of its own: the same parameters
    and buffers under the same names (so a parallel module runs it on the shards it holds), a
    different computation. ``generate``'s KV-cache steps are entries: the model run against a
    cache given as tensors, returning the new tokens' keys and values.

    ``forward(module, *args)`` is traced in place of ``module.forward``. ``split_inputs``: flat
    user inputs stored split the way their readers read them (a cache split by heads), given
    to the graph as this rank's part; ``split_outputs``: flat outputs returned as this rank's
    part of their split instead of gathered. ``sp``: sequence parallelism for this entry
    (None: the module's option)."""

    name: str
    forward: Callable[..., Any]
    split_inputs: tuple[int, ...] = ()
    split_outputs: Container[int] = ()
    sp: bool | None = None


@contextlib.contextmanager
def _traced_forward(module: nn.Module, forward: Callable[..., Any] | None):
    """``module.forward`` is ``forward`` inside (an instance attribute, removed after): the module
    itself is traced, so its state keeps its names."""
    if forward is None:
        yield
        return
    own = module.__dict__.get("forward")  # a forward set on the instance (a hook library's): put back after
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def capture(template: FakeTemplate, args: tuple, kwargs: dict, entry: Entry | None = None) -> CapturedGraph:
    """Trace ``template.module(*args, **kwargs)`` (or ``entry.forward``) to an ATen graph; errors
    say why not. One rank's graph, also under simulated ranks: tracing never sees LocalTensors."""
    with maybe_disable_local_tensor_mode(), _traced_forward(template.module, entry.forward if entry else None):
        return _capture(template, args, kwargs)


def _capture(template: FakeTemplate, args: tuple, kwargs: dict) -> CapturedGraph:
    fake_args, fake_kwargs = template.fake_inputs(args, kwargs)
    try:
        # A meta kernel that refuses our inputs is logged with a traceback before the exception
        # we turn into a message: noise above the message (quiet_fake_tensor_meta_failures).
        # Autograd on whatever the caller's mode (a forward under torch.no_grad() that meets a new
        # input shape captures again, and its graph is cached for training too): the traced run's
        # autograd graph is what finds custom Functions (CustomFunctionWatch).
        with quiet_fake_tensor_meta_failures(), torch.enable_grad(), CustomFunctionWatch(template.module) as functions, \
                PythonRandomWatch() as draws, StateWatch(template.module) as state:
            ep = torch.export.export(template.module, fake_args, fake_kwargs, strict=False)
    except Exception as err:  # torch raises many types here; re-raise one the user can act on
        with quiet_fake_tensor_meta_failures():
            error = _capture_error(template, fake_args, fake_kwargs, err)
        raise error from err
    # Every check that can refuse runs on the exported graph, before functionalization: a model
    # that writes a parameter in place (Gemma 3n clamps one) can crash inside
    # ``run_decompositions``, and a refusal must never depend on what runs after it.
    signature = ep.graph_signature
    mutated = [f"{spec.target!r} ({spec.kind.name})" for spec in signature.output_specs
               if spec.kind != OutputKind.USER_OUTPUT]
    state_names, params = [], set()
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        state_names.append(spec.target)
        if spec.kind == InputKind.PARAMETER:
            params.add(spec.target)
    constants = {}
    buffers = {name for name, _ in template.module.named_buffers(remove_duplicate=False)}
    foreign = []
    placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
    for placeholder, spec in zip(placeholders, signature.input_specs):
        name = spec.target
        if spec.kind != InputKind.CONSTANT_TENSOR or name in buffers:
            continue  # a non-persistent buffer: its value comes from the real module
        value = ep.constants[name]
        writes = _writes_into(ep.graph_module, placeholder)
        if writes:  # ``self.weight.data.clamp_()``: export lifts the alias as a constant it writes into.
            # Checked whatever the constant's type: under simulated ranks it is not a FakeTensor,
            # and a write missed there made the simulated module silently different (Gemma 3n).
            mutated.extend(f"a .data/.detach() alias of a parameter or buffer, written by {describe(w)}"
                           for w in writes)
            continue
        if isinstance(value, FakeTensor):
            own = _template_state_of(template, value)
            if own is not None:
                # The template's own fake parameter held by a functools.partial (or any object export's
                # parameter swap does not reach): the parameter itself.
                state_names[state_names.index(name)] = own
                if own in template.param_names:
                    params.add(own)
                continue
            raise ValueError(
                f"the model creates the tensor constant {name!r} inside forward; sptransform "
                "captures with fake tensors and cannot recover its value: register it as a buffer"
            )
        own = template.own_storage.get(_storage_key(value)) if _storage_key(value) is not None else None
        if own is not None:  # the model's own tensor, reached where the template's copy did not rebind it
            state_names[state_names.index(name)] = own
            if own in template.param_names:
                params.add(own)
            continue
        if _storage_ptr(value) in template.foreign_storage:
            foreign.append(f"{name}: {template.foreign_storage[_storage_ptr(value)]}")
            continue
        constants[name] = value
    # A write through an alias export does not report: ``w.data.clamp_()`` can also be traced as
    # ``clamp_(detach(w))`` (which of the two depends on the fake tensors: simulated ranks got
    # this one), and the captured graph would then leave ``w`` unchanged.
    reported = {spec.target for spec in signature.output_specs if spec.kind != OutputKind.USER_OUTPUT}
    for placeholder, spec in zip(placeholders, signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target not in reported:
            mutated.extend(f"an alias of {spec.target!r} ({spec.kind.name}), written by {describe(w)}"
                           for w in _writes_into(ep.graph_module, placeholder))
    if mutated:
        raise ValueError(
            f"the model's forward mutates {_sites(mutated)}. sptransform supports "
            "forwards that do not write to parameters, buffers or inputs: move the write out of forward (e.g. "
            "clamp the weight after the optimizer step) or compute on a copy"
        )
    if foreign:
        raise ValueError(
            "the model's forward reads parameters of a module that is not part of it, reached through a "
            "closure, functools.partial or bound method (copy.deepcopy does not copy closures: a copy of a "
            "model whose head is `lambda t: t @ self.emb.weight.t()` still reads the original's weight). "
            "Their gradients would never reach the model's parameters. Pass the model itself (not a "
            "copy.deepcopy of it), copy it with sptransform.faithful_deepcopy (which rebinds closures), or "
            "make the tensor a parameter of the model. Read:\n  " + "\n  ".join(foreign)
        )
    refuse_custom_autograd_functions(functions)
    refuse_python_random(draws)
    refuse_state_written_every_call(template.module, template.fake_mode, fake_args, fake_kwargs, state.changes)
    lost_draws = 0
    if _hidden_writes(ep.graph_module):
        # In-place writes read through another alias: functionalize (no decompositions), so
        # that every read of a written value is an edge of the graph (``copy_`` into a slice of a
        # buffer becomes ``slice_scatter``, and later readers read its result).
        draws = random_draws(ep.graph_module)
        with disable_current_modes():  # a disabled LocalTensorMode still on the stack breaks functionalization
            ep = ep.run_decompositions({})
        left = random_draws(ep.graph_module)
        # erased draws matter only where a draw is left to come from a shifted point of the stream
        lost_draws = max(0, draws - left) if left else 0
        views_as_reshapes(ep.graph_module)
        _refuse_hidden_writes(ep.graph_module)
    _drop_export_asserts(ep.graph_module)
    _merge_duplicate_state(ep.graph_module, state_names)  # input order is the signature's, before and after
    num_user = sum(1 for s in signature.input_specs if s.kind == InputKind.USER_INPUT)
    return CapturedGraph(
        gm=ep.graph_module,
        state_names=state_names,
        param_names=params,
        num_user_inputs=num_user,
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        constants=constants,
        tied=_tied_names(template.module),
        lost_draws=lost_draws,
    )


def _tied_names(module: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: tuple(group) for group in names.values() if len(group) > 1 for name in group}


def random_draws(gm: fx.GraphModule) -> int:
    """How many ops of ``gm`` draw from a random generator: ``dropout`` / ``native_dropout`` that
    train with p > 0, and every other ``nondeterministic_seeded`` op (``rand``, ``bernoulli``, ...)."""
    count = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded not in target.tags:
            continue
        if target.overloadpacket in (torch.ops.aten.dropout, torch.ops.aten.native_dropout):
            args = list(node.args) + [node.kwargs.get(k) for k in ("input", "p", "train")[len(node.args):]]
            if not args[1] or args[2] is False:
                continue
        count += 1
    return count


class InputsRejected(ValueError):
    """The model's own forward raises on these inputs (it would on one device too): the inputs,
    not the tracing, are at fault. ``ParallelModule`` adds how they differ from the example."""


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [repr(err)])[0][:300]}"


def _capture_error(template: FakeTemplate, fake_args: tuple, fake_kwargs: dict, err: Exception) -> ValueError:
    """Why ``torch.export`` failed, in the user's terms. A failure that is not one of export's
    own (``tracing_limit_errors``) is told apart by running the same forward plainly on the same
    fake inputs: if that raises too, the model rejects these inputs (a float where token ids go,
    a misspelt keyword, a wrong rank) and saying "not traceable" would send the user the wrong way."""
    if not isinstance(err, tracing_limit_errors()):
        try:
            with maybe_disable_local_tensor_mode(), template.fake_mode, torch.no_grad():
                template.module(*fake_args, **fake_kwargs)
        except Exception as plain:  # the model's own error, whatever its type
            return InputsRejected(
                f"the model raises on these inputs, as it would on one device ({_first_line(plain)}): check what "
                "is passed (names, dtypes, shapes) against the model's forward")
    if isinstance(err, GuardOnDataDependentSymNode):
        return ValueError(
            f"sptransform could not capture the model as one graph: Python control flow {_model_frame(err)} "
            f"depends on the values of a tensor ({_first_line(err)}), e.g. a loop over the experts that "
            "`nonzero` found, whose count changes from batch to batch. Data-dependent shapes themselves are "
            "captured (routing with nonzero, boolean masks or .tolist() runs whole on every rank); a Python "
            "branch or loop count that depends on them is not: loop over a fixed range (for e in "
            "range(num_experts)) and let an expert's selection be empty; see the README's 'Limits'.")
    return ValueError(
        f"sptransform could not capture the model as one graph ({_first_line(err)}). The forward must be "
        "traceable without data-dependent control flow or graph breaks; see the README's 'Limits'.")


def _model_frame(err: BaseException) -> str:
    """``at model.py, line 42: code``: the innermost frame of ``err`` outside torch and sptransform
    (the model's line that made the failing guard), or "" when every frame is theirs."""
    ours = tuple(os.path.dirname(inspect.getfile(m)) + os.sep for m in (torch, _model_frame))
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(ours)]
    if not frames:
        return ""
    frame = frames[-1]
    return f"at {frame.filename}, line {frame.lineno} ({(frame.line or '').strip()})"


def _template_state_of(template: FakeTemplate, value: FakeTensor) -> str | None:
    """The name of the template's parameter or buffer that ``value`` is (same fake storage and view)."""
    key = (StorageWeakRef(value.untyped_storage()), value.storage_offset(), tuple(value.shape), tuple(value.stride()))
    for name, t in _named_state(template.module):
        if isinstance(t, FakeTensor) and key == (StorageWeakRef(t.untyped_storage()), t.storage_offset(),
                                                 tuple(t.shape), tuple(t.stride())):
            return name
    return None


def _writes_into(gm: fx.GraphModule, placeholder: fx.Node) -> list[fx.Node]:
    """The ops that write in place into ``placeholder`` or a view of it."""
    aliases, stack = {placeholder}, [placeholder]
    while stack:
        for user in stack.pop().users:
            if _aliased_input(user) in aliases and user not in aliases:
                aliases.add(user)
                stack.append(user)
    return [node for node in gm.graph.nodes if set(_written_inputs(node)) & aliases]


def _sites(sites: list[str], most: int = 3) -> str:
    """Distinct sites (node names aside: one per layer is one site), the first ``most`` of them."""
    distinct = list(dict.fromkeys(re.sub(r" \(node \w+\)", "", site) for site in sites))
    more = f"; and {len(distinct) - most} more" if len(distinct) > most else ""
    return "; ".join(distinct[:most]) + more


def _merge_duplicate_state(gm: fx.GraphModule, state_names: list[str]) -> None:
    """One placeholder per state name: a constant recognised as a parameter the graph also reads
    directly (a tied head: the embedding by attribute, the head through a closure) becomes that
    parameter's placeholder, so its gradient is one sum."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][: len(state_names)]
    first: dict[str, fx.Node] = {}
    for node, name in list(zip(placeholders, state_names)):
        if name in first:
            node.replace_all_uses_with(first[name])
            gm.graph.erase_node(node)
        else:
            first[name] = node
    if len(first) != len(state_names):
        state_names[:] = list(dict.fromkeys(state_names))
        gm.recompile()


def views_as_reshapes(gm: fx.GraphModule) -> None:
    """Every ``view`` of a functional graph made a ``reshape`` (in place). Tracing turns
    ``reshape`` into ``view`` where the traced (fake) strides allowed it, but what runs may lay a
    value out otherwise: a kernel at run time (SDPA's output, then ``transpose``; at capture),
    or inductor's decompositions of a partitioned graph (``passes.remat``). A functional graph
    never writes through a view, so a ``reshape`` means the same and copies only when it must."""
    views = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is torch.ops.aten.view.default]
    for node in views:
        node.target = torch.ops.aten.reshape.default
    if views:
        gm.recompile()


def _drop_export_asserts(gm: fx.GraphModule) -> None:
    """Export leaves ``_assert_tensor_metadata`` checks behind; they would pin global
    metadata onto tensors that become local shards, and carry no computation."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """A hashable key of what a capture depends on: structure, shapes, dtypes, plain values."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    key = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append(("T", tuple(x.shape), x.dtype, x.requires_grad))
        else:
            key.append(("V", repr(x)))
    return (str(spec), tuple(key))


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s value shares (a view, an in-place op's return, an
    item of a split), read from the op overload's schema; None for a fresh tensor."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and _aliased_input(source) is not None else None
    schema = op_schema(node.target)
    if schema is None:
        return None
    values = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
    for argument, value in zip(schema.arguments, values):
        if argument.alias_info is not None and isinstance(value, fx.Node):
            return value
    return None


def _written_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs an op writes into (``Tensor(a!)`` in its schema: ``copy_``, ``add_``, ``out=``)."""
    schema = op_schema(node.target) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    values = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
    return [value for argument, value in zip(schema.arguments, values)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node)]


def _refuse_hidden_writes(gm: fx.GraphModule) -> None:
    """Refuse what ``_hidden_writes`` finds: after ``capture`` functionalized the graph, a
    safety net (functionalization leaves none)."""
    sites = _hidden_writes(gm)
    if sites:
        raise ValueError(
            "the model's forward writes in place into a tensor that it then reads under another name; "
            "sptransform follows dataflow and would miss the write (a parallel graph could read the value "
            "from before it): write it out of place (torch.cat, torch.where, x = x * s) or read the result "
            "of the in-place op. Writes:\n  " + "\n  ".join(sites)
        )


def _hidden_writes(gm: fx.GraphModule) -> list[str]:
    """An in-place write (``buf[..., :k].copy_(x)``, ``t.masked_fill_(...)``) whose result is
    read afterwards through another alias of the same storage (``buf`` itself, an earlier view)
    is invisible to dataflow: the analysis would place, cut or gather the unwritten value.
    Reads through the in-place op's own result are dataflow and fine. One line per such write."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    source = {node: _aliased_input(node) for node in nodes}
    root: dict[fx.Node, fx.Node] = {}
    group: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        root[node] = root[source[node]] if source[node] is not None else node
        group.setdefault(root[node], []).append(node)

    def written_through(node: fx.Node, write: fx.Node) -> bool:
        while node is not None:
            if node is write:
                return True
            node = source[node]
        return False

    sites = []
    for write in nodes:
        readers = [user for target in _written_inputs(write) for member in group[root[target]]
                   if not written_through(member, write)
                   for user in member.users if order[user] > order[write] and source[user] is not member]
        readers = list(dict.fromkeys(readers))
        if readers:
            more = f" (and {len(readers) - 2} more)" if len(readers) > 2 else ""
            sites.append(f"{describe(write)}\n    is read afterwards, not through its result, by "
                         + "; ".join(describe(r) for r in readers[:2]) + more)
    return sites
