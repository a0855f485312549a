"""The conjugate collectives of Megatron tensor and sequence parallelism.

Each is a ``torch.autograd.Function`` over torch's functional collectives, so the
graphs that call them stay traceable (torch.compile, AOTAutograd) and run on any
process group (gloo, NCCL, the fake group, LocalTensorMode's simulated ranks).

====================  ===================  ===================
name                  forward              backward
====================  ===================  ===================
``copy_to_tp`` (f)    identity             all-reduce
``reduce_from_tp`` (f̄) all-reduce           identity
``gather_seq`` (g)    all-gather on dim    reduce-scatter on dim
``scatter_seq`` (ḡ)   reduce-scatter       all-gather on dim
``gather_output``     all-gather on dim    keep local slice
``sync_grads``        identity (bucket)    one all-reduce of all grads
``average_grads``     identity (bucket)    all-reduce / dp (data parallel)
====================  ===================  ===================

Gradients of replicated tensors that feed sharded work arrive *partial* (each rank
holds its shard's contribution); ``sync_grads`` sums them for parameters over the
tensor-parallel group; ``average_grads`` acts on the data-parallel group (ZeRO-3's gathers
are ``runtime.zero.gather_params``). The two gradient buckets take ``overlap``: their
all-reduce is then not waited on inside the bucket's backward but at the end of the backward
pass (or where a gradient is read first), so it runs behind the rest of the backward, as DDP's
buckets do.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sptransform.runtime.faults import naming_failures

from sptransform.torch_internals import funcol, queue_backward_callback, resolve_process_group


def _resolve(group: str) -> torch.distributed.ProcessGroup:
    return resolve_process_group(group)


def _all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return waited(funcol.all_reduce(x.contiguous(), op, group))


def waited(out: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited on once. Eagerly it is torch's
    ``AsyncCollectiveTensor``, waited here; traced (``torch.compile``, AOTAutograd) funcol has
    already put the ``wait_tensor`` node after the collective, and a second one would be a second
    wait per collective in every compiled graph (measured: 24 waits for 12 all-reduces in the
    forward of a 4-layer GPT-2, tp=2). Eagerly, ``trigger_wait`` waits once and returns the plain
    result; ``funcol.wait_tensor`` on the ``AsyncCollectiveTensor`` went through its Python
    dispatch, which waits to unwrap it and then runs ``wait_tensor`` on the result again (3
    ``wait_tensor`` calls per collective in an eager step, profiled: 27 for 9 all-reduces)."""
    return out.trigger_wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _all_reduce_later(x: torch.Tensor, group: str, naming=None) -> torch.Tensor:
    """An all-reduce not waited on here (see ``_later``)."""
    return _later(funcol.all_reduce(x.contiguous(), "sum", group), naming)


def _later(result: torch.Tensor, naming=None) -> torch.Tensor:
    """A gradient bucket's collective, left in flight while the rest of the backward runs.
    Eagerly, ``result`` is torch's ``AsyncCollectiveTensor``: the gradients are views of it, and
    reading one before the collective is done waits for it (views do not); in any case the
    bucket is waited on when the backward pass ends, as DDP does, so ``.grad`` is complete after
    ``backward()`` and no collective outlives it. The bucket owns its wait: a callback of the
    running pass, and, for a pass that raised (the engine drops its callbacks), a finalizer that
    waits when the result is freed; nothing is kept outside the pass. Traced (AOTAutograd,
    ``torch.compile``), ``result`` is already a ``wait_tensor`` node, which the overlap pass
    moves to its first reader."""
    if isinstance(result, funcol.AsyncCollectiveTensor):
        queue_backward_callback(result.trigger_wait if naming is None else functools.partial(_wait_named, result, naming))
        weakref.finalize(result, funcol.wait_tensor, result.elem)
    return result


def _wait_named(result, naming) -> None:
    """``result``'s wait, its failure raised by ``naming`` (a ``runtime.faults.naming_failures``)."""
    with naming:
        result.trigger_wait()


def note_gradient(param: torch.nn.Parameter) -> None:
    """A parameter's post-accumulate-grad hook (``runtime.params.shard_parameter`` installs it):
    a gradient that is a view of a bucket left in flight is replaced by its plain tensor once
    the backward pass ends (a callback of that pass, queued after the bucket's wait). Left as
    torch's ``AsyncCollectiveTensor``, ``.grad`` would send every optimizer op through one more
    Python dispatch (AdamW's step took 2x as long on 60 such gradients)."""
    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
    if isinstance(local, funcol.AsyncCollectiveTensor):
        queue_backward_callback(functools.partial(_settle, param))


def _settle(param: torch.nn.Parameter) -> None:
    grad = param.grad
    if isinstance(grad, DTensor):
        local = grad.to_local()
        if isinstance(local, funcol.AsyncCollectiveTensor):
            param.grad = DTensor.from_local(local.trigger_wait(), grad.device_mesh, grad.placements,
                                            run_check=False, shape=grad.shape, stride=grad.stride())
    elif isinstance(grad, funcol.AsyncCollectiveTensor):
        param.grad = grad.trigger_wait()


