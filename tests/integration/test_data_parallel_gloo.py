"""Data parallelism on real gloo processes: dp x tp (4 ranks) and dp x pp x tp (8 ranks), ZeRO 0
to 3, with and without overlap, train like one device on the global batch (dp-averaged loss,
``clip_grad_norm_``, every gradient, parameters after AdamW steps); ZeRO 1 to 3 hold 1/dp of the
parameters, gradients and optimizer state between steps; ZeRO-3 keeps no gathered parameter for
backward, ZeRO 1 and 2 keep exactly those it gathers again. Replicas with different token counts
and local batch sizes get the concatenated batch's gradients (``dp_loss="tokens"``) or the mean
of their own (``"replicas"``)."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from simulate import spawn_with_deadline

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, PER_RANK_BATCH = 128, 16, 2


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _train(kind: str, *, dp: int, tp: int, pp: int, zero: int, recompute: str = "none", steps: int = 2,
           checkpoint: str | None = None, overlap: bool = True, compile: str = "eager") -> dict:
    """Train the parallel model on this rank's slice of a global batch and the original on all of
    it; assert they agree (also ``clip_grad_norm_``'s norm and the clipped gradients: torch's with
    ``pp=1``, ``PipelinedModule.clip_grad_norm_`` across the stages).
    Returns per-rank state bytes, what ZeRO-3 did not keep and the gathered parameters autograd
    kept for backward (``kept``, measured with ``pp=1``)."""
    import sptransform
    import sptransform.runtime.module as module_
    import sptransform.runtime.zero as zero_
    from sptransform.torch_internals import StorageWeakRef

    model = _model(kind)
    ref = copy.deepcopy(model)
    dp_rank = dist.get_rank() // (pp * tp)
    microbatches = 2 if pp > 1 else 1
    batch = PER_RANK_BATCH * microbatches
    torch.manual_seed(1)
    data = [torch.randint(0, VOCAB, (batch * dp, SEQ)) for _ in range(steps)]
    local = [ids[dp_rank * batch:(dp_rank + 1) * batch] for ids in data]
    extra = dict(pp=pp, n_microbatches=microbatches) if pp > 1 else {}
    pm = sptransform.parallelize(model, tp=tp, dp=dp, zero=zero, recompute=recompute, compile=compile,
                                 overlap=overlap, example_inputs=dict(input_ids=local[0], labels=local[0]), **extra)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    ref_params = dict(ref.named_parameters())
    not_kept: dict = {}
    kept: dict = {}

    def count_kept(tensor):  # outermost hooks: ZeRO-3's own (inner) hooks hide its tensors from these
        if zero_._gathered(tensor) is not None:
            kept[StorageWeakRef(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    class Counting(zero_.Regather):
        def pack(self, tensor):
            packed = super().pack(tensor)
            if packed is not tensor:
                not_kept[StorageWeakRef(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
            return packed

    original = module_.regather_saved
    module_.regather_saved = Counting
    try:
        for step in range(steps):
            if pp > 1:
                loss = pm.step(input_ids=local[step], labels=local[step])
            else:
                with torch.autograd.graph.saved_tensors_hooks(count_kept, lambda t: t):
                    loss = pm(input_ids=local[step], labels=local[step]).loss
                loss.backward()
            ref_loss = ref(input_ids=data[step], labels=data[step]).loss
            ref_loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # every rank of a data-parallel replica holds that replica's loss
            torch.testing.assert_close(mean / dist.get_world_size(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
            # overlap: every bucket waited on when backward ended, every .grad a plain tensor again
            assert torch._C._distributed_c10d._get_work_registry_size() == 0
            unsettled = [n for n, p in pm.named_parameters() if isinstance(p.grad.to_local(), AsyncCollectiveTensor)]
            assert not unsettled, unsettled
            # the norm over every piece of every gradient: on the (dp, tp) mesh, and over the stages
            norm = (pm.clip_grad_norm_(0.5) if pp > 1
                    else torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm=0.5).full_tensor())
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
            for name, p in pm.named_parameters():
                torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, n=name: f"step {step} grad of {n}: {m}")
            state_bytes = (_local_bytes(list(pm.parameters())), _local_bytes([p.grad for p in pm.parameters()]))
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        module_.regather_saved = original
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), rtol=1e-4, atol=1e-5)
    if checkpoint is not None:
        _checkpoint_round_trip(pm, kind, dp=dp, tp=tp, zero=zero, example=local[0], path=checkpoint)
    optimizer = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return dict(params=state_bytes[0], grads=state_bytes[1], optimizer=_local_bytes(optimizer),
                not_kept=sum(not_kept.values()), kept=sum(kept.values()))


def _checkpoint_round_trip(pm, kind: str, *, dp: int, tp: int, zero: int, example, path: str) -> None:
    """DCP: this layout's parameters saved, loaded into another ZeRO stage on the same mesh
    (pieces over dp <-> replicas, or ZeRO-1 <-> 2), every parameter bit-equal after the load."""
    import torch.distributed.checkpoint as dcp

    import sptransform

    dcp.save(pm.state_dict(), checkpoint_id=path)
    other = sptransform.parallelize(_model(kind), tp=tp, dp=dp, zero=3 - zero,  # 1 <-> 2: pieces <-> pieces
                                    example_inputs=dict(input_ids=example, labels=example))
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    saved = dict(pm.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p.full_tensor(), saved[name].full_tensor()), f"{name} after a DCP round trip"


def _unequal_batches(dp_rank: int) -> dict:
    """Replica 0: 4 sequences, 24 of their targets ignored; replica 1: 2 sequences, 3 ignored
    (different token counts and local batch sizes)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (6, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 4:] = -100
    labels[1, 8:] = -100
    labels[4, :3] = -100
    rows = slice(0, 4) if dp_rank == 0 else slice(4, 6)
    return dict(input_ids=ids[rows], labels=labels[rows]), dict(input_ids=ids, labels=labels)


