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


def test_the_message_counts_the_models_kv_heads_not_their_repeats():
    """6 heads over 2 grouped K/V heads, expanded to 6 before attention: tp=4 names 2 K/V heads."""
    config = TinyConfig(hidden=24, heads=6, kv_heads=2, ffn=48, sdpa=True)
    with simulated_ranks(4), pytest.raises(ValueError, match=r"tp=4 does not divide the 6 attention heads / 2 K/V heads"):
        _parallelize(config, 4)


def test_fewer_kv_heads_than_tp_run_replicated_and_train_like_single_device():
    """2 K/V heads at tp=4: each rank computes the K/V heads and keeps the one its query heads
    use; the K/V weights stay whole and their gradients are summed over the ranks."""
    config = TinyConfig(hidden=32, heads=8, kv_heads=2, ffn=64, sdpa=True)
    torch.manual_seed(0)
    report = sptransform.verify(TinyLM(config), tp=4, sp=True, example_inputs=_inputs(config), processes=False)
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
    report = sptransform.verify(CumsumAttention(config), tp=2, sp=False, example_inputs=_inputs(config),
                                processes=False)
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


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 61, (4, 8), generator=g)


BAD_OPTIONS = [
    # (keyword arguments of parallelize(TinyLM, tp=1, ...), error, message pattern): value, rule, fix
    (dict(seed="x"), TypeError, r"seed must be an int, got 'x' \(str\): pass an int in \[0, 2\*\*63\), or None"),
    (dict(seed=1.5), TypeError, r"seed must be an int, got 1.5 \(float\)"),
    (dict(seed=True), TypeError, r"seed must be an int, got True \(bool\)"),
    (dict(seed=2**70), ValueError, r"seed=1180591620717411303424 must be in \[0, 9223372036854775808\)"),
    (dict(seed=-1), ValueError, r"seed=-1 must be in \[0, "),
    (dict(n_microbatches=0), ValueError, r"n_microbatches=0 must be at least 1: the number of microbatches"),
    (dict(n_microbatches=2.0), TypeError, r"n_microbatches must be an int, got 2.0"),
    (dict(n_microbatches=3), ValueError, r"a batch of 4 cannot be split into n_microbatches=3 .*use n_microbatches in"),
    (dict(pp=0), ValueError, r"pp=0 must be at least 1"),
    (dict(pp=2, stages_per_rank=0), ValueError, r"stages_per_rank=0 must be at least 1"),
    (dict(pp=2, stages_per_rank=2), ValueError, r"schedule='1f1b' runs 1 stage\(s\) per rank, not stages_per_rank=2"),
    (dict(pp=2, stored_microbatches=-1, recompute="full"), ValueError, r"stored_microbatches=-1 must be at least 0"),
    (dict(pp=2, stored_microbatches=1), ValueError, r"stored_microbatches=1 .* recompute='none' recomputes nothing"),
    (dict(stages_per_rank=1), ValueError, r"stages_per_rank=1 describes a pipeline of several stages, and pp=1 has one"),
    (dict(stored_microbatches=1, recompute="full"), ValueError, r"stored_microbatches=1 describes a pipeline"),
    (dict(schedule="zbv"), ValueError, r"schedule='zbv' describes a pipeline.*'1f1b' \(default\) or 'gpipe'"),
    (dict(schedule="interleaved1f1b", n_microbatches=2), ValueError, r"schedule='interleaved1f1b' describes"),
    (dict(schedule="round_robin"), ValueError, r"schedule='round_robin' is not one sptransform runs; use one of gpipe"),
    (dict(schedule=3), TypeError, r"schedule must be a name, got 3"),
    (dict(recompute=1.5), ValueError, r"recompute=1.5: a float budget is a fraction .* must be in \(0, 1\]"),
    (dict(recompute=float("nan")), ValueError, r"recompute=nan: a float budget"),
    (dict(recompute=0.0), ValueError, r"recompute=0.0: a float budget"),
    (dict(recompute=1), ValueError, r"recompute=1: an int budget is bytes per rank and must be at least 2; pass 1.0"),
    (dict(recompute=True), TypeError, r"recompute=True \(bool\) is neither a policy nor a budget"),
    (dict(recompute=[0.5]), TypeError, r"recompute=\[0.5\] \(list\) is neither a policy nor a budget"),
    (dict(check_inputs="yes"), TypeError, r"check_inputs must be True or False, got 'yes'"),
    (dict(graph_cache_size=0), ValueError, r"graph_cache_size=0 must be at least 1: the number of input signatures"),
    (dict(graph_cache_size=None), TypeError, r"graph_cache_size must be an int, got None"),
    (dict(sp=1), TypeError, r"sp must be True or False, got 1"),
    (dict(dropout_rng=None), ValueError, r"dropout_rng=None: use 'independent' or 'reference'"),
    (dict(compile="aot_eager"), ValueError,
     r"compile='aot_eager' must be one of \['eager', 'inductor'\]: use 'inductor' \(fused kernels, the default\) or 'eager'"),
    (dict(compile=None), ValueError, r"compile=None must be one of \['eager', 'inductor'\]"),
    (dict(dp_loss="sum"), ValueError, r"dp_loss='sum': use 'tokens' \(weighted by each replica's count of non-ignored"),
    (dict(peer_timeout_s=0), ValueError, r"peer_timeout_s=0: pass a positive number of seconds, or None"),
    (dict(peer_timeout_s="5"), ValueError, r"peer_timeout_s='5': pass a positive number of seconds"),
    (dict(mesh="cpu"), TypeError, r"mesh must be a torch.distributed.device_mesh.DeviceMesh .*got str"),
    (dict(example_inputs=3), TypeError, r"example_inputs must be a tuple of positional inputs, a dict"),
    (dict(example_inputs=(_ids(), _ids(), _ids())), TypeError,
     r"example_inputs do not fit TinyLM.forward\(ids, targets\): too many positional arguments"),
    (dict(example_inputs={"ids": _ids(), "labels": _ids()}), TypeError,
     r"example_inputs do not fit TinyLM.forward.*missing a required argument: 'targets'"),
    (dict(example_inputs=(_ids(), object())), TypeError, r"example_inputs holds a object .*pass those"),
    (dict(example_inputs=(_ids(),), ), TypeError, r"do not fit TinyLM.forward.*missing a required argument"),
    (dict(example_inputs=((_ids(), _ids()), {"targets": _ids()})), TypeError, r"multiple values for argument 'targets'"),
]


