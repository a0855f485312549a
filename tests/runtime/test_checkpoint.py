"""What ``pm.state_dict()`` hands to ``torch.distributed.checkpoint``: for a fused weight stored
``_StridedShard``, a view that names every box of the global tensor a rank holds (DCP's own
description, one box, is wrong for it). The DCP round trips across layouts, on real processes,
are in ``tests/integration/test_checkpoint_gloo.py``."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import sptransform
from simulate import per_rank, simulated_ranks
from sptransform.runtime.checkpoint import ChunkedDTensor, checkpoint_view, checkpointable
from sptransform.torch_internals import FakeStore, StridedShard, dtensor_as, maybe_disable_local_tensor_mode

transformers = pytest.importorskip("transformers")


def _as_rank(rank: int, world: int):
    """A fake process group in which this process is ``rank``: DTensor's local split needs no peer."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


CASES = [
    # (global shape, mesh shape, placements): sptransform's placements, uneven splits, a 2-D mesh
    ((4, 12), (2,), [StridedShard(1, split_factor=3)]),        # GPT-2's Conv1D c_attn, tp=2
    ((12, 4), (4,), [StridedShard(0, split_factor=3)]),        # nn.Linear [q|k|v], tp=4
    ((12,), (4,), [StridedShard(0, split_factor=3)]),          # its bias
    ((15, 2), (4,), [StridedShard(0, split_factor=3)]),        # segments of 5 split 2/2/1/0
    ((257, 4), (4,), [Shard(0)]),                              # a vocabulary 4 does not divide
    ((4, 6), (2,), [Replicate()]),
    ((8, 12), (2, 2), [Replicate(), StridedShard(1, split_factor=3)]),  # tp replicated over dp
    ((8, 12), (2, 2), [Shard(0), StridedShard(1, split_factor=3)]),     # and sharded over dp
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_boxes_are_exactly_what_the_local_tensor_holds(shape, mesh_shape, placements):
    """On every rank: each box DCP is told about is a view of the local tensor holding exactly those
    global entries, the boxes fill the local tensor, and all ranks' boxes cover the global tensor
    once per replica."""
    world = 1
    for n in mesh_shape:
        world *= n
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    covered = torch.zeros(shape)
    try:
        for rank in range(world):
            _as_rank(rank, world)
            mesh = init_device_mesh("cpu", mesh_shape)
            dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
            view = dtensor_as(ChunkedDTensor, dt)
            chunks = view.__create_chunk_list__()
            items = view.__create_write_items__("w", view)
            assert [i.tensor_data.chunk for i in items] == chunks
            assert sum(c.sizes.numel() for c in chunks) == dt.to_local().numel()
            for chunk, item in zip(chunks, items):
                box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                shard = view.__get_tensor_shard__(item.index)
                assert torch.equal(shard, full[box]), (rank, chunk)
                assert shard.untyped_storage().data_ptr() == dt.to_local().untyped_storage().data_ptr()
                covered[box] += 1
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    replicas = 1  # how many ranks hold each entry: the mesh dims it is replicated over
    for size, placement in zip(mesh_shape, placements):
        replicas *= size if isinstance(placement, Replicate) else 1
    assert torch.all(covered == replicas), covered


def test_a_view_is_a_dtensor_that_pickles_and_copies_as_a_plain_one():
    _as_rank(0, 2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        dt = distribute_tensor(torch.randn(4, 12), mesh, [StridedShard(1, split_factor=3)], src_data_rank=None)
        view = checkpoint_view(dt)
        assert type(view) is ChunkedDTensor and view.placements == dt.placements and view.shape == dt.shape
        # the same local storage: loading into the view loads the parameter
        assert view.to_local().data_ptr() == dt.to_local().data_ptr()
        assert type(view * 2) is DTensor and type(view.detach()) is DTensor
        assert type(copy.deepcopy(view)) is DTensor
        buffer = io.BytesIO()
        torch.save({"w": view}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)  # weights_only=True: DTensor is allowed, ChunkedDTensor would not be
        assert type(loaded["w"]) is DTensor and torch.equal(loaded["w"].to_local(), dt.to_local())
        assert checkpoint_view(distribute_tensor(torch.randn(4), mesh, [Shard(0)], src_data_rank=None)).__class__ \
            is DTensor  # one box already: left alone
        assert checkpoint_view(view) is view
    finally:
        dist.destroy_process_group()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=61, n_positions=32,
                                     attn_implementation="eager", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


def _batch():
    g = torch.Generator().manual_seed(3)
    with maybe_disable_local_tensor_mode():  # one batch for every simulated rank
        return dict(input_ids=torch.randint(0, 61, (2, 8), generator=g), labels=torch.randint(0, 61, (2, 8), generator=g))


def test_state_dict_gives_views_of_fused_weights_under_the_original_names():
    model = _gpt2()
    with simulated_ranks(2):
        pm = sptransform.parallelize(copy.deepcopy(model), tp=2, example_inputs=_batch())
        state = pm.state_dict()
        assert list(state) == list(model.state_dict())
        fused = {k for k, v in state.items() if isinstance(v, ChunkedDTensor)}
        assert fused == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"}
        for key in fused:
            assert all(torch.equal(a, b) for a, b in zip(per_rank(state[key].full_tensor()),
                                                        per_rank(pm.get_parameter(key).full_tensor())))
        assert isinstance(pm.transformer.h[0].attn.state_dict()["c_attn.weight"], ChunkedDTensor)  # submodules too
        assert not any(isinstance(v, ChunkedDTensor) for v in pm.state_dict(keep_vars=True).values())
        other = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batch())
        with torch.no_grad():
            for p in other.parameters():
                p.to_local().normal_()
        other.load_state_dict(state)  # views load like DTensors
        for name, p in other.named_parameters():
            assert all(torch.equal(a, b) for a, b in zip(per_rank(p.full_tensor()),
                                                        per_rank(pm.get_parameter(name).full_tensor()))), name


def test_checkpointable_wraps_optimizer_state_and_keeps_its_structure():
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batch())
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)
        pm(**_batch()).loss.backward()
        opt.step()
        state = opt.state_dict()
        wrapped = checkpointable(state)
        assert wrapped["param_groups"] == state["param_groups"] and wrapped["state"].keys() == state["state"].keys()
        names = [n for n, _ in pm.named_parameters()]
        for index, entry in wrapped["state"].items():
            fused = "c_attn" in names[index]
            assert isinstance(entry["exp_avg"], ChunkedDTensor) == fused, names[index]
            assert entry["step"] is state["state"][index]["step"]


