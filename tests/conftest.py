"""Shared test setup: the helpers in tests/ are importable from every folder, and every test
leaves no process group and no simulated ranks behind (so no test depends on test order)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch.distributed as dist

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
