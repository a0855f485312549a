"""How a split dim moves through views and splits (pure shape logic, no graphs run)."""

from __future__ import annotations

from sptransform.graph.placement import DimShard, whole
from sptransform.graph.rules import reshape_spec, view_groups


def test_view_groups_pair_merged_and_split_dims():
    assert view_groups((2, 8, 64), (16, 64)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((2, 8, 64), (2, 8, 4, 16)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((1, 8, 64), (8, 64)) == [([0], []), ([1], [0]), ([2], [1])]


def test_indices_of_a_strided_split_take_each_segment_s_part():
    spec = DimShard(0, ((0, 4), (4, 4), (8, 4)))  # [q|k|v], 4 features each
    assert spec.indices(0, 2) == [0, 1, 4, 5, 8, 9]
    assert spec.indices(1, 2) == [2, 3, 6, 7, 10, 11]
    assert spec.local_size(2) == 6


def test_heads_split_maps_to_contiguous_features_and_back():
    heads = DimShard(2, ((0, 4),))  # [b, s, 4 heads, 16]
    features = reshape_spec(heads, (2, 8, 4, 16), (2, 8, 64), tp=2)
    assert features == whole(2, 64)
    assert reshape_spec(features, (2, 8, 64), (2, 8, 4, 16), tp=2) == heads


def test_per_head_interleaved_qkv_is_one_segment():
    # [b, s, nh, 3*hd] viewed from [b, s, 3h]: heads outermost, so a contiguous split
    heads = DimShard(2, ((0, 4),))
    assert reshape_spec(heads, (2, 8, 4, 48), (2, 8, 192), tp=2) == whole(2, 192)


def test_split_of_tokens_merged_with_batch_is_one_segment_per_batch_row():
    seq = whole(1, 8)  # [b=2, s=8, h] split along s
    merged = reshape_spec(seq, (2, 8, 64), (16, 64), tp=2)
    assert merged == DimShard(0, ((0, 8), (8, 8)))
    assert merged.indices(1, 2) == [4, 5, 6, 7, 12, 13, 14, 15]


def test_a_split_that_does_not_divide_evenly_is_refused():
    assert reshape_spec(DimShard(2, ((0, 6),)), (2, 8, 6, 4), (2, 8, 24), tp=4) is None
