"""Capture refuses graphs whose meaning is not in their dataflow: in-place writes read through
another alias of the same storage (the matching on its own, on exported graphs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


from models.zoo import DoubleGrad
from sptransform.capture import _refuse_hidden_writes

aten = torch.ops.aten


def _graph(fn, *args):
    class Wrap(nn.Module):
        def forward(self, *a):
            return fn(*a)

    return torch.export.export(Wrap(), args, strict=False).graph_module


def _buffer(x):
    out = x.new_empty(2, 8)
    out[:, :4].copy_(x)  # written through a view...
    out[:, 4:].copy_(x * 2)
    return out.sum(-1)  # ...read through the buffer


def _through_result(x):
    y = (x + 1).mul_(2)  # the in-place op's own result is read: dataflow
    z = y.clone()
    return z.masked_fill_(z > 3, 0.0).sum()


def _earlier_view(x):
    base = x + 0
    view = base[:, :2]
    base.add_(1)
    return view * 3  # a view taken before the write, read after it


def test_a_write_read_through_the_buffer_is_refused_naming_the_write_and_the_read():
    with pytest.raises(ValueError) as info:
        _refuse_hidden_writes(_graph(_buffer, torch.randn(2, 4)))
    message = str(info.value)
    assert "writes in place into a tensor that it then reads under another name" in message
    assert message.count("aten.copy_.default") == 2 and "aten.sum.dim_IntList" in message  # both writes, one read
    assert "write it out of place" in message


def test_reads_through_the_in_place_result_are_dataflow_and_pass():
    _refuse_hidden_writes(_graph(_through_result, torch.randn(2, 4)))


def test_a_view_taken_before_the_write_and_read_after_it_is_refused():
    with pytest.raises(ValueError, match=r"aten\.add_\.Tensor.*\n.*read afterwards.*aten\.mul\.Tensor"):
        _refuse_hidden_writes(_graph(_earlier_view, torch.randn(2, 4)))


def test_capture_functionalizes_a_graph_with_hidden_writes_and_keeps_the_model_s_ops():
    """``capture`` turns ``copy_`` into slices of a buffer into ``slice_scatter`` (every read of the
    written value an edge of the graph), keeps linear / SDPA whole, and views become reshapes."""
    import sys

    from sptransform.capture import FakeTemplate, capture

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "models"))
    import zoo

    model, inputs = zoo.build("buffer_key")
    graph = capture(FakeTemplate(model, torch.device("cpu")), inputs, {}).gm
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert aten.slice_scatter.default in targets and aten.copy_.default not in targets
    assert {aten.linear.default, aten.scaled_dot_product_attention.default} <= targets
    assert aten.view.default not in targets
    _refuse_hidden_writes(graph)  # the safety net finds nothing left


def test_functional_copies_become_casts_or_broadcast_copies():
    from sptransform.passes.canonicalize import functional_copies

    class Copy(nn.Module):
        def forward(self, dst, src, wide):
            return torch.ops.aten.copy.default(dst, src), torch.ops.aten.copy.default(wide, src[:1].double())

    dst, src, wide = torch.zeros(2, 3), torch.randn(2, 3), torch.zeros(4, 3)
    gm = _graph(lambda *a: Copy()(*a), dst, src, wide)
    assert functional_copies(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.copy.default not in targets and aten.expand.default in targets
    first, second = gm(dst, src, wide)
    torch.testing.assert_close(first, src)
    torch.testing.assert_close(second, src[:1].expand(4, 3))
    src.requires_grad_()
    gm(dst, src, wide)[0].sum().backward()  # functional copy has no autograd formula; these do
    torch.testing.assert_close(src.grad, torch.ones(2, 3))


def test_functional_copies_drop_the_slice_written_into_when_nothing_else_reads_it():
    """MLA's key: ``k = x.new_empty(...); k[..., :8].copy_(a); k[..., 8:].copy_(b)``. Once the copies
    are ``a`` and ``b``, the slices of ``k`` they wrote into are read by nobody; left in, they would
    read ``k`` whole, outside the attention's tensor-parallel region."""
    from sptransform.passes.canonicalize import functional_copies

    def write_halves(a, b):
        k = a.new_empty(2, 16)
        first = torch.ops.aten.copy.default(k[:, :8], a)
        k = torch.ops.aten.slice_scatter.default(k, first, 1, 0, 8)
        second = torch.ops.aten.copy.default(k[:, 8:], b)
        return torch.ops.aten.slice_scatter.default(k, second, 1, 8, 16)

    a, b = torch.randn(2, 8), torch.randn(2, 8)
    gm = _graph(write_halves, a, b)
    slices = sum(n.target is aten.slice.Tensor for n in gm.graph.nodes)
    assert functional_copies(gm) == 2
    assert sum(n.target is aten.slice.Tensor for n in gm.graph.nodes) == slices - 2
    torch.testing.assert_close(gm(a, b)[0], torch.cat([a, b], 1))


