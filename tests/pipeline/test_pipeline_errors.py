"""Bad pipeline input gets a ValueError naming the value, the rule and the fix (on a fake process group)."""

from __future__ import annotations

import pytest
import torch

import sptransform
from simulate import fake_group
from tiny_models import TinyConfig, TinyLM


def _model(layers: int = 2):
    torch.manual_seed(0)
    return TinyLM(TinyConfig(layers=layers))


def _batch(batch: int = 4, seq: int = 8):
    return torch.randint(0, 61, (batch, seq)), torch.randint(0, 61, (batch, seq))


def test_fewer_layers_than_stages():
    with fake_group(2), pytest.raises(ValueError, match=r"pp=2 x stages_per_rank=2 = 4 pipeline stages need at least "
                                                        r"4 transformer layers; the model has 2: use pp x stages_per_rank <= 2"):
        sptransform.parallelize(_model(2), tp=1, pp=2, schedule="interleaved1f1b", n_microbatches=2,
                                example_inputs=_batch())


def test_batch_not_divisible_into_microbatches():
    with fake_group(2), pytest.raises(ValueError, match=r"a batch of 6 cannot be split into n_microbatches=4 equal "
                                                        r"microbatches: use n_microbatches in \{1, 2, 3, 6\}"):
        sptransform.parallelize(_model(), tp=1, pp=2, n_microbatches=4, example_inputs=_batch(6))


@pytest.mark.parametrize("schedule,stages_per_rank,message", [
    ("gpipe", 2, r"schedule='gpipe' runs 1 stage\(s\) per rank, not stages_per_rank=2: use stages_per_rank=1, "
                 r"or schedule='interleaved1f1b'"),
    ("zbv", 3, r"schedule='zbv' runs 2 stage\(s\) per rank, not stages_per_rank=3: use stages_per_rank=2"),
    ("interleaved1f1b", 1, r"runs at least 2 stage\(s\) per rank, not stages_per_rank=1"),
])
def test_schedule_that_cannot_take_the_placement(schedule, stages_per_rank, message):
    with pytest.raises(ValueError, match=message):
        sptransform.parallelize(_model(4), tp=1, pp=2, schedule=schedule, stages_per_rank=stages_per_rank,
                                example_inputs=_batch())


@pytest.mark.parametrize("stored,recompute,error,message", [
    (2, "none", ValueError, r"stored_microbatches=2 keeps every activation of that many microbatches and recomputes "
                            r"the others, but recompute='none' recomputes nothing: pass recompute='selective' or 'full'"),
    (-1, "full", ValueError, r"stored_microbatches=-1 must be at least 0"),
    (True, "full", TypeError, r"stored_microbatches must be an int, got True"),
])
def test_microbatch_level_recompute_needs_a_policy_and_a_count(stored, recompute, error, message):
    with pytest.raises(error, match=message):
        sptransform.parallelize(_model(), tp=1, pp=2, recompute=recompute, stored_microbatches=stored,
                                example_inputs=_batch())


def test_unknown_schedule_names_the_ones_that_run():
    with pytest.raises(ValueError, match=r"schedule='pipedream' is not one sptransform runs; use one of gpipe, 1f1b"):
        sptransform.parallelize(_model(), tp=1, pp=2, schedule="pipedream", example_inputs=_batch())


def test_world_size_must_be_pp_times_tp():
    with fake_group(3), pytest.raises(ValueError, match=r"pp=2 x tp=1 = 2 ranks, but the process group has 3: "
                                                        r"choose pp and tp with pp \* tp == 3"):
        sptransform.parallelize(_model(), tp=1, pp=2, example_inputs=_batch())


def test_pp_without_a_process_group():
    with pytest.raises(ValueError, match=r"pp=2 x tp=2 needs a process group of 4 ranks, and none is initialized"):
        sptransform.parallelize(_model(), tp=2, pp=2, example_inputs=_batch())


def test_forward_without_a_loss():
    class LogitsOnly(TinyLM):
        def forward(self, ids):
            return self.head(self.norm(self.blocks[0](self.tok(ids))))

    with fake_group(2), pytest.raises(ValueError, match=r"trains on a loss the model computes, and this forward "
                                                        r"returns none.*pass the labels in example_inputs"):
        sptransform.parallelize(LogitsOnly(TinyConfig(layers=2)), tp=1, pp=2, example_inputs=(_batch()[0],))


def test_step_with_other_shapes_than_the_example():
    with fake_group(2):
        pm = sptransform.parallelize(_model(), tp=1, pp=2, n_microbatches=2, example_inputs=_batch(4))
        with pytest.raises(ValueError, match=r"step\(\) got inputs of other shapes.*pass example_inputs= shaped like"):
            pm.step(*_batch(8))
        with pytest.raises(TypeError, match=r"call \.step\(\*inputs, \*\*kwargs\)"):
            pm(*_batch(4))


def test_fewer_layers_than_stages_says_what_was_found():
    with fake_group(2), pytest.raises(ValueError, match=r"the model has 1: use pp x stages_per_rank <= 1 \(found 2 "
                                                        r"residual blocks in 1 layers of 2 block\(s\); a layer starts "
                                                        r"at each block holding attention\)"):
        sptransform.parallelize(_model(1), tp=1, pp=2, schedule="1f1b", n_microbatches=2, example_inputs=_batch())
