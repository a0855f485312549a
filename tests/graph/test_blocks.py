"""Repeated residual blocks and their grouping into layers, on models whose attention the
tensor-parallel analysis does not recognise (the layers a pipeline cuts between)."""

from __future__ import annotations

import pytest
import torch

from sptransform.capture import FakeTemplate, capture
from sptransform.graph.blocks import ResidualBlock, find_residual_blocks, group_layers
from models.pipeline_blocks import BLOCK_MODELS, BlocksConfig


def _blocks(name: str, layers: int):
    torch.manual_seed(0)
    model = BLOCK_MODELS[name](BlocksConfig(layers=layers))
    ids = torch.randint(0, 96, (2, 8))
    captured = capture(FakeTemplate(model, torch.device("cpu")), (ids, ids), {})
    nodes = [n for n in captured.gm.graph.nodes if n.op != "output"]
    return find_residual_blocks(nodes, captured.state_placeholders)


@pytest.mark.parametrize("name,blocks_per_layer,attention", [
    ("alternating", 2, False),   # attention written with einsum: no attention core, found by repetition
    ("qk_norm", 2, True),
    ("multi_query", 1, True),    # x + attn(ln(x)) + mlp(ln(x)): one residual block per layer
])
@pytest.mark.parametrize("layers", [2, 3])
def test_residual_blocks_group_into_as_many_layers_as_the_model_has(name, blocks_per_layer, attention, layers):
    blocks = _blocks(name, layers)
    assert len(blocks) == layers * blocks_per_layer
    assert blocks[0].attention is attention
    grouped = group_layers(blocks)
    assert [len(layer) for layer in grouped] == [blocks_per_layer] * layers
    if name != "multi_query":  # there the block's add is x + attn; its mlp is added after it
        for previous, block in zip(blocks, blocks[1:]):
            assert block.skip is previous.residual  # one residual stream, block after block


def _block(signature: str, attention: bool = False) -> ResidualBlock:
    return ResidualBlock(skip=None, residual=None, body=frozenset(), attention=attention,
                         signature=((signature, 1),))


@pytest.mark.parametrize("signatures,attention,expected", [
    ("AFAFAF", "", [2, 2, 2]),        # repeating unit of two
    ("AAFAAF", "", [3, 3]),
    ("BBBB", "", [1, 1, 1, 1]),
    ("ABC", "", [1, 1, 1]),           # no repetition: a layer per block
    ("AFAFF", "", [1, 1, 1, 1, 1]),
    ("FAFAF", "01010", [1, 2, 2]),    # with attention: a new layer at each attention block
])
def test_layers_start_at_attention_else_repeat_the_shortest_unit(signatures, attention, expected):
    flags = [i < len(attention) and attention[i] == "1" for i in range(len(signatures))]
    blocks = [_block(s, a) for s, a in zip(signatures, flags)]
    assert [len(layer) for layer in group_layers(blocks)] == expected
