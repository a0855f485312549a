"""The meshes ``runtime.mesh`` builds: they name their process groups without keeping them alive."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from sptransform.runtime.mesh import resolve_tp_mesh


def test_destroy_process_group_frees_the_group_of_a_mesh_built_here_that_dtensors_still_use():
    """``init_device_mesh`` keeps its groups in the mesh, and DTensor's sharding caches keep the
    mesh until the interpreter ends: a group held there would outlive ``destroy_process_group``
    with its gloo threads (the cause of aborts at exit, tests/integration/test_clean_exit_gloo.py)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    group = weakref.ref(dist.group.WORLD)
    mesh = resolve_tp_mesh(1, None, torch.device("cpu"))
    x = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
    assert torch.equal(x.redistribute(mesh, [Replicate()]).to_local(), x.full_tensor())  # fills DTensor's caches
    assert mesh.get_group() is group()
    dist.destroy_process_group()
    gc.collect()
    assert group() is None, "the mesh (or a DTensor on it) kept the destroyed process group alive"
    del x, mesh
