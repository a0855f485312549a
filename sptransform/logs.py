"""sptransform's loggers: INFO lines per phase (capture, transform, compile, weight loading),
quiet on every rank but the first by default.

A user sees them with ``logging.basicConfig(level=logging.INFO)`` (or by configuring the
``sptransform`` logger). On a job of many ranks, one copy of each line is what a user reads:
records from a rank other than 0 of the default process group are dropped unless
``SPTRANSFORM_LOG_ALL_RANKS=1``. A logger's filters apply only to records made on that logger,
not to its children's, so every module takes its logger from ``logger()`` here, which attaches
the filter.

Progress bars (``progress``) use tqdm when it is installed, on rank 0, on a terminal (tqdm's
own ``disable=None``); elsewhere the iterable is returned untouched.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _FirstRankOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return os.environ.get("SPTRANSFORM_LOG_ALL_RANKS") == "1" or _rank() == 0


_FILTER = _FirstRankOnly()


def logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the first-rank filter attached (once)."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


@contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as t: ...`` then ``t[0]`` is the wall time of the block in seconds."""
    out = [0.0]
    start = time.perf_counter()
    try:
        yield out
    finally:
        out[0] = time.perf_counter() - start


def _tqdm():
    """tqdm's class on rank 0 when it is installed; None otherwise."""
    if _rank() != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


def progress(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterable[T]:
    """``items`` with a tqdm progress bar on rank 0 when tqdm is installed and stderr is a
    terminal; ``items`` itself otherwise."""
    tqdm = _tqdm()
    if tqdm is None:
        return items
    return tqdm(items, desc=desc, total=total, disable=None, leave=False)


@contextmanager
def phases(names: Sequence[str], *, desc: str) -> Iterator[Callable[[str], None]]:
    """A progress bar over named phases of one piece of work (shown as ``progress`` shows its bar):
    ``with phases(("reference", "parallel"), desc="verify") as begin: begin("reference"); ...``;
    each ``begin(name)`` counts the phases before it done and shows the name of the one starting."""
    tqdm = _tqdm()
    bar = None if tqdm is None else tqdm(total=len(names), desc=desc, disable=None, leave=False)

    def begin(name: str) -> None:
        if bar is not None:
            bar.update(names.index(name) - bar.n)
            bar.set_postfix_str(name)

    try:
        yield begin
        if bar is not None:
            bar.update(len(names) - bar.n)
    finally:
        if bar is not None:
            bar.close()
