"""Random ops in the rematerialisation pass: replaying an op's RNG exactly instead of
saving its output, and keeping a dropout's mask as one byte.

    before:  y = dropout(x)                     (the mask lives inside the op)
    after:   m = bernoulli(x, p) -> bool; y = x * m / (1 - p)    (mask isolated, 1 byte)

Split out of ``remat.py``; the partition itself is there.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from sptransform.graph.nodes import is_collective, is_tangent, joint_id, packet, val
from sptransform.torch_internals import detect_fake_mode

aten = torch.ops.aten


def generator_state(generator: torch.Generator) -> torch.Tensor:
    """The state ``generator`` is in (called by a forward graph before a replayed draw)."""
    return generator.get_state()


def run_with_generator_state(state: torch.Tensor, op, *args, generator: torch.Generator, **kwargs):
    """``op(*args, generator=<a copy of generator in state>)``: the draw the forward made, again,
    leaving ``generator`` itself where it is."""
    replica = torch.Generator(device=generator.device)
    replica.set_state(state)
    return op(*args, generator=replica, **kwargs)


def replay_own_generators(fw: fx.GraphModule, bw: fx.GraphModule, replayed: list[fx.Node], *, num_sym_nodes: int) -> None:
    """Random ops drawing from a generator of their own (``generator=`` a graph constant): the
    forward saves the generator's state just before the draw, the backward draws again from a
    copy in that state. What ``functionalize_rng_ops`` does for the default generator.

        before:  fw: m = bernoulli(e, p, generator=g)     bw: m = bernoulli(e, p, generator=g)
        after:   fw: s = generator_state(g); m = bernoulli(e, p, generator=g)
                 bw: m = run_with_generator_state(s, bernoulli, e, p, generator=g)

    Edits ``fw`` and ``bw`` in place (the state joins the saved outputs, before symints). The
    joint graph's nodes must carry ``JOINT_ID`` (``number_joint_nodes``): a node's forward and
    backward copies are found by it."""
    fw_nodes = {joint_id(n): n for n in fw.graph.nodes if joint_id(n) is not None}
    bw_nodes = {joint_id(n): n for n in bw.graph.nodes if joint_id(n) is not None}
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    first_tangent = next((n for n in placeholders if is_tangent(n)), None)
    states = []
    for i, node in enumerate(replayed):
        forward, backward = fw_nodes.get(joint_id(node)), bw_nodes.get(joint_id(node))
        if forward is None or backward is None:
            continue
        fake = _fake_generator_state(forward)
        with fw.graph.inserting_before(forward):
            state = fw.graph.call_function(generator_state, (forward.kwargs["generator"],))
            state.meta["val"] = fake
        states.append(state)
        where = bw.graph.inserting_before(first_tangent) if first_tangent else bw.graph.inserting_after(placeholders[-1])
        with where:
            saved = bw.graph.placeholder(f"generator_state_{i}")
            saved.meta["val"] = fake
        with bw.graph.inserting_before(backward):
            again = bw.graph.call_function(run_with_generator_state, (saved, backward.target, *backward.args),
                                           dict(backward.kwargs))
            again.meta = dict(backward.meta)
        backward.replace_all_uses_with(again)
        bw.graph.erase_node(backward)
    output = next(iter(fw.graph.find_nodes(op="output")))
    outs = tuple(output.args[0])
    cut = len(outs) - num_sym_nodes
    output.args = (outs[:cut] + tuple(states) + outs[cut:],)
    fw.recompile()
    bw.recompile()


def _fake_generator_state(node: fx.Node) -> torch.Tensor:
    size = torch.Generator().get_state().numel()
    mode = detect_fake_mode([v for v in pytree_leaves(val(node)) if isinstance(v, torch.Tensor)])
    if mode is None:
        return torch.empty(size, dtype=torch.uint8)
    with mode:
        return torch.empty(size, dtype=torch.uint8)


def pytree_leaves(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _keeps_when_dead(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    return node.is_impure(impure_random=False) and not is_collective(node)


def isolate_dropout_masks(joint: fx.GraphModule) -> int:
    """Make each dropout draw its mask from the shape alone, so replaying it needs no activation.

        before:  out, mask = native_dropout(x, p, True)
        after:   noise, mask = native_dropout(ones_like(x), p, True);  out = x * noise

    ``noise`` is ``mask * 1/(1-p)`` in x's dtype, exactly what ``native_dropout``
    multiplies x by (bitwise equal output, the same RNG draws); the backward keeps
    using ``mask``. Edits ``joint`` in place; returns the number of dropouts rewritten."""
    graph, count = joint.graph, 0
    for node in list(graph.nodes):
        if node.target is not aten.native_dropout.default:
            continue
        x, p, train = (list(node.args) + [None])[:3]
        x_val = val(x)
        if not train or not 0 < p < 1 or not isinstance(x_val, torch.Tensor):
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        with graph.inserting_before(node):
            ones = graph.call_function(
                aten.full.default, (list(x_val.shape), 1.0),
                {"dtype": x_val.dtype, "layout": torch.strided, "device": x_val.device, "pin_memory": False},
            )
            ones.meta["val"] = x_val
            drawn = graph.call_function(aten.native_dropout.default, (ones, p, train))
            drawn.meta["val"] = node.meta["val"]
            noise = graph.call_function(operator.getitem, (drawn, 0))
            noise.meta["val"] = node.meta["val"][0]
            mask = graph.call_function(operator.getitem, (drawn, 1))
            mask.meta["val"] = node.meta["val"][1]
            out = graph.call_function(aten.mul.Tensor, (x, noise))
            out.meta["val"] = node.meta["val"][0]
        for index, replacement in ((0, out), (1, mask)):
            if index in items:
                items[index].replace_all_uses_with(replacement)
                graph.erase_node(items[index])
        graph.erase_node(node)
        count += 1
    if count:
        joint.recompile()
    return count


def compact_bernoulli_masks(joint: fx.GraphModule) -> int:
    """Keep a float Bernoulli draw (0 or 1) as a 1-byte mask, so saving it costs a byte an element.

        before:  keep = bernoulli(empty_like(x), p)          # dtype of x
        after:   keep = bernoulli(empty(shape), p); mask = keep != 0; keep01 = mask.to(keep.dtype)

    Every user of ``keep`` reads ``keep01`` (bit for bit the same values); the partition
    then saves ``mask`` and rebuilds the rest for free, and a replayed draw needs no
    activation. Edits ``joint`` in place; returns
    the number of draws rewritten."""
    graph, count = joint.graph, 0
    for node in list(graph.nodes):
        value = val(node)
        if packet(node) is not aten.bernoulli or not isinstance(value, torch.Tensor) or value.dtype is torch.bool:
            continue
        users = list(node.users)
        if node.target is aten.bernoulli.p and isinstance(node.args[0], fx.Node):
            # bernoulli(x, p) reads only x's shape: draw from a fresh tensor, so replaying
            # the draw needs no activation
            with graph.inserting_before(node):
                blank = graph.call_function(aten.empty.memory_format, (list(value.shape),),
                                            {"dtype": value.dtype, "device": value.device})
            blank.meta["val"] = value
            node.replace_input_with(node.args[0], blank)
        with graph.inserting_after(node):
            mask = graph.call_function(aten.ne.Scalar, (node, 0))
        with graph.inserting_after(mask):
            keep01 = graph.call_function(aten._to_copy.default, (mask,), {"dtype": value.dtype})
        mask.meta["val"] = value.ne(0)
        keep01.meta["val"] = value
        for user in users:
            user.replace_input_with(node, keep01)
        count += 1
    if count:
        joint.recompile()
    return count
