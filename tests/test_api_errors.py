"""Bad input gets a ValueError/TypeError that names the value, the rule and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import sptransform
from simulate import fake_group, simulated_ranks
from tiny_models import TinyConfig, TinyLM


def _inputs(config: TinyConfig, batch=2, seq=8):
    return (torch.randint(0, config.vocab, (batch, seq)), torch.randint(0, config.vocab, (batch, seq)))


def _parallelize(config, tp, inputs=None, **kw):
    torch.manual_seed(0)
    return sptransform.parallelize(TinyLM(config), tp=tp, example_inputs=inputs or _inputs(config), **kw)


def test_heads_not_divisible_by_tp_names_heads_and_valid_tp():
    config = TinyConfig(hidden=24, heads=6, kv_heads=6, ffn=48, sdpa=True)
    with simulated_ranks(4), pytest.raises(ValueError, match=r"tp=4 does not divide the 6 attention heads / 6 K/V heads.*use tp in \{1, 2, 3, 6\}"):
        _parallelize(config, 4)


def test_fewer_kv_heads_than_tp_run_replicated_and_train_like_single_device():
    """2 K/V heads at tp=4: each rank computes the K/V heads and keeps the one its query heads
    use; the K/V weights stay whole and their gradients are summed over the ranks."""
    config = TinyConfig(hidden=32, heads=8, kv_heads=2, ffn=64, sdpa=True)
    torch.manual_seed(0)
    report = sptransform.verify(TinyLM(config), tp=4, sp=True, example_inputs=_inputs(config))
    assert report.ok, str(report)
    placements = {row.name: row.placement for row in report.rows if row.kind == "grad"}
    assert placements["blocks.0.attn.kv.weight"] == "Replicate()"
    assert placements["blocks.0.attn.q.weight"] == "Shard(0)"


def test_mlp_width_not_divisible_by_tp():
    config = TinyConfig(hidden=32, heads=8, kv_heads=8, ffn=36)
    with simulated_ranks(8), pytest.raises(ValueError, match=r"tp=8 does not divide the MLP width 36.*use tp in \{1, 2, 3, 4, 6, 9, 12, 18, 36\}"):
        _parallelize(config, 8)


def test_sequence_not_divisible_under_sp_says_use_a_multiple_or_sp_false():
    config = TinyConfig()
    with simulated_ranks(4), pytest.raises(ValueError, match=r"sequence length 6 is not divisible by tp=4.*multiple of 4, or sp=False"):
        _parallelize(config, 4, _inputs(config, seq=6))
    with simulated_ranks(4):
        _parallelize(config, 4, _inputs(config, seq=6), sp=False)  # fine without SP


def test_tp_different_from_group_size():
    with fake_group(4), pytest.raises(ValueError, match=r"tp=2 differs from the process group's size 4"):
        _parallelize(TinyConfig(), 2)


def test_no_process_group_for_tp_above_one():
    with pytest.raises(ValueError, match=r"tp=2 needs a process group.*torchrun"):
        _parallelize(TinyConfig(), 2)


@pytest.mark.parametrize("tp,error", [(0, ValueError), (2.0, TypeError), ("2", TypeError), (True, TypeError)])
def test_tp_must_be_a_positive_int(tp, error):
    with pytest.raises(error, match="tp"):
        _parallelize(TinyConfig(), tp)


def test_bad_option_values():
    with pytest.raises(TypeError, match="sp must be True or False"):
        _parallelize(TinyConfig(), 1, sp="yes")
    with pytest.raises(ValueError, match="dropout_rng='exact'"):
        _parallelize(TinyConfig(), 1, dropout_rng="exact")
    with pytest.raises(ValueError, match=r"recompute='some' is not a policy: use one of \['none', 'selective', 'full', 'norm_upproj'\]"):
        _parallelize(TinyConfig(), 1, recompute="some")
    with pytest.raises(ValueError, match="recompute=-1"):
        _parallelize(TinyConfig(), 1, recompute=-1)


class CumsumAttention(TinyLM):
    """An op no rule covers (cumsum over heads) inside the attention."""

    def __init__(self, config):
        super().__init__(config)
        self.blocks[0].attn.forward = self._attn

    def _attn(self, x):
        attn = self.blocks[0].attn
        b, s, _ = x.shape
        q = attn.q(x).view(b, s, 4, -1)
        mixed = torch.cumsum(q, dim=2)  # mixes heads: cannot run on a head split
        return attn.o(mixed.reshape(b, s, -1))


def test_an_op_no_rule_splits_runs_whole_and_stays_correct():
    """cumsum over the heads inside attention: no rule splits it, so the heads are gathered for it
    (the plan says so) and the model still trains like the original."""
    config = TinyConfig()
    torch.manual_seed(0)
    report = sptransform.verify(CumsumAttention(config), tp=2, sp=False, example_inputs=_inputs(config))
    assert report.ok, str(report)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        x = self.emb(ids)
        if x.sum() > 0:  # data-dependent control flow
            x = self.lin(x)
        return x


def test_data_dependent_control_flow_is_a_clear_capture_error():
    with pytest.raises(ValueError, match=r"could not capture the model as one graph.*data-dependent"):
        sptransform.parallelize(DataDependent(), tp=1, example_inputs=(torch.randint(0, 10, (2, 4)),))


def test_example_inputs_of_a_wrong_type():
    with pytest.raises(TypeError, match="example_inputs must be"):
        sptransform.parallelize(TinyLM(TinyConfig()), tp=1, example_inputs=3)
