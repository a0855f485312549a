"""The data-parallel pass on hand-built graphs: buckets by layer when the analysis found layers,
by size in first-use order when it did not (tp=1), each inserted before its first reader."""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.passes.data_parallel import DataParallelPlan, _by_size, data_parallel
from sptransform.runtime.collectives import average_grads


def _three_layers() -> tuple[fx.GraphModule, dict]:
    """x -> tanh(x @ w0) -> tanh(. @ w1) -> tanh(. @ w2), the weights as placeholders."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    weights = [graph.placeholder(f"w{i}") for i in range(3)]
    for w in weights:
        w.meta["val"] = torch.empty(4, 4)  # 64 bytes each
    h = x
    for w in weights:
        h = graph.call_function(torch.tanh, (graph.call_function(torch.matmul, (h, w)),))
    graph.output(h)
    return fx.GraphModule(torch.nn.Module(), graph), {w: f"layer{i}.weight" for i, w in enumerate(weights)}


def _buckets(gm) -> list[list[str]]:
    return [[a.name for a in n.args[2:]] for n in gm.graph.nodes if n.target is average_grads]


def test_without_layers_parameters_are_bucketed_by_size_in_first_use_order():
    gm, params = _three_layers()
    data_parallel(gm, params, DataParallelPlan(group="dp", size=2, zero=0), [], bucket_bytes=128)
    assert _buckets(gm) == [["w0", "w1"], ["w2"]]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for bucket in (n for n in gm.graph.nodes if n.target is average_grads):
        readers = [u for g in bucket.users for u in g.users]
        assert all(position[bucket] < position[r] for r in readers)
    second = next(n for n in gm.graph.nodes if n.target is average_grads and n.args[2].name == "w2")
    matmuls = [n for n in gm.graph.nodes if n.target is torch.matmul]
    assert position[matmuls[1]] < position[second] < position[matmuls[2]]  # where the third layer starts


def test_a_large_cap_makes_one_bucket_and_a_parameter_larger_than_the_cap_goes_alone():
    gm, params = _three_layers()
    data_parallel(gm, params, DataParallelPlan(group="dp", size=2, zero=0), [], bucket_bytes=1 << 20)
    assert _buckets(gm) == [["w0", "w1", "w2"]]
    nodes = [fx.Node(fx.Graph(), f"p{i}", "placeholder", f"p{i}", (), {}) for i in range(3)]
    for node, n in zip(nodes, (10, 100, 10)):
        node.meta["val"] = torch.empty(n)
    assert _by_size(nodes, 200) == [0, 1, 2]


def test_with_layers_parameters_are_bucketed_by_the_layer_that_reads_them():
    gm, params = _three_layers()
    matmuls = [n for n in gm.graph.nodes if n.target is torch.matmul]
    data_parallel(gm, params, DataParallelPlan(group="dp", size=2, zero=0), [(matmuls[1], 0), (matmuls[2], 1)],
                  bucket_bytes=1)
    # a row linear's own weight is its layer's (before, "after its first use" put it in the next
    # layer's bucket, which a pipeline stage boundary between the layers then made both stages hold)
    assert _buckets(gm) == [["w0", "w1"], ["w2"]]
