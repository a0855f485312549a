"""Shared test setup: the helpers in tests/ are importable from every folder, every test
leaves no process group and no simulated ranks behind (so no test depends on test order), and
under pytest-xdist the multi-process tests run one after another on one worker."""

from __future__ import annotations

import os
import pathlib
import sys

# One torch (OpenMP) thread per test process, set before torch is imported here: the xdist workers
# and the gloo ranks the tests spawn (they inherit it) already share the 2 cores, and more threads
# than cores spin-wait on each other (tests/integration/test_experts_gloo.py, 2 ranks: 60 s with
# the default, 36 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # simulate.py, tiny_models.py

from sptransform.torch_internals import local_tensor_mode  # noqa: E402


@pytest.fixture(autouse=True)
def _no_global_state_left_behind(request):
    yield
    leaked = []
    if dist.is_available() and dist.is_initialized():
        leaked.append(f"a {dist.get_backend()} process group of {dist.get_world_size()} ranks")
        dist.destroy_process_group()  # so that the next test starts clean either way
    if local_tensor_mode() is not None:
        leaked.append("an active LocalTensorMode")
    if leaked:
        pytest.fail(f"{request.node.nodeid} left {' and '.join(leaked)} behind", pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with ``--dist loadgroup`` (the README's test command: ``-n 2``) every
    ``slow`` test that spawns ranks (real gloo processes, up to 8 ranks each, on a 2-core
    machine) joins one group, which one worker runs one test after another, as a plain
    ``pytest`` run does: two of them at once would double the waits their collective timeouts
    bound. The in-process tests, the slow ones marked ``in_process`` included, are shared out to
    both workers, so they run beside the process tests."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("in_process") is None:
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture(autouse=True)
def _in_process_tests_start_no_process(request, monkeypatch):
    """A test marked ``in_process`` runs beside the process tests under xdist; one that spawned
    ranks would run two worlds at once on the 2 cores, so it fails here."""
    if request.node.get_closest_marker("in_process") is None:
        yield
        return
    import torch.multiprocessing

    def refuse(*args, **kwargs):
        raise pytest.fail.Exception(f"{request.node.nodeid} is marked in_process but spawned ranks: "
                                    "remove the marker (it then runs with the process tests)")

    # what starts ranks (mp.spawn calls the module's own); inductor's compiler subprocesses stay allowed
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)
    monkeypatch.setattr(sys.modules["torch.multiprocessing.spawn"], "start_processes", refuse)
    yield
