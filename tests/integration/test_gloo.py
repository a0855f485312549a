"""Real multi-process runs on gloo: the parallel HF models train like the originals.

Each rank builds the same model from the same seed, computes the single-device
reference itself, and checks the parallel losses and gathered gradients."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from simulate import assert_grads_match, spawn_with_deadline, train_like_reference

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=8, vocab_size=257, n_positions=64,
                                         attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        return transformers.GPT2LMHeadModel(config).train()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                      intermediate_size=96, vocab_size=257, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, bool]], checkpoint: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for kind, sp in cases:  # one process group for all cases: spawning is the slow part
            _train_and_compare(kind, sp, world)
        if world == 2:  # once is enough: these check the engine, not the layout
            _checkpoint_round_trip(world, checkpoint)
            _compiles_without_graph_breaks(world)
            _recompute_policies_match_single_device(world)
            _own_loss_paths(world)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def _train_and_compare(kind: str, sp: bool, world: int) -> None:
    import sptransform

    model = _model(kind)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    batches = [dict(input_ids=torch.randint(0, 257, (2, 32)), labels=torch.randint(0, 257, (2, 32)), use_cache=False)
               for _ in range(3)]
    pm = sptransform.parallelize(model, tp=world, sp=sp, example_inputs=batches[0], dropout_rng="reference")
    train_like_reference(pm, ref, batches, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-4),
                         loss_tol=(1e-5, 1e-6), grad_tol=(1e-4, 1e-5), grad_steps=(0,), seed=100, clip_norm=1.0,
                         what=f"{kind} sp={sp} ")


def _own_loss_paths(world: int) -> None:
    """The user's own loss on the vocabulary-split logits (tests/own_loss.py), on real ranks."""
    import sptransform
    from own_loss import check_own_loss_paths

    model = _model("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 257, (2, 32))
    check_own_loss_paths(sptransform.parallelize(model, tp=world, example_inputs=(ids,)), ref, ids, rtol=1e-4)


def _checkpoint_round_trip(world: int, path: str) -> None:
    """torch.distributed.checkpoint saves the sharded parameters under the original names and
    loads them into a parallel model built from different weights."""
    import torch.distributed.checkpoint as dcp

    import sptransform

    batch = dict(input_ids=torch.randint(0, 257, (2, 32)), labels=torch.randint(0, 257, (2, 32)))
    saved = sptransform.parallelize(_model("llama"), tp=world, example_inputs=batch)
    dcp.save(saved.state_dict(), checkpoint_id=path)
    torch.manual_seed(42)
    other = _model("llama")
    for p in other.parameters():
        torch.nn.init.normal_(p)
    loaded = sptransform.parallelize(other, tp=world, example_inputs=batch)
    state = loaded.state_dict()
    assert set(state) == set(_model("llama").state_dict())
    dcp.load(state, checkpoint_id=path)
    loaded.load_state_dict(state)
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(loaded(**batch).loss, saved(**batch).loss)


def _compiles_without_graph_breaks(world: int) -> None:
    """The parallel module stays traceable: torch.compile captures its computation as one graph
    (the collectives are functional) and gives the eager loss. The only breaks are the two
    eager steps around it that sptransform marks ``torch.compiler.disable`` (choosing the graph
    and checking inputs; building DTensor outputs): see ``ParallelModule.forward``."""
    import torch._dynamo

    import sptransform

    from tiny_models import TinyConfig, TinyLM

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    config = TinyConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=51)  # 51: padded vocab
    ids, targets = torch.randint(0, 51, (2, 8)), torch.randint(0, 51, (2, 8))
    pm = sptransform.parallelize(TinyLM(config), tp=world, example_inputs=(ids, targets))
    eager = pm(ids, targets)
    compiled = torch.compile(pm, backend="aot_eager")(ids, targets)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    assert all(p.grad is not None for p in pm.parameters())
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert all("ParallelModule._dispatch" in b or "ParallelModule._finish" in b for b in breaks), breaks
    assert sum(breaks.values()) <= 2, breaks
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _recompute_policies_match_single_device(world: int) -> None:
    """parallelize(..., recompute=...) partitions the parallel graph (selective, full, a
    budget) and still gives the single-device loss and gradients."""
    import sptransform

    torch.manual_seed(0)
    # vocabulary 257: the vocab-parallel head's last shard is narrower (padded), under AOTAutograd too
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=8, vocab_size=257, n_positions=64,
                                     attn_implementation="eager", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = transformers.GPT2LMHeadModel(config).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 257, (2, 32))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    for policy in ("selective", "full", 0.5):
        pm = sptransform.parallelize(copy.deepcopy(model), tp=world, example_inputs=dict(input_ids=ids, labels=ids),
                                     recompute=policy, compile="eager")  # the partition; inductor: test_compile_gloo
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        assert_grads_match(pm, ref, rtol=1e-4, atol=1e-5, what=f"{policy}: ")


@pytest.mark.parametrize(
    "world,cases",
    [
        (2, [("gpt2", True), ("llama", True), ("gpt2", False), ("llama", False)]),
        (4, [("gpt2", True), ("llama", True)]),
    ],
    ids=["tp2", "tp4"],
)
def test_gloo_training_matches_single_device(world, cases, tmp_path):
    """3 AdamW steps with grad clipping: losses equal single device, step-0 gradients too;
    then a torch.distributed.checkpoint save/load round trip."""
    spawn_with_deadline(_worker, world, 900.0, cases, str(tmp_path / "ckpt"))
