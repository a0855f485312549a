"""HostEMA on CPU: values against a reference EMA over several steps, state_dict round trips,
and DTensor parameters averaged by their local shard."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sptransform.runtime.ema import HostEMA

FAST = settings(derandomize=True, max_examples=25, deadline=None)


def reference_ema(history, decay):
    """float64 EMA of a list of snapshots {name: tensor}, starting at the first."""
    average = {name: t.double().clone() for name, t in history[0].items()}
    for snapshot in history[1:]:
        for name, t in snapshot.items():
            average[name] = decay * average[name] + (1 - decay) * t.double()
    return average


def perturb_and_snapshot(module, generator):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype))
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@FAST
@given(st.floats(0.0, 0.999), st.integers(1, 12), st.sampled_from([torch.float32, torch.bfloat16]))
def test_average_matches_a_reference_ema_over_several_steps(decay, steps, dtype):
    generator = torch.Generator().manual_seed(steps)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7)).to(dtype)
    ema = HostEMA(model, decay=decay)
    history = [{name: p.detach().clone() for name, p in model.named_parameters()}]
    for _ in range(steps):
        history.append(perturb_and_snapshot(model, generator))
        ema.update()
    ema.synchronize()
    averaged = ema.averaged()
    for name, want in reference_ema(history, decay).items():
        assert averaged[name].dtype == torch.float32
        torch.testing.assert_close(averaged[name].double(), want, rtol=1e-5, atol=1e-5)
    assert ema.num_updates == steps


def test_state_dict_round_trip_continues_identically():
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 3)
    first = HostEMA(model, decay=0.9)
    for _ in range(3):
        perturb_and_snapshot(model, generator)
        first.update()
    saved = {k: ({n: t.clone() for n, t in v.items()} if k == "shadow" else v) for k, v in first.state_dict().items()}
    second = HostEMA(model, decay=0.5)
    second.load_state_dict(saved)
    assert second.decay == 0.9 and second.num_updates == 3
    perturb_and_snapshot(model, generator)
    first.update()
    second.update()
    for name, value in first.averaged().items():
        torch.testing.assert_close(second.averaged()[name], value, rtol=0, atol=0)


def test_copy_to_writes_the_average_into_parameters():
    model = nn.Linear(2, 2)
    ema = HostEMA(model, decay=0.0)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update()
    with torch.no_grad():
        model.weight.fill_(-1.0)
    ema.copy_to(model)
    assert torch.all(model.weight == 3.0)


def test_host_buffers_are_pinned_only_when_cuda_is_available():
    ema = HostEMA(nn.Linear(2, 2))
    assert all(t.device.type == "cpu" for t in ema.averaged().values())
    assert all(t.is_pinned() == torch.cuda.is_available() for t in ema.averaged().values())


def test_bad_decay_and_mismatched_state_fail_with_the_fix():
    with pytest.raises(ValueError, match=r"decay=1.0 must be in \[0, 1\)"):
        HostEMA(nn.Linear(2, 2), decay=1.0)
    ema = HostEMA(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        ema.load_state_dict({"decay": 0.9, "num_updates": 0, "shadow": {"weight": torch.zeros(2, 2)}})
    with pytest.raises(ValueError, match=r"has shape \(3, 2\) but this rank's shard is \(2, 2\)"):
        ema.load_state_dict({"decay": 0.9, "num_updates": 0,
                             "shadow": {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}})


@pytest.fixture
def fake_two_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_dtensor_parameters_are_averaged_by_their_local_shard(fake_two_rank_mesh):
    from torch.distributed.tensor import DTensor, Shard

    local = torch.arange(6.0).reshape(3, 2)
    weight = nn.Parameter(DTensor.from_local(local.clone(), fake_two_rank_mesh, [Shard(0)], run_check=False))
    assert weight.shape == (6, 2)
    ema = HostEMA([("weight", weight)], decay=0.5)
    with torch.no_grad():
        weight.to_local().add_(2.0)
    ema.update()
    average = ema.averaged()["weight"]
    assert average.shape == (3, 2)
    torch.testing.assert_close(average, local + 1.0)
    assert isinstance(weight, DTensor)
