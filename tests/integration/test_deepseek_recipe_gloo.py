"""The DeepSeek-V3 memory chapter's recipe as one ``parallelize`` call, on 4 real gloo ranks: a
shrunk transformers ``deepseek_v3`` (4 layers of MLA attention: three with a dense MLP, the last
with routed + shared experts) with no tensor parallelism, 2 pipeline stages per rank on the DualPipeV schedule (V
placement: the embedding and the head on rank 0), ZeRO-1 over 2 data-parallel replicas, the
routed experts split over those 2 replicas (``ep=2``: each holds 2 of the 4, tokens exchanged by
all-gather and reduce-scatter), ``recompute="norm_upproj"`` and an fp32 EMA of the weights in
host memory.

It trains like the original on the global batch (float64; loss, every gradient, the parameters
and the EMA after 3 AdamW steps), and each rank's memory is measured bucket by bucket (weights,
gradients, optimizer state, EMA, activations kept for backward) and checked against the planner's
formulas for this layout (``planner.memory.model_state_bytes``), the buckets the chapter adds up.
``python -m pytest -s`` prints the table the README quotes."""

from __future__ import annotations

import copy
import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simulate import spawn_with_deadline

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sweep_transformers as sweep  # noqa: E402  (shrunk as the sweep shrinks it)

DP, EP, PP, MICROBATCHES, PER_REPLICA, SEQ, STEPS = 2, 2, 2, 4, 8, 16, 3
BUCKETS = ("weights", "gradients", "optimizer", "ema")


def _model():
    classes = {entry["model_type"]: entry["class"] for entry in sweep.families(["deepseek_v3"])}
    model, _, _ = sweep.build("deepseek_v3", classes["deepseek_v3"], sweep.Target(layers=4))  # one layer per stage
    model.set_experts_implementation("batched_mm")  # bmm has a float64 kernel, grouped_mm does not
    return model.double()


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        results[rank] = _train(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(rank: int) -> dict:
    from torch.distributed.tensor import distribute_tensor

    import sptransform
    from sptransform.runtime.ema import HostEMA

    model = _model()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    data = [torch.randint(0, 128, (PER_REPLICA * DP, SEQ)) for _ in range(STEPS)]
    replica = rank // PP
    local = [ids[replica * PER_REPLICA:(replica + 1) * PER_REPLICA] for ids in data]
    example = dict(input_ids=local[0], labels=local[0])
    recipe = dict(tp=1, dp=DP, ep=EP, pp=PP, schedule="dualpipev", n_microbatches=MICROBATCHES, zero=1)
    pm = sptransform.parallelize(model, recompute="norm_upproj", example_inputs=example, **recipe)
    plain = sptransform.parallelize(copy.deepcopy(ref), recompute="none", example_inputs=example, **recipe)
    ema, ref_ema = HostEMA(pm, decay=0.9), HostEMA(ref, decay=0.9)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    ref_params = dict(ref.named_parameters())
    held = dict(pm.named_parameters())
    for step in range(STEPS):
        loss = pm.step(input_ids=local[step], labels=local[step])
        plain.step(input_ids=local[step], labels=local[step])  # measured below; its training is not the subject
        ref_loss = ref(input_ids=data[step], labels=data[step]).loss
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank of a replica holds that replica's loss
        # HF computes the loss from float32 logits: float32's rounding, whatever the model's dtype
        torch.testing.assert_close(mean / dist.get_world_size(), ref_loss.detach(), rtol=1e-6, atol=1e-6)
        for name, p in held.items():
            torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"step {step} grad of {n}: {m}")
        grads = _local_bytes([p.grad for p in held.values()])
        ema.before_optimizer_step()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        ema.update(), ref_ema.update()
    for name, p in held.items():
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), rtol=1e-5, atol=1e-7)
    shadow, ref_shadow = ema.state_dict()["shadow"], ref_ema.state_dict()["shadow"]
    for name, p in held.items():  # each rank averages its own piece of each parameter
        piece = distribute_tensor(ref_shadow[name], p.device_mesh, p.placements).to_local()
        torch.testing.assert_close(shadow[name], piece, rtol=1e-6, atol=1e-7)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    from torch.distributed.tensor import Shard

    # on the ("edp", "ep", "tp") mesh experts are Shard(0) on ep; the rest's ZeRO pieces are alike on edp and ep
    experts = {name: p for name, p in held.items() if p.placements[1] == Shard(0) != p.placements[0]}
    return dict(
        experts=sorted(experts), expert_local=_local_bytes(experts.values()),
        expert_whole=sum(p.numel() * p.element_size() for p in experts.values()),
        params=sum(p.numel() for p in held.values()),  # whole parameters (a DTensor's global size)
        weights=_local_bytes(held.values()), gradients=grads, optimizer=_local_bytes(state),
        ema=sum(t.numel() * t.element_size() for t in shadow.values()),
        ema_on_device=sum(t.numel() * t.element_size() for t in shadow.values() if t.device.type != "cpu"),
        activations=sum(m.saved_activation_bytes for m in pm.stage_modules),
        activations_none=sum(m.saved_activation_bytes for m in plain.stage_modules),
        stages=[m.index for m in pm.stage_modules],
    )


