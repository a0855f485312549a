"""How an op's output dims correspond to its inputs' dims: one ``LinksRule`` per kind of op.

A links rule returns, for each tensor input, ``{out_dim: in_dim}`` of the dims that correspond
one to one, and the output dims that may not be split (reduced, normalized, contracted or
sliced). Both directions read it: forward, a split input dim moves to the output dim linked to
it; backward, an output split asks each input for the dim linked to it. Shapes come from
``node.meta["val"]``; a dim of size 1 broadcast against a larger one is not linked.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.graph.nodes import packet, shape_of
from sptransform.graph.rules.base import Links, norm_dim
from sptransform.torch_internals import op_schema

aten = torch.ops.aten

POINTWISE = frozenset({
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.rsqrt, aten.sqrt,
    aten.exp, aten.log, aten.tanh, aten.sigmoid, aten.silu, aten.gelu, aten.relu,
    aten.where, aten.masked_fill, aten.clone, aten.contiguous, aten.alias, aten.detach,
    aten.to, aten._to_copy, aten.type_as, aten.dropout, aten.eq, aten.ne, aten.lt,
    aten.le, aten.gt, aten.ge, aten.logical_not, aten.logical_and, aten.bitwise_and,
    aten.__and__, aten.__or__, aten.abs, aten.clamp, aten.clamp_min, aten.clamp_max,
    aten.maximum, aten.minimum, aten.erf, aten.reciprocal, aten.square, aten.rsub,
    aten.sin, aten.cos, aten.lift_fresh_copy, aten.zeros_like, aten.ones_like,
    aten.full_like, aten.empty_like, aten.rand_like, aten.bernoulli, aten.softmax,
    aten._softmax, aten.log_softmax, aten._log_softmax, aten.copy, aten.mish,
    aten.hardtanh, aten.leaky_relu, aten.elu, aten.softplus, aten.sign, aten.floor_divide,
})
"""Elementwise ops (with broadcasting), by packet; ops tagged ``torch.Tag.pointwise`` count too.
The softmaxes are elementwise but for the dim they normalize over."""
SOFTMAXES = frozenset({aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax})
REDUCTIONS = frozenset({aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.var_mean, aten.argmax,
                        aten.argmin, aten.logsumexp})
REDUCING_OVERLOADS = frozenset({aten.max.dim, aten.min.dim, aten.max.default, aten.min.default})
"""``max``/``min`` by overload: ``max.dim`` reduces (values and indices, e.g. the row maximum an
attention with sinks subtracts before its softmax) while ``max.other`` is elementwise."""


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found = []
    for a in list(node.args) + list(node.kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        for x in items:
            if isinstance(x, fx.Node) and shape_of(x) is not None and x not in found:
                found.append(x)
    return found


def pointwise_links(node: fx.Node) -> tuple[Links, set[int]]:
    """Trailing dims line up (broadcasting); a softmax may not be split along its dim."""
    out = shape_of(node)
    links = []
    for arg in _tensor_args(node):
        shape = shape_of(arg)
        offset = len(out) - len(shape)
        links.append((arg, {d + offset: d for d in range(len(shape)) if shape[d] != 1 or out[d + offset] == 1}))
    forbidden = {norm_dim(node.args[1], len(out))} if packet(node) in SOFTMAXES else set()
    return links, forbidden


def reduction_links(node: fx.Node) -> tuple[Links, set[int]]:
    """The kept dims link to the input's; reduced dims (kept as size 1 or dropped) do not."""
    x = node.args[0]
    n = len(shape_of(x))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
    dims = {norm_dim(d, n) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    mapping, o = {}, 0
    for d in range(n):
        if d in dims:
            if keep:
                o += 1
            continue
        mapping[o] = d
        o += 1
    return [(x, mapping)], set()


def norm_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``layer_norm``/``rms_norm``: the normalized trailing dims may not be split."""
    x = node.args[0]
    n = len(shape_of(x))
    k = len(node.args[1])
    return [(x, {d: d for d in range(n - k)})], set(range(n - k, n))


def _permuted(x: fx.Node, perm: list[int]) -> tuple[Links, set[int]]:
    return [(x, {o: perm[o] for o in range(len(perm))})], set()


def transpose_links(node: fx.Node) -> tuple[Links, set[int]]:
    n = len(shape_of(node))
    a, b = (norm_dim(d, n) for d in node.args[1:3])
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return _permuted(node.args[0], perm)


def t_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``numpy_T`` reverses every dim; ``mT`` (and ``t`` of a 2-D tensor) swaps the last two."""
    p = packet(node)
    n = len(shape_of(node))
    if p is aten.numpy_T:
        return _permuted(node.args[0], [n - 1 - o for o in range(n)])
    if p is aten.mT or n == 2:
        perm = list(range(n))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return _permuted(node.args[0], perm)
    return [(node.args[0], {0: 0})], set()


def permute_links(node: fx.Node) -> tuple[Links, set[int]]:
    return _permuted(node.args[0], [norm_dim(d, len(shape_of(node))) for d in node.args[1]])


def unsqueeze_links(node: fx.Node) -> tuple[Links, set[int]]:
    n = len(shape_of(node))
    k = norm_dim(node.args[1], n)
    return [(node.args[0], {o: (o if o < k else o - 1) for o in range(n) if o != k})], set()


def squeeze_links(node: fx.Node) -> tuple[Links, set[int]]:
    x = node.args[0]
    shape = shape_of(x)
    kept = [d for d in range(len(shape)) if not (shape[d] == 1 and _squeezed(node, d, len(shape)))]
    return [(x, dict(enumerate(kept)))], set()


def _squeezed(node: fx.Node, d: int, ndim: int) -> bool:
    if len(node.args) < 2:
        return True
    dims = node.args[1]
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return d in {norm_dim(x, ndim) for x in dims}


def expand_links(node: fx.Node) -> tuple[Links, set[int]]:
    x = node.args[0]
    out, shape = shape_of(node), shape_of(x)
    offset = len(out) - len(shape)
    return [(x, {d + offset: d for d in range(len(shape)) if shape[d] == out[d + offset]})], set()


def slice_links(node: fx.Node) -> tuple[Links, set[int]]:
    """Every dim links; the sliced dim may not be split unless the slice takes all of it."""
    x = node.args[0]
    out = shape_of(node)
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out))
    full = shape_of(x)[d] == out[d]
    return [(x, {o: o for o in range(len(out))})], set() if full else {d}


