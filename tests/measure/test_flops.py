"""FLOPs counted on the graphs: model (joint graph) vs hardware (forward + backward graphs), per policy,
for one GPT-3 175B layer traced under fake tensors."""

from __future__ import annotations

import pytest
import torch

from examples.nanogpt import Block, GPTConfig
from sptransform.measure import measure_shape, partition_module
from sptransform.measure.flops import graph_cost, node_cost, recomputed_nodes
from sptransform.measure.layer import layer_flops
from sptransform.measure.models import fake_copy
from sptransform.passes.remat import RematOptions
from sptransform.planner.presets import PRESETS

S, B = 2048, 1
H, A = PRESETS["gpt-175b"].hidden, PRESETS["gpt-175b"].num_heads


@pytest.fixture(scope="module")
def layer_flops_by_policy():
    """One 175B layer (examples/nanogpt.py's Block), partitioned with each policy."""
    cfg = GPTConfig(block_size=S, vocab_size=51200, n_layer=1, n_head=A, n_embd=H, dropout=0.1)
    with torch.device("meta"):
        block = Block(cfg)
    block, fake_mode = fake_copy(block, dtype=torch.bfloat16)
    with fake_mode:
        x = torch.empty(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    for policy in ("none", "selective", "full", "norm_upproj"):
        p = partition_module(block, [x], options=RematOptions(policy=policy, recompute_fusible=False))
        out[policy] = (p.flops(), p)
    return out


def test_model_flops_are_three_forwards_of_the_papers_gemms(layer_flops_by_policy):
    flops, _ = layer_flops_by_policy["none"]
    assert flops.model_flops == 72 * B * S * H * H + 12 * B * S * S * H  # Appendix A, per layer
    assert flops.hardware_flops == flops.model_flops


@pytest.mark.parametrize("policy", ["selective", "full", "norm_upproj"])
def test_hardware_minus_model_is_what_the_backward_graph_recomputes(layer_flops_by_policy, policy):
    flops, p = layer_flops_by_policy[policy]
    counted = graph_cost(recomputed_nodes(p.backward)).matmul_flops
    assert flops.hardware_flops - flops.model_flops == counted == flops.recompute_flops > 0


def test_selective_recomputes_one_qk_product_per_layer(layer_flops_by_policy):
    """The backward of attention-over-V needs its inputs (the dropped-out probabilities and V),
    never its output, so the graph runs QK^T again but not A V: 2bs^2h, not the paper's 4bs^2h."""
    flops, p = layer_flops_by_policy["selective"]
    assert flops.recompute_flops == 2 * B * S * S * H
    matmuls = [n for n in recomputed_nodes(p.backward) if node_cost(n).matmul_flops]
    assert len(matmuls) == 1
    overhead = flops.recompute_flops / flops.model_flops
    assert overhead == pytest.approx(S / (36 * H) / (1 + S / (6 * H)))
    assert overhead == pytest.approx(0.0045, abs=1e-4)  # paper: s/6h = 2.8% (eq. 9), 0.90% (Appendix A text)


def test_full_recomputes_one_forward_except_the_mlp_down_projection(layer_flops_by_policy):
    """Full recompute keeps each layer's input; the MLP down-projection's output only feeds the
    next layer's (saved) input, so the backward never needs it again."""
    flops, _ = layer_flops_by_policy["full"]
    one_forward = 24 * B * S * H * H + 4 * B * S * S * H
    assert flops.recompute_flops == one_forward - 8 * B * S * H * H


def test_norm_upproj_recomputes_the_mlp_up_projection(layer_flops_by_policy):
    flops, _ = layer_flops_by_policy["norm_upproj"]
    assert flops.recompute_flops == 8 * B * S * H * H


def test_layer_flops_of_a_preset_are_the_difference_of_two_graphs():
    m = measure_shape(PRESETS["gpt-175b"], options=RematOptions(policy="selective", recompute_fusible=False), num_layers=2)
    per_layer = layer_flops(m)
    assert per_layer.model_flops == 72 * B * S * H * H + 12 * B * S * S * H
    assert per_layer.recompute_flops == 2 * B * S * S * H
