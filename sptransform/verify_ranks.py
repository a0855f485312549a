"""Where ``sptransform.verify`` runs the two sides it compares, and what it records of them.

The reference (``run_reference``): an unmodified copy of the model trained ``steps`` SGD steps on
one device. The parallel side (``ParallelCase``): ``parallelize(copy of the model, ...)`` trained
by the same loop, on one of two engines that record the same values, per rank:

* ``run_simulated``: the ``tp`` ranks simulated in this process (a fake process group plus
  ``LocalTensorMode``: every rank's values side by side, collectives exact);
* ``run_processes``: ``dp * pp * tp`` real processes on gloo (CPU), spawned here (start method
  ``spawn``: the cases are pickled to them), all cases of one call in ONE spawn, bounded by
  ``timeout_s``; or ``run_on_group``: the same loop on the ranks of the caller's initialized
  process group (inside a ``torchrun`` job, where every rank calls it).

Every engine reseeds the default generator with ``SEED + 1 + step`` before each step, as the
reference does, so that ``dropout_rng="reference"`` masks are drawn alike.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from sptransform.api import parallelize
from sptransform.copying import faithful_deepcopy
from sptransform.runtime.params import held_share
from sptransform.torch_internals import (
    FakeStore, LocalTensorMode, StridedShard, local_values, maybe_disable_local_tensor_mode,
    quiet_fake_tensor_meta_failures,
)

LR = 1e-2
"""Learning rate of the SGD steps."""
SEED = 1234
"""Seed of verify's default inputs and of ``parallelize``; step ``i`` of every side reseeds with
``SEED + 1 + i`` (so reference-mode dropout masks are drawn alike)."""


@dataclass
class Record:
    """One side's values: outputs and grads per step, parameters after the last step. Parallel
    values are per rank, ``{rank: tensor}`` (a DTensor gathered to its full value)."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, Any]] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)
    """Parameter name (or ``output:<name>``) -> its placement on the tensor-parallel axis."""
    linears: tuple[int, int] | None = None
    plan_notes: list[str] = field(default_factory=list)
    held_share: float | None = None
    """The largest share of the model's parameter bytes one rank stores (``runtime.params.held_share``)."""


@dataclass(frozen=True)
class ParallelCase:
    """One parallel run: a model, its inputs, the layout and the training loop's settings."""

    model: nn.Module
    """Never modified: every engine trains a copy (``faithful_deepcopy``, or an unpickled one)."""
    args: tuple
    kwargs: dict
    tp: int
    sp: bool = True
    pp: int = 1
    dp: int = 1
    ep: int = 1
    """Expert parallelism over groups of ``ep`` of the ``dp`` ranks."""
    steps: int = 1
    loss: str = ""
    """The reference's choice of what to back-propagate (``"loss"``, ``"sum(logits)"``); pp > 1
    back-propagates what ``step()`` does."""
    n_microbatches: int = 1
    """With pp > 1: microbatches of ``step()``."""
    recompute: str | float | int = "none"
    """``parallelize``'s ``recompute`` (a policy or a budget); other than ``"none"``, real ranks only."""
    compile: str = "inductor"
    """``parallelize``'s ``compile``: how the graphs ``recompute`` partitions are compiled."""
    shard_whole: bool = False
    """``parallelize``'s ``shard_whole``: what tp keeps whole stored in 1/tp pieces."""
    build: Callable[[], nn.Module] | None = None
    """An importable function returning a model of the same structure: spawned processes call it
    and load ``model``'s state and train()/eval() modes into the result, instead of unpickling
    ``model`` (for a model pickle refuses, e.g. one holding a lambda)."""

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


@dataclass
class ParallelRun:
    """What one engine recorded of one case."""

    record: Record = field(default_factory=Record)
    error: str | None = None
    """What the parallel model (or a rank) raised while running: sptransform's failure."""
    refused: str | None = None
    """``parallelize``'s ValueError/TypeError (or the first forward's, where capture happens)."""
    evaluated: bool = False
    """``parallelize`` refused reference-mode dropout in train() mode (dropout inside a fused
    attention kernel, dropout masks capture erased), so the case ran in eval() mode; the reference must too."""
    evaluated_because: str = ""
    """That refusal's message."""


