"""What every subcommand shares: argument types, their limits, and one-line argparse errors.

Each type reads one command-line value and raises ``BadValue`` (an ``argparse.ArgumentTypeError``
that is also a ``ValueError``) saying what the value is, the rule it breaks and how to write a good
one; argparse puts the flag in front (``argument --tp: 0 is not a positive integer ...``).
``CliParser`` raises ``UsageError`` for argparse's own errors (an unknown flag, a missing value)
instead of printing its usage block and exiting, so ``sptransform.cli.main`` prints one
``sptransform <command>: error: ...`` line and returns 2 for every bad call.

Limits that keep an enumeration short (each refused above with a message that states it):

* ``PIPELINE_LIMITS``: ``schedule`` and ``memory --pp`` simulate every forward and backward of
  every microbatch on every stage.
* ``sptransform.planner.search.SEARCH_LIMITS``: ``plan``'s layout search.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

MAX_COUNT = 2**31 - 1
"""The largest count any flag takes (a sanity bound: no model or cluster dimension is near it)."""

PIPELINE_LIMITS = {
    "pp": 256,
    "microbatches": 1024,
    "stages_per_rank": 64,
    "stage_microbatches": 32768,
    "stage_microbatches_torch": 2048,
}
"""Bounds on a simulated pipeline schedule (``sptransform schedule``, ``sptransform memory --pp``):
pipeline ranks, microbatches and stages per rank each, and pp x stages-per-rank x microbatches
(the forwards simulated) for gpipe/1f1b, whose order sptransform computes, and for
interleaved1f1b/looped_bfs/zbv, whose order torch's schedule code builds (its cost grows faster).
At these limits a call takes a few seconds on one CPU core."""

TORCH_BUILT_SCHEDULES = ("interleaved1f1b", "looped_bfs", "zbv", "dualpipev")

PLOT_LIMIT = 1024
"""``schedule -o`` draws at most this many stage-microbatches (pp x stages-per-rank x microbatches)..."""
PLOT_MAX_RANKS = 32
"""... and at most this many pipeline ranks (a figure takes a few seconds at these limits)."""


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A command-line value that breaks its rule (argparse names the flag)."""


