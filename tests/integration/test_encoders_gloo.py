"""Beyond causal LMs, on real gloo ranks in float64: torch's encoder, decoder and Transformer,
``nn.MultiheadAttention`` cross-attending to a memory longer than the query (its query rows of
``in_proj_weight`` got half their gradient under SP; batch- and sequence-first, ``kdim``/``vdim``,
no bias, ``need_weights``), and timm's unbind attention (refused under SP) train like one device,
with and without sequence parallelism; every attention, self- and cross-, is split per head (each
rank holds ~1/tp of the parameter bytes: cross-attention's ``in_proj_weight.split([E, 2E])`` pieces
are column-parallel)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from models.encoders import MODELS, inputs
from simulate import spawn_with_deadline

pytestmark = pytest.mark.slow

SLACK = 0.02  # the layer norms and the biases added after row-parallel linears stay whole


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _worker(rank: int, world: int, port: int) -> None:
    import sptransform

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        failures = []
        for name, make in MODELS.items():
            for sp in (True, False):
                torch.manual_seed(0)
                model, ref = make().double(), None
                torch.manual_seed(0)
                ref = make().double()
                ids, memory, labels = inputs()
                pm = sptransform.parallelize(model, tp=world, sp=sp, example_inputs=(ids, memory, labels))
                loss = pm(ids, memory, labels)
                loss.backward()
                ref_loss = ref(ids, memory, labels)
                ref_loss.backward()
                worst = _rel(loss.detach(), ref_loss.detach())
                grads = dict(ref.named_parameters())
                for n, p in pm.named_parameters():
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    worst = max(worst, _rel(g, grads[n].grad))
                if worst > 1e-9:
                    failures.append(f"{name} sp={sp}: rel error {worst:.1e}")
                if pm.held_share() > 1 / world + SLACK:
                    failures.append(f"{name} sp={sp}: each rank holds {pm.held_share():.3f} of the parameter bytes")
        assert not failures, failures
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_encoders_decoders_and_cross_attention_match_one_device_on_real_ranks():
    spawn_with_deadline(_worker, 2, 600)
