"""ZeRO on a rank: parameters held in 1/dp pieces, gathered where a layer uses them.

``gather_params(group, size, dims, shapes, *pieces)`` all-gathers one bucket of parameter
pieces over the data-parallel group in one collective and returns the tensor-parallel-local
parameters; its backward reduce-scatters the bucket's gradients back to the pieces and
averages them over the group (ZeRO-2 and 3), or, with ``whole_gradient`` (ZeRO-1), all-reduces
the bucket's whole gradient and keeps this rank's piece of it.

ZeRO-1 and 2 stop there: a gathered parameter that a layer's backward reads (a linear saves its
weight) is kept by autograd from the forward to that backward, as FSDP2's
``reshard_after_forward=False`` keeps it, and freed when the backward has used it.

ZeRO-3 keeps none: ``regather_saved`` is the saved-tensor hook that prevents it. A gathered
parameter saved for backward (or a view of it) is stored as its bucket and position, and
gathered again when the backward needs it (the last two buckets gathered again are kept, since
a layer's backward reads its parameters one after another). The hook finds the bucket through
the tensor's own autograd history (the gather's backward node holds it and its outputs'
storages; a view reaches it through its view nodes), so nothing is registered outside the
forward that gathered.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from sptransform.runtime.collectives import _all_gather, _all_reduce, _reduce_scatter, _reduce_scatter_later
from sptransform.torch_internals import StorageWeakRef, local_tensor_mode, resolve_process_group

class _Bucket:
    """What gathering a bucket again needs: this rank's pieces, how to rebuild, the group."""

    def __init__(self, pieces, group: str, size: int, dims, shapes):
        self.pieces = [p.detach() for p in pieces]
        self.group, self.size, self.dims, self.shapes = group, size, tuple(dims), tuple(shapes)

    def gather(self) -> list[torch.Tensor]:
        return _gather(self.pieces, self.group, self.size, self.dims, self.shapes)


def _gather(pieces, group: str, size: int, dims, shapes) -> list[torch.Tensor]:
    flat = torch.cat([p.reshape(-1) for p in pieces])
    return _rebuild(_all_gather(flat, 0, group), pieces, size, dims, shapes)


def _remember(ctx, pieces, group: str, size: int, dims, shapes) -> list[torch.Tensor]:
    """Gather a bucket; eagerly, record on ``ctx`` what ``Regather`` needs to gather it again
    (the bucket and its outputs' storages). Traced (``torch.compile``) nothing is recorded: the
    recorded detached pieces would become outputs of the compiled graph that alias its inputs,
    which AOTAutograd refuses beside DTensor outputs, and saved-tensor hooks do not run in a
    compiled backward anyway."""
    if torch.compiler.is_compiling():
        return _gather(pieces, group, size, dims, shapes)
    ctx.bucket = _Bucket(pieces, group, size, dims, shapes)  # read by ``Regather.pack`` (``_gathered``)
    full = ctx.bucket.gather()
    ctx.storages = [StorageWeakRef(t.untyped_storage()) for t in full]
    return full


def _rebuild(gathered: torch.Tensor, pieces, size: int, dims, shapes) -> list[torch.Tensor]:
    """Split ``[size * n]`` (every rank's flat bucket) into the full parameters: rank k's piece of
    a parameter is its k-th chunk along its ZeRO dim."""
    rows = gathered.view(size, -1)
    out, offset = [], 0
    for piece, dim, shape in zip(pieces, dims, shapes):
        n = piece.numel()
        chunk = rows[:, offset: offset + n].reshape(size, *piece.shape)
        out.append(chunk.movedim(0, dim).reshape(shape).contiguous())
        offset += n
    return out


