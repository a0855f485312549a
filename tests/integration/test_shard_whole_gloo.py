"""``shard_whole=True`` on real gloo ranks: what tensor parallelism keeps whole (HF Falcon's fused
multi-query QKV and its output projection, JetMoE's data-dependent experts, every norm) is stored in
1/tp pieces, and the models train like the originals (float64: loss, every gradient after
``clip_grad_norm_``, the parameters after 3 AdamW steps) while each rank holds half of the parameter
bytes at tp=2 (0.66 and 0.98 without). Also: ``torch.compile(pm)``, a DCP checkpoint written with
pieces and read into a module without them, ZeRO-3 over dp=2 (a ZeRO piece of a tp piece) and
pp=2 stages, on 4 ranks; the same two layouts for Nemotron-H without the option, whose Mamba-2
``in_proj`` is stored in pieces anyway (split in the graph in segments DTensor cannot hold).

Two spawns (2 and 4 ranks); each rank trains the single-device reference itself."""

from __future__ import annotations

import copy
import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist

from simulate import assert_grads_match, assert_params_match, spawn_with_deadline, train_like_reference

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sweep_transformers as sweep  # noqa: E402  (each family shrunk as the sweep shrinks it)

CLOSE = (1e-5, 1e-6)  # float64; HF's loss from float32 logits
PARAMS_CLOSE = (1e-4, 1e-5)  # after AdamW steps a near-zero gradient's rounding moves its parameter by lr


def _model(family: str, layers: int = 1):
    classes = {entry["model_type"]: entry["class"] for entry in sweep.families([family])}
    model, _, _ = sweep.build(family, classes[family], sweep.Target(layers=layers))
    return model.double()


def _nemotron_h():
    """Nemotron-H in float64, its experts as ``batched_mm`` (torch's grouped matmul has no float64 CPU kernel)."""
    model = _model("nemotron_h", layers=2)
    model.set_experts_implementation("batched_mm")
    return model


