"""The ``sptransform`` torch.compile backend: AOTAutograd with the rematerialisation partition.

    model = torch.compile(model, backend="sptransform", options={"policy": "selective"})
    model = torch.compile(model, backend="sptransform", options={"policy": "budget", "budget": 0.5})

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``).
``options`` are the fields of ``sptransform.passes.remat.RematOptions``. The
forward and backward graphs run as ATen graphs (no code generation); the partition
is the same one ``sptransform memory`` measures.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from sptransform.options import RematOptions
from sptransform.passes.remat import remat_partition
from sptransform.torch_internals import dynamo_static_input
from sptransform.transform import aot_compile, state_count

log = logging.getLogger(__name__)

_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(RematOptions))


def backend_options(options: dict | None = None, **overrides) -> RematOptions:
    """``RematOptions`` from a torch.compile ``options`` dict; unknown keys are an error."""
    merged = {**(options or {}), **overrides}
    unknown = sorted(set(merged) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown sptransform backend option(s) {unknown}; valid options are {list(_OPTION_NAMES)}")
    return RematOptions(**merged)


def sptransform_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **overrides):
    """A dynamo backend: partition ``gm``'s joint graph with ``RematOptions(**options)``."""
    remat = backend_options(options, **overrides)
    # Dynamo lifts parameters and buffers to graph inputs and marks them static; the
    # partition treats them as state (never activations, never recomputed).
    own = state_count(gm)  # AOTAutograd lifts gm's own parameters/buffers in front of the inputs
    state = list(range(own)) + [own + i for i, x in enumerate(example_inputs) if _is_state(x)]
    return aot_compile(gm, example_inputs, partition_fn=remat_partition(remat, state_indices=state))


def _is_state(x) -> bool:
    return isinstance(x, torch.nn.Parameter) or (isinstance(x, torch.Tensor) and dynamo_static_input(x))