class _GatherParams(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, size, dims, shapes, overlap, whole_gradient, divisor, *pieces):
        ctx.group, ctx.size, ctx.dims, ctx.shapes, ctx.overlap = group, size, dims, shapes, overlap
        ctx.divisor = divisor
        ctx.rank = _group_rank(group) if whole_gradient else None
        ctx.piece_shapes = [p.shape for p in pieces]
        ctx.dtypes = [p.dtype for p in pieces]
        return tuple(_remember(ctx, pieces, group, size, dims, shapes))

    @staticmethod
    def backward(ctx, *grads):
        pieces = []
        for grad, dim, shape, piece_shape, dtype in zip(grads, ctx.dims, ctx.shapes, ctx.piece_shapes, ctx.dtypes):
            if grad is None:
                grad = torch.zeros(shape, dtype=dtype)
            # [.., size * L, ..] -> [size, .., L, ..]: rank k's chunk first, then flattened
            split = grad.reshape(*shape[:dim], ctx.size, piece_shape[dim], *shape[dim + 1:]).movedim(dim, 0)
            pieces.append(split.reshape(ctx.size, -1))
        # divided before the sum, so that with ``overlap`` the pieces are views of the collective's
        # own (unwaited) result; for a power-of-two group the two orders give the same bits
        flat = torch.cat(pieces, dim=1).reshape(-1) / ctx.divisor
        if ctx.rank is not None:
            # ZeRO-1: the whole average, as zero=0 computes it, then this rank's row [rank k's
            # pieces] copied out, so that the whole bucket is freed here (waited on at once)
            local = _all_reduce(flat, ctx.group).view(ctx.size, -1)[ctx.rank].clone()
        else:
            local = (_reduce_scatter_later if ctx.overlap else _reduce_scatter)(flat, 0, ctx.group)
        out, offset = [], 0
        for piece_shape in ctx.piece_shapes:
            n = piece_shape.numel()
            out.append(local[offset: offset + n].view(piece_shape))
            offset += n
        return (None, None, None, None, None, None, None, *out)


def _group_rank(group: str) -> int:
    """This rank's index in ``group`` (whose row of an all-reduced bucket ZeRO-1 keeps)."""
    if local_tensor_mode() is not None:
        raise ValueError(
            "zero=1 keeps the row of the all-reduced gradient given by this rank's index in the "
            "data-parallel group, which simulated ranks (LocalTensorMode) do not have; use zero=2 "
            "(the same pieces, reduce-scattered) in simulation, or real processes for zero=1"
        )
    return dist.get_rank(resolve_process_group(group))


def gather_params(group: str, size: int, dims: list[int], shapes: list[list[int]], *pieces: torch.Tensor,
                  overlap: bool = False, whole_gradient: bool = False, divisor: int | None = None):
    """The full (tensor-parallel-local) parameters of one bucket, from this rank's pieces; their
    gradients reduce-scattered back (with ``overlap``, waited on when the backward ends), or with
    ``whole_gradient`` (ZeRO-1) all-reduced whole and this rank's piece kept; divided by
    ``divisor`` (default ``size``: the average over the group; expert parameters' gradients,
    already summed over the expert-parallel ranks, by all ``dp`` replicas)."""
    return _GatherParams.apply(group, size, tuple(dims), tuple(tuple(s) for s in shapes), overlap, whole_gradient,
                               size if divisor is None else divisor, *pieces)


def gather_summed(group: str, size: int, dims: list[int], shapes: list[list[int]], *pieces: torch.Tensor):
    """Parameters split in the graph but stored in 1/``size`` pieces (``passes.shard_whole``):
    all-gathered where a layer reads them, their gradient, partial on each rank, summed over the
    group and reduce-scattered back (``gather_params`` summing, its own op so that ``explain()``
    tells it from ZeRO's)."""
    return gather_params(group, size, dims, shapes, *pieces, divisor=1)


class _GatherWhole(torch.autograd.Function):
    """``gather_whole``: the forward as ``_GatherParams``'s; the backward cuts this rank's piece
    out of a gradient that arrives whole and equal on every rank of the group, with no collective."""

    @staticmethod
    def forward(ctx, group, size, dims, shapes, rank, *pieces):
        ctx.dims, ctx.piece_shapes = dims, [p.shape for p in pieces]
        ctx.save_for_backward(rank)
        return tuple(_remember(ctx, pieces, group, size, dims, shapes))

    @staticmethod
    def backward(ctx, *grads):
        (rank,) = ctx.saved_tensors
        out = []
        for grad, dim, piece_shape in zip(grads, ctx.dims, ctx.piece_shapes):
            if grad is None:  # this parameter got no gradient (nor does it on one device)
                out.append(None)
                continue
            length = piece_shape[dim]
            index = torch.arange(length, device=grad.device) + rank.to(grad.device) * length
            out.append(grad.index_select(dim, index))
        return (None, None, None, None, None, *out)