@pytest.mark.parametrize("kwargs,error,pattern", BAD_OPTIONS, ids=[", ".join(f"{k}={v!r:.20}" for k, v in c[0].items())
                                                                   for c in BAD_OPTIONS])
def test_bad_options_are_refused_at_the_call(kwargs, error, pattern):
    """Every option is validated before anything is built (no process group needed even for pp=2)."""
    kwargs = {"example_inputs": (_ids(), _ids()), **kwargs}
    with pytest.raises(error, match=pattern):
        sptransform.parallelize(TinyLM(TinyConfig()), tp=1, **kwargs)


def test_use_cache_true_in_example_inputs_is_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61, n_positions=64)
    with pytest.raises(ValueError, match=r"use_cache=True: .*pass use_cache=False"):
        sptransform.parallelize(transformers.GPT2LMHeadModel(config), tp=1,
                                example_inputs=dict(input_ids=_ids(), use_cache=True))


def test_pp1_options_are_used_not_ignored():
    """pp=1 with n_microbatches and schedule: step() accumulates over the microbatches."""
    import copy

    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    ref = copy.deepcopy(model)
    ids, targets = _ids(), _ids().roll(1, 1)
    pm = sptransform.parallelize(model, tp=1, n_microbatches=2, schedule="gpipe", example_inputs=(ids, targets))
    loss = pm.step(ids, targets)
    expected = (ref(ids[:2], targets[:2]) + ref(ids[2:], targets[2:])) / 2
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(pm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("zero, error, pattern", [
    ("3", TypeError, r"zero='3' \(str\): the ZeRO stage is an int, 0 to 3"),
    (True, TypeError, r"zero=True \(bool\)"),
    (-1, ValueError, r"zero=-1: ZeRO stages are 0, 1, 2 and 3; use one of them \(0: no sharding\)"),
    (4, ValueError, r"zero=4: ZeRO stages are 0, 1, 2 and 3"),
])
def test_zero_stage_errors_fit_the_value(zero, error, pattern):
    config = TinyConfig()
    with simulated_ranks(2), pytest.raises(error, match=pattern):
        _parallelize(config, 2, zero=zero)


def test_an_already_parallel_module_is_refused_by_type():
    config = TinyConfig()
    with simulated_ranks(2):
        pm = _parallelize(config, 2)
        with pytest.raises(TypeError, match=r"parallelize got a ParallelModule, which sptransform.parallelize already "
                           r"returned: parallelize the original model once"):
            sptransform.parallelize(pm, tp=2, example_inputs=_inputs(config))
        holder = nn.Module()
        holder.w = nn.Parameter(pm.get_parameter("blocks.0.attn.q.weight").detach())  # a DTensor from elsewhere
        with pytest.raises(TypeError, match=r"1 parameter\(s\) of the model are already DTensors \(e.g. 'w'\)"):
            sptransform.parallelize(holder, tp=2)
