"""Real 2-process pipeline runs (gloo, tp=1, pp=2, 1F1B, 2 microbatches) of models whose layers
the tensor-parallel analysis does not recognise (their attention is left whole), cut between
repeated residual blocks: x-transformers-like, OLMo-2-like and Falcon-like hand-built models, and
x-transformers itself when it is installed. They were refused before ("the model has 1" layer).

Each rank builds the same model from the same seed and trains the unmodified model itself on the
whole batch. Over 2 SGD steps the loss on every rank and every gradient this rank holds equal the
reference's: rel 1e-9 in float64, 1e-5 in float32. One spawn runs every case, under a deadline."""

from __future__ import annotations

import datetime
import importlib.util
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from simulate import spawn_with_deadline

pytestmark = pytest.mark.slow

DEADLINE_S = 170
TOLERANCES = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-6)}


class XTransformersLM(nn.Module):
    """x-transformers' decoder LM, returning the cross-entropy loss."""

    def __init__(self):
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        self.net = TransformerWrapper(num_tokens=96, max_seq_len=64, attn_layers=Decoder(dim=64, depth=2, heads=4))

    def forward(self, idx, targets):
        logits = self.net(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _model(name: str) -> nn.Module:
    from models.pipeline_blocks import BLOCK_MODELS, BlocksConfig

    torch.manual_seed(0)
    return XTransformersLM() if name == "x_transformers" else BLOCK_MODELS[name](BlocksConfig())


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, str]]) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        for name, dtype in cases:  # one process group for all cases: spawning is the slow part
            _train_and_compare(name, dtype)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_and_compare(name: str, dtype: str) -> None:
    import sptransform

    model = _model(name).to(getattr(torch, dtype)).train()
    ref = sptransform.faithful_deepcopy(model)
    torch.manual_seed(1)
    batches = [(ids, ids.roll(-1, 1)) for ids in (torch.randint(0, 96, (4, 16)) for _ in range(2))]
    pm = sptransform.parallelize(model, tp=1, pp=2, schedule="1f1b", n_microbatches=2,
                                 example_inputs=batches[0], compile="eager")
    assert "2 layers (" in pm.explain(), pm.explain()
    held = dict(pm.named_parameters())
    ref_params = dict(ref.named_parameters())
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(held))
    assert set().union(*names) == set(ref_params), "every parameter is held by some rank"
    assert all(len(n) < len(ref_params) for n in names), "each rank holds only its stage's parameters"
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = TOLERANCES[dtype]
    for step, (ids, targets) in enumerate(batches):
        ref_loss = ref(ids, targets)
        ref_loss.backward()
        loss = pm.step(ids, targets)
        torch.testing.assert_close(loss, ref_loss.detach(), **tol, msg=lambda m: f"{name} {dtype} step {step} loss: {m}")
        for param_name, p in held.items():
            torch.testing.assert_close(p.grad.full_tensor(), ref_params[param_name].grad, **tol,
                                       msg=lambda m, n=param_name: f"{name} {dtype} step {step} grad of {n}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def test_models_with_layers_the_analysis_misses_train_like_the_original_on_two_stages():
    names = ["alternating", "qk_norm", "multi_query"]
    if importlib.util.find_spec("x_transformers") is not None:
        names.append("x_transformers")
    else:
        warnings.warn("x-transformers is not installed: its case did not run", stacklevel=1)
    cases = [(name, dtype) for name in names for dtype in ("float64", "float32")]
    spawn_with_deadline(_worker, 2, DEADLINE_S, cases)