def gather_whole(group: str, size: int, dims: list[int], shapes: list[list[int]], rank: torch.Tensor,
                 *pieces: torch.Tensor):
    """Parameters that tensor parallelism uses whole, stored in 1/``size`` pieces over the
    tensor-parallel ``group`` (``ParallelOptions.shard_whole``): all-gathered in one collective
    where a layer reads them. Their gradient arrives whole and equal on every rank (the
    tensor-parallel pass has already summed any partial one: its ``sync_grads`` reads the
    gathered parameter), so the backward keeps rank ``rank``'s piece of it, communicating nothing."""
    return _GatherWhole.apply(group, size, tuple(dims), tuple(tuple(s) for s in shapes), rank, *pieces)


class _CountedOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size):
        ctx.size = size
        return x.view_as(x)  # a view: ``Regather`` finds the gathered parameter through it

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


def counted_once(x: torch.Tensor, size: int) -> torch.Tensor:
    """Identity forward; backward divides the gradient by ``size``. For a reader of a gathered
    parameter whose gradient is equal on every rank, in front of a backward that sums over the
    ``size`` ranks (``gather_summed``): counted once in that sum."""
    return _CountedOnce.apply(x, size)


_REGATHER = object()  # a constant marker: what ``Regather.pack`` stores for a gathered parameter


_VIEW_DEPTH = 8
"""How many one-input autograd nodes (a view's ``t``, ``view``, ``expand``...) ``_gathered`` walks up."""


def _gathered(tensor: torch.Tensor) -> tuple[_Bucket, int] | None:
    """The bucket and position of the gathered parameter ``tensor`` is, or shares storage with (a
    view of it): walking up one-input autograd nodes from ``tensor`` reaches a ``_GatherParams``
    backward whose output ``index`` has ``tensor``'s storage."""
    storage = StorageWeakRef(tensor.untyped_storage())
    fn, index = tensor.grad_fn, tensor.output_nr
    for _ in range(_VIEW_DEPTH):
        if fn is None:
            return None
        storages = getattr(fn, "storages", None)
        if storages is not None and isinstance(getattr(fn, "bucket", None), _Bucket):
            return (fn.bucket, index) if storages[index] == storage else None
        sources = [(source, nr) for source, nr in fn.next_functions if source is not None]
        if len(sources) != 1:
            return None
        fn, index = sources[0]
    return None


class Regather:
    """The saved-tensor hooks of one forward pass: gathered parameters are not kept for backward,
    but gathered again when it needs them (see the module docstring). ``pack``/``unpack`` can be
    composed with other hooks; ``with Regather():`` installs them alone."""

    def __init__(self):
        self.cache: OrderedDict[int, list[torch.Tensor]] = OrderedDict()

    def pack(self, tensor: torch.Tensor):
        found = _gathered(tensor)
        if found is None:
            return tensor
        bucket, index = found
        return (_REGATHER, bucket, index, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self, saved):
        if not (isinstance(saved, tuple) and saved and saved[0] is _REGATHER):
            return saved
        _, bucket, index, size, stride, offset = saved
        key = id(bucket)
        if key not in self.cache:
            self.cache[key] = bucket.gather()
            while len(self.cache) > 2:
                self.cache.popitem(last=False)
        return self.cache[key][index].as_strided(size, stride, offset)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def regather_saved() -> Regather:
    """``with regather_saved(): forward`` (see ``Regather``)."""
    return Regather()


def data_parallel_placement(plan, name: str):
    """A parameter's placement on the data-parallel axis: split along its ZeRO dim (stages 1 to
    3: the optimizer then holds 1/dp of its state), else whole."""
    from torch.distributed.tensor import Replicate, Shard

    dim = plan.dims.get(name) if plan is not None and plan.zero >= 1 else None
    return Shard(dim) if dim is not None else Replicate()
