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
from typing import Iterable, Iterator, TypeVar

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


def progress(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterable[T]:
    """``items`` with a tqdm progress bar on rank 0 when tqdm is installed and stderr is a
    terminal; ``items`` itself otherwise."""
    if _rank() != 0:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, total=total, disable=None, leave=False)
