"""Property test of expert parallelism on real gloo ranks: MoE layers written in many ways
(``tests/models/routed.py``: the router, the experts' stored layout and how they are applied
(gathered per pair, a grouped matmul of the sorted pairs, or every expert on every token by a
matmul batched over the experts: ``bmm`` or ``einsum``), biases, gating, where the
routing weight is applied, how pairs are summed back to tokens, a shared expert), drawn by
hypothesis, trained at ``dp=2, ep=2`` (ZeRO 0 or 1; tp 1 or 2) like the original on the whole batch: the
loss, every gradient and the parameters after 2 AdamW steps, in float64. Each example spawns its
2 processes (the analysis runs on each rank's captured graph)."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from models.routed import RoutedConfig, RoutedLM
from simulate import assert_grads_match, assert_params_match, spawn_with_deadline

pytestmark = pytest.mark.slow

BATCH, SEQ, STEPS = 2, 8, 2
TP = tuple(int(t) for t in os.environ.get("EP_PROPERTY_TP", "1 2").split())
"""Tensor-parallel degrees drawn (tp=2: 4 ranks, the experts split by their hidden dims too)."""


def _worker(rank: int, world: int, port: int, config: RoutedConfig, zero: int, tp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        _train_and_compare(config, zero, tp)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_and_compare(config: RoutedConfig, zero: int, tp: int) -> None:
    import sptransform
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = RoutedLM(config).double()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    dp, replica = world // tp, rank // tp  # a replica's tp ranks share its batch
    data = [torch.randint(0, config.vocab, (BATCH * dp, SEQ)) for _ in range(STEPS)]
    local = [ids[replica * BATCH:(replica + 1) * BATCH] for ids in data]
    pm = sptransform.parallelize(model, tp=tp, sp=False, dp=dp, ep=2, zero=zero,  # (no attention: no SP)
                                 example_inputs=(local[0], local[0]))
    what = f"{config}, zero={zero}, tp={tp}: "
    params, ref_params = dict(pm.named_parameters()), dict(ref.named_parameters())
    experts = ("up", "down", "up_bias", "down_bias")  # (every expert on every token: biases added by broadcasting)
    split = {n for n, p in params.items() if isinstance(p, DTensor) and p.to_local().shape[0] * 2 == p.shape[0]
             and n.split(".")[-1] in ("up", "down", "up_bias", "down_bias")}
    assert split == {n for n in ref_params if n.split(".")[-1] in experts}, what
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    for step in range(STEPS):
        loss = pm(local[step], local[step])
        loss.backward()
        ref_loss = ref(data[step], data[step])
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-10, atol=1e-12, msg=lambda m: what + m)
        assert_grads_match(pm, ref, rtol=1e-8, atol=1e-11, what=f"{what}step {step}: ")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_match(pm, ref, rtol=1e-8, atol=1e-10, what=what)


CONFIGS = st.builds(
    RoutedConfig,
    experts=st.sampled_from([2, 4, 6]),
    top_k=st.sampled_from([1, 2]),
    router=st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid"]),
    gated=st.booleans(),
    layout=st.sampled_from(["out_in", "in_out"]),
    bias=st.booleans(),
    combine=st.sampled_from(["view_sum", "index_add", "index_add_", "einsum"]),
    weights_before=st.booleans(),
    shared=st.booleans(),
    dispatch=st.sampled_from(["gather", "grouped", "dense", "dense_einsum"]),
)


@settings(max_examples=7, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, zero=st.sampled_from([0, 1]), tp=st.sampled_from(TP))
@example(config=RoutedConfig(dispatch="grouped", layout="in_out", bias=True, combine="index_add"), zero=1, tp=1)
@example(config=RoutedConfig(dispatch="dense", layout="in_out", bias=True, combine="einsum", shared=True), zero=1, tp=1)
@example(config=RoutedConfig(dispatch="dense_einsum", weights_before=True, gated=False, experts=6, top_k=1), zero=0,
         tp=int(TP[-1]))
def test_routed_experts_written_many_ways_split_over_ep_and_train_like_the_original(config, zero, tp):
    spawn_with_deadline(_worker, 2 * tp, 300.0, config, zero, tp)
