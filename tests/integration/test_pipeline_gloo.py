"""Real multi-process pipeline runs on gloo: HF GPT-2 (tied embedding/head) and HF Llama,
cut into stages and driven by torch's schedules, train like the originals.

Each rank builds the same model from the same seed and trains the single-device
reference itself on the whole batch; the pipeline splits it into microbatches. Over
3 AdamW steps the loss returned on every rank and every gradient this rank holds
(gathered over tp) equal the reference's, and the ranks hold every parameter between them."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from simulate import spawn_with_deadline

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


def _model(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=8, vocab_size=257, n_positions=64,
                                         attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).train()
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=96, vocab_size=257,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def _worker(rank: int, world: int, port: int, cases: list[tuple]) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for case in cases:  # one process group for all cases: spawning is the slow part
            if case[0] == "dropout":
                _recompute_replays_dropout_exactly(*case[1:])
            elif case[0] == "dtype":
                _loss_crosses_stages_in_the_models_dtype(*case[1:])
            else:
                _train_and_compare(*case)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def _train_and_compare(kind: str, tp: int, pp: int, schedule: str, stages_per_rank: int | None, tied: str,
                       recompute: str | float = "none", stored_microbatches: int | None = None) -> None:
    import sptransform

    model = _model(kind, layers=4)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    batches = [dict(input_ids=torch.randint(0, 257, (8, 16)), labels=torch.randint(0, 257, (8, 16)))
               for _ in range(3)]
    pm = sptransform.parallelize(model, tp=tp, pp=pp, schedule=schedule, n_microbatches=4,
                                 stages_per_rank=stages_per_rank, example_inputs=batches[0], recompute=recompute,
                                 stored_microbatches=stored_microbatches, compile="eager")  # inductor: test_compile_gloo
    assert tied in pm.explain(), pm.explain()
    _same_stage_graphs_on_every_rank(pm)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    ref_params = dict(ref.named_parameters())
    held = dict(pm.named_parameters())
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(held))
    assert set().union(*names) == set(ref_params), "every parameter is held by some rank"
    for step, batch in enumerate(batches):
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        loss = pm.step(**batch)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{kind} {schedule} {recompute} step {step} loss: {m}")
        for name, p in held.items():
            torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{kind} {schedule} {recompute} step {step} grad of {n}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for name, p in held.items():  # tied copies on two ranks stayed equal to the one reference weight
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), rtol=1e-4, atol=1e-5)
    if schedule == "1f1b":  # non-last stages send their residual stream and free it
        last = pm.pipeline_plan.options.num_stages - 1
        assert all(m.saved_outputs == set() for m in pm.stage_modules if m.index != last)


def _same_stage_graphs_on_every_rank(pm) -> None:
    """The ranks that hold one stage (its tensor-parallel peers) built the same graph for it: a
    pass whose output depended on the process (hash or address order) would pair different
    collectives across them, which gloo may abort on, or, for equal sizes, compute wrong."""
    import hashlib

    mine = {m.index: hashlib.sha1(m.graph.code.encode()).hexdigest() for m in pm.stage_modules}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for index in mine:
        assert len({held[index] for held in every if index in held}) == 1, f"stage {index}: graphs differ across ranks"


def _loss_crosses_stages_in_the_models_dtype(dtype: str) -> None:
    """A model whose loss is float64 (or bfloat16): the loss the last stage broadcasts is received in
    the graph's dtype (it was received as float32: gloo aborted the process, 8 vs 4 bytes)."""
    import sptransform
    from sptransform.copying import faithful_deepcopy
    from tiny_models import TinyConfig, TinyLM

    torch.manual_seed(0)
    model = TinyLM(TinyConfig(layers=2, vocab=64)).to(getattr(torch, dtype))
    ref = faithful_deepcopy(model)
    ids, targets = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    pm = sptransform.parallelize(model, tp=1, pp=2, n_microbatches=2, example_inputs=(ids, targets), compile="eager")
    loss = pm.step(ids, targets)
    ref_loss = ref(ids, targets)
    ref_loss.backward()
    assert loss.dtype == ref_loss.dtype, (loss.dtype, ref_loss.dtype)
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == "float64" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, ref_loss.detach(), **tol)
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, **tol,
                                   msg=lambda m, n=name: f"{dtype} grad of {n}: {m}")


