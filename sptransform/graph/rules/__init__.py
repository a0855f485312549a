"""Sharding rules: what each ATen op does to a split, in one registry that the forward
propagation (``graph.propagate``) and the backward region walk (``graph.analysis``) both ask.

* ``registry``: ``RULES`` (op packet -> ``OpRule``), ``forward_rule``, ``input_specs_for_output``;
* ``links``: how output dims correspond to input dims, per kind of op;
* ``forward`` / ``backward``: our rules for each direction, built on the links;
* ``geometry``: how a split moves through views, splits into chunks and slices;
* ``dtensor``: the one bridge to DTensor's strategies, for ops we have no rule for;
* ``base``: the types they share (``Decision``, ``RuleContext``, ``OpRule``, ``ShardingError``).
"""

from sptransform.graph.rules.base import CUT, Decision, OpRule, RuleContext, ShardingError, tensor_inputs
from sptransform.graph.rules.geometry import (
    SPLIT_PACKETS, is_getitem, is_split, local_slice_bounds, reshape_spec, slice_bounds, slice_output_spec,
    slices_input_spec, split_chunks, split_dim, split_input_spec, split_output_specs, view_groups,
)
from sptransform.graph.rules.links import GROUPS_ARG, is_depthwise
from sptransform.graph.rules.registry import (
    RULES, forward_rule, gather_all, input_specs_for_output, reduces_into_alike_outputs, rule_for,
)

__all__ = [
    "CUT", "Decision", "GROUPS_ARG", "OpRule", "RULES", "RuleContext", "SPLIT_PACKETS", "ShardingError", "forward_rule",
    "gather_all", "input_specs_for_output", "is_depthwise", "is_getitem", "reduces_into_alike_outputs", "is_split", "local_slice_bounds", "reshape_spec",
    "rule_for", "slice_bounds", "slice_output_spec", "slices_input_spec", "split_chunks", "split_dim",
    "split_input_spec", "split_output_specs", "tensor_inputs", "view_groups",
]
