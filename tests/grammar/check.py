"""The property: the parallel model equals the original (loss or logits, every gradient, every
parameter after an SGD step) or ``parallelize`` refuses it with a ValueError/TypeError and a
message. Anything else, a difference or another exception, fails.

Tolerances (``verify``'s relative error, against the largest value of each kind): float64 1e-9
(rounding of a different summation order is ~1e-15); float32 1e-4; bfloat16 3e-2 (8 bits of
mantissa: one rounding of a sum taken in another order is ~4e-3 of its value, and a step's
gradient goes through several)."""

from __future__ import annotations

import sptransform

from .config import Config, Layout
from .model import build

RTOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 3e-2}


def verify(c: Config, layout: Layout, *, processes: bool | None = False):
    model, inputs = build(c)
    return sptransform.verify(model, tp=layout.tp, sp=layout.sp, pp=layout.pp, dp=layout.dp,
                              example_inputs=inputs, rtol=RTOL[c.dtype], processes=processes)


def assert_equal_or_refused(report, c: Config, layout: Layout) -> None:
    if report.status == "refused":
        assert report.error and len(report.error) > 20, f"a refusal without a message: {report.error!r}"
        return
    assert report.status == "equal", f"{c}\n{layout}\n{report}"