def select_links(node: fx.Node) -> tuple[Links, set[int]]:
    n = len(shape_of(node))
    d = norm_dim(node.args[1], n + 1)
    return [(node.args[0], {o: (o if o < d else o + 1) for o in range(n)})], set()


def repeat_interleave_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``out[i] = in[i // repeats]`` along dim: a contiguous split maps to one ``repeats`` times
    smaller. Repeats given as a tensor: no rule (``KeyError``)."""
    if not isinstance(node.args[1], int):
        raise KeyError(packet(node))
    return [(node.args[0], {o: o for o in range(len(shape_of(node)))})], set()


def cat_links(node: fx.Node) -> tuple[Links, set[int]]:
    n = len(shape_of(node))
    d = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), n)
    return [(t, {o: o for o in range(n) if o != d}) for t in node.args[0]], {d}


def pad_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``constant_pad_nd(x, pad)`` and ``pad(x, pad, mode)`` (any mode: reflect and replicate read
    only along the padded dims): ``pad`` pairs from the last dim backwards; a dim padded (or
    cropped) on either side may not be split, every other dim links one to one."""
    x = node.args[0]
    n = len(shape_of(x))
    pad = node.args[1]
    padded = {n - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    return [(x, {d: d for d in range(n) if d not in padded})], padded


def unfold_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``unfold(x, dim, size, step)``: windows of ``size`` along ``dim``, laid along a new last
    dim. A window reads neighbours along ``dim`` (not split) and is the new dim (not split);
    every other dim links one to one (a short convolution's channels, unfolded along time)."""
    x = node.args[0]
    n = len(shape_of(x))
    d = norm_dim(node.args[1], n)
    return [(x, {o: o for o in range(n) if o != d})], {d, n}


def flip_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``flip(x, dims)``: the flipped dims are not split (a piece would hold the other end's
    elements); every other dim links one to one."""
    x = node.args[0]
    n = len(shape_of(x))
    flipped = {norm_dim(d, n) for d in node.args[1]}
    return [(x, {o: o for o in range(n) if o not in flipped})], flipped


def index_select_links(node: fx.Node) -> tuple[Links, set[int]]:
    n = len(shape_of(node))
    return [(node.args[0], {o: o for o in range(n)})], {norm_dim(node.args[1], n)}


ALONG_DIM = frozenset({aten.topk, aten.sort, aten.argsort, aten.kthvalue, aten.cummax, aten.cummin, aten.mode})
"""Ops that work along one dim, each slice along it on its own (select the k largest, sort, a
running maximum), most with two outputs (values and indices): every other dim passes a split
through, that dim may not be split. (``cumsum`` and its kin have one output: DTensor's rules.)"""


def dim_argument(node: fx.Node, default: int = -1) -> int:
    """The op's ``dim`` argument, found by name in its schema (positional or keyword)."""
    for i, arg in enumerate(op_schema(node.target).arguments):
        if arg.name == "dim":
            if arg.kwarg_only or i >= len(node.args):
                return node.kwargs.get("dim", arg.default_value if arg.default_value is not None else default)
            return node.args[i]
    raise KeyError(packet(node))


def along_dim_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``topk(x, k, dim)``, ``sort(x, dim)``, ``cummax(x, dim)``: an output element reads the
    slice of ``x`` along ``dim`` at its own position in the other dims, so those link one to one
    (every output: values and indices alike); ``dim`` itself may not be split."""
    x = node.args[0]
    n = len(shape_of(x))
    d = norm_dim(dim_argument(node), n)
    return [(x, {o: o for o in range(n) if o != d})], {d}


SCATTERS = frozenset({aten.scatter, aten.scatter_add, aten.scatter_reduce, aten.gather})


def scatter_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``scatter(x, dim, ids, src)`` / ``gather(x, dim, ids)``: along ``dim`` any position may
    land anywhere (not split); along every other dim element ``i`` reads element ``i`` of ``x``,
    ``ids`` and ``src``, which link one to one where all their sizes equal the output's. A dim
    where one is larger (an index covering only the first rows of ``x``) is not split either:
    position ``i`` of a rank's piece would read row ``i`` of the whole, not its own row."""
    out = shape_of(node)
    n = len(out)
    d = norm_dim(node.args[1], n)
    args = _tensor_args(node)
    if any(len(shape_of(a)) != n for a in args):
        raise KeyError(packet(node))  # (torch requires equal ranks; no rule otherwise)
    kept = {o: o for o in range(n) if o != d and all(shape_of(a)[o] == out[o] for a in args)}
    forbidden = set(range(n)) - set(kept)
    return [(a, dict(kept)) for a in args], forbidden


def index_add_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``index_add(x, dim, ids, source)``: rows of ``source`` added into the rows ``ids`` of ``x``
    along ``dim`` (experts' outputs laid back where their tokens came from). Every other dim
    links to ``x``'s and ``source``'s alike; ``dim`` itself cannot be split (any row of ``x`` may
    receive any row of ``source``); ``ids`` is read whole."""
    n = len(shape_of(node))
    d = norm_dim(node.args[1], n)
    kept = {o: o for o in range(n) if o != d}
    return [(node.args[0], kept), (node.args[3], kept)], {d}


def index_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``index(x, [None, ids, None])``: advanced indexing by integer tensors in adjacent dims.
    The dims no index reads link to ``x``'s (so ``W[ids]`` of an expert weight ``[E, N, K]``
    split on ``N`` is split on ``N``); the dims the indices make (their broadcast shape, where the
    first indexed dim was) link to each index tensor, where it is not broadcast. Boolean masks
    (data-dependent shapes) or indices in dims apart (torch moves their dims first): no rule
    (``KeyError``)."""
    x, indices = node.args[0], list(node.args[1])
    at = [d for d, t in enumerate(indices) if t is not None]
    if not at or at != list(range(at[0], at[-1] + 1)) or any(
            not isinstance(indices[d], fx.Node) or indices[d].meta["val"].dtype in (torch.bool, torch.uint8) for d in at):
        raise KeyError(packet(node))
    n_in, n_out = len(shape_of(x)), len(shape_of(node))
    made = n_out - (n_in - len(at))  # dims of the broadcast index shape
    first = at[0]
    mapping = {o: o for o in range(first)}
    mapping.update({first + made + k: at[-1] + 1 + k for k in range(n_in - at[-1] - 1)})
    links = [(x, mapping)]
    out = shape_of(node)
    for d in at:
        shape = shape_of(indices[d])
        offset = made - len(shape)
        links.append((indices[d], {first + offset + k: k for k in range(len(shape))
                                   if shape[k] != 1 or out[first + offset + k] == 1}))
    return links, set()


TRIANGLES = frozenset({aten.tril, aten.triu})


def triangle_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``tril``/``triu`` keep or zero each element by its position in the last two dims: the
    leading (batch, head) dims link one to one; the matrix dims may not be split (a rank's rows
    would need their global index)."""
    n = len(shape_of(node))
    return [(node.args[0], {d: d for d in range(n)})], {n - 2, n - 1}


CONVOLUTIONS = frozenset({aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution})
GROUPS_ARG = {aten.conv1d: 6, aten.conv2d: 6, aten.conv3d: 6, aten.convolution: 8}
"""Where each convolution takes ``groups`` (``convolution``'s args: input, weight, bias, stride,
padding, dilation, transposed, output_padding, groups)."""


def conv_groups(node: fx.Node) -> int:
    index = GROUPS_ARG[packet(node)]
    return node.args[index] if len(node.args) > index else node.kwargs.get("groups", 1)


def is_depthwise(node: fx.Node) -> bool:
    """A convolution whose every channel is its own group (``groups == in == out channels``,
    one input channel per filter, not transposed): channel ``c`` of the output reads channel
    ``c`` of the input, filter ``c`` and bias ``c`` only, so a channel split passes through."""
    x, w = node.args[0], node.args[1]
    if packet(node) is aten.convolution and node.args[6]:
        return False
    channels = shape_of(x)[1]
    return shape_of(w)[0] == channels == shape_of(node)[1] and shape_of(w)[1] == 1 and conv_groups(node) == channels


def group_size(node: fx.Node) -> int | None:
    """The channels of one group of a grouped convolution that keeps its channel count (``groups
    > 1``, as many output channels as input ones, not transposed): output channels ``[j*g,
    (j+1)*g)`` read input channels ``[j*g, (j+1)*g)`` and filters ``[j*g, (j+1)*g)`` only. A split
    of the channels whose every piece holds whole groups passes through (``conv_aligned``); None
    for any other convolution (depthwise is the case ``g == 1``)."""
    x, w = node.args[0], node.args[1]
    if packet(node) is aten.convolution and node.args[6]:
        return None
    groups, channels = conv_groups(node), shape_of(x)[1]
    if groups <= 1 or channels != shape_of(node)[1] or shape_of(w)[0] != channels or channels % groups:
        return None
    return channels // groups


def conv_aligned(node: fx.Node, segments, tp: int) -> bool:
    """Every rank's piece of every segment is whole groups of the convolution's channels."""
    g = group_size(node)
    return g is not None and all(start % g == 0 and length % tp == 0 and (length // tp) % g == 0
                                 for start, length in segments)


def conv_links(node: fx.Node) -> tuple[Links, set[int]]:
    """Batch links to the input's batch; a grouped convolution's channels (depthwise: one channel
    per group) link to the input's, the filters' and the bias's channels (the split's ``groups``
    is localized; the forward and backward rules also require the pieces to hold whole groups);
    a convolution that mixes all its channels contracts them (no link). Spatial dims slide a
    window: never split."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    out = shape_of(node)
    spatial = set(range(2, len(out)))
    if group_size(node) is None:
        return [(x, {0: 0})], spatial | {1}
    links = [(x, {0: 0, 1: 1}), (w, {1: 0})]
    if isinstance(bias, fx.Node):
        links.append((bias, {1: 0}))
    return links, spatial


def matmul_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``mm``/``bmm``/``matmul``: rows link to ``a``, columns to ``b``, batch dims to whichever
    operand has them unbroadcast; the contracted dim is no output dim."""
    a, b = node.args[0], node.args[1]
    sa, sb, out = shape_of(a), shape_of(b), shape_of(node)
    n = len(out)
    la, lb = {}, {}
    if len(sa) >= 2:
        la[n - 2] = len(sa) - 2
    if len(sb) >= 2:
        lb[n - 1] = len(sb) - 1
    for o in range(n - 2):
        for shape, links in ((sa, la), (sb, lb)):
            d = o - (n - len(shape))
            if 0 <= d < len(shape) - 2 and shape[d] == out[o]:
                links[o] = d
    return [(a, la), (b, lb)], set()


def grouped_mm_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``grouped_mm(x [S, K], w [E, K, N], offs)``: output features link to ``w``'s last dim. Rows
    link to nothing: which rows form group ``e`` is fixed by ``offs`` over all of them, so a
    split of the rows is no split of the op (it may not be split); ``K`` is contracted."""
    x, w, offs = node.args[:3]
    return [(x, {}), (w, {1: 2}), (offs, {})], {0}


def einsum_subscripts(node: fx.Node) -> tuple[list[str], str] | None:
    """``einsum(equation, [a, b])`` -> (each operand's letters, the output's) for an explicit
    equation over two operands, each letter once per operand; None otherwise (``...``)."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or "->" not in equation or "." in equation or len(operands) != 2:
        return None
    ins, out = equation.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2 or any(len(set(p)) != len(p) for p in (*parts, out)):
        return None
    if any(len(p) != len(shape_of(o) or ()) for p, o in zip(parts, operands)):
        return None
    return parts, out


def einsum_links(node: fx.Node) -> tuple[Links, set[int]]:
    """Each output letter links to the same letter in each operand that has it; letters in both
    operands but not in the output are contracted (``matmul_forward`` makes their split a
    partial sum)."""
    found = einsum_subscripts(node)
    if found is None:
        raise KeyError("not an explicit two-operand einsum")
    (sa, sb), out = found
    a, b = node.args[1]
    return [(a, {o: sa.index(c) for o, c in enumerate(out) if c in sa}),
            (b, {o: sb.index(c) for o, c in enumerate(out) if c in sb})], set()


def linear_links(node: fx.Node) -> tuple[Links, set[int]]:
    """``linear(x, w, b)``: tokens link to ``x``, output features to ``w``'s rows and ``b``."""
    x, w = node.args[0], node.args[1]
    n = len(shape_of(node))
    links = [(x, {o: o for o in range(n - 1)}), (w, {n - 1: 0})]
    if len(node.args) > 2 and node.args[2] is not None:
        links.append((node.args[2], {n - 1: 0}))
    return links, set()


def addmm_links(node: fx.Node) -> tuple[Links, set[int]]:
    bias, x, w = node.args[:3]
    sb = shape_of(bias)
    return [(x, {0: 0}), (w, {1: 1}), (bias, {1: len(sb) - 1} if sb and sb[-1] != 1 else {})], set()


def sdpa_links(node: fx.Node) -> tuple[Links, set[int]]:
    """q, k, v link along batch and head dims (K/V may broadcast or hold fewer, grouped heads),
    v's features to the output's; the mask links where it is not broadcast. The output's feature
    dim may not be split: q and k are contracted over theirs."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    out = shape_of(node)
    n = len(out)
    sk = shape_of(k)
    kv = {o: o for o in range(n - 2) if sk[o] != 1 or out[o] == 1}
    links = [(q, {o: o for o in range(n - 1)}), (k, kv), (v, kv | {n - 1: n - 1})]
    if isinstance(mask, fx.Node):
        sm = shape_of(mask)
        off = n - len(sm)
        links.append((mask, {o: o - off for o in range(off, n - 1) if sm[o - off] != 1}))
    return links, {n - 1}


def embedding_links(node: fx.Node) -> tuple[Links, set[int]]:
    """Token dims link to the ids, the feature dim to the weight's columns."""
    w, ids = node.args[0], node.args[1]
    n = len(shape_of(node))
    return [(ids, {o: o for o in range(n - 1)}), (w, {n - 1: 1})], set()
