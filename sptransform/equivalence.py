"""``sptransform.verify``: does ``parallelize`` get *this* model right? Run it and see.

    report = sptransform.verify(model, tp=2)
    print(report)            # one row per output, gradient and updated parameter
    assert report.ok

The ``tp`` ranks are simulated in this one process (a fake process group plus
``LocalTensorMode``: every rank's values exist side by side, collectives are exact), so
nothing needs launching and no accelerator is needed. The parallel model, built by
``parallelize(copy, tp=..., sp=..., dropout_rng="reference")``, and an unmodified deep copy
of the model run the same inputs for ``steps`` training steps, and each of these is compared
on every simulated rank:

* every output (a DTensor output, e.g. vocab-sharded logits, through ``full_tensor()``);
* every parameter's gradient;
* every parameter after ``steps`` optimizer steps.

With ``pp > 1`` the ``pp * tp`` ranks are real processes on gloo (CPU), spawned here and
bounded by ``timeout_s``; see ``verify``'s docstring.

Relative error of one compared tensor ``a`` (parallel; the worst over the simulated ranks)
against ``b`` (single device)::

    rel_error = max|a - b| / max(max|b|, FLOOR * scale)

where ``scale`` is the largest ``max|b|`` among the rows of the same kind (all outputs, all
gradients, all updated parameters) and ``FLOOR = 1e-3``. The floor keeps a tensor that is
zero up to rounding (the gradient of a key bias, which softmax ignores, is ~1e-9 noise) from
being judged against its own noise; any error above ``rtol * 1e-3`` of the kind's largest
value still counts. Equal non-finite entries (inf/inf, nan/nan) count as equal; a shape
mismatch, a missing value or an unequal non-finite entry is ``inf``. Over ``steps > 1`` an
output's and a gradient's row keeps its worst step.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import math
import os
import tempfile
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from sptransform.api import normalize_example_inputs, parallelize
from sptransform.copying import faithful_deepcopy
from sptransform.runtime.params import call_defaults
from sptransform.torch_internals import (
    FakeStore, LocalTensor, LocalTensorMode, StridedShard, local_tensor_mode, maybe_disable_local_tensor_mode,
)

FLOOR = 1e-3
"""See the module docstring: the denominator is at least ``FLOOR`` times the kind's largest value."""
LR = 1e-2
"""Learning rate of the SGD steps."""
_SEED = 1234
"""Seed of the default inputs; each step reseeds with ``_SEED + 1 + step`` on both sides
(so reference-mode dropout masks are drawn alike)."""


@dataclass(frozen=True)
class VerifyRow:
    name: str
    """The output (``loss``, ``logits``, ``output[0]``, ...) or parameter name."""
    kind: str
    """``"output"``, ``"grad"`` or ``"param after N steps"``."""
    placement: str
    """As the parallel model holds it: ``Shard(0)``, ``Replicate()``, ``_StridedShard(0, split_factor=3)``;
    an output that is a plain (replicated) tensor says ``plain``."""
    rel_error: float
    ok: bool
    """``rel_error <= rtol``."""