# -- custom autograd.Functions in a forward whose plain run cannot be traced --------------------

_E, _H, _I, _V = 4, 16, 32, 64  # experts, hidden, expert width, vocabulary


def _grouped_mm(x, w, offs):
    # As transformers' MoE experts on CPU: torch's kernel eagerly, transformers' custom op while
    # traced; a fake run of torch's kernel fails (its meta kernel takes bfloat16 only).
    if torch.compiler.is_compiling():
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    return torch._grouped_mm(x, w, offs=offs)


class _EagerGroupedMoE(nn.Module):
    """Top-1 routed experts, one grouped matmul each way, with or without a custom Function
    (identity forward, doubled gradient) on the routed tokens."""

    def __init__(self, custom: bool):
        super().__init__()
        self.custom = custom
        self.emb = nn.Embedding(_V, _H)
        self.router = nn.Linear(_H, _E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(_E, 2 * _I, _H) / _H ** 0.5)  # read transposed, as transformers stores it
        self.down = nn.Parameter(torch.randn(_E, _I, _H) / _I ** 0.5)
        self.norm = nn.RMSNorm(_H)
        self.head = nn.Linear(_H, _V, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids).flatten(0, 1)  # [S, H]
        weight, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        offs = torch.histc(expert.float(), bins=_E, min=0, max=_E - 1).cumsum(0).to(torch.int32)
        xs = DoubleGrad.apply(x[order]) if self.custom else x[order]  # export drops its backward
        gate, up = _grouped_mm(xs, self.gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
        ys = _grouped_mm(nn.functional.silu(gate) * up, self.down, offs)  # [S, H]
        y = torch.empty_like(ys).index_copy(0, order, ys) * weight[:, None]
        return nn.functional.cross_entropy(self.head(self.norm(x + y)), labels.flatten())


def test_a_custom_autograd_function_is_refused_also_where_a_plain_fake_run_of_the_forward_fails():
    pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
    import sptransform
    from simulate import simulated_ranks

    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, _V, (2, 8), generator=g), torch.randint(0, _V, (2, 8), generator=g)
    torch.manual_seed(0)
    _EagerGroupedMoE(custom=True)(*inputs).backward()  # the model runs eagerly (torch's kernel)
    with simulated_ranks(2):
        with pytest.raises(ValueError, match=r"custom torch.autograd.Function.*zoo.DoubleGrad \(backward at "):
            sptransform.parallelize(_EagerGroupedMoE(custom=True), tp=2, sp=False, example_inputs=inputs)
        with torch.no_grad(), pytest.raises(ValueError, match="zoo.DoubleGrad"):  # traced with autograd on anyway
            sptransform.parallelize(_EagerGroupedMoE(custom=True), tp=2, sp=False, example_inputs=inputs)
        pm = sptransform.parallelize(_EagerGroupedMoE(custom=False), tp=2, sp=False, example_inputs=inputs)
        assert pm.held_share() < 0.75


