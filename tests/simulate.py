"""In-process simulation of N ranks: the fake process group plus LocalTensorMode,
and helpers to read every simulated rank's value. For real gloo ranks: spawning them
(``spawn_with_deadline``) and, on each, training the parallel module beside the unmodified
model it came from (``train_like_reference``, ``assert_grads_match``, ``assert_params_match``)."""

from __future__ import annotations

import contextlib
import socket
import time

import torch
import torch.distributed as dist
from sptransform.copying import faithful_deepcopy
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore


def free_port() -> int:
    """A TCP port free on this machine, for a real process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_with_deadline(fn, world: int, deadline_s: float, *args) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` spawned processes (a real gloo world), with a
    hard deadline: the test fails (and the processes are killed) past it, so a hang never blocks
    the suite.

    When a rank fails, the failure names every rank's outcome, not only the first process to die:
    a rank that raised tears its connections down and its peers then die of it (a gloo rank
    blocked on a send or receive may abort, SIGABRT), and ``mp.spawn`` reports whichever exited
    first, often a peer. Each rank's stderr (C++ messages included: gloo's reason for an abort)
    goes to a file whose tail the failure quotes, with the Python stack ``faulthandler`` wrote at
    the signal.

    A world in which no rank raised a Python exception but one died by a signal is run once more,
    with a warning that quotes the first try: the real-rank tests share a loaded 2-core machine
    with other tests, and one such abort of a gloo transport thread (SIGABRT in
    ``test_pipeline_gloo``, in CI, not reproduced in 27 runs here) failed a whole CI run. A rank
    that raised, a second abort, or a hang fails the test."""
    import tempfile
    import warnings

    import pytest

    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="sptransform-ranks-") as logs:
            outcome = _run_world(fn, world, deadline_s, logs, args)
        if outcome is None:
            return
        report, retry = outcome
        if retry and attempt == 1:
            warnings.warn(f"{fn.__name__}: a rank died by a signal and none raised; ran the world again. "
                          f"The first try:\n{report}", stacklevel=2)
            continue
        pytest.fail(f"{fn.__name__} on {world} real ranks failed (try {attempt}):\n{report}", pytrace=False)


def _rank_entry(rank: int, fn, world: int, port: int, logs: str, args: tuple) -> None:
    """A spawned rank: its stderr (file descriptor 2, so C++ writes too) to ``logs``, a Python
    stack dump on a fatal signal, then ``fn``."""
    import faulthandler
    import os
    import sys

    log = open(os.path.join(logs, f"rank{rank}.err"), "w", buffering=1)  # noqa: SIM115 (lives as long as the rank)
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    fn(rank, world, port, *args)