class UsageError(ValueError):
    """An argparse error (unknown flag, missing value, bad choice) of the parser named ``prog``."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog
        self.message = message


class CliParser(argparse.ArgumentParser):
    """argparse's parser, raising ``UsageError`` instead of printing usage and exiting with 2.

    Subparsers made by ``add_subparsers`` are of the same class."""

    def error(self, message: str):
        raise UsageError(self.prog, message)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# -- integers ---------------------------------------------------------------------


def int_type(minimum: int, maximum: int = MAX_COUNT, *, why: str = "") -> Callable[[str], int]:
    """An argparse type for a whole number in [``minimum``, ``maximum``]; ``why`` says where the
    maximum comes from (it goes into the error message)."""
    what = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")

    def read(text: str) -> int:
        stripped = str(text).strip()
        if not re.fullmatch(r"[+-]?[0-9]+", stripped):
            raise BadValue(f"{text!r} is not {what}: write it with digits only, e.g. 8")
        digits = len(stripped.lstrip("+-"))
        shown = stripped if digits <= 24 else f"{stripped[:12]}... ({digits} digits)"
        value = int(stripped) if digits <= 24 else None  # int() refuses thousands of digits
        if value is not None and value < minimum or value is None and stripped.startswith("-"):
            raise BadValue(f"{shown} is not {what}: give a whole number >= {minimum}")
        if value is None or value > maximum:
            raise BadValue(f"{shown} is above the limit of {maximum:,}{f' ({why})' if why else ''}: "
                           f"give at most {maximum}")
        return value

    read.__name__ = "positive_int" if minimum == 1 else "int"
    return read


positive_int = int_type(1)
non_negative_int = int_type(0)


# -- floats -----------------------------------------------------------------------


def float_type(*, minimum: float | None = None, maximum: float | None = None, exclusive_minimum: bool = False,
               example: str = "2") -> Callable[[str], float]:
    """An argparse type for a finite number (no nan/inf) in a range."""

    def read(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise BadValue(f"{text!r} is not a number: write a finite number, e.g. {example}") from None
        if not math.isfinite(value):
            raise BadValue(f"{text!r} is not a finite number: write one, e.g. {example}")
        if minimum is not None and (value < minimum or exclusive_minimum and value == minimum):
            rule = f"> {minimum:g}" if exclusive_minimum else f">= {minimum:g}"
            raise BadValue(f"{text} must be a finite number {rule}, e.g. {example}")
        if maximum is not None and value > maximum:
            shown = f"{int(maximum):,}" if float(maximum).is_integer() else f"{maximum:g}"
            raise BadValue(f"{text} is above the limit of {shown}: give a finite number <= {shown}")
        return value

    read.__name__ = "float"
    return read


finite_float = float_type()
positive_float = float_type(minimum=0.0, exclusive_minimum=True)
non_negative_float = float_type(minimum=0.0, example="0")


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    value = float_type(example="0.5")(text)
    if not 0 < value <= 1:
        raise BadValue(f"{text} is not a fraction in (0, 1]: give e.g. 0.5 (a share, not a percentage)")
    return value


# -- pipeline schedules -------------------------------------------------------------


def schedule_and_stages(schedule: str, stages_per_rank: int | None):
    """(the ``ScheduleSpec`` of ``--schedule``, stages per rank: ``--stages-per-rank`` or the
    schedule's default), the schedule's rules checked with the flags named."""
    from sptransform.pipeline.schedule import check_stages_per_rank, schedule_spec

    try:
        spec = schedule_spec(schedule)
    except ValueError as error:
        raise ValueError(f"--schedule: {error}") from None
    v = stages_per_rank if stages_per_rank is not None else spec.default_stages_per_rank
    try:
        check_stages_per_rank(spec, v)
    except ValueError as error:
        raise ValueError(f"--stages-per-rank: {error}") from None
    return spec, v


def check_pipeline_size(pp: int, microbatches: int, stages_per_rank: int, schedule: str, *,
                        microbatches_flag: str = "--microbatches") -> None:
    """Refuse a schedule too large to simulate in seconds (``PIPELINE_LIMITS``); the flags named
    are the ``schedule``/``memory`` ones."""
    for flag, value, key in (("--pp", pp, "pp"), (microbatches_flag, microbatches, "microbatches"),
                             ("--stages-per-rank", stages_per_rank, "stages_per_rank")):
        if value > PIPELINE_LIMITS[key]:
            raise ValueError(f"{flag} {value} is above the limit of {PIPELINE_LIMITS[key]} "
                             f"(the schedule is simulated action by action): give at most {PIPELINE_LIMITS[key]}")
    torch_built = schedule in TORCH_BUILT_SCHEDULES
    limit = PIPELINE_LIMITS["stage_microbatches_torch" if torch_built else "stage_microbatches"]
    total = pp * stages_per_rank * microbatches
    if total > limit:
        who = f"{schedule} (its order is built by torch's schedule code)" if torch_built else schedule
        raise ValueError(
            f"--pp {pp} x --stages-per-rank {stages_per_rank} x {microbatches_flag} {microbatches} = {total:,} "
            f"stage-microbatches is above the limit of {limit:,} for {who}: use fewer pipeline ranks or "
            f"microbatches (e.g. {microbatches_flag} {max(1, limit // (pp * stages_per_rank))})"
        )


# -- models -------------------------------------------------------------------------


def load_model(name: str):
    """The ``ModelShape`` of ``--model`` (a preset, a HF config.json or a folder holding one); every
    problem with it, the config's fields included, is a ``ValueError`` naming ``--model``."""
    from sptransform.planner.presets import get_preset

    try:
        return get_preset(name)
    except ValueError as error:
        raise ValueError(f"--model: {error}") from None