class _Refused(Exception):
    pass


# -- the single-device reference -----------------------------------------------------


def split_batch(args: tuple, kwargs: dict, parts: int) -> list[tuple[tuple, dict]]:
    """The inputs of each of ``parts`` data-parallel groups: every tensor whose dim 0 is the
    batch (the first tensor's dim 0) split into equal consecutive pieces along dim 0, other
    values as they are. Raises ValueError when the batch does not split evenly."""
    if parts == 1:
        return [(args, kwargs)]
    leaves = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim()]
    batch = leaves[0].shape[0] if leaves else 0
    if batch == 0 or batch % parts:
        raise ValueError(f"dp={parts}: each data-parallel group trains on its own piece of the batch, and the "
                         f"example inputs' batch of {batch} does not split into {parts} equal pieces: pass inputs "
                         f"whose dim 0 is a multiple of {parts}")

    def piece(x, i):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch:
            return x.chunk(parts)[i]
        return x

    return [(tuple(piece(x, i) for x in args), {k: piece(v, i) for k, v in kwargs.items()}) for i in range(parts)]


def run_reference(model: nn.Module, args: tuple, kwargs: dict, steps: int, *, dp: int = 1) -> tuple[Record, str]:
    """Train a copy of ``model`` ``steps`` SGD steps: (its record, the name of what it
    back-propagated). With ``dp > 1`` each step runs the ``dp`` pieces of the batch
    (``split_batch``) and back-propagates the mean of their losses, as data parallelism does;
    outputs are then ``{piece: tensor}``. Exceptions propagate (the model must run before it can
    be compared)."""
    ref = faithful_deepcopy(model)
    params = dict(ref.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=LR)
    record, loss_name = Record(), ""
    pieces = split_batch(args, kwargs, dp)
    for step in range(steps):
        outputs: dict[str, Any] = {}
        for i, (piece_args, piece_kwargs) in enumerate(pieces):
            torch.manual_seed(SEED + 1 + step)
            named = flatten(ref(*piece_args, **piece_kwargs))
            loss_name, loss = loss_of(named)
            for n, t in named:
                if dp == 1:
                    outputs[n] = t.detach().clone()
                else:
                    outputs.setdefault(n, {})[i] = t.detach().clone()
            (loss / dp if dp > 1 else loss).backward()
        record.outputs.append(outputs)
        record.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    record.params = {n: p.detach().clone() for n, p in params.items()}
    return record, loss_name


