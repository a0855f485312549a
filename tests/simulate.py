"""In-process simulation of N ranks: the fake process group plus LocalTensorMode,
and helpers to read every simulated rank's value."""

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
    """``mp.spawn`` of ``fn(rank, world, port, *args)`` with a hard deadline: the test fails (and the
    processes are killed) past it, so a hang never blocks the suite."""
    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > end:
                pytest.fail(f"{fn.__name__} did not finish within {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


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


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[-1]
    return out.loss
