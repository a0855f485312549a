"""A user's loss on vocabulary-split logits (issue 19 item 4), on simulated ranks; the same
check runs on real gloo ranks in tests/integration/test_gloo.py."""

from __future__ import annotations

import copy

import pytest
import torch

import sptransform
from own_loss import check_own_loss_paths
from simulate import simulated_ranks

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("sp", [True, False])
def test_own_loss_on_sharded_logits(sp):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=130, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 130, (2, 16))
    with simulated_ranks(2):
        pm = sptransform.parallelize(model, tp=2, sp=sp, example_inputs=(ids,))
        check_own_loss_paths(pm, ref, ids)


def test_hint_leaves_dtensor_losses_alone():
    """Only calls that DTensor would refuse anyway get the message: a loss on DTensors alone
    (targets made a DTensor too) runs as without sptransform."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from sptransform.runtime.loss_hint import install_loss_hint

    install_loss_hint()
    with simulated_ranks(2):
        mesh = init_device_mesh("cpu", (2,))
        logits, targets = torch.randn(6, 10), torch.randint(0, 10, (6,))
        expected = torch.nn.functional.cross_entropy(logits, targets)
        loss = torch.nn.functional.cross_entropy(distribute_tensor(logits, mesh, [Shard(1)]),
                                                 distribute_tensor(targets, mesh, [Replicate()]))
        torch.testing.assert_close(loss.full_tensor(), expected)