def test_load_hf_weights_into_a_plain_module_loads_the_tied_head_through_its_embedding(tmp_path):
    source = _gpt2()
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()
    source.save_pretrained(tmp_path)
    target = _gpt2()
    loaded = sptransform.load_hf_weights(target, tmp_path)
    assert "lm_head.weight" not in loaded and "transformer.wte.weight" in loaded
    assert target.lm_head.weight is target.transformer.wte.weight
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name


def test_load_hf_weights_names_what_is_missing(tmp_path):
    _gpt2().save_pretrained(tmp_path)
    other = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61,
                                                                 n_positions=32))
    with pytest.raises(KeyError, match=r"no weights for parameter\(s\) 'transformer.h.1.ln_1.weight'.*key_map="):
        sptransform.load_hf_weights(other, tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        sptransform.load_hf_weights(other, tmp_path / "model.safetensors")


def test_an_optimizer_stepping_a_fused_weight_gives_views_in_its_state_dict():
    """``opt.state_dict()`` (and so torch's ``get_state_dict``) of an optimizer that has stepped the
    module: the fused weight's moments are views DCP can save (the issue's "overlapping chunks"),
    sharing the optimizer's tensors; the optimizer's own state stays plain DTensors."""
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batch())
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)
        pm(**_batch()).loss.backward()
        opt.step()
        names = [n for n, _ in pm.named_parameters()]
        state = opt.state_dict()["state"]
        for index, entry in state.items():
            assert isinstance(entry["exp_avg"], ChunkedDTensor) == ("c_attn" in names[index]), names[index]
        fused = names.index("transformer.h.0.attn.c_attn.weight")
        own = opt.state[pm.get_parameter(names[fused])]["exp_avg"]
        assert type(own) is DTensor
        state[fused]["exp_avg"].to_local().zero_()  # the view shares the optimizer's tensor: DCP loads into it
        assert all(not t.any() for t in per_rank(own.to_local()))


def test_checkpointable_creates_a_fresh_optimizers_state_without_moving_anything():
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batch())
        before = {n: per_rank(p.to_local().clone()) for n, p in pm.named_parameters()}
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
        state = checkpointable(opt)
        assert len(state["state"]) == len(before) and opt.param_groups[0]["lr"] == 1e-3
        assert all(float(entry["step"]) == 0 for entry in state["state"].values())
        assert all(p.grad is None for p in pm.parameters())
        for name, p in pm.named_parameters():
            assert all(torch.equal(a, b) for a, b in zip(per_rank(p.to_local()), before[name])), name


def test_a_fresh_optimizer_after_a_restore_warns_that_its_state_was_not_restored():
    """The plain recipe into an optimizer that has not stepped restores none of its state; the
    first step after ``pm.load_state_dict`` of DTensors (a distributed checkpoint) says so. Whole
    tensors (weights) and an optimizer that has state do not warn."""
    with simulated_ranks(2):
        pm = sptransform.parallelize(_gpt2(), tp=2, example_inputs=_batch())

        def first_step(opt):
            pm(**_batch()).loss.backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            opt.zero_grad()
            return [str(w.message) for w in caught if "no state for them" in str(w.message)]

        pm.load_state_dict(_gpt2().state_dict())  # whole tensors: weights, not a resume
        assert first_step(torch.optim.AdamW(pm.parameters(), foreach=False)) == []
        pm.load_state_dict(pm.state_dict())  # DTensors: a distributed checkpoint
        [message] = first_step(torch.optim.AdamW(pm.parameters(), foreach=False))
        assert "get_state_dict" in message and "checkpointable(opt)" in message
        opt = torch.optim.AdamW(pm.parameters(), foreach=False)
        checkpointable(opt)
        pm.load_state_dict(pm.state_dict())
        assert first_step(opt) == []
