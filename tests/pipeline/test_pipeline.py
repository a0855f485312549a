"""``parallelize(..., pp=1, n_microbatches=...)``: a ParallelModule with ``step()``, one plain
forward and backward of the whole batch; and the pipeline's ``explain()`` on a fake group."""

from __future__ import annotations

import copy

import pytest
import torch

import sptransform
from simulate import assert_all_ranks_close, fake_group, simulated_ranks
from tiny_models import TinyConfig, TinyLM


def _batch(batch: int = 4, seq: int = 8):
    return torch.randint(0, 61, (batch, seq)), torch.randint(0, 61, (batch, seq))


def test_pp1_step_is_one_forward_and_backward_of_the_batch():
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(layers=2))
    ref = copy.deepcopy(model)
    ids, targets = _batch()
    pm = sptransform.parallelize(model, tp=1, n_microbatches=1, example_inputs=(ids, targets))
    loss = pm.step(ids, targets)
    ref_loss = ref(ids, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert not loss.requires_grad
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad)


def test_pp1_step_on_simulated_tensor_parallel_ranks():
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(layers=1))
    ref = copy.deepcopy(model)
    ids, targets = _batch()
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, pp=1, schedule="1f1b", example_inputs=(ids, targets))
        loss = pm.step(ids, targets)
        with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
            ref_loss = ref(ids, targets)
        assert_all_ranks_close(loss, ref_loss.detach(), what="loss")


def test_explain_names_stages_cuts_and_how_tied_weights_are_kept():
    torch.manual_seed(0)
    with fake_group(2):
        pm = sptransform.parallelize(TinyLM(TinyConfig(layers=4)), tp=1, pp=2, schedule="1f1b", n_microbatches=2,
                                     example_inputs=_batch())
        text = pm.explain()
    assert "pp=2 x tp=1" in text and "schedule=1f1b (Schedule1F1B)" in text
    assert "cuts (tensors crossing, per microbatch):" in text and "(2,048 B)" in text  # [2, 8, 32] fp32 residual
    assert "tied parameter head.weight: stages [0, 1] on pipeline ranks [0, 1]" in text
    assert "gradients summed over those ranks every step" in text
    assert "forward outputs are freed once sent" in text
    held = {name for name, _ in pm.named_parameters()}
    assert "blocks.0.attn.q.weight" in held and "norm.weight" not in held  # rank 0 holds only its stage


@pytest.mark.parametrize("name,found", [
    ("alternating", "4 residual blocks in 2 layers of 2 block(s); their ops repeat every 2 block(s)"),
    ("qk_norm", "4 residual blocks in 2 layers of 2 block(s); a layer starts at each block holding attention"),
    ("multi_query", "2 residual blocks in 2 layers of 1 block(s); a layer starts at each block holding attention"),
])
def test_models_whose_attention_the_analysis_leaves_whole_get_a_stage_per_layer(name, found):
    """x-transformers-like, OLMo-2-like and Falcon-like layers: the analysis finds 1 layer (pp=2 was refused)."""
    from models.pipeline_blocks import BLOCK_MODELS, BlocksConfig

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (4, 8))
    with fake_group(2):
        pm = sptransform.parallelize(BLOCK_MODELS[name](BlocksConfig()), tp=1, pp=2, schedule="1f1b",
                                     n_microbatches=2, example_inputs=(ids, ids.roll(-1, 1)))
        text = pm.explain()
    assert f"2 layers ({found})" in text, text
    assert "(2,048 B)" in text  # one [2, 8, 32] fp32 residual stream crosses the cut


def test_a_freeing_stage_copies_every_sent_output_before_freeing_any(monkeypatch):
    """1F1B stages send copies of their outputs and free the outputs' storage. Two outputs that
    are views of one storage (an activation and its reshape, both crossing the cut) are both
    copied before it is freed: freeing after the first copy left the second send reading a
    freed storage. A view of what the stage's autograd saved is neither copied nor freed."""
    import types

    from torch.distributed.pipelining import PipelineStage

    import sptransform.pipeline.stage as stage_module

    base, saved = torch.arange(8.0), torch.arange(4.0) + 100
    outputs = (base.view(2, 4), base.view(4, 2), saved, saved.view(2, 2))
    monkeypatch.setattr(PipelineStage, "get_fwd_send_ops",
                        lambda self, chunk: [types.SimpleNamespace(tensor=out) for out in outputs])  # P2POps' one field read
    monkeypatch.setattr(stage_module, "stage_forward_cache", lambda stage: {0: (outputs, None)})
    stage = object.__new__(stage_module._FreeingStage)
    stage.stage_index, stage.num_stages = 0, 2
    stage.submod = type("Submod", (), {"saved_outputs": {2, 3}})()
    ops = stage.get_fwd_send_ops(0)
    assert [op.tensor.tolist() for op in ops[:2]] == [[[0.0, 1, 2, 3], [4, 5, 6, 7]], [[0.0, 1], [2, 3], [4, 5], [6, 7]]]
    assert base.untyped_storage().nbytes() == 0  # the stage's own outputs freed
    assert ops[2].tensor is saved and saved.untyped_storage().nbytes() == 16  # kept for backward