def flatten(out: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(name, tensor) for every tensor of a model output: a tensor is ``output``, a mapping's
    (HF ``ModelOutput``'s) entries their keys, a sequence's ``output[i]``."""
    if isinstance(out, torch.Tensor):
        return [(prefix or "output", out)]
    if isinstance(out, Mapping):
        found = []
        for key, value in out.items():
            found += flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return found
    if isinstance(out, (tuple, list)):
        found = []
        for i, value in enumerate(out):
            found += flatten(value, f"{prefix or 'output'}[{i}]")
        return found
    return []


def loss_of(named: list[tuple[str, torch.Tensor]], like: str | None = None) -> tuple[str, torch.Tensor]:
    """The 0-dim floating output, else ``sum()`` of the first floating output; with ``like`` (the
    reference's choice, e.g. ``"loss"`` or ``"sum(logits)"``), that same output."""
    if like:
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


# -- the parallel side: one loop, every engine ---------------------------------------------


def _placement(t: torch.Tensor) -> str:
    """The placement on the tensor-parallel axis (the mesh's last) of a DTensor, preceded, where the
    mesh has an ``ep`` axis and the tensor is split there (experts), by that one; ``plain`` otherwise."""
    if not isinstance(t, DTensor):
        return "plain"
    names = tuple(t.device_mesh.mesh_dim_names or ())
    if "ep" in names and isinstance(t.placements[names.index("ep")], Shard) and \
            t.placements[names.index("ep")] != t.placements[names.index("ep") - 1]:
        experts = f"ep Shard({t.placements[names.index('ep')].dim})"
        tp = t.device_mesh.size(len(names) - 1)
        return experts if tp == 1 or isinstance(t.placements[-1], Replicate) else \
            f"{experts}, tp {_describe(t.placements[-1])}"
    return _describe(t.placements[-1])


def _describe(placement) -> str:
    if isinstance(placement, StridedShard):
        return f"_StridedShard({placement.dim}, split_factor={placement.split_factor})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    return repr(placement)


def _values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every rank's full value of ``t`` that this process holds (a DTensor is gathered first):
    each simulated rank's under LocalTensorMode, else this process's under its global rank;
    detached copies on the CPU."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    with maybe_disable_local_tensor_mode():
        per_rank = local_values(t)
        if per_rank is not None:
            return {r: per_rank[r].detach().clone().cpu() for r in sorted(per_rank)}
        return {dist.get_rank() if dist.is_initialized() else 0: t.detach().clone().cpu()}


def _parallel_run(case: ParallelCase, model: nn.Module) -> ParallelRun:
    """Parallelize ``model`` (a copy this run owns) as ``case`` says and train it. A refusal of
    reference-mode dropout in train() mode is retried in eval() mode (``evaluated``)."""
    try:
        return ParallelRun(*_train(case, model))
    except _Refused as refusal:
        because = str(refusal)
        if not (case.pp == 1 and case.model.training and "dropout" in because):
            return ParallelRun(refused=because)
    evaluated = _copy_of(case).eval()
    try:
        return ParallelRun(*_train(case, evaluated), evaluated=True, evaluated_because=because)
    except _Refused as refusal:
        return ParallelRun(refused=str(refusal), evaluated=True, evaluated_because=because)


def _train(case: ParallelCase, model: nn.Module) -> tuple[Record, str | None]:
    """(record, what the parallel model raised while training or None). Raises ``_Refused``."""
    torch.manual_seed(SEED)
    options = dict(dropout_rng="reference") if case.pp == 1 else dict(n_microbatches=case.n_microbatches)
    options.update(recompute=case.recompute, compile=case.compile, shard_whole=case.shard_whole)
    # this rank's data-parallel group's piece of the batch (mesh (dp, pp, tp), row-major)
    group = dist.get_rank() // (case.pp * case.tp) if case.dp > 1 else 0
    args, kwargs = split_batch(case.args, case.kwargs, case.dp)[group]
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        pm = parallelize(model, tp=case.tp, sp=case.sp, pp=case.pp, dp=case.dp, ep=case.ep, example_inputs=(args, kwargs),
                         **options)
    except (ValueError, TypeError) as error:
        raise _Refused(str(error)) from error
    record = Record()
    params = dict(pm.named_parameters(remove_duplicate=False))
    record.placements = {name: _placement(p) for name, p in params.items()}
    record.held_share = held_share(pm, whole_bytes=whole_bytes)
    plan = getattr(pm, "plan", None)
    if plan is not None:
        record.linears = plan.linears
        record.plan_notes = [f"linears split over the ranks: {plan.linears[0]} of {plan.linears[1]}", *plan.notes]
    opt = torch.optim.SGD(list(pm.parameters()), lr=LR, foreach=False)
    step = 0
    try:
        for step in range(case.steps):
            torch.manual_seed(SEED + 1 + step)
            if case.pp > 1:
                record.outputs.append({"loss": _values(pm.step(*args, **kwargs))})
            else:
                try:
                    named = flatten(pm(*args, **kwargs))
                except (ValueError, TypeError) as error:
                    if step == 0:  # the first call captures the graph: its refusals are parallelize's
                        raise _Refused(str(error)) from error
                    raise
                record.placements.update({f"output:{n}": _placement(t) for n, t in named if isinstance(t, DTensor)})
                record.outputs.append({n: _values(t) for n, t in named})
                loss_of(named, like=case.loss)[1].backward()
            record.grads.append({n: None if p.grad is None else _values(p.grad) for n, p in params.items()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        record.params = {n: _values(p.detach()) for n, p in params.items()}
    except _Refused:
        raise
    except Exception as error:  # sptransform's failure, reported
        return record, f"{type(error).__name__} at step {step}: {error} ({_where(error)})"
    return record, None


def _where(error: BaseException) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def _copy_of(case: ParallelCase) -> nn.Module:
    return faithful_deepcopy(case.model)


# -- engine 1: simulated ranks ----------------------------------------------------------


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


def run_simulated(case: ParallelCase) -> ParallelRun:
    """``case`` (pp = dp = 1) on ``tp`` simulated ranks in this process. Exceptions of
    ``parallelize`` other than its refusals propagate; the process group and LocalTensorMode are
    gone when it returns or raises."""
    assert case.pp == 1 and case.dp == 1, "simulated ranks run tensor parallelism only"
    with quiet_fake_tensor_meta_failures(), simulated_ranks(case.tp):
        return _parallel_run(case, _copy_of(case))


# -- engine 2: real processes --------------------------------------------------------------


class NotPortable(ValueError):
    """A case cannot be sent to spawned processes (pickle refuses it, or it refers to ``__main__``)."""


class _PortablePickler(pickle.Pickler):
    """Refuses classes and functions of ``__main__``: a spawned process imports the parent's main
    module as ``__mp_main__`` only when it is a guarded script, and runs an unguarded one again."""

    def reducer_override(self, obj):
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            if getattr(obj, "__module__", None) == "__main__":
                raise NotPortable(f"{getattr(obj, '__qualname__', obj)!r} is defined in __main__, which spawned "
                                  "processes cannot import")
        return NotImplemented


def portable(cases: list[ParallelCase]) -> bytes:
    """The cases as the spawned processes load them (a case with ``build`` travels as the function,
    the state dict and the modules' train()/eval() modes). Raises ``NotPortable`` saying why not."""
    sent = []
    for case in cases:
        if case.build is None:
            sent.append((case, None))
        else:
            modes = {name: m.training for name, m in case.model.named_modules()}
            sent.append((replace(case, model=None), (case.model.state_dict(), modes)))
    buffer = io.BytesIO()
    try:
        _PortablePickler(buffer).dump(sent)
    except NotPortable:
        raise
    except Exception as error:
        raise NotPortable(f"pickle refuses it: {type(error).__name__}: {error}") from None
    return buffer.getvalue()


def _unpack(sent: tuple) -> tuple[ParallelCase, nn.Module]:
    case, built = sent
    if built is None:
        return case, faithful_deepcopy(case.model)  # case.model stays pristine for an eval() retry
    state, modes = built
    model = case.build()
    model.load_state_dict(state)
    for name, m in model.named_modules():
        m.train(modes.get(name, m.training))
    return replace(case, model=model), faithful_deepcopy(model)


def run_processes(cases: list[ParallelCase], *, timeout_s: float) -> list[ParallelRun]:
    """Every case on ``world`` real gloo processes spawned once (all cases share the world size).
    Raises ``NotPortable`` when the cases cannot be pickled to them, ``TimeoutError`` (after killing
    them) when they do not finish within ``timeout_s``, also their process group's timeout, and
    ``RuntimeError`` when a rank dies before saving its result (a signal: a crash, not a verdict)."""
    worlds = {case.world for case in cases}
    assert len(worlds) == 1, f"one spawn runs one world size, got {sorted(worlds)}"
    world = worlds.pop()
    payload = portable(cases)
    with tempfile.TemporaryDirectory(prefix="sptransform-verify-") as folder:
        with open(os.path.join(folder, "cases.pkl"), "wb") as f:
            f.write(payload)
        _spawn(world=world, folder=folder, timeout_s=timeout_s)
        per_rank = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return _merge(per_rank, len(cases))


def run_on_group(cases: list[ParallelCase]) -> list[ParallelRun]:
    """Every case on the ranks of the caller's initialized process group (every rank calls this,
    in the same order); every rank returns the merged runs."""
    mine = _run_cases(cases)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return _merge(gathered, len(cases))


def _run_cases(cases: list) -> list[ParallelRun] | str:
    """This rank's runs of every case (``cases``: ParallelCases, or what ``portable`` sent)."""
    runs = []
    with quiet_fake_tensor_meta_failures():
        for sent in cases:
            case, model = _unpack(sent) if isinstance(sent, tuple) else (sent, _copy_of(sent))
            try:
                runs.append(_parallel_run(case, model))
            except Exception as error:  # parallelize crashed: recorded, the next case still runs
                runs.append(ParallelRun(error=f"{type(error).__name__}: {error} ({_where(error)})"))
    return runs


def _merge(per_rank: list, count: int) -> list[ParallelRun]:
    """One run per case from every rank's runs: values keyed by rank, the first refusal, every
    rank's error (a rank that failed as a whole, a str, is an error of every case)."""
    merged = [ParallelRun() for _ in range(count)]
    for rank, runs in enumerate(per_rank):
        for i, out in enumerate(merged):
            if isinstance(runs, str):
                out.error = "; ".join(filter(None, [out.error, f"rank {rank}: {runs}"]))
                continue
            run = runs[i]
            out.refused = out.refused or run.refused
            out.evaluated = out.evaluated or run.evaluated
            out.evaluated_because = out.evaluated_because or run.evaluated_because
            if run.error:
                out.error = "; ".join(filter(None, [out.error, f"rank {rank}: {run.error}"]))
            _merge_record(out.record, run.record)
    return merged


def _merge_record(into: Record, record: Record) -> None:
    for mine, theirs in ((into.outputs, record.outputs), (into.grads, record.grads)):
        for step, values in enumerate(theirs):
            while len(mine) <= step:
                mine.append({})
            for name, by_rank in values.items():
                if by_rank is None:
                    mine[step].setdefault(name, None)
                else:
                    mine[step][name] = {**(mine[step].get(name) or {}), **by_rank}
    for name, by_rank in record.params.items():
        into.params[name] = {**into.params.get(name, {}), **by_rank}
    into.placements.update(record.placements)
    into.linears = into.linears or record.linears
    if record.held_share is not None:
        into.held_share = max(into.held_share or 0.0, record.held_share)
    into.plan_notes = into.plan_notes or record.plan_notes


def _spawn(*, world: int, folder: str, timeout_s: float) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(_worker, args=(world, port, folder, timeout_s), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the verification did not finish within timeout_s={timeout_s:g} s: its "
                                   f"{world} processes were killed; pass a larger timeout_s")
    except mp.ProcessExitedException as died:  # a rank saves its own errors: this one was killed
        raise RuntimeError(f"a verification rank died before saving its result ({died}): a crash of the "
                           "process (torch, gloo, or memory), not a verdict on the model; its message is in its "
                           "stderr above. Run verify again") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def _worker(rank: int, world: int, port: int, folder: str, timeout_s: float) -> None:
    """One rank: run every case, save what this rank holds. Never raises (the parent reads the
    result file; a rank that failed as a whole saves its error as text)."""
    torch.set_num_threads(1)  # several ranks share the cores
    runs: list[ParallelRun] | str
    try:
        with open(os.path.join(folder, "cases.pkl"), "rb") as f:
            cases = pickle.load(f)
        # The parent prints the report; a worker's library warnings (transformers' config notices, once
        # per rank) only repeat what the parent's run of the model printed. Set after unpickling the
        # model, whose import of transformers sets its logger's level.
        logging.getLogger("transformers").setLevel(logging.ERROR)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(1.0, timeout_s)))
        try:
            runs = _run_cases(cases)
            dist.barrier()  # no rank tears its connections down while another still uses them
        finally:
            dist.destroy_process_group()
    except Exception as error:
        runs = f"{type(error).__name__}: {error} ({_where(error)})"
    torch.save(runs, os.path.join(folder, f"rank{rank}.pt"))
    # Its result saved, the rank leaves without tearing the interpreter down: that teardown has
    # aborted a rank after its save (SIGABRT, "terminate called without an active exception", a
    # C++ thread destroyed at exit; HF FalconMamba at tp=2: 6 of the 29 runs counted, before and
    # after its mixer was split), and the parent would report that crash instead of the saved verdict.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


__all__ = ["LR", "SEED", "split_batch", "Record", "ParallelCase", "ParallelRun", "NotPortable", "run_reference", "run_simulated",
           "run_processes", "run_on_group", "portable", "simulated_ranks", "flatten", "loss_of"]
