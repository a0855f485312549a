"""Every recompute policy trains exactly like saving everything: same loss, same gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.nanogpt import GPT, GPTConfig
from sptransform.measure import partition_module
from sptransform.passes.remat import RematOptions

POLICIES = (
    RematOptions(policy="none"),
    RematOptions(policy="selective"),
    RematOptions(policy="full"),
    RematOptions(policy="norm_upproj"),
    RematOptions(policy="budget", budget=0.3),
    RematOptions(policy="selective", replay_rng=False),
)


def _loss_and_grads(model: GPT, options: RematOptions, idx: torch.Tensor, seed: int):
    model = copy.deepcopy(model)
    p = partition_module(model, [idx, idx], options=options, select_output=lambda out: out[1])
    torch.manual_seed(seed)  # the same dropout draws for every policy
    loss = p.compiled(idx, idx)[0]
    loss.backward()
    return loss.detach(), {name: q.grad for name, q in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.in_process  # no spawned ranks: runs beside the process tests
@settings(derandomize=True, max_examples=5, deadline=None)
@given(
    layers=st.integers(1, 2),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    seq=st.integers(3, 12),
    batch=st.integers(1, 3),
    dropout=st.sampled_from([0.0, 0.1, 0.5]),
    bias=st.booleans(),
)
def test_every_policy_gives_the_loss_and_grads_of_none(layers, heads, head_dim, seq, batch, dropout, bias):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=32, n_layer=layers, n_head=heads, n_embd=heads * head_dim,
                    dropout=dropout, bias=bias)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    reference_loss, reference_grads = _loss_and_grads(model, POLICIES[0], idx, seed=1)
    for options in POLICIES[1:]:
        loss, grads = _loss_and_grads(model, options, idx, seed=1)
        assert torch.equal(loss, reference_loss), options
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-6, atol=1e-7, msg=f"{options} {name}")