@dataclass(frozen=True)
class VerifyReport:
    status: Literal["equal", "different", "refused"]
    worst: float
    """The largest ``rel_error`` over all rows (0.0 with no rows; nan when refused)."""
    rows: list[VerifyRow] = field(default_factory=list)
    error: str | None = None
    """``parallelize``'s refusal (status ``"refused"``), or what the parallel model raised
    while running (status ``"different"``)."""
    notes: list[str] = field(default_factory=list)
    linears: tuple[int, int] | None = None
    """(linears whose weight the parallel model splits over the ranks, linears in the model): a
    model can be equal and still run some linears whole on every rank (the notes say which)."""
    tp: int = 1
    sp: bool = True
    pp: int = 1
    steps: int = 1
    rtol: float = 1e-4

    @property
    def ok(self) -> bool:
        """``status == "equal"``."""
        return self.status == "equal"

    @property
    def failing(self) -> list[VerifyRow]:
        return [row for row in self.rows if not row.ok]

    def __str__(self) -> str:
        layout = f"tp={self.tp}" + (f" pp={self.pp}" if self.pp > 1 else "") + f" sp={self.sp}"
        lines = [f"sptransform.verify: {layout}, {self.steps} SGD step{'s' if self.steps != 1 else ''}, "
                 f"rtol {self.rtol:g}"]
        if self.rows:
            header = ("name", "kind", "placement", "rel error", "ok")
            cells = [(r.name, r.kind, r.placement, _fmt(r.rel_error), "ok" if r.ok else "FAIL") for r in self.rows]
            widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
            for row in [header, *cells]:
                lines.append("  ".join(c.rjust(w) if i == 3 else c.ljust(w)
                                       for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        lines += [f"note: {note}" for note in self.notes]
        if self.status == "refused":
            lines.append(f"verdict: REFUSED: parallelize refused the model: {self.error}")
        elif self.status == "equal":
            lines.append(f"verdict: EQUAL: all {len(self.rows)} rows within rtol {self.rtol:g} "
                         f"(worst {_fmt(self.worst)})")
        else:
            failing = self.failing
            what = f"{len(failing)} of {len(self.rows)} rows exceed rtol {self.rtol:g}"
            if failing:
                first = max(failing, key=lambda r: r.rel_error)
                what += f" (worst: {first.kind} of {first.name}, {_fmt(first.rel_error)})"
            if self.error:
                what = f"the parallel model raised: {self.error}" + (f"; {what}" if failing else "")
            lines.append(f"verdict: DIFFERENT: {what}")
        return "\n".join(lines)


def _fmt(x: float) -> str:
    return "inf" if x == math.inf else ("nan" if math.isnan(x) else f"{x:.1e}")


def verify(
    model: nn.Module,
    *,
    tp: int,
    sp: bool = True,
    pp: int = 1,
    example_inputs: Any = None,
    steps: int = 1,
    rtol: float = 1e-4,
    timeout_s: float = 600.0,
) -> VerifyReport:
    """Compare ``parallelize(copy of model, tp=..., sp=..., pp=...)`` with the model itself.

    ``model`` is never modified (both sides run deep copies). ``example_inputs`` takes the
    forms ``parallelize`` takes (tuple of args, dict of kwargs, ``(args, kwargs)``); omitted,
    token ids as ``parallelize`` builds them (``api.default_token_ids``: ``[2, 8*tp]``), passed
    as the first input, plus ``labels=`` the same ids when ``forward`` takes ``labels`` (HF),
    so that the model computes its loss. The same inputs run every step.

    **Loss.** What is back-propagated on both sides: the first output that is a 0-dim
    floating tensor (HF's ``.loss``); if there is none, ``sum()`` of the first floating
    output (a DTensor output is summed as a DTensor, whose backward is the same).

    **Optimizer.** Plain SGD (lr ``LR``, no momentum). Its update is linear in the gradient,
    so a parameter after ``steps`` differs from the reference by ``lr`` times the gradients'
    differences, which the gradient rows already bound. Adam divides by ``sqrt(v) + eps``: a
    gradient that is zero up to rounding (a key bias's, ~1e-9 of noise whose sign differs
    with summation order) would take a full ``±lr`` step of random sign, turning rounding
    noise into a visible difference.

    **Dropout.** Compared in the model's own mode (``train()``/``eval()``) with
    ``dropout_rng="reference"``: each rank's masks equal, bit for bit, the single-device
    model's for the same seed. When ``parallelize`` refuses reference mode (dropout inside a
    fused attention kernel, e.g. SDPA with ``dropout_p > 0``), the report says so in
    ``notes`` and both sides are compared in ``eval()`` mode instead.

    **pp > 1.** ``LocalTensorMode`` cannot run torch's pipelining, so ``pp * tp`` gloo
    processes are spawned on CPU (start method ``spawn``: the model and inputs are pickled
    to them, so the model's classes must be importable). They run ``pm.step()`` with
    ``n_microbatches = pp`` (1 when the batch does not split evenly) and the default
    schedule (1F1B); every rank reports the loss, the gradients and parameters it holds
    (gathered over tp), and each is compared with the reference. Rows: ``loss`` (the loss
    ``step()`` returns, the batch mean of microbatch means), grads, parameters. Pipeline
    ranks draw dropout masks per microbatch and per process, which no single-device run
    reproduces, so a model in ``train()`` mode is compared in ``eval()`` mode (noted).
    If the processes do not finish within ``timeout_s`` (also their process group's
    timeout) they are killed and ``TimeoutError`` is raised.

    **Errors.** A ``ValueError``/``TypeError`` from ``parallelize`` (or from the parallel
    model's first forward, where a new input shape is captured) is a refusal: status
    ``"refused"`` with the message in ``error``, nothing raised. Any other exception from
    the parallel model while it runs is reported as status ``"different"`` with ``error``
    set (it is sptransform's failure, not the model's). Exceptions from the unmodified
    model itself (on single device) propagate: the model must run before it can be
    compared. Bad arguments to ``verify`` raise ``ValueError``/``TypeError``, and so does
    calling it in a process with an initialized process group (the simulated ranks need
    their own fake one; run verify in a process without ``init_process_group``) or inside
    an active ``LocalTensorMode``.

    The process group, ``LocalTensorMode`` and the default RNG state (``torch.random``) are
    as before the call when it returns or raises.
    """
    _check_arguments(model, tp=tp, sp=sp, pp=pp, steps=steps, rtol=rtol, timeout_s=timeout_s)
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "sptransform.verify simulates the tp ranks in this process with its own fake process group, "
            f"but a process group (backend {dist.get_backend()!r}, world size {dist.get_world_size()}) is "
            "already initialized here: run verify in a process without init_process_group (e.g. before it, "
            "or in a separate script), not inside a torchrun job"
        )

    if local_tensor_mode() is not None:
        raise ValueError("sptransform.verify was called inside an active LocalTensorMode: call it outside")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        args, kwargs, notes = _inputs(model, example_inputs, tp)
        if pp > 1:
            return _verify_pipeline(model, tp=tp, sp=sp, pp=pp, args=args, kwargs=kwargs, steps=steps, rtol=rtol,
                                    timeout_s=timeout_s, notes=notes)
        return _verify_simulated(model, tp=tp, sp=sp, args=args, kwargs=kwargs, steps=steps, rtol=rtol,
                                 notes=notes)


# -- arguments and inputs ---------------------------------------------------


def _check_arguments(model, *, tp, sp, pp, steps, rtol, timeout_s) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"verify expects an nn.Module, got {type(model).__name__}")
    for name, value in (("tp", tp), ("pp", pp), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if not isinstance(sp, bool):
        raise TypeError(f"sp must be True or False, got {sp!r}")
    for name, value in (("rtol", rtol), ("timeout_s", timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")


def _inputs(model: nn.Module, example_inputs: Any, tp: int) -> tuple[tuple, dict, list[str]]:

    notes = []
    args, kwargs = normalize_example_inputs(model, example_inputs, tp)
    if example_inputs is None:
        ids = args[0]
        notes.append(f"inputs: token ids of shape {list(ids.shape)} (api.default_token_ids)")
        if _takes(model, "labels"):
            kwargs["labels"] = ids
            notes[-1] += ", labels = the same ids"
    # the parallel model sets these (use_cache=False for HF) unless the caller does; so does the reference
    kwargs = {**call_defaults(model), **kwargs}
    return tuple(args), kwargs, notes


def _takes(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


# -- outputs, loss and comparison -------------------------------------------


def _flatten(out: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(name, tensor) for every tensor of a model output: a tensor is ``output``, a mapping's
    (HF ``ModelOutput``'s) entries their keys, a sequence's ``output[i]``."""
    if isinstance(out, torch.Tensor):
        return [(prefix or "output", out)]
    if isinstance(out, Mapping):
        found = []
        for key, value in out.items():
            found += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return found
    if isinstance(out, (tuple, list)):
        found = []
        for i, value in enumerate(out):
            found += _flatten(value, f"{prefix or 'output'}[{i}]")
        return found
    return []


def _loss_of(named: list[tuple[str, torch.Tensor]], like: str | None = None) -> tuple[str, torch.Tensor]:
    """The 0-dim floating output, else ``sum()`` of the first floating output; with ``like`` (the
    reference's choice, e.g. ``"loss"`` or ``"sum(logits)"``), that same output."""
    if like is not None:
        name = like[4:-1] if like.startswith("sum(") else like
        t = dict(named).get(name)
        if t is None:
            raise RuntimeError(f"the parallel model does not return {name!r}, which the original back-propagates")
        if not t.requires_grad:
            raise RuntimeError(f"the parallel model's output {name!r} does not require grad while the original's "
                               "does: its backward is cut")
        return like, (t.sum() if like.startswith("sum(") else t)
    floating = [(n, t) for n, t in named if t.is_floating_point() and t.requires_grad]
    for name, t in floating:
        if t.dim() == 0:
            return name, t
    if not floating:
        raise ValueError(
            "the model returns no floating tensor that requires grad, so there is nothing to back-propagate: "
            "verify compares gradients of a loss; return one from forward"
        )
    name, t = floating[0]
    return f"sum({name})", t.sum()


def _rel_error(a: torch.Tensor | None, b: torch.Tensor | None, scale: float) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        # an unused parameter's gradient is None; a zero gradient on the other side equals it
        other = a if b is None else b
        if other is not None and bool((other == 0).all()):
            return 0.0
        return math.inf
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().double(), b.detach().double()
    same = (a == b) | (a.isnan() & b.isnan())
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    if diff.numel() == 0:
        return 0.0
    worst = float(diff.max())
    if math.isnan(worst) or math.isinf(worst):
        return math.inf
    if worst == 0.0:
        return 0.0
    finite = b[b.isfinite()]
    size = float(finite.abs().max()) if finite.numel() else 0.0
    return worst / max(size, FLOOR * scale, torch.finfo(torch.float64).tiny)


def _scale(values: list[torch.Tensor | None]) -> float:
    scale = 0.0
    for v in values:
        if v is not None and v.numel():
            finite = v.detach()[v.detach().isfinite()]
            if finite.numel():
                scale = max(scale, float(finite.double().abs().max()))
    return scale


@dataclass
class _Record:
    """One side's values: outputs and grads per step, parameters after the last step.
    Parallel values are per rank: ``{rank: tensor}``."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, Any]] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)
    linears: tuple[int, int] | None = None
    plan_notes: list[str] = field(default_factory=list)


def _compare(ref: _Record, par: _Record, *, steps: int, rtol: float, param_names: list[str]) -> list[VerifyRow]:
    rows: list[VerifyRow] = []
    kind_param = f"param after {steps} step{'s' if steps != 1 else ''}"

    def errors(ref_values: list[dict], par_values: list[dict], name: str, scale: float) -> float:
        """Worst over steps and ranks; a value one side lacks (not produced, no rank holds it) is inf."""
        worst = 0.0
        for step_ref, step_par in zip(ref_values, par_values):
            if (name in step_ref) != (name in step_par):
                return math.inf
            expected, got = step_ref.get(name), step_par.get(name)
            for value in (got.values() if isinstance(got, dict) else [got]):
                worst = max(worst, _rel_error(value, expected, scale))
        if len(par_values) < len(ref_values):  # the parallel run stopped early (it raised)
            return math.inf
        return worst

    def scale_of(values: list[dict]) -> float:
        return _scale([t for step in values for t in step.values()])

    output_names = list(dict.fromkeys(n for step in [*ref.outputs, *par.outputs] for n in step))
    scale = scale_of(ref.outputs)
    for name in output_names:
        e = errors(ref.outputs, par.outputs, name, scale)
        rows.append(VerifyRow(name, "output", par.placements.get(f"output:{name}", "plain"), e, e <= rtol))
    scale = scale_of(ref.grads)
    for name in param_names:
        e = errors(ref.grads, par.grads, name, scale)
        rows.append(VerifyRow(name, "grad", par.placements.get(name, "?"), e, e <= rtol))
    scale = _scale(list(ref.params.values()))
    for name in param_names:
        e = errors([ref.params], [par.params], name, scale)
        rows.append(VerifyRow(name, kind_param, par.placements.get(name, "?"), e, e <= rtol))
    return rows


def _report(rows: list[VerifyRow], *, error: str | None = None, **fields) -> VerifyReport:
    worst = max((r.rel_error for r in rows), default=0.0)
    status = "equal" if error is None and all(r.ok for r in rows) else "different"
    return VerifyReport(status=status, worst=worst, rows=rows, error=error, **fields)


def _placement(placement) -> str:

    if isinstance(placement, StridedShard):
        return f"_StridedShard({placement.dim}, split_factor={placement.split_factor})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    return repr(placement)


# -- the single-device reference ---------------------------------------------


def _run_reference(model: nn.Module, args: tuple, kwargs: dict, steps: int) -> tuple[_Record, str]:
    """Train a deep copy of ``model`` ``steps`` SGD steps; exceptions propagate."""
    ref = faithful_deepcopy(model)
    params = dict(ref.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=LR)
    record, loss_name = _Record(), ""
    for step in range(steps):
        torch.manual_seed(_SEED + 1 + step)
        named = _flatten(ref(*args, **kwargs))
        loss_name, loss = _loss_of(named)
        record.outputs.append({n: t.detach().clone() for n, t in named})
        loss.backward()
        record.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    record.params = {n: p.detach().clone() for n, p in params.items()}
    return record, loss_name


# -- tp: simulated ranks ------------------------------------------------------


@contextlib.contextmanager
def simulated_ranks(world: int):
    """A fake process group of ``world`` ranks and ``LocalTensorMode(world)``; both are gone on exit,
    also when the body raises."""
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with LocalTensorMode(world) as mode:
            yield mode
    finally:
        dist.destroy_process_group()


def _per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every simulated rank's full value of ``t`` (a DTensor is gathered first), detached copies."""

    if isinstance(t, DTensor):
        t = t.full_tensor()
    with maybe_disable_local_tensor_mode():
        if isinstance(t, LocalTensor):
            return {r: t._local_tensors[r].detach().clone() for r in sorted(t._local_tensors)}
        return {0: t.detach().clone()}


class _Refused(Exception):
    pass


def _verify_simulated(model, *, tp, sp, args, kwargs, steps, rtol, notes) -> VerifyReport:
    fields = dict(tp=tp, sp=sp, pp=1, steps=steps, rtol=rtol)
    ref, loss_name = _run_reference(model, args, kwargs, steps)
    mode_note = None
    try:
        try:
            par, error = _run_parallel(model, tp=tp, sp=sp, args=args, kwargs=kwargs, steps=steps, loss=loss_name)
        except _Refused as refusal:
            message = str(refusal)
            if not (model.training and "dropout" in message):
                raise
            mode_note = (f"parallelize refuses dropout_rng='reference' in train() mode ({message}); "
                         "compared in eval() mode (dropout off) instead")
            evaluated = faithful_deepcopy(model).eval()
            ref, loss_name = _run_reference(evaluated, args, kwargs, steps)
            par, error = _run_parallel(evaluated, tp=tp, sp=sp, args=args, kwargs=kwargs, steps=steps,
                                       loss=loss_name)
    except _Refused as refusal:
        return VerifyReport(status="refused", worst=math.nan, error=str(refusal), notes=notes, **fields)
    if mode_note:
        notes.append(mode_note)
    elif model.training:
        notes.append("compared in train() mode; dropout masks, if any, are the single-device model's "
                     "(dropout_rng='reference')")
    notes.append(f"back-propagated: {loss_name}; optimizer: SGD lr={LR:g}")
    notes.extend(par.plan_notes)
    rows = _compare(ref, par, steps=steps, rtol=rtol, param_names=list(ref.params))
    return _report(rows, error=error, notes=notes, linears=par.linears, **fields)


def _run_parallel(model, *, tp, sp, args, kwargs, steps, loss: str) -> tuple[_Record, str | None]:
    """Parallelize a deep copy of ``model`` on ``tp`` simulated ranks and train it like the reference.
    Raises ``_Refused`` for parallelize's ValueError/TypeError; returns what else it raised as text."""


    record = _Record()
    with simulated_ranks(tp):
        try:
            pm = parallelize(faithful_deepcopy(model), tp=tp, sp=sp, example_inputs=(args, kwargs),
                             dropout_rng="reference")
        except (ValueError, TypeError) as error:
            raise _Refused(str(error)) from error
        params = {n: p for n, p in pm.named_parameters(remove_duplicate=False)}
        for name, p in params.items():
            record.placements[name] = _placement(p.placements[0]) if isinstance(p, DTensor) else "plain"
        plan = getattr(pm, "plan", None)
        if plan is not None:
            record.linears = plan.linears
            record.plan_notes = [f"linears split over the ranks: {plan.linears[0]} of {plan.linears[1]}", *plan.notes]
        opt = torch.optim.SGD(list(pm.parameters()), lr=LR, foreach=False)
        step = 0
        try:
            for step in range(steps):
                torch.manual_seed(_SEED + 1 + step)
                try:
                    named = _flatten(pm(*args, **kwargs))
                except (ValueError, TypeError) as error:
                    if step == 0:
                        raise _Refused(str(error)) from error
                    raise
                for name, t in named:
                    if isinstance(t, DTensor):
                        record.placements[f"output:{name}"] = _placement(t.placements[0])
                record.outputs.append({n: _per_rank(t) for n, t in named})
                _loss_of(named, like=loss)[1].backward()
                record.grads.append({n: None if p.grad is None else _per_rank(p.grad) for n, p in params.items()})
                opt.step()
                opt.zero_grad(set_to_none=True)
            record.params = {n: _per_rank(p.detach()) for n, p in params.items()}
        except _Refused:
            raise
        except Exception as error:  # sptransform's failure, reported
            where = traceback.extract_tb(error.__traceback__)[-1]
            return record, (f"{type(error).__name__} at step {step}: {error} "
                            f"({os.path.basename(where.filename)}:{where.lineno})")
    return record, None


# -- pp: real gloo processes --------------------------------------------------


def _verify_pipeline(model, *, tp, sp, pp, args, kwargs, steps, rtol, timeout_s, notes) -> VerifyReport:
    import pickle

    import torch.multiprocessing as mp

    fields = dict(tp=tp, sp=sp, pp=pp, steps=steps, rtol=rtol)
    if model.training:
        model = faithful_deepcopy(model).eval()
        notes.append("pp > 1: pipeline ranks draw dropout masks per microbatch and per process, which no "
                     "single-device run reproduces: compared in eval() mode (dropout off)")
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    batch = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
    n_microbatches = pp if batch % pp == 0 else 1
    notes.append(f"{pp * tp} gloo processes (pp={pp} x tp={tp}), schedule 1F1B, {n_microbatches} microbatches")
    ref, loss_name = _run_reference(model, args, kwargs, steps)
    notes.append(f"back-propagated: {loss_name} (the pipeline's step() loss); optimizer: SGD lr={LR:g}")
    payload = dict(model=model, args=args, kwargs=kwargs, tp=tp, sp=sp, pp=pp, steps=steps,
                   n_microbatches=n_microbatches, timeout_s=timeout_s)
    try:
        payload_bytes = pickle.dumps(payload)
    except Exception as error:
        raise ValueError(f"pp > 1 verification sends the model to {pp * tp} spawned processes, so it must be "
                         f"picklable (its classes importable by module name), and it is not: {error}") from error
    with tempfile.TemporaryDirectory(prefix="sptransform-verify-") as folder:
        with open(os.path.join(folder, "payload.pkl"), "wb") as f:
            f.write(payload_bytes)
        _run_processes(mp, world=pp * tp, folder=folder, timeout_s=timeout_s)
        results = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(pp * tp)]
    refused = [r["refused"] for r in results if r.get("refused")]
    if refused:
        return VerifyReport(status="refused", worst=math.nan, error=refused[0], notes=notes, **fields)
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(results) if r.get("error")]
    par = _Record()
    for rank, result in enumerate(results):
        for step, losses in enumerate(result.get("losses", [])):
            while len(par.outputs) <= step:
                par.outputs.append({})
            par.outputs[step].setdefault("loss", {})[rank] = losses
        for step, grads in enumerate(result.get("grads", [])):
            while len(par.grads) <= step:
                par.grads.append({})
            for name, g in grads.items():
                par.grads[step].setdefault(name, {})[rank] = g
        for name, p in result.get("params", {}).items():
            par.params.setdefault(name, {})[rank] = p
        par.placements.update(result.get("placements", {}))
    ref.outputs = [{"loss": step[loss_name] if loss_name in step else None} for step in ref.outputs]
    rows = _compare(ref, par, steps=steps, rtol=rtol, param_names=list(ref.params))
    # a parameter some rank holds but no rank reported is a missing value: inf (from _compare)
    return _report(rows, error="; ".join(errors) or None, notes=notes, **fields)


def _run_processes(mp, *, world: int, folder: str, timeout_s: float) -> None:
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(_pipeline_worker, args=(world, port, folder, timeout_s), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pp verification did not finish within timeout_s={timeout_s:g} s: its "
                                   f"{world} processes were killed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def _pipeline_worker(rank: int, world: int, port: int, folder: str, timeout_s: float) -> None:
    """One pipeline rank: build the pipelined model, run the steps, save what this rank holds.
    Never raises (the parent reads the result file)."""
    import pickle


    torch.set_num_threads(1)  # several ranks share the cores
    result: dict[str, Any] = {}
    try:
        with open(os.path.join(folder, "payload.pkl"), "rb") as f:
            payload = pickle.load(f)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(1.0, timeout_s)))
        try:
        
            try:
                pm = parallelize(payload["model"], tp=payload["tp"], sp=payload["sp"], pp=payload["pp"],
                                 n_microbatches=payload["n_microbatches"],
                                 example_inputs=(payload["args"], payload["kwargs"]))
            except (ValueError, TypeError) as error:
                result["refused"] = str(error)
            else:
                held = dict(pm.named_parameters(remove_duplicate=False))
                result["placements"] = {n: _placement(p.placements[-1]) if isinstance(p, DTensor) else "plain"
                                        for n, p in held.items()}
                opt = torch.optim.SGD(list(pm.parameters()), lr=LR, foreach=False)
                result["losses"], result["grads"] = [], []
                for step in range(payload["steps"]):
                    torch.manual_seed(_SEED + 1 + step)
                    loss = pm.step(*payload["args"], **payload["kwargs"])
                    result["losses"].append(loss.detach().clone())
                    result["grads"].append({n: None if p.grad is None else _full(p.grad) for n, p in held.items()})
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                result["params"] = {n: _full(p.detach()) for n, p in held.items()}
            dist.barrier()  # no rank tears its connections down while another still uses them
        finally:
            dist.destroy_process_group()
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        result["error"] = f"{type(error).__name__}: {error} ({os.path.basename(where.filename)}:{where.lineno})"
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))


def _full(t: torch.Tensor) -> torch.Tensor:

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
