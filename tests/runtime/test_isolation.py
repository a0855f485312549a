"""Two parallel modules in one process do not interfere, and nothing of one outlives it: its
generators, buckets in flight and graphs belong to it (no module-level state in ``runtime/``)."""

from __future__ import annotations

import datetime
import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import sptransform
from simulate import per_rank, simulated_ranks, spawn_with_deadline
from sptransform.torch_internals import maybe_disable_local_tensor_mode
from tiny_models import TinyConfig, TinyLM


def _batches(n: int, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    with maybe_disable_local_tensor_mode():
        return [(torch.randint(0, 61, (2, seq), generator=g), torch.randint(0, 61, (2, seq), generator=g))
                for _ in range(n)]


def _module(seed: int, batch, **options):
    torch.manual_seed(seed)
    model = TinyLM(TinyConfig(layers=2, dropout=0.3)).train()
    return sptransform.parallelize(model, tp=2, example_inputs=batch, seed=seed, **options)


def _step(pm, batch, lr: float = 0.1) -> list[int]:
    """One SGD step (dropout draws from the module's generators); the loss bits of each rank."""
    loss = pm(*batch)
    loss.backward()
    with torch.no_grad():
        for p in pm.parameters():
            p -= lr * p.grad
            p.grad = None
    return [int(t.view(torch.int32)) for t in per_rank(loss.detach())]


def _bits(pm) -> dict[str, list[torch.Tensor]]:
    return {n: [t.clone() for t in per_rank(p.full_tensor())] for n, p in pm.named_parameters()}


def test_two_modules_stepping_interleaved_train_as_each_does_alone():
    batches = _batches(3)
    with simulated_ranks(2):
        alone = {}
        for seed in (1, 2):
            torch.manual_seed(100)  # the default generator (replicated draws) starts alike in both runs
            pm = _module(seed, batches[0])
            alone[seed] = ([_step(pm, b) for b in batches], _bits(pm))
        torch.manual_seed(100)
        first, second = _module(1, batches[0]), _module(2, batches[0])
        losses = {1: [], 2: []}
        for batch in batches:
            losses[1].append(_step(first, batch))
            losses[2].append(_step(second, batch))
        for seed, pm in ((1, first), (2, second)):
            assert losses[seed] == alone[seed][0], f"module {seed}: losses differ when stepped beside another"
            for name, values in _bits(pm).items():
                assert all(torch.equal(a, b) for a, b in zip(values, alone[seed][1][name])), (seed, name)


def test_nothing_of_a_dropped_module_stays_referenced():
    batch = _batches(1)[0]
    with simulated_ranks(2):
        pm = _module(1, batch)
        pm(*batch).backward()
        pm(*_batches(1, seq=8)[0])  # a second graph in the cache
        # (not its graphs: torch.export's _FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT, a torch global,
        # keeps the last capture's nodes until the next export)
        refs = {"module": weakref.ref(pm), "generators": weakref.ref(pm.rng._generators),
                "factory": weakref.ref(pm._factory), "template": weakref.ref(pm._factory.template)}
        refs.update({f"parameter {n}": weakref.ref(p) for n, p in pm.named_parameters()})
        del pm
        gc.collect()
        alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, f"still referenced after the module was dropped: {alive}"


def _interleaved_worker(rank: int, world: int, port: int) -> None:
    """dp=2 with overlap: two modules' backward passes, each leaving its gradient buckets in flight,
    run one after the other between their forwards; each module's gradients equal those it gets
    alone, and no collective is left unwaited."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        batches = {seed: _batches(seed + 1)[seed] for seed in (0, 1)}

        def make(seed):
            torch.manual_seed(seed)
            model = TinyLM(TinyConfig(layers=2))
            return sptransform.parallelize(model, tp=1, dp=2, overlap=True, example_inputs=batches[seed])

        def grads(pm):
            return {n: p.grad.full_tensor() for n, p in pm.named_parameters()}

        alone = {}
        for seed in (0, 1):
            pm = make(seed)
            pm(*batches[seed]).backward()
            alone[seed] = grads(pm)
        first, second = make(0), make(1)
        loss_first, loss_second = first(*batches[0]), second(*batches[1])
        loss_first.backward()
        loss_second.backward()
        assert torch._C._distributed_c10d._get_work_registry_size() == 0
        for seed, pm in ((0, first), (1, second)):
            for name, grad in grads(pm).items():
                assert type(pm.get_parameter(name).grad.to_local()) is torch.Tensor, name  # settled
                torch.testing.assert_close(grad, alone[seed][name], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_data_parallel_modules_with_gradients_in_flight_do_not_mix():
    spawn_with_deadline(_interleaved_worker, 2, 240)


CONSTANT_TABLES = {"checks.py": {"_INDEX_PRESERVING", "_BITS"}, "explain.py": {"COLLECTIVE_DIRECTIONS"}}
"""Module-level tables in ``runtime/`` that are never written at run time (each says so in a comment)."""


def test_runtime_keeps_no_module_level_mutable_state():
    """Lists, dicts, sets, counters and weak registries at module level would outlive the modules
    that use them and let two parallel modules interfere; state belongs to its owner."""
    import ast
    import pathlib

    mutable_calls = {"list", "dict", "set", "count", "OrderedDict", "defaultdict", "deque", "local",
                     "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
    runtime = pathlib.Path(sptransform.__file__).parent / "runtime"
    found = []
    for path in sorted(runtime.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            value = node.value
            called = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else \
                value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) \
                or called in mutable_calls
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if mutable and not names <= CONSTANT_TABLES.get(path.name, set()) | {"__all__"}:
                found.append(f"{path.name}:{node.lineno} {sorted(names)}")
    assert not found, f"module-level mutable state in sptransform/runtime: {found}"
