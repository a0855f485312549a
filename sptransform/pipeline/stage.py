"""The pieces torch's schedules run: one ``StageModule`` per stage, inside a ``PipelineStage``.

``StageModule`` runs a stage's graph on the local shards of the parameters it reads, plain or
partitioned by the rematerialisation pass (``recompute=``, per microbatch with
``stored_microbatches``); ``_Stage`` tells it which microbatch runs; ``_FreeingStage`` frees
1F1B's forward outputs once sent.
"""

from __future__ import annotations

import contextlib

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from sptransform.runtime.params import set_by_path
from sptransform.runtime.zero import regather_saved
from sptransform.passes.pipeline_split import StageGraph
from sptransform.torch_internals import StorageWeakRef, stage_forward_cache


class StageModule(nn.Module):
    """One stage: its graph run on the local shards of the parameters it reads.

    ``forward(*activations, **inputs)``: the previous stage's activations, and the
    microbatch's tensor inputs by flat index (``input_<i>``).

    With ``recompute`` the graph runs through AOTAutograd with the rematerialisation
    partition. With ``fully_stored`` (microbatch-level recomputation), the microbatches in
    that set run the plain graph and keep every activation, the others the partitioned one;
    ``_Stage`` tells the module which microbatch it is running."""

    def __init__(self, stage: StageGraph, state: dict[str, torch.Tensor], fixed_inputs: dict[int, Any],
                 rank: torch.Tensor | None, compile_stage: Callable | None = None,
                 fully_stored: set[int] | None = None, zero3: bool = False):
        """``compile_stage(gm, inputs, state_positions)``: the rematerialisation driver
        (``transform.GraphFactory.compile``), or None to run the graph as captured. ``zero3``:
        parameters gathered from ZeRO-3 pieces are gathered again for backward, not kept."""
        super().__init__()
        self._zero3 = zero3
        self._regather = regather_saved
        self.index = stage.index
        self.graph = stage.gm
        self._compile_stage = compile_stage
        self.fully_stored = fully_stored
        self.microbatch: int | None = None
        """The microbatch the schedule is running (None while torch infers shapes)."""
        self._remat = None
        """The stage graph compiled by AOTAutograd with the rematerialisation partition (first call)."""
        self.params = nn.Module()
        self._state = [state[name] for name in stage.state_names]
        for name, value in zip(stage.state_names, self._state):
            if isinstance(value, nn.Parameter):
                set_by_path(self.params, name, value, kind="parameter")
        self._user = [(i, fixed_inputs.get(i)) for i in stage.user_inputs]
        self._extra = [rank for _ in stage.extra_inputs]
        self._observed: dict[str, tuple[set[int], int]] = {}
        self.saved_outputs: set[int] | None = None
        """Indices of outputs whose storage this stage's autograd saves (found on the first call
        of each way the stage runs)."""

    @property
    def saved_activation_bytes(self) -> int | None:
        """Bytes of the distinct storages autograd keeps for one microbatch's backward, parameters
        and buffers excluded, under the recompute policy (measured on its first call)."""
        observed = self._observed.get("plain" if self._compile_stage is None else "remat")
        return None if observed is None else observed[1]

    @property
    def fully_stored_bytes(self) -> int | None:
        """The same for a microbatch that keeps every activation (microbatch-level recompute)."""
        observed = self._observed.get("plain")
        return None if observed is None else observed[1]

    def forward(self, *activations, **inputs):
        state = [v.to_local() if isinstance(v, DTensor) else v for v in self._state]
        user = [inputs[f"input_{i}"] if fixed is None else fixed for i, fixed in self._user]
        if not torch.is_grad_enabled():
            return self.graph(*activations, *state, *user, *self._extra)
        way = self._way_of_next_microbatch()
        run = self.graph if way == "plain" else self._remat_runner(activations, state, user)
        if way in self._observed:
            with self._regather() if self._zero3 else contextlib.nullcontext():
                return run(*activations, *state, *user, *self._extra)
        saved: dict[StorageWeakRef, int] = {}
        regather = self._regather() if self._zero3 else None

        def pack(t):
            if regather is not None:
                packed = regather.pack(t)
                if packed is not t:  # a gathered parameter: gathered again in backward, not kept
                    return packed
            storage = t.untyped_storage()
            saved[StorageWeakRef(storage)] = storage.nbytes()
            return t

        unpack = regather.unpack if regather is not None else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = run(*activations, *state, *user, *self._extra)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        state_storages = {StorageWeakRef(t.untyped_storage()) for t in state if isinstance(t, torch.Tensor)}
        self._observed[way] = (
            {i for i, o in enumerate(outputs) if StorageWeakRef(o.untyped_storage()) in saved},
            sum(n for ref, n in saved.items() if ref not in state_storages),
        )
        self.saved_outputs = set().union(*(kept for kept, _ in self._observed.values()))
        return out

    def _way_of_next_microbatch(self) -> str:
        if self._compile_stage is None:
            return "plain"
        if self.fully_stored is None or self.microbatch is None:
            return "remat"
        return "plain" if self.microbatch in self.fully_stored else "remat"

    def _remat_runner(self, activations: tuple, state: list, user: list):
        if self._remat is None:
            inputs = [*activations, *state, *user, *self._extra]
            first_state = len(activations)
            compiled = self._compile_stage(self.graph, inputs, range(first_state, first_state + len(state)))

            returns_tuple = self._returns_tuple

            def run(*all_inputs):
                out = compiled(*[x for x in all_inputs if isinstance(x, torch.Tensor)])
                if not isinstance(out, (tuple, list)):
                    return out
                return tuple(out) if returns_tuple else out[0]

            self._remat = run
        return self._remat

    @property
    def _returns_tuple(self) -> bool:
        output = next(iter(self.graph.graph.find_nodes(op="output")))
        return isinstance(output.args[0], (tuple, list))


class _Stage(PipelineStage):
    """A ``PipelineStage`` that tells its ``StageModule`` which microbatch each forward runs."""

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        self.submod.microbatch = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self.submod.microbatch = None


class _FreeingStage(_Stage):
    """A ``PipelineStage`` that frees each forward output once its send is posted.

    torch's schedules keep a stage's outputs in ``fwd_cache`` until that microbatch's
    backward (only the last stage detaches them early), though backward needs only
    their ``grad_fn`` and shape. Here the send goes from a copy, which the schedule
    drops once it has waited on the send (1F1B: before the next send), and the
    output's storage is released at once. Outputs the stage's own autograd saved are kept."""

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if self.is_last:
            return ops
        outputs, _ = stage_forward_cache(self)[fwd_chunk_id]
        assert len(ops) == len(outputs), "one send per output"
        keep = self.submod.saved_outputs or set()  # by storage: a view of a saved tensor is kept too
        sent = [out for index, out in enumerate(outputs) if index not in keep and out.untyped_storage().nbytes()]
        for op, out in zip(ops, outputs):
            if any(out is s for s in sent):
                op.tensor = op.tensor.clone()
        for out in sent:  # only after every copy: two outputs may be views of one storage
            out.untyped_storage().resize_(0)
        return ops