# what a rank raises when a peer died under it (gloo's transport errors)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _run_world(fn, world: int, deadline_s: float, logs: str, args: tuple) -> tuple[str, bool] | None:
    """None when every rank exited cleanly; else (every rank's outcome, whether the failure is only
    signals: no rank raised)."""
    import os
    import pickle
    import signal

    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_entry, args=(fn, world, free_port(), logs, args), nprocs=world,
                                 join=False, start_method="spawn")
    processes = context.processes
    end, grace_end, timed_out, killed = time.monotonic() + deadline_s, None, False, set()
    try:
        while any(p.exitcode is None for p in processes):
            now = time.monotonic()
            if any(p.exitcode not in (None, 0) for p in processes):
                # a rank failed: let its peers finish dying of it (their reports name the cause)
                grace_end = grace_end or now + 10.0
            if now > end or (grace_end is not None and now > grace_end):
                timed_out = now > end
                break
            time.sleep(0.2)
    finally:
        for rank, p in enumerate(processes):
            if p.is_alive():
                killed.add(rank)
                p.kill()
            p.join(10)
    codes = [p.exitcode for p in processes]
    if all(code == 0 for code in codes):
        return None
    own, lines, first = set(), [], []  # own: the ranks that raised an error of their own
    for rank, (code, error_file) in enumerate(zip(codes, context.error_files)):
        tail = ""
        path = os.path.join(logs, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                tail = "".join(f.readlines()[-40:])
        if os.path.exists(error_file) and os.path.getsize(error_file):
            with open(error_file, "rb") as f:
                trace = pickle.load(f)
            what = "raised:\n" + trace
            if not any(lost in trace for lost in _PEER_LOST):  # not only the death of a peer
                own.add(rank)
        elif rank in killed:
            what = f"killed by the test harness, still running; the end of its stderr:\n{tail}"
        elif code is not None and code < 0:
            what = f"died by signal {signal.Signals(-code).name}; the end of its stderr:\n{tail}"
        else:
            what = "finished" if code == 0 else f"exit code {code}; the end of its stderr:\n{tail}"
        (first if rank in own else lines).append(f"--- rank {rank}: {what}")
    lines = first + lines  # the ranks whose own error it was, then their peers
    head = f"the ranks did not finish within {deadline_s:g} s\n" if timed_out else ""
    signalled = any(code is not None and code < 0 and rank not in killed for rank, code in enumerate(codes))
    return head + "\n".join(lines), signalled and not own and not timed_out


@contextlib.contextmanager
def fake_group(world: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank():
    """A real one-rank gloo group in this process (collectives are the identity); yields its name."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def simulated_ranks(world: int):
    with fake_group(world), LocalTensorMode(world) as mode:
        yield mode


def per_rank(t) -> list[torch.Tensor]:
    """Every simulated rank's full value of ``t`` (DTensors are gathered first)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, LocalTensor):
        return [t._local_tensors[r] for r in sorted(t._local_tensors)]
    return [t]


def assert_all_ranks_close(value, expected: torch.Tensor, *, rtol=1e-5, atol=1e-6, what="") -> None:
    for rank, v in enumerate(per_rank(value)):
        torch.testing.assert_close(v, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what} rank {rank}: {m}")


def train_side_by_side(make_model, inputs: tuple, *, tp: int, sp: bool, steps: int = 3, lr: float = 1e-2,
                       call=None, dropout_rng: str = "reference", rtol=1e-5, atol=1e-6):
    """Train the original and the parallel model with AdamW from the same weights; assert
    that the loss, every gradient and every updated parameter agree at each step."""
    import sptransform

    call = call or (lambda m: m(*inputs))
    torch.manual_seed(0)
    model = make_model()
    ref = faithful_deepcopy(model)
    # eps well above float noise: a key bias gets a ~1e-9 gradient (softmax ignores it),
    # which the default eps=1e-8 would turn into a full +-lr step of random sign.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=1e-4)
    with simulated_ranks(tp):
        pm = sptransform.parallelize(model, tp=tp, sp=sp, example_inputs=inputs, dropout_rng=dropout_rng)
        opt = torch.optim.AdamW(pm.parameters(), lr=lr, eps=1e-4, foreach=False)
        ref_params = dict(ref.named_parameters())
        for step in range(steps):
            with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
                torch.manual_seed(1000 + step)
                ref_loss = _loss_of(call(ref))
                ref_loss.backward()
            torch.manual_seed(1000 + step)
            loss = _loss_of(call(pm))
            loss.backward()
            assert_all_ranks_close(loss, ref_loss.detach(), rtol=rtol, atol=atol, what=f"step {step} loss")
            for name, p in pm.named_parameters():
                assert_all_ranks_close(p.grad, ref_params[name].grad, rtol=rtol * 10, atol=atol * 10,
                                       what=f"step {step} grad of {name}")
            opt.step()
            opt.zero_grad()
            with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
                ref_opt.step()
                ref_opt.zero_grad()
        for name, p in pm.named_parameters():
            assert_all_ranks_close(p.data, ref_params[name].data, rtol=1e-4, atol=1e-5, what=f"param {name}")
    return pm


def _gathered(t):
    """A DTensor's full value, gathered from every rank; anything else as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_grads_match(pm, ref, *, rtol: float, atol: float, what: str = "") -> None:
    """On a real rank: every parameter's gradient of the parallel module ``pm``, gathered from
    the ranks (``full_tensor``), equals the gradient of the same-named parameter of ``ref``."""
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(_gathered(p.grad), ref_params[name].grad, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what}grad of {n}: {m}")


def assert_params_match(pm, ref, *, rtol: float, atol: float, what: str = "") -> None:
    """On a real rank: every parameter of ``pm``, gathered, equals ``ref``'s of the same name."""
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(_gathered(p).detach(), ref_params[name].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what}{n}: {m}")


def train_like_reference(pm, ref, batches, *, loss_tol: tuple[float, float], grad_tol: tuple[float, float],
                         optimizer=None, grad_steps=None, logits_tol=None, params_tol=None, seed: int | None = None,
                         clip_norm: float | None = None, step_after_last: bool = True, parallel=None,
                         what: str = "") -> None:
    """On a real rank (run by every rank of the group alike): train the parallel module ``pm``
    beside ``ref``, the unmodified model, whole on this process, one batch a step, and assert
    that they agree at each step: the loss; with ``logits_tol`` the logits, gathered; every
    parameter's gradient, gathered (``assert_grads_match``), at the steps in ``grad_steps``
    (every step if None); and after the last step, with ``params_tol``, every parameter
    (``assert_params_match``). Tolerances are ``(rtol, atol)``.

    ``optimizer(parameters)`` builds each side's optimizer (None: no step); each side steps after
    each batch, after clipping its gradients' norm to ``clip_norm`` if given, except after the
    last batch when ``step_after_last`` is False. With ``seed``, ``torch.manual_seed(seed + step)``
    comes before each side's forward, so that both draw the same dropout masks
    (``dropout_rng="reference"``). ``parallel`` is what the parallel side's batches are fed to
    (``torch.compile(pm)``; ``pm`` if None). A batch is a dict of keyword arguments or a tuple of
    positional ones; the loss is the output, its last element or its ``.loss``."""
    parallel = pm if parallel is None else parallel
    optimizers = (optimizer(pm.parameters()), optimizer(ref.parameters())) if optimizer else ()
    for step, batch in enumerate(batches):
        at = f"{what}step {step}: "
        outputs = []
        for model in (ref, parallel):
            if seed is not None:
                torch.manual_seed(seed + step)
            out = model(**batch) if isinstance(batch, dict) else model(*batch)
            _loss_of(out).backward()
            outputs.append(out)
        ref_out, out = outputs
        torch.testing.assert_close(_loss_of(out).detach(), _loss_of(ref_out).detach(), rtol=loss_tol[0],
                                   atol=loss_tol[1], msg=lambda m: f"{at}loss: {m}")
        if logits_tol is not None:
            torch.testing.assert_close(_gathered(out.logits), ref_out.logits.detach(), rtol=logits_tol[0],
                                       atol=logits_tol[1], msg=lambda m: f"{at}logits: {m}")
        if grad_steps is None or step in grad_steps:
            assert_grads_match(pm, ref, rtol=grad_tol[0], atol=grad_tol[1], what=at)
        if not optimizers or (step == len(batches) - 1 and not step_after_last):
            continue
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(pm.parameters(), clip_norm)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    if params_tol is not None:
        assert_params_match(pm, ref, rtol=params_tol[0], atol=params_tol[1], what=f"{what}after the optimizer steps: ")


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[-1]
    return out.loss
