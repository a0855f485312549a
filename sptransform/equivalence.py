"""``sptransform.verify``: does ``parallelize`` get *this* model right? Run it and see.

    report = sptransform.verify(model, tp=2)
    print(report)            # one row per output, gradient and updated parameter
    assert report.ok

The parallel model, built by ``parallelize(copy, tp=..., sp=..., dropout_rng="reference")``,
and an unmodified copy of the model run the same inputs for ``steps`` training steps, and each
of these is compared on every rank:

* every output (a DTensor output, e.g. vocab-sharded logits, through ``full_tensor()``);
* every parameter's gradient;
* every parameter after ``steps`` optimizer steps.

The ranks are real gloo processes spawned here by default, or simulated in this one process
(``processes=False``), or the ranks of the caller's ``torchrun`` job; ``sptransform.verify_ranks``
runs them, and ``verify``'s docstring says which runs when.

Relative error of one compared tensor ``a`` (parallel; the worst over the ranks)
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

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from sptransform.api import normalize_example_inputs
from sptransform.copying import faithful_deepcopy
from sptransform.logs import phases
from sptransform.options import ParallelOptions, check_graph_compiler, check_recompute
from sptransform.runtime.params import call_defaults
from sptransform.torch_internals import local_tensor_mode, quiet_fake_tensor_meta_failures
from sptransform.verify_ranks import (
    LR, SEED, NotPortable, ParallelCase, ParallelRun, Record, run_on_group, run_processes, run_reference,
    run_simulated, split_batch,
)

FLOOR = 1e-3
"""See the module docstring: the denominator is at least ``FLOOR`` times the kind's largest value."""


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
    held_share: float | None = None
    """The largest share of the model's parameter bytes one rank stores, measured on its tensors (~1/tp
    when the big weights are split, 1.0 when none is: equal but not split)."""
    tp: int = 1
    sp: bool = True
    pp: int = 1
    dp: int = 1
    ep: int = 1
    shard_whole: bool = False
    steps: int = 1
    rtol: float = 1e-4
    recompute: str | float | int = "none"
    compile: str = "inductor"
    """``parallelize``'s ``recompute`` and ``compile`` (the latter used only with a ``recompute``)."""
    ranks: Literal["simulated", "processes"] = "simulated"
    """Where the parallel model ran: ranks simulated in one process (``LocalTensorMode``), or
    real processes (spawned by verify, or the caller's ``torchrun`` job)."""
    processes: int = 0
    """With ``ranks="processes"``: how many (``dp * pp * tp``)."""
    backend: str | None = None
    """With ``ranks="processes"``: their process group's backend (``"gloo"`` when spawned)."""

    @property
    def ok(self) -> bool:
        """``status == "equal"``."""
        return self.status == "equal"

    @property
    def engine(self) -> str:
        """What ran the parallel ranks, in words: ``real gloo processes (2)`` or ``simulated ranks
        (LocalTensorMode)``."""
        if self.ranks == "processes":
            return f"real {self.backend} processes ({self.processes})"
        return "simulated ranks (LocalTensorMode)"

    @property
    def failing(self) -> list[VerifyRow]:
        return [row for row in self.rows if not row.ok]

    def __str__(self) -> str:
        layout = (f"tp={self.tp}" + (f" pp={self.pp}" if self.pp > 1 else "") + (f" dp={self.dp}" if self.dp > 1 else "")
                  + (f" ep={self.ep}" if self.ep > 1 else "") + f" sp={self.sp}"
                  + (" shard_whole=True" if self.shard_whole else "")
                  + (f" recompute={self.recompute!r} compile={self.compile!r}" if self.recompute != "none" else ""))
        lines = [f"sptransform.verify: {layout}, {self.engine}, {self.steps} SGD step{'s' if self.steps != 1 else ''}, "
                 f"rtol {self.rtol:g}"]
        if self.rows:
            header = ("name", "kind", "placement", "rel error", "ok")
            cells = [(r.name, r.kind, r.placement, _fmt(r.rel_error), "ok" if r.ok else "FAIL") for r in self.rows]
            widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
            for row in [header, *cells]:
                lines.append("  ".join(c.rjust(w) if i == 3 else c.ljust(w)
                                       for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        lines += [f"note: {note}" for note in self.notes]
        if self.held_share is not None:
            lines.append(f"held per rank: {self.held_share:.3f} of the parameter bytes (1/{self.tp * self.pp} "
                         f"= {1 / (self.tp * self.pp):.3f} if every weight were split over tp x pp"
                         + (f"; the experts are split over ep={self.ep} too" if self.ep > 1 else "") + ")")
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
    dp: int = 1,
    ep: int = 1,
    example_inputs: Any = None,
    steps: int = 1,
    rtol: float = 1e-4,
    timeout_s: float = 600.0,
    processes: bool | None = None,
    recompute: str | float | int = "none",
    compile: Literal["inductor", "eager"] = "inductor",
    shard_whole: bool = False,
) -> VerifyReport:
    """Compare ``parallelize(copy of model, tp=..., sp=..., pp=..., dp=...)`` with the model itself.

    ``model`` is never modified (both sides run copies, ``faithful_deepcopy``). ``example_inputs``
    takes the forms ``parallelize`` takes (tuple of args, dict of kwargs, ``(args, kwargs)``);
    omitted, token ids as ``parallelize`` builds them (``api.default_token_ids``: ``[2, 8*tp]``,
    ``dp`` such batches with ``dp > 1``; ``ep`` splits the experts over groups of ``ep`` of
    them, as ``parallelize``'s), passed as the first input, plus ``labels=`` the same
    ids when ``forward`` takes ``labels`` (HF), so that the model computes its loss. The same
    inputs run every step.

    **Where the ranks run** (``processes``; the report's first line says which ran):

    * ``None`` (default): real processes, ``dp * pp * tp`` of them, spawned here on gloo (CPU;
      start method ``spawn``: the model and inputs are pickled to them, so the model's classes
      must be importable by module name). A model that cannot be sent (pickle refuses it, e.g.
      a lambda stored on a module, or its class is defined in ``__main__``) is verified on
      simulated ranks instead when pp = dp = 1, with a note saying why; with pp or dp > 1 that
      is a ``ValueError``.
    * ``True``: real processes; a model that cannot be sent is a ``ValueError``.
    * ``False``: simulated ranks: ``tp`` ranks in this one process (a fake process group plus
      ``LocalTensorMode``: every rank's values side by side, collectives exact); pp = dp = 1 only.

    Inside a job whose process group is already initialized (``torchrun``), nothing is spawned:
    every rank of the job must call ``verify`` with the same arguments, the job's world size must
    be ``dp * pp * tp``, and each rank runs its part on the job's own process group (its backend
    and devices; ``timeout_s`` does not apply, the group's own timeout does); every rank returns
    the same report. ``processes=False`` is refused there (the simulated ranks need their own
    fake process group).

    Spawned processes are bounded by ``timeout_s`` (also their process group's timeout): when they
    do not finish in time they are killed and ``TimeoutError`` is raised.

    **What is compared.** Every output (a DTensor output, e.g. vocab-sharded logits, gathered),
    every parameter's gradient, every parameter after ``steps`` SGD steps, on every rank,
    against the reference; one row each in the report. **Loss.** What is back-propagated on both
    sides: the first output that is a 0-dim floating tensor (HF's ``.loss``); if there is none,
    ``sum()`` of the first floating output (a DTensor output is summed as a DTensor, whose
    backward is the same).

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

    **pp > 1.** ``pm.step()`` with ``n_microbatches = pp`` (1 when the batch does not split
    evenly) and the default schedule (1F1B); every rank reports the loss, the gradients and
    parameters it holds (gathered over tp). Rows: ``loss`` (the loss ``step()`` returns, the
    batch mean of microbatch means), grads, parameters. Pipeline ranks draw dropout masks per
    microbatch and per process, which no single-device run reproduces, so a model in
    ``train()`` mode is compared in ``eval()`` mode (noted).

    **dp > 1.** Each data-parallel group trains on its piece of the batch (dim 0 split into
    ``dp`` equal pieces; ``ValueError`` when it does not split); the reference runs the same
    pieces on one device and back-propagates the mean of their losses, which is what averaging
    the groups' gradients computes. Each rank's outputs are compared with the reference's
    outputs of its piece.

    **recompute, compile.** Passed to ``parallelize`` as they are (see there): the parallel graph
    (of the module, or of each pipeline stage) is partitioned by the ``recompute`` policy or
    budget and the partitioned forward and backward compiled by ``compile`` (``"inductor"``:
    generated kernels). AOTAutograd cannot trace simulated ranks, so ``recompute`` other than
    ``"none"`` needs real processes: ``processes=False`` is then a ``ValueError``, and so is a
    model that cannot be sent to them. ``compile`` is unused with ``recompute="none"``.

    **Errors.** A ``ValueError``/``TypeError`` from ``parallelize`` (or from the parallel
    model's first forward, where a new input shape is captured) is a refusal: status
    ``"refused"`` with the message in ``error``, nothing raised. Any other exception from
    the parallel model while it runs is reported as status ``"different"`` with ``error``
    set (it is sptransform's failure, not the model's). Exceptions from the unmodified
    model itself (on single device) propagate: the model must run before it can be
    compared. Bad arguments to ``verify`` raise ``ValueError``/``TypeError``, and so does
    calling it inside an active ``LocalTensorMode``.

    Torch's fake-tensor log records "failed while attempting to run meta for <op>" (logged
    before a fallback that succeeds, e.g. ``grouped_mm`` in MoE experts on CPU) are dropped
    while verify runs: its output is its report.

    The process group, ``LocalTensorMode`` and the default RNG state (``torch.random``) are
    as before the call when it returns or raises.
    """
    _check_arguments(model, tp=tp, sp=sp, pp=pp, dp=dp, steps=steps, rtol=rtol, timeout_s=timeout_s,
                     processes=processes, recompute=recompute, compile=compile, ep=ep,
                     shard_whole=shard_whole)
    if local_tensor_mode() is not None:
        raise ValueError("sptransform.verify was called inside an active LocalTensorMode: call it outside")
    on_group = dist.is_available() and dist.is_initialized()
    if on_group:
        _check_group(tp=tp, pp=pp, dp=dp, processes=processes)
    elif processes is False and (pp > 1 or dp > 1):
        raise ValueError(
            f"processes=False simulates tensor-parallel ranks only, and {'pp' if pp > 1 else 'dp'}="
            f"{pp if pp > 1 else dp} needs real processes (LocalTensorMode runs neither torch's pipelining nor "
            "data-parallel meshes): pass processes=None or True"
        )
    elif processes is False and recompute != "none":
        raise ValueError(
            f"processes=False simulates the ranks, and recompute={recompute!r} needs real processes (AOTAutograd, "
            "which partitions and compiles the graphs, cannot trace LocalTensorMode's simulated ranks): pass "
            "processes=None or True, or recompute='none'"
        )
    with torch.random.fork_rng(devices=[]), quiet_fake_tensor_meta_failures(), \
            phases(("single device", "parallel ranks", "comparison"), desc="verify") as begin:
        torch.manual_seed(SEED)
        begin("single device")
        args, kwargs, notes = _inputs(model, example_inputs, tp, dp)
        fields = dict(tp=tp, sp=sp, pp=pp, dp=dp, ep=ep, shard_whole=shard_whole, steps=steps, rtol=rtol, recompute=recompute, compile=compile)
        if pp > 1 and model.training:
            model = faithful_deepcopy(model).eval()
            notes.append("pp > 1: pipeline ranks draw dropout masks per microbatch and per process, which no "
                         "single-device run reproduces: compared in eval() mode (dropout off)")
        ref, loss_name = run_reference(model, args, kwargs, steps, dp=dp)
        begin("parallel ranks")
        case = ParallelCase(model, args, kwargs, tp=tp, sp=sp, pp=pp, dp=dp, ep=ep, steps=steps, loss=loss_name,
                            n_microbatches=_microbatches(args, kwargs, pp, dp), recompute=recompute,
                            compile=compile, shard_whole=shard_whole)
        run, fields["ranks"], fields["processes"], fields["backend"] = _run_parallel(
            case, on_group=on_group, processes=processes, timeout_s=timeout_s, notes=notes)
        if run.refused:
            return VerifyReport(status="refused", worst=math.nan, error=run.refused, notes=notes, **fields)
        if run.evaluated:
            because = f" ({run.evaluated_because})" if run.evaluated_because else ""
            notes.append(f"parallelize refuses dropout_rng='reference' in train() mode{because}; compared in "
                         "eval() mode (dropout off) instead")
            ref, loss_name = run_reference(faithful_deepcopy(model).eval(), args, kwargs, steps, dp=dp)
        elif model.training:
            notes.append("compared in train() mode; dropout masks, if any, are the single-device model's "
                         "(dropout_rng='reference')")
        if pp > 1:
            notes.append(f"schedule 1F1B, {case.n_microbatches} microbatches")
            ref.outputs = [{"loss": step.get(loss_name)} for step in ref.outputs]
            loss_name += " (the pipeline's step() loss)"
        notes.append(f"back-propagated: {loss_name}; optimizer: SGD lr={LR:g}")
        notes.extend(run.record.plan_notes)
        begin("comparison")
        rows = _compare(ref, run.record, steps=steps, rtol=rtol, param_names=list(ref.params), group=pp * tp)
        # a parameter some rank holds but no rank reported is a missing value: inf (from _compare)
        return _report(rows, error=run.error, notes=notes, linears=run.record.linears,
                       held_share=run.record.held_share, **fields)


def _run_parallel(case: ParallelCase, *, on_group: bool, processes: bool | None, timeout_s: float,
                  notes: list[str]) -> tuple[ParallelRun, str, int, str | None]:
    """(the run, ``ranks``, the number of processes, their backend) on the engine ``processes`` asks for."""
    if on_group:
        notes.append(f"ran on the caller's process group ({case.world} ranks)")
        return run_on_group([case])[0], "processes", case.world, dist.get_backend()
    if processes is not False:
        try:
            return run_processes([case], timeout_s=timeout_s)[0], "processes", case.world, "gloo"
        except NotPortable as why:
            needs_processes = case.pp > 1 or case.dp > 1 or case.recompute != "none"
            if processes or needs_processes:
                raise ValueError(
                    f"real processes are spawned (start method 'spawn'), so the model must be picklable with its "
                    f"classes importable by module name, and it is not: {why}; define the model in an importable "
                    "module without lambdas" + ("" if needs_processes else
                                                ", or pass processes=False for simulated ranks")
                ) from None
            notes.append(f"simulated ranks, not real processes: the model cannot be sent to spawned processes ({why})")
    return run_simulated(case), "simulated", 0, None


def _check_group(*, tp: int, pp: int, dp: int, processes: bool | None) -> None:
    world, backend = dist.get_world_size(), dist.get_backend()
    if processes is False:
        raise ValueError(
            f"processes=False simulates the ranks in this process with its own fake process group, but a process "
            f"group (backend {backend!r}, world size {world}) is already initialized here: pass processes=None to "
            "run on this job's ranks, or call verify in a process without init_process_group"
        )
    if world != dp * pp * tp:
        raise ValueError(
            f"verify inside a job runs on the job's ranks, and its world size {world} is not dp x pp x tp = "
            f"{dp} x {pp} x {tp} = {dp * pp * tp}: choose tp, pp and dp whose product is {world}, or call verify "
            "outside the job (it then spawns its own processes)"
        )


def _microbatches(args: tuple, kwargs: dict, pp: int, dp: int) -> int:
    """pp microbatches of the local batch when it splits evenly, else 1."""
    if pp == 1:
        return 1
    local_args, local_kwargs = split_batch(args, kwargs, dp)[0]
    tensors = [x for x in (*local_args, *local_kwargs.values()) if isinstance(x, torch.Tensor)]
    batch = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
    return pp if batch % pp == 0 else 1


# -- arguments and inputs ---------------------------------------------------


def _check_arguments(model, *, tp, sp, pp, dp, steps, rtol, timeout_s, processes, recompute="none",
                     compile="inductor", ep=1, shard_whole=False) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"verify expects an nn.Module, got {type(model).__name__}")
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if not isinstance(sp, bool):
        raise TypeError(f"sp must be True or False, got {sp!r}")
    if processes is not None and not isinstance(processes, bool):
        raise TypeError(f"processes must be None (real processes where the model can be sent to them), True "
                        f"(real processes) or False (simulated ranks), got {processes!r} ({type(processes).__name__})")
    for name, value in (("rtol", rtol), ("timeout_s", timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    # parallelize's rules for ep (it divides dp) and shard_whole (tp > 1), before anything is spawned
    ParallelOptions(tp=tp, dp=dp, ep=ep, shard_whole=shard_whole)
    check_recompute(recompute)  # parallelize's own rules, checked before anything is spawned
    check_graph_compiler(compile)


def _inputs(model: nn.Module, example_inputs: Any, tp: int, dp: int) -> tuple[tuple, dict, list[str]]:
    """(args, kwargs, notes): the whole batch (dp pieces of it with dp > 1)."""
    notes = []
    args, kwargs = normalize_example_inputs(model, example_inputs, tp)
    if example_inputs is None:
        ids = torch.cat([args[0], *(normalize_example_inputs(model, None, tp)[0][0] for _ in range(dp - 1))])
        args = (ids,)
        notes.append(f"inputs: token ids of shape {list(ids.shape)} (api.default_token_ids)")
        if _takes(model, "labels"):
            kwargs["labels"] = ids
            notes[-1] += ", labels = the same ids"
    # the parallel model sets these (use_cache=False for HF) unless the caller does; so does the reference
    kwargs = {**call_defaults(model), **kwargs}
    split_batch(tuple(args), kwargs, dp)  # a batch that does not split over dp is refused here
    return tuple(args), kwargs, notes


def _takes(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


# -- comparison -------------------------------------------------------------


def rel_error(a: torch.Tensor | None, b: torch.Tensor | None, scale: float) -> float:
    """``max|a - b| / max(max|b|, FLOOR * scale)`` (the module docstring's rule); 0 for two Nones or a
    None against zeros, inf for a shape mismatch, a missing value or an unequal non-finite entry."""
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
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
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


def _compare(ref: Record, par: Record, *, steps: int, rtol: float, param_names: list[str],
             group: int = 1) -> list[VerifyRow]:
    """One row per output, gradient and parameter. ``group``: ranks per data-parallel group
    (pp x tp); a reference output of several batch pieces (``{piece: tensor}``, dp > 1) is
    compared on rank r with piece ``r // group``."""
    rows: list[VerifyRow] = []
    kind_param = f"param after {steps} step{'s' if steps != 1 else ''}"

    def errors(ref_values: list[dict], par_values: list[dict], name: str, scale: float) -> float:
        """Worst over steps and ranks; a value one side lacks (not produced, no rank holds it) is inf."""
        worst = 0.0
        for step_ref, step_par in zip(ref_values, par_values):
            if (name in step_ref) != (name in step_par):
                return math.inf
            expected, got = step_ref.get(name), step_par.get(name)
            for rank, value in (got.items() if isinstance(got, dict) else [(0, got)]):
                want = expected.get(rank // group) if isinstance(expected, dict) else expected
                worst = max(worst, rel_error(value, want, scale))
        if len(par_values) < len(ref_values):  # the parallel run stopped early (it raised)
            return math.inf
        return worst

    def scale_of(values: list[dict]) -> float:
        return _scale([t for step in values for v in step.values()
                       for t in (v.values() if isinstance(v, dict) else [v])])

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


__all__ = ["verify", "VerifyReport", "VerifyRow", "rel_error", "FLOOR", "LR"]
