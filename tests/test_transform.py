"""The AOTAutograd driver's compile-cache key: sptransform's inductor compiles are keyed by rank."""

from __future__ import annotations

import torch

from simulate import fake_group
from sptransform.transform import _keyed_by_rank, rank_cache_tag


def test_cache_tag_names_the_rank_only_with_several_ranks():
    assert rank_cache_tag() == torch.compiler.config.cache_key_tag  # no process group: unchanged
    with fake_group(2):
        assert rank_cache_tag() == "sptransform rank 0/2"
        with torch.compiler.config.patch(cache_key_tag="mine"):
            assert rank_cache_tag() == "mine|sptransform rank 0/2"  # the user's own tag is kept


def test_each_compile_runs_under_the_rank_tag_and_leaves_the_config_as_it_was():
    seen = []
    record = lambda gm, inputs: seen.append(torch.compiler.config.cache_key_tag)  # noqa: E731
    compiler = _keyed_by_rank(record, "sptransform rank 1/2")
    compiler(None, [])
    assert seen == ["sptransform rank 1/2"]
    assert torch.compiler.config.cache_key_tag == ""