def _grad_errors(pm, grads: dict) -> float:
    """The largest relative error (norm of the difference / norm of the reference) over the gradients."""
    return max(float((p.grad.full_tensor() - grads[n]).norm() / grads[n].norm()) for n, p in pm.named_parameters())


def _unequal_tokens(kind: str, *, tp: int, zero: int, dp_loss: str, pp: int = 1) -> float:
    """dp=2 replicas with different numbers of ignored labels and of sequences: with ``dp_loss=
    "tokens"`` every gradient equals one device's on the concatenated batch; with ``"replicas"``
    it equals the mean of one device's gradients on each replica's batch. Each replica's loss is
    its own batch's mean. Returns the largest relative gradient error against the concatenated
    batch."""
    import sptransform

    dp_rank = dist.get_rank() // (pp * tp)
    mine, everything = _unequal_batches(dp_rank)
    model = _model(kind)
    ref = copy.deepcopy(model)
    example = {k: v[:4] for k, v in everything.items()}  # one example shape on every rank (replica 1 recaptures)
    pm = sptransform.parallelize(model, tp=tp, dp=2, zero=zero, dp_loss=dp_loss, example_inputs=example)
    loss = pm(**mine).loss
    loss.backward()
    single = {}
    for name, batch in (("all", everything), *((f"replica {r}", _unequal_batches(r)[0]) for r in range(2))):
        ref.zero_grad()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        single[name] = {n: p.grad.clone() for n, p in ref.named_parameters()}
        if name == f"replica {dp_rank}":
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)  # the local mean
    expected = single["all"] if dp_loss == "tokens" else \
        {n: (single["replica 0"][n] + single["replica 1"][n]) / 2 for n in single["all"]}
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"dp_loss={dp_loss}: grad of {n}: {m}")
    return _grad_errors(pm, single["all"])


def _worker(rank: int, world: int, port: int, cases: list, results: dict) -> None:
    torch.set_num_threads(1)  # 4 or 8 ranks share two cores: more threads only contend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        for case in cases:
            measured = _unequal_tokens(**case["unequal"]) if "unequal" in case else _train(**case)
            if rank == 0:
                results[repr(case)] = measured
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world: int, cases: list[dict]) -> dict:
    results = mp.Manager().dict()
    spawn_with_deadline(_worker, world, 900.0, cases, results)
    return dict(results)


def test_dp_times_tp_and_dp_alone_train_like_one_device_with_zero_0_to_3(tmp_path):
    cases = [dict(kind=kind, dp=2, tp=2, pp=1, zero=zero) for kind in ("gpt2", "llama") for zero in (0, 1, 2, 3)]
    cases[3]["checkpoint"] = str(tmp_path / "gpt2_zero3")  # fused QKV pieces over dp and tp -> zero 0
    cases[1]["checkpoint"] = str(tmp_path / "gpt2_zero1")  # ZeRO-1 -> ZeRO-2
    cases[4]["overlap"] = False  # buckets waited on inside the backward (the rest: in the optimizer step)
    cases[6]["overlap"] = False
    cases.append(dict(kind="gpt2", dp=2, tp=2, pp=1, zero=3, recompute="selective"))
    cases.append(dict(kind="llama", dp=2, tp=2, pp=1, zero=3, recompute="selective", compile="inductor"))
    unequal = [dict(unequal=dict(kind="gpt2", tp=2, zero=3, dp_loss="tokens")),
               dict(unequal=dict(kind="llama", tp=2, zero=0, dp_loss="replicas"))]
    alone = [dict(kind="llama", dp=4, tp=1, pp=1, zero=3)]  # the same 4 ranks, one data-parallel mesh
    # dp x pp at tp=1: the data-parallel buckets sit between the parameters and the linears, and
    # the stages still find the loss output (they did not: "this forward returns none")
    alone.append(dict(kind="gpt2", dp=2, tp=1, pp=2, zero=1))
    results = _run(4, cases + unequal + alone)
    tokens, replicas = (results[repr(case)] for case in unequal)
    assert tokens < 1e-5 and replicas > 0.1, (tokens, replicas)  # the mean of replica means is 22% off here
    for kind in ("gpt2", "llama"):
        plain = [case for case in cases if case["kind"] == kind and "recompute" not in case]
        zero0, *sharded = (results[repr(case)] for case in plain)
        for measured in sharded:
            for what in ("params", "grads", "optimizer"):  # 1/dp, within 5% (a few small tensors stay whole)
                assert measured[what] == pytest.approx(zero0[what] / 2, rel=0.05), (kind, what)
        zero1, zero2, zero3 = sharded
        assert zero0["not_kept"] == zero0["kept"] == 0
        assert zero3["not_kept"] > 0 and zero3["kept"] == 0  # gathered again in backward, not saved
        assert zero1["kept"] == zero2["kept"] == zero3["not_kept"]  # ZeRO 1 and 2 keep what ZeRO-3 regathers
        assert zero1["not_kept"] == zero2["not_kept"] == 0


def test_dp_times_pp_times_tp_on_eight_ranks():
    cases = [dict(kind="gpt2", dp=2, tp=2, pp=2, zero=0), dict(kind="llama", dp=2, tp=2, pp=2, zero=3),
             dict(kind="gpt2", dp=2, tp=2, pp=2, zero=1)]
    _run(8, cases)
