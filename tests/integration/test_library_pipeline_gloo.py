"""Issue 23 on real library code: litgpt's and x-transformers' own models (``tests/models/library_lms.py``,
shrunk, the loss in a wrapper) split into 2 pipeline stages on real gloo processes, in float64, equal to
one device: loss, every gradient, every parameter after a step.

Skipped where the library is not installed (CI installs ``.[test]`` only; litgpt's ``model`` module
imports ``lightning``). ``tools/sweep_libraries.py`` runs every model of the module both dtypes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import sptransform

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from models import library_lms  # noqa: E402

pytestmark = pytest.mark.slow


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # ImportError, or litgpt's own imports (lightning) failing
        return False
    return True


@pytest.mark.parametrize("key", [
    "pythia",   # LayerNorm, parallel residual: exact in float64
    "llama3",   # RMSNorm computed in float32 inside (litgpt casts), GQA
    "falcon",   # multi-query, one norm shared by the parallel attention and MLP
    "xt_decoder",
])
def test_library_model_splits_into_two_stages_equal_in_float64(key):
    spec = library_lms.MODELS[key]
    module = {"litgpt": "litgpt.model", "x-transformers": "x_transformers"}[spec.library]
    if not _importable(module):
        pytest.skip(f"{spec.library} is not installed (or does not import here)")
    model, inputs = library_lms.build(key, torch.float64)
    rtol = 2e-5 if spec.float32_inside else 1e-9
    report = sptransform.verify(model, tp=1, pp=2, example_inputs=inputs, processes=True, rtol=rtol, timeout_s=300)
    assert report.ok, str(report)
    assert report.ranks == "processes" and report.processes == 2
    names = {n for n, _ in model.named_parameters()}
    assert {row.name for row in report.rows if row.kind == "grad"} == names