class _LayerDrop(nn.Module):
    """Layers skipped at random in training, drawn in Python (``how``): the module's ``random.uniform``,
    a name imported from ``random`` (a method of its global generator), or numpy's module function."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        import random
        from random import uniform

        import numpy as np

        draw = {"random.uniform": lambda: random.uniform(0, 1), "imported uniform": lambda: uniform(0, 1),
                "numpy": lambda: float(np.random.rand())}[self.how]
        for layer in self.layers:
            if self.training and draw() < 0.5:
                continue
            x = torch.relu(layer(x))
        return x.square().mean()


@pytest.mark.parametrize("how", ["random.uniform", "imported uniform", "numpy"])
def test_a_python_random_draw_in_the_forward_is_refused_naming_the_line_and_the_draws_are_restored(how):
    import random

    import numpy as np
    import sptransform
    from simulate import simulated_ranks

    functions = (random.uniform, random.random, vars(random.Random).get("random"), np.random.rand)
    x = torch.randn(2, 4, 8)
    with simulated_ranks(2):
        with pytest.raises(ValueError, match=r"draws Python random numbers \((random|numpy\.random)\.\w+ at "
                                             r".*test_capture\.py, line \d+ \(.*(uniform|rand)\("):
            sptransform.parallelize(_LayerDrop(how), tp=2, sp=False, example_inputs=(x,))
        # in eval() nothing is drawn: the model is captured as it runs
        pm = sptransform.parallelize(_LayerDrop(how).eval(), tp=2, sp=False, example_inputs=(x,))
        assert pm.training is False
    # the patched draws are the originals again, and the global generator draws as before
    assert (random.uniform, random.random, vars(random.Random).get("random"), np.random.rand) == functions
    random.seed(3)
    first = random.random()
    random.seed(3)
    assert random.random() == first


class _Stateful(nn.Module):
    """A forward that writes its own Python state: a step counter read by a warm-up branch, an
    auxiliary loss stored for the training loop, or a table built once for the input's length."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.up = how, nn.Linear(8, 8)
        self.calls, self.table, self.built_for = 0, None, 0

    def forward(self, x):
        y = self.up(x)
        if self.how == "counter":
            self.calls += 1
            if self.calls > 2:  # a warm-up: the graph traced on call 1 would never get here
                y = y * 2
        elif self.how == "aux loss":
            self.aux_loss = y.square().mean()
        elif self.built_for != x.shape[0]:  # "cache": built on the first call, then read as it is
            self.table, self.built_for = torch.arange(x.shape[0]), x.shape[0]
        return y.sum()


@pytest.mark.parametrize("how, attribute", [("counter", r"calls: 0 -> 1|calls: 1 -> 2"),
                                            ("aux loss", r"aux_loss: a tensor of shape \[\] -> a tensor")])
def test_a_forward_that_changes_its_python_state_at_every_call_is_refused_naming_it(how, attribute):
    import sptransform

    model = _Stateful(how)
    with pytest.raises(ValueError, match=r"changes its own Python state at every call \((" + attribute + ")"):
        sptransform.parallelize(model, tp=1, example_inputs=(torch.randn(2, 8),))
    assert model.calls == 0 and "aux_loss" not in vars(model)  # the user's model is never run


def test_a_write_the_forward_repeats_alike_is_captured_and_the_template_left_as_export_leaves_it():
    import sptransform
    from sptransform.capture import FakeTemplate, capture
    from sptransform.capture_watches import module_state

    template = FakeTemplate(_Stateful("cache"), torch.device("cpu"))
    before = module_state(template.module)
    capture(template, (torch.randn(2, 8),), {})  # the first call builds the table, a second one reads it
    assert all(before[k] is v for k, v in module_state(template.module).items())
    model = _Stateful("cache")
    x = torch.randn(2, 8)
    torch.testing.assert_close(sptransform.parallelize(model, tp=1, example_inputs=(x,))(x), model(x))