def _recompute_replays_dropout_exactly(tp: int, pp: int, schedule: str, stages_per_rank: int | None,
                                       recompute: str | float, stored_microbatches: int | None = None) -> None:
    """GPT-2 with dropout 0.1 everywhere: the pipeline with ``recompute`` (and, if given,
    microbatch-level recomputation) gives bit-equal losses and gradients to the pipeline without
    (the backward replays each stage's dropout draws), while its stages keep less for backward."""
    import sptransform

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=8, vocab_size=257, n_positions=64,
                                     attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config).train()
    torch.manual_seed(1)
    batches = [dict(input_ids=torch.randint(0, 257, (8, 16)), labels=torch.randint(0, 257, (8, 16)))
               for _ in range(2)]
    runs = {}
    for policy in ("none", recompute):
        pm = sptransform.parallelize(copy.deepcopy(model), tp=tp, pp=pp, schedule=schedule, n_microbatches=4,
                                     stages_per_rank=stages_per_rank, example_inputs=batches[0], recompute=policy,
                                     seed=7, stored_microbatches=None if policy == "none" else stored_microbatches,
                                     compile="eager")
        steps = []
        for step, batch in enumerate(batches):
            torch.manual_seed(5 + step)  # replicated activations draw from the default generator
            loss = pm.step(**batch)
            steps.append((loss, {n: p.grad.full_tensor().clone() for n, p in pm.named_parameters()}))
            pm.zero_grad()
        runs[policy] = (steps, sum(m.saved_activation_bytes for m in pm.stage_modules))
    (plain, plain_bytes), (remat, remat_bytes) = runs["none"], runs[recompute]
    for (loss, grads), (loss_r, grads_r) in zip(plain, remat):
        assert torch.equal(loss, loss_r), (loss, loss_r)
        for name, grad in grads.items():
            assert torch.equal(grad, grads_r[name]), name
    assert remat_bytes < plain_bytes, (recompute, remat_bytes, plain_bytes)


SUMMED, COLOCATED, NONE = "gradients summed over those ranks every step", "(co-located)", "tied parameters: none"


@pytest.mark.parametrize(
    "world,cases",
    [
        (2, [("gpt2", 1, 2, "gpipe", None, SUMMED), ("llama", 1, 2, "1f1b", None, NONE),
             ("gpt2", 1, 2, "interleaved1f1b", 2, SUMMED), ("gpt2", 1, 2, "zbv", 2, COLOCATED),
             ("gpt2", 1, 2, "1f1b", None, SUMMED, "full"), ("llama", 1, 2, "zbv", 2, NONE, "selective"),
             ("dropout", 1, 2, "1f1b", None, "full"), ("dropout", 1, 2, "zbv", 2, 0.5),
             ("gpt2", 1, 2, "1f1b", None, SUMMED, "full", 1), ("dtype", "float64"), ("dtype", "bfloat16")]),
        (4, [("gpt2", 1, 4, "1f1b", None, SUMMED), ("gpt2", 2, 2, "1f1b", None, SUMMED),
             ("llama", 2, 2, "interleaved1f1b", 2, NONE), ("gpt2", 2, 2, "1f1b", None, SUMMED, "selective"),
             ("dropout", 2, 2, "interleaved1f1b", 2, "full", 1)]),
    ],
    ids=["pp2", "pp4-and-pp2xtp2"],
)
def test_pipeline_training_matches_single_device(world, cases):
    """pp in {2, 4}, pp x tp = 2 x 2, GPipe / 1F1B / interleaved (v=2) / ZB-V: 3 AdamW steps; with
    recompute= (full, selective, a 0.5 budget; microbatch-level with a window of 1) also against
    the same pipeline without recompute."""
    spawn_with_deadline(_worker, world, 900.0, cases)
