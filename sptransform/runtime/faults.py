"""Faults between ranks: the data-parallel replicas' check at each call, and collective failures
named by rank.

A data-parallel replica that runs a forward under ``torch.no_grad()`` while its peers train, or
skips a backward, leaves its peers blocked in the gradient all-reduce; a killed peer makes them
fail with gloo's ``Connection reset by peer`` and no rank named. So:

* **the replica check** (``ReplicaCheck.arrive``, every call with ``check_inputs``, before the
  step's first collective): each data-parallel rank writes one key to the default process
  group's store (grad mode, train/eval mode, whether its previous call ran a backward, whether
  its own input checks failed) and waits, at most ``peer_timeout_s``, for its peers' keys. A
  different grad mode raises ``ValueError`` on every replica; a peer whose key never comes is
  named (``RuntimeError``), with the last call it reached. Through the store, not a collective
  of the data-parallel group: a peer still blocked in that group's gradient all-reduce must not
  pair its collective with this one.
* **records**: each rank's key of its last call stays there for a peer to read when something
  fails; ``naming_failures`` wraps a collective's wait and, if it raises (a timeout, a closed
  connection), writes a failure report, waits ``GRACE_S`` for the peers' reports and raises
  ``PeerFailure`` naming this rank, the collective, and each peer: what it reported, or that it
  reported nothing (exited, killed or stuck elsewhere), with its last call.

Costs: per call and rank, one store write, one wait and one read of dp keys (measured in the
README, "Faults and timeouts"). Nothing here runs without a real process group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from sptransform.torch_internals import default_store

PREFIX = "sptransform/ranks"
GRACE_S = 5.0
"""How long a rank whose collective failed waits for its peers' failure reports: a peer that
sends none by then has exited, was killed, or waits elsewhere."""


class PeerFailure(RuntimeError):
    """A collective of a parallel module failed; the message names the ranks and the collective."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:240]}" if text else type(err).__name__