def _batches(n: int, rows: int = 2):
    torch.manual_seed(1)
    return [dict(input_ids=torch.randint(0, 128, (rows, 16)), labels=torch.randint(0, 128, (rows, 16)))
            for _ in range(n)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def _two_ranks(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    import sptransform

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        held = {}
        for family, sp in (("falcon", True), ("jetmoe", False)):
            model = _model(family)
            ref = copy.deepcopy(model)
            plain = sptransform.parallelize(copy.deepcopy(model), tp=2, sp=sp, example_inputs=_batches(1)[0])
            pm = sptransform.parallelize(model, tp=2, sp=sp, example_inputs=_batches(1)[0], shard_whole=True)
            held[family] = (plain.held_share(), pm.held_share())
            assert pm.held_share() == pytest.approx(0.5, abs=1e-9), (family, pm.held_share(), pm.explain())
            train_like_reference(pm, ref, _batches(3), optimizer=_adamw, loss_tol=CLOSE, grad_tol=CLOSE,
                                 params_tol=PARAMS_CLOSE, clip_norm=1.0, what=f"{family} shard_whole: ")
            if family == "falcon":  # pieces written, read back into a module that keeps them whole
                dcp.save({"model": pm.state_dict()}, checkpoint_id=folder)
                other = sptransform.parallelize(_model(family), tp=2, sp=sp, example_inputs=_batches(1)[0])
                state = {"model": other.state_dict()}
                dcp.load(state, checkpoint_id=folder)
                other.load_state_dict(state["model"])
                for (name, a), (_, b) in zip(pm.named_parameters(), other.named_parameters()):
                    torch.testing.assert_close(a.detach().full_tensor(), b.detach().full_tensor(), rtol=0, atol=0,
                                               msg=lambda m, name=name: f"{name} after dcp: {m}")
        # torch.compile(pm): the gathers traced into the compiled graph (nothing kept for re-gathering)
        model = _model("falcon")
        ref = copy.deepcopy(model)
        pm = sptransform.parallelize(model, tp=2, example_inputs=_batches(1)[0], shard_whole=True)
        train_like_reference(pm, ref, _batches(2), parallel=torch.compile(pm), optimizer=_adamw, loss_tol=CLOSE,
                             grad_tol=CLOSE, params_tol=PARAMS_CLOSE, what="falcon shard_whole, torch.compile: ")
        if rank == 0:  # the figures the README quotes (pytest -s shows them)
            for family, (before, after) in held.items():
                print(f"{family} tp=2: each rank holds {before:.3f} of the parameter bytes, {after:.3f} with shard_whole")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _four_ranks(rank: int, world: int, port: int) -> None:
    import sptransform

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        # tp=2 x dp=2, ZeRO-3: each rank a quarter; its data-parallel replica trains on its half of the batch
        model = _model("falcon")
        ref = copy.deepcopy(model)
        batches = _batches(3, rows=4)
        replica = rank // 2
        local = [{k: v[2 * replica: 2 * replica + 2] for k, v in b.items()} for b in batches]
        pm = sptransform.parallelize(model, tp=2, dp=2, zero=3, example_inputs=local[0], shard_whole=True)
        assert pm.held_share() == pytest.approx(0.25, abs=0.01), (pm.held_share(), pm.explain())
        opt, ref_opt = _adamw(pm.parameters()), _adamw(ref.parameters())
        for step, (whole, mine) in enumerate(zip(batches, local)):
            pm(**mine).loss.backward()
            ref(**whole).loss.backward()
            torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            assert_grads_match(pm, ref, rtol=CLOSE[0], atol=CLOSE[1], what=f"tp2 x dp2 zero=3 step {step}: ")
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        assert_params_match(pm, ref, rtol=PARAMS_CLOSE[0], atol=PARAMS_CLOSE[1], what="tp2 x dp2 zero=3: ")
        # tp=2 x pp=2: each stage's parameters in pieces over its tp pair
        model = _model("falcon", layers=2)
        ref = copy.deepcopy(model)
        batch = _batches(1, rows=4)[0]
        pm = sptransform.parallelize(model, tp=2, pp=2, n_microbatches=2, example_inputs=batch, shard_whole=True)
        loss = pm.step(**batch)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=CLOSE[0], atol=CLOSE[1])
        assert_grads_match(pm, ref, rtol=CLOSE[0], atol=CLOSE[1], what="tp2 x pp2: ")
        # without the option: Nemotron-H's Mamba-2 in_proj, split in the graph in segments no DTensor
        # placement holds, is stored in pieces anyway (gather_summed: its gradient reduce-scattered),
        # under ZeRO-3 over dp=2 (gathered again for backward) and with pp=2 stages
        model = _nemotron_h()
        ref = copy.deepcopy(model)
        pm = sptransform.parallelize(model, tp=2, dp=2, zero=3, example_inputs=local[0])
        assert pm.held_share() < 0.26, (pm.held_share(), pm.explain())
        opt, ref_opt = _adamw(pm.parameters()), _adamw(ref.parameters())
        for step, (whole, mine) in enumerate(zip(batches, local)):
            pm(**mine).loss.backward()
            ref(**whole).loss.backward()
            assert_grads_match(pm, ref, rtol=CLOSE[0], atol=CLOSE[1], what=f"nemotron_h tp2 x dp2 zero=3 step {step}: ")
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        assert_params_match(pm, ref, rtol=PARAMS_CLOSE[0], atol=PARAMS_CLOSE[1], what="nemotron_h tp2 x dp2 zero=3: ")
        model = _nemotron_h()
        ref = copy.deepcopy(model)
        pm = sptransform.parallelize(model, tp=2, pp=2, n_microbatches=2, example_inputs=batch)
        loss = pm.step(**batch)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=CLOSE[0], atol=CLOSE[1])
        assert_grads_match(pm, ref, rtol=CLOSE[0], atol=CLOSE[1], what="nemotron_h tp2 x pp2: ")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_what_tp_keeps_whole_is_stored_in_pieces_and_trains_like_one_device_on_two_ranks(tmp_path):
    spawn_with_deadline(_two_ranks, 2, 900.0, str(tmp_path / "checkpoint"))


def test_pieces_compose_with_zero3_and_pipeline_stages_on_four_ranks():
    spawn_with_deadline(_four_ranks, 4, 900.0)
