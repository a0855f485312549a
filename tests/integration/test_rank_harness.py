"""The real-rank harness (``simulate.spawn_with_deadline``) reports the rank whose error it was,
not the peer that died first of it, and runs a world again only after a bare signal death."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from simulate import _PEER_LOST, spawn_with_deadline

pytestmark = pytest.mark.slow


def _raise_on_rank0(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        dist.barrier()
        if rank == 0:
            raise AssertionError("the primary error")
        dist.all_reduce(torch.ones(4))  # its peer is gone: this rank fails of it
    finally:
        dist.destroy_process_group()


def _abort_once(rank: int, world: int, port: int, marker: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        dist.barrier()
        if rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.abort()  # SIGABRT, as a gloo transport thread's uncaught error does
        dist.all_reduce(torch.ones(4))  # on the first try rank 0 fails of its lost peer
    finally:
        dist.destroy_process_group()


def test_the_rank_that_raised_is_reported_first_and_not_run_again():
    with pytest.raises(pytest.fail.Exception) as failed:
        spawn_with_deadline(_raise_on_rank0, 2, 120.0)
    report = str(failed.value)
    assert "(try 1)" in report, report
    assert report.index("--- rank 0: raised") < report.index("--- rank 1:"), report
    assert "the primary error" in report, report


def test_a_bare_abort_is_reported_with_its_stack_and_run_again(tmp_path):
    with pytest.warns(UserWarning, match="died by a signal") as caught:
        spawn_with_deadline(_abort_once, 2, 120.0, str(tmp_path / "aborted"))
    message = str(caught[0].message)
    assert "rank 1: died by signal SIGABRT" in message, message
    # not its own error: gloo says the peer closed or reset the connection, whichever it saw first
    assert "--- rank 0: raised" in message and any(lost in message for lost in _PEER_LOST), message
    assert "Fatal Python error: Aborted" in message, message  # faulthandler's dump, from the rank's stderr
