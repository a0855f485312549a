"""The pass runner (``passes.base``) on a hand-built graph: contracts checked in list order,
disabled passes skipped, each pass's op-count change logged at DEBUG."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx

from sptransform.passes.base import Pass, PassResult, declared_meta_keys, op_count_change, op_counts, run_passes

aten = torch.ops.aten


@dataclass
class Record:
    enabled: bool = True
    found: int | None = None


def _graph() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.relu.default, (x,))
    graph.output(graph.call_function(aten.relu.default, (y,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _find(gm: fx.GraphModule, record: Record) -> PassResult:
    record.found = sum(1 for n in gm.graph.nodes if n.target is aten.relu.default)
    return PassResult(gm, False)


def _mark(gm: fx.GraphModule, record: Record) -> PassResult:
    for n in gm.graph.nodes:
        n.meta["marked"] = record.found
    return PassResult(gm, False)


def _relu_to_sigmoid(gm: fx.GraphModule, record: Record) -> PassResult:
    for n in gm.graph.nodes:
        if n.target is aten.relu.default:
            n.target = aten.sigmoid.default
    gm.recompile()
    return PassResult(gm, True)


FIND = Pass("find", _find, adds=("found",))
MARK = Pass("mark", _mark, requires=("found",), adds=("marked",))
REWRITE = Pass("rewrite", _relu_to_sigmoid, requires=("marked",), enabled=lambda r: r.enabled)


def test_passes_run_in_order_and_a_later_one_reads_what_an_earlier_one_added():
    gm = run_passes([FIND, MARK, REWRITE], _graph(), record := Record())
    assert record.found == 2
    assert op_counts(gm)["aten.sigmoid.default"] == 2 and all(n.meta["marked"] == 2 for n in gm.graph.nodes)


def test_a_pass_whose_requirement_no_earlier_pass_adds_is_named_with_the_key():
    with pytest.raises(AssertionError, match=r"pass 'mark' requires \['found'\]"):
        run_passes([MARK, FIND], _graph(), Record())
    with pytest.raises(AssertionError, match=r"pass 'rewrite' requires \['marked'\]"):
        run_passes([FIND, REWRITE], _graph(), Record())


def test_a_disabled_pass_does_not_run():
    gm = run_passes([FIND, MARK, REWRITE], _graph(), Record(enabled=False))
    assert op_counts(gm)["aten.relu.default"] == 2


def test_a_pass_must_return_a_pass_result_and_set_the_fields_it_adds():
    with pytest.raises(AssertionError, match="returned GraphModule, not a PassResult"):
        run_passes([Pass("bare", lambda gm, r: gm)], _graph(), Record())
    with pytest.raises(AssertionError, match=r"declares it adds \['found'\] but left them unset"):
        run_passes([Pass("lazy", lambda gm, r: PassResult(gm, False), adds=("found",))], _graph(), Record())


def test_each_pass_logs_its_op_count_change_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="sptransform.passes"):
        run_passes([FIND, MARK, REWRITE], _graph(), Record())
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "find: 4 -> 4 nodes; no change"
    assert messages[2] == "rewrite: 4 -> 4 nodes; aten.relu.default 2->0, aten.sigmoid.default 0->2"


def test_op_count_change_lists_only_the_ops_whose_count_changed():
    before, after = op_counts(_graph()), op_counts(_relu_to_sigmoid(_graph(), Record()).gm)
    assert op_count_change(before, after) == {"aten.relu.default": (2, 0), "aten.sigmoid.default": (0, 2)}


def test_declared_meta_keys_are_the_adds_that_are_no_record_field():
    assert declared_meta_keys([FIND, MARK, REWRITE], Record) == {"marked"}
