"""The ``sptransform`` torch.compile backend: found by name, and trains like eager."""

from __future__ import annotations

import copy
from importlib.metadata import entry_points

import pytest
import torch

from examples.nanogpt import GPT, GPTConfig
from sptransform.backend import backend_options


def test_backend_is_registered_through_the_entry_point():
    found = {e.name: e.value for e in entry_points(group="torch_dynamo_backends")}
    if "sptransform" not in found:
        pytest.skip("sptransform is not pip-installed here, so its entry point is not visible")
    assert found["sptransform"] == "sptransform.backend:sptransform_backend"
    assert "sptransform" in torch._dynamo.list_backends(exclude_tags=())


def _train_step(model, idx, seed):
    torch.manual_seed(seed)
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("options", [
    {"policy": "none"},
    {"policy": "selective"},
    {"policy": "full"},
    {"policy": "budget", "budget": 0.25},
    {"policy": "blocks", "blocks": ("attention",)},
    {"policy": "blocks", "blocks": ("attention", "mlp")},
])
def test_compiled_model_matches_eager(options):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    idx = torch.randint(0, 64, (2, 16))
    eager = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    backend = "sptransform" if "sptransform" in torch._dynamo.list_backends(exclude_tags=()) else \
        __import__("sptransform.backend", fromlist=["x"]).sptransform_backend
    compiled = torch.compile(compiled_model, backend=backend, options=options, fullgraph=True)
    torch._dynamo.reset()
    expected = _train_step(eager, idx, seed=3)
    got = _train_step(compiled, idx, seed=3)
    # ATen's CPU dropout and the graph's native_dropout draw the same masks
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_unknown_backend_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid options are .*policy"):
        backend_options({"polcy": "selective"})
    with pytest.raises(ValueError, match="use one of"):
        backend_options({"policy": "half"})
