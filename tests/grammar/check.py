"""The property: the parallel model equals the original (loss or logits, every gradient, every
parameter after an SGD step) or ``parallelize`` refuses it with a ValueError/TypeError and a
message. Anything else, a difference or another exception, fails.

Tolerances (``verify``'s relative error, against the largest value of each kind): float64 1e-9
(rounding of a different summation order is ~1e-15); float32 1e-4; bfloat16 3e-1: its 8-bit
mantissa rounds each sum taken in another order by ~4e-3 of its value, and a gradient goes through
dozens of them: a norm weight's gradient reached 4.7e-2 at tp=2 and 1.2e-1 at tp=4 (a shared
block's sandwich norm, 4 partial sums) on models equal within 1.0e-14 in float64. So bfloat16
examples catch structural errors (a gradient halved or missing a rank's part: 5e-1 and more), not
rounding; float32 and float64 examples catch the rest. A float64 model whose norm
computes in float32 (``rms_float32``: ``x.float()``, then back) rounds to float32 there and is
judged at float32's tolerance (found on real ranks: 1.5e-7 with it, 5.1e-16 with a float64 norm)."""

from __future__ import annotations

import sptransform

from .config import Config, Layout
from .model import build

RTOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 3e-1}


def rtol(c: Config) -> float:
    """The tolerance of the lowest precision the model computes in."""
    if c.dtype == "float64" and c.norm == "rms_float32":
        return RTOL["float32"]
    return RTOL[c.dtype]


def verify(c: Config, layout: Layout, *, processes: bool | None = False):
    model, inputs = build(c)
    return sptransform.verify(model, tp=layout.tp, sp=layout.sp, pp=layout.pp, dp=layout.dp,
                              example_inputs=inputs, rtol=rtol(c), processes=processes)


def assert_equal_or_refused(report, c: Config, layout: Layout) -> None:
    if report.status == "refused":
        assert report.error and len(report.error) > 20, f"a refusal without a message: {report.error!r}"
        return
    assert report.status == "equal", f"{c}\n{layout}\n{report}"


def recompute_check(c: Config, layout: Layout) -> tuple[str, str]:
    """(status, what) of ``layout`` (pp = dp = 1, a ``recompute`` policy or budget, ``compile``) on the
    caller's process group: verify does not take ``recompute``, so this runs one SGD step of the
    parallel model and of a single-device copy and compares loss/logits, every gradient and every
    parameter after the step with verify's relative error (``equivalence.rel_error``)."""
    import torch
    from torch.distributed.tensor import DTensor

    from sptransform.copying import faithful_deepcopy
    from sptransform.equivalence import _scale, rel_error

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    model, (args, kwargs) = build(c)
    ref = faithful_deepcopy(model)
    torch.manual_seed(1)
    ref_out = ref(*args, **kwargs)
    (ref_out if ref_out.dim() == 0 else ref_out.sum()).backward()
    try:
        pm = sptransform.parallelize(model, tp=layout.tp, sp=layout.sp, recompute=layout.recompute,
                                     compile=layout.compile, example_inputs=(args, kwargs), dropout_rng="reference")
        torch.manual_seed(1)
        out = pm(*args, **kwargs)
    except (ValueError, TypeError) as refusal:
        return "refused", str(refusal)
    (out if out.dim() == 0 else out.sum()).backward()
    tolerance, worst, where = rtol(c), rel_error(full(out), ref_out, _scale([ref_out])), "output"
    ref_params = dict(ref.named_parameters())
    grads = {n: full(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
    scale = _scale([p.grad for p in ref_params.values()])
    for name, p in ref_params.items():
        e = rel_error(grads.get(name), p.grad, scale)
        worst, where = max((worst, where), (e, f"grad of {name}"))
    for module in (pm, ref):
        torch.optim.SGD(module.parameters(), lr=1e-2).step()
    scale = _scale([p.detach() for p in ref_params.values()])
    for name, p in pm.named_parameters():
        e = rel_error(full(p.detach()), ref_params[name].detach(), scale)
        worst, where = max((worst, where), (e, f"param {name} after a step"))
    return ("equal" if worst <= tolerance else "different"), f"worst {worst:.1e} ({where})"
