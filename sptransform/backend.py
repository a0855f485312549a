"""The ``sptransform`` torch.compile backend: AOTAutograd with the rematerialisation partition.

    model = torch.compile(model, backend="sptransform", options={"policy": "selective"})
    model = torch.compile(model, backend="sptransform", options={"policy": "budget", "budget": 0.5})
    model = torch.compile(model, backend="sptransform", options={"policy": "full", "compile": "eager"})

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``).
``options`` are the fields of ``sptransform.options.RematOptions``, plus ``"compile"``:
``"inductor"`` (default) generates fused kernels for the partitioned forward and backward
graphs, ``"eager"`` runs them as ATen graphs op by op (for debugging); and ``"overlap"``
(default True): the overlap pass on both graphs (it changes nothing in a graph without
functional collectives). Either way the
partition is the one ``sptransform memory`` measures: inductor compiles the two graphs it is
given and does not partition again.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from sptransform.options import GRAPH_COMPILERS, RematOptions, check_graph_compiler
from sptransform.passes.remat import remat_partition
from sptransform.torch_internals import dynamo_static_input
from sptransform.compile_graphs import aot_compile, state_count
from sptransform.logs import logger

log = logger(__name__)

_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(RematOptions)) + ("compile", "overlap")
DEFAULT_COMPILE = "inductor"


def backend_options(options: dict | None = None, **overrides) -> RematOptions:
    """``RematOptions`` from a torch.compile ``options`` dict; unknown keys are an error."""
    return _parse(options, **overrides)[0]


def _parse(options: dict | None = None, **overrides) -> tuple[RematOptions, str, bool]:
    merged = {**(options or {}), **overrides}
    unknown = sorted(set(merged) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown sptransform backend option(s) {unknown}; valid options are {list(_OPTION_NAMES)}")
    compile = merged.pop("compile", DEFAULT_COMPILE)
    check_graph_compiler(compile)
    overlap = merged.pop("overlap", True)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r} ({type(overlap).__name__})")
    return RematOptions(**merged), compile, overlap


def sptransform_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **overrides):
    """A dynamo backend: partition ``gm``'s joint graph with ``RematOptions(**options)`` and
    compile the forward and backward with ``options["compile"]`` (one of ``GRAPH_COMPILERS``)."""
    remat, compile, overlap = _parse(options, **overrides)
    # Dynamo lifts parameters and buffers to graph inputs and marks them static; the
    # partition treats them as state (never activations, never recomputed).
    own = state_count(gm)  # AOTAutograd lifts gm's own parameters/buffers in front of the inputs
    state = list(range(own)) + [own + i for i, x in enumerate(example_inputs) if _is_state(x)]
    return aot_compile(gm, example_inputs, partition_fn=remat_partition(remat, state_indices=state), compile=compile,
                       overlap=overlap)


def _is_state(x) -> bool:
    return isinstance(x, torch.nn.Parameter) or (isinstance(x, torch.Tensor) and dynamo_static_input(x))


__all__ = ["GRAPH_COMPILERS", "backend_options", "sptransform_backend"]