def _get(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _describe_peers(store, peers: list[int], reports: dict[int, str | None]) -> str:
    parts = []
    for rank in peers:
        last = _get(store, f"{PREFIX}/last/{rank}")
        where = f"its last call: {last}" if last else "it made no call of a data-parallel module"
        if reports.get(rank):
            parts.append(f"rank {rank} failed too ({reports[rank]}; {where})")
        else:
            parts.append(f"rank {rank} reported nothing within {GRACE_S:.0f} s: its process exited, was killed, "
                         f"or waits outside this module ({where})")
    return "; ".join(parts)


def failure(err: BaseException, what: str, peers: list[int], waited: float) -> PeerFailure:
    """The ``PeerFailure`` of ``err``, raised by ``what`` after ``waited`` s (module docstring)."""
    me = dist.get_rank()
    others = [r for r in peers if r != me]
    try:
        peers_text = _exchange_reports(me, others, f"{what}: {_first_line(err)}"[:400])
    except Exception as store_error:  # the store lives in the process of global rank 0, which may be gone
        peers_text = (f"{', '.join(f'rank {r}' for r in others)}, not reachable through the process group's store "
                      f"({_first_line(store_error)}): the process of global rank 0, which holds it, may have exited")
    return PeerFailure(
        f"rank {me}: {what} failed after {waited:.1f} s ({_first_line(err)}). Peers: {peers_text}. A rank that stops (killed, out of memory, an exception "
        "between forward and backward) or skips a backward that its data-parallel peers run leaves them "
        "waiting; every rank of a data-parallel group must run the same calls and backwards"
    )


def _exchange_reports(me: int, others: list[int], report: str) -> str:
    """Leave this rank's failure report; wait up to ``GRACE_S`` for the peers' (module docstring)."""
    store = default_store()
    store.set(f"{PREFIX}/failed/{me}", report)
    deadline = time.monotonic() + GRACE_S
    reports: dict[int, str | None] = {}
    for rank in others:
        key = f"{PREFIX}/failed/{rank}"
        with contextlib.suppress(RuntimeError):  # the store's timeout: that peer sent no report
            store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
        reports[rank] = _get(store, key)
    return _describe_peers(store, others, reports)


@contextlib.contextmanager
def naming_failures(what: Callable[[], str], peers: Callable[[], list[int]]) -> Iterator[None]:
    """Raise a collective's failure inside as a ``PeerFailure`` (module docstring). ``what`` and
    ``peers`` (global ranks of the collective's group) are built only on failure."""
    start = time.monotonic()
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as err:  # gloo/NCCL's DistBackendError, timeouts: RuntimeError subclasses
        if not dist.is_initialized() or not _from_collective(err):
            raise
        raise failure(err, what(), peers(), time.monotonic() - start) from err


def _from_collective(err: RuntimeError) -> bool:
    """Whether ``err`` is a collective's: a ``DistError``, or raised from torch.distributed's own
    code (gloo's timeouts and closed connections arrive as plain ``RuntimeError`` from the wait),
    not an error of the model's arithmetic (out of memory, a bad shape) that happened meanwhile."""
    if isinstance(err, dist.DistError):
        return True
    tb = err.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class ReplicaCheck:
    """This module's data-parallel ranks meeting at each call through the store (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float | None):
        self._store = default_store()
        self._ranks = dist.get_process_group_ranks(group)
        self._me = dist.get_rank()
        # Modules are built collectively, in one order on every rank of the group: the n-th one
        # built here is the n-th everywhere, and its keys are its own.
        count = self._store.add(f"{PREFIX}/modules/{group.group_name}", 1)
        self._prefix = f"{PREFIX}/{group.group_name}/{(count - 1) // len(self._ranks)}"
        self._timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else default_pg_timeout
        self.calls = 0
        self.backward_of = 0
        """The last call whose backward ran (set by the module's output hook)."""

    @property
    def peers(self) -> list[int]:
        return list(self._ranks)

    def arrive(self, mode: int, failed: bool, shapes: int = 0) -> None:
        """Meet the replicas at this call: raise on every one if they disagree or one failed its
        input checks, and name a peer that does not come within the timeout. ``shapes``: a hash of
        the inputs' shapes where the replicas must agree on them (expert parallelism exchanges
        tokens), else 0."""
        self.calls += 1
        n, grad = self.calls, torch.is_grad_enabled()
        ran = self.backward_of == n - 1 or n == 1
        row = f"{int(failed)},{int(grad)},{mode},{int(ran)},{shapes}"
        self._store.set(f"{self._prefix}/{n}/{self._me}", row)
        self._store.set(f"{PREFIX}/last/{self._me}", f"call {n} ({'gradients on' if grad else 'under no_grad'}; "
                        f"the previous call's backward {'ran' if ran else 'did not run'})")
        keys = [f"{self._prefix}/{n}/{r}" for r in self._ranks]
        start = time.monotonic()
        try:
            self._store.wait(keys, self._timeout)
        except Exception as err:  # the store's timeout: name who is missing
            missing = [r for r, key in zip(self._ranks, keys) if not self._store.check([key])]
            who = ", ".join(f"rank {r}" for r in missing)
            raise failure(err, f"call {n}'s check of the data-parallel replicas (waiting for {who}, which did not "
                          f"arrive; this rank's previous call's backward {'ran' if ran else 'did not run'})",
                          self._ranks, time.monotonic() - start) from err
        rows = {r: [int(v) for v in self._store.get(key).decode().split(",")] for r, key in zip(self._ranks, keys)}
        if n > 1:
            self._store.delete_key(f"{self._prefix}/{n - 1}/{self._me}")  # every peer has read it: they are at n
        self._store.delete_key(f"{PREFIX}/failed/{self._me}")  # an earlier failure's report, if any, is over
        _raise_if_replicas_disagree(rows, self._me)


def _raise_if_replicas_disagree(rows: dict[int, list[int]], me: int) -> None:
    failed = [r for r, row in rows.items() if row[0]]
    if failed and me not in failed:
        raise RuntimeError(
            f"the inputs of this call were rejected on data-parallel rank(s) {', '.join(map(str, failed))} (that "
            f"rank's error says why); rank {me} raises too, so that no replica waits in a collective for one that stopped")
    if failed:
        return  # this rank raises its own error
    for column, what, fix in ((1, "gradients enabled", "call the module under torch.no_grad() on every replica alike, "
                               "or on none"),
                              (2, "train/eval modes", "call .train() / .eval() on every replica alike")):
        values: dict[int, list[int]] = {}
        for r, row in rows.items():
            values.setdefault(row[column], []).append(r)
        if len(values) > 1:
            split = " vs ".join(f"[{', '.join(f'rank {r}' for r in ranks)}]" for ranks in values.values())
            raise ValueError(
                f"data-parallel ranks {split} differ in {what} at this call: a replica that runs no backward leaves "
                f"its peers waiting in the gradient all-reduce; {fix}"
            )
    shapes: dict[int, list[int]] = {}
    for r, row in rows.items():
        shapes.setdefault(row[4], []).append(r)
    if len(shapes) > 1:
        split = " vs ".join(f"[{', '.join(f'rank {r}' for r in ranks)}]" for ranks in shapes.values())
        raise ValueError(
            f"data-parallel ranks {split} pass inputs of different shapes at this call, and with ep > 1 the ranks "
            "of an expert-parallel group exchange their tokens in collectives of one shape: give every rank batches "
            "of the same shape (pad them, or drop the last uneven batch)")
