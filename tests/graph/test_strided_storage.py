"""``graph.strided_storage`` on its own: refining a split's segments, and reading each run of rows
read whole through one slice of the run."""

from __future__ import annotations

import torch
import torch.fx as fx

from sptransform.graph.findings import ModelAnalysis
from sptransform.graph.placement import DimShard
from sptransform.graph.strided_storage import refine, whole_runs

aten = torch.ops.aten


def test_refine_cuts_every_segment_alike_or_says_it_cannot():
    assert refine(DimShard(0, ((0, 64),)), 4, 2) == DimShard(0, ((0, 16), (16, 16), (32, 16), (48, 16)))
    assert refine(DimShard(1, ((0, 32), (32, 16))), 2, 2) == DimShard(1, ((0, 16), (16, 16), (32, 8), (40, 8)))
    assert refine(DimShard(0, ((0, 12),)), 4, 2) is None  # 3-row pieces: tp=2 does not divide them


def test_whole_runs_reads_adjacent_whole_pieces_through_one_slice_of_their_run():
    graph = fx.Graph()
    w = graph.placeholder("w")
    w.meta["val"] = torch.empty(80, 16)
    pieces = []
    for start, end in ((0, 64), (64, 72), (72, 80)):
        piece = graph.call_function(aten.slice.Tensor, (w, 0, start, end))
        piece.meta["val"] = torch.empty(end - start, 16)
        pieces.append(piece)
    graph.output(tuple(pieces))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    analysis = ModelAnalysis(linears={}, embeddings=[], regions=[], head=None, loss=None, vocab_embeddings=[],
                             fused={"w": DimShard(0, ((0, 64),))}, read_whole_rows={"w": ((64, 16),)})
    assert whole_runs(gm, {w: "w"}, analysis) == 2
    q, k, v = pieces
    assert q.args == (w, 0, 0, 64)  # the split piece reads the parameter as before
    run = k.args[0]
    assert run is v.args[0] and run.args == (w, 0, 64, 80)
    assert k.args[1:] == (0, 0, 8) and v.args[1:] == (0, 8, 16)
    value = torch.randn(80, 16)
    out = gm(value)
    torch.testing.assert_close(out[1], value[64:72])
    torch.testing.assert_close(out[2], value[72:80])