def _flat_bucket(grads, shapes) -> torch.Tensor:
    """One flat tensor of a bucket's gradients (zeros for a parameter that got none)."""
    like = next((g for g in grads if g is not None), None)
    kind = {} if like is None else {"device": like.device, "dtype": like.dtype}
    return torch.cat([(g if g is not None else torch.zeros(s, **kind)).reshape(-1) for g, s in zip(grads, shapes)])


def _unflatten(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of ``flat`` in ``shapes`` (views, so an unwaited result stays unwaited)."""
    out, offset = [], 0
    for s in shapes:
        n = s.numel()
        out.append(flat[offset: offset + n].view(s))
        offset += n
    return out


def _all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return waited(funcol.all_gather_single(x.contiguous(), dim, group))


def _reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return waited(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


def _reduce_scatter_later(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """A reduce-scatter not waited on here (see ``_later``)."""
    return _later(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


def fresh(x: torch.Tensor) -> torch.Tensor:
    """The output of an identity-forward ``autograd.Function`` whose backward does the work (f's
    all-reduce, a gradient bucket's): a new view eagerly, a new tensor while ``torch.compile``
    traces. AOTAutograd hands an output that is a *view* of the graph's input or intermediate back
    by replaying the view outside the compiled graph, and a graph break between the Function and
    its reader (dynamo breaks at a data-dependent ``nonzero``) makes it such an output: its
    gradient then reached the base without the Function's backward, and the all-reduce was lost
    (measured: every gradient off by up to 1e-2 at tp=2 under ``torch.compile(pm)``). A copy is not
    a view; inductor drops it as a no-op where no graph boundary needs it."""
    return x.clone() if torch.compiler.is_compiling() else x.view_as(x)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return fresh(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, group):
        ctx.dim, ctx.group, ctx.local = dim, group, x.shape[dim]
        ctx.save_for_backward(rank)
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        (rank,) = ctx.saved_tensors
        index = torch.arange(ctx.local, device=grad.device) + rank * ctx.local
        return grad.index_select(ctx.dim, index), None, None, None


class _SyncGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, overlap, *params):
        ctx.group, ctx.overlap = group, overlap
        ctx.shapes = [p.shape for p in params]
        return tuple(fresh(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = _flat_bucket(grads, ctx.shapes)
        flat = _all_reduce_later(flat, ctx.group) if ctx.overlap else _all_reduce(flat, ctx.group)
        return (None, None, *_unflatten(flat, ctx.shapes))


class _AverageGrads(torch.autograd.Function):
    """Data parallelism, parameters replicated: identity forward; backward, the bucket's
    gradients averaged over the data-parallel group in one all-reduce. Divided before the sum
    so that, with ``overlap``, the gradients are views of the collective's own result, left in
    flight (``_later``); for a power-of-two group the two orders give the same bits."""

    @staticmethod
    def forward(ctx, group, size, overlap, *params):
        ctx.group, ctx.size, ctx.overlap = group, size, overlap
        ctx.shapes = [p.shape for p in params]
        return tuple(fresh(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = _flat_bucket(grads, ctx.shapes) / ctx.size
        # Eagerly, a failed all-reduce names the ranks (runtime.faults); traced, there is no wait here.
        naming = None if torch.compiler.is_compiling() else _named(ctx.group, len(ctx.shapes))
        if ctx.overlap:
            flat = _all_reduce_later(flat, ctx.group, naming)
        else:
            with naming or contextlib.nullcontext():
                flat = _all_reduce(flat, ctx.group)
        return (None, None, None, *_unflatten(flat, ctx.shapes))


def _named(group: str, count: int):
    """A data-parallel bucket's collective, whose failure names the ranks (``runtime.faults``)."""
    return naming_failures(lambda: f"the data-parallel gradient all-reduce of a bucket of {count} parameters",
                           lambda: dist.get_process_group_ranks(_resolve(group)))


def average_grads(group: str, size: int, *params: torch.Tensor, overlap: bool = False) -> tuple[torch.Tensor, ...]:
    """Identity on a bucket of parameters replicated over the data-parallel ranks; their
    gradients are averaged over the ``size`` ranks of ``group`` in one all-reduce (with
    ``overlap``, waited on when the backward ends)."""
    return _AverageGrads.apply(group, size, overlap, *params)


def copy_to_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """f: enter a tensor-parallel region (identity forward, all-reduce backward)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """f̄: leave a tensor-parallel region (all-reduce forward, identity backward)."""
    return _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """g: enter a tensor-parallel region from a sequence-parallel one."""
    return _GatherSeq.apply(x, dim, group)


def scatter_seq(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """ḡ: leave a tensor-parallel region into a sequence-parallel one."""
    return _ScatterSeq.apply(x, dim, group)


def gather_output(x: torch.Tensor, dim: int, rank: torch.Tensor, group: str) -> torch.Tensor:
    """All-gather a sequence-sharded tensor returned to the user (backward keeps the local slice)."""
    return _GatherOutput.apply(x, dim, rank, group)


def sync_grads(group: str, *params: torch.Tensor, overlap: bool = False) -> tuple[torch.Tensor, ...]:
    """Identity on a bucket of replicated parameters; their partial gradients are summed
    over the group in one all-reduce (with ``overlap``, waited on when the backward ends)."""
    return _SyncGrads.apply(group, overlap, *params)