def test_deepseek_v3_recipe_trains_like_one_device_and_its_memory_matches_the_formulas():
    from sptransform.planner.memory import model_state_bytes
    from sptransform.planner.workload import StateBytes

    results = mp.Manager().dict()
    spawn_with_deadline(_worker, DP * PP, 1200.0, results)  # a hang fails the test instead of blocking CI
    results = dict(results)
    # float64 weights and gradients, AdamW's two float64 moments (no master copy), an fp32 EMA
    state_bytes = StateBytes(weights=8, gradients=8, optimizer=16, ema=4)
    # the chapter's activation estimate, 12 hidden-wide tensors per layer and token (x 0.7 with
    # recompute), for one microbatch of this rank's 2 layers
    hidden = _model().config.hidden_size
    estimate = 12 * 2 * (PER_REPLICA // MICROBATCHES) * SEQ * hidden * 8
    print(f"\nbytes per rank (measured / formula); activations: one microbatch, chapter's estimate {estimate:,} "
          f"without recompute, {int(0.7 * estimate):,} with")
    print("| rank | stages | weights | gradients | optimizer (ZeRO-1) | EMA (host) | activations, none "
          "| activations, norm_upproj |")
    print("|---|---|---|---|---|---|---|---|")
    for rank in sorted(results):
        r = results[rank]
        # between steps sptransform's ZeRO-1 stores 1/dp of the weights, gradients and optimizer state
        # (and so of the EMA); the planner's stage 1 counts the textbook's peak, whole weights and
        # gradients, so what is held is its stage-3 figure
        planned = model_state_bytes(r["params"], zero_stage=3, dp=DP, state_bytes=state_bytes, with_ema=True)
        cells = [f"{r[b]:,} ({r[b] / getattr(planned, b):.3f})" for b in BUCKETS]
        print(f"| {rank} | {r['stages']} | " + " | ".join(cells)
              + f" | {r['activations_none']:,} | {r['activations']:,} |")
        for bucket in BUCKETS:  # within 5%: a parameter with no dim dp divides stays whole
            assert r[bucket] == pytest.approx(getattr(planned, bucket), rel=0.05), (rank, bucket, r[bucket])
        assert r["ema_on_device"] == 0
        assert r["activations"] < r["activations_none"], (rank, r["activations"], r["activations_none"])
    # the MoE layer (the last) is on pipeline rank 0, its 3 expert tensors split over the ep ranks
    counts = [len(results[rank]["experts"]) for rank in sorted(results)]
    assert counts[0] > 0 and counts == [counts[0], 0, counts[0], 0], results
    assert all(".experts." in name for name in results[0]["experts"]), results[0]["experts"]
    assert results[0]["expert_local"] * EP == results[0]["expert_whole"]
    # V placement: stages 0 and 3 (embedding and head) on pipeline rank 0, 1 and 2 on rank 1
    assert results[0]["stages"] == [0, 3] and results[1]["stages"] == [1, 2]
