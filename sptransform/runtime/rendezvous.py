"""The start of ``parallelize``: every rank must be there, with the same model and options.

``parallelize`` is collective: it creates device meshes (process groups) and later steps run
collectives whose peers must be running the same graph. A rank that never calls it (a typo in
a rank condition, a rank that raised earlier, a script run on one rank only) would leave the
others blocked inside torch with no word of why. So ``parallelize`` begins with one small
all-gather of a fingerprint (options, parameter names/shapes/dtypes, example input shapes):

* a rank whose peers do not arrive fails when the process group's timeout (the ``timeout=``
  of ``init_process_group``; torch's default is 30 minutes) ends the collective, with an
  sptransform message saying that every rank must call ``parallelize``;
* ranks that called it with different models or options fail alike, naming what differs;
* once every rank has captured its first graph, ``agree_on_graph`` gathers each graph's
  fingerprint (``graph.fingerprint``): ranks whose forward traced differently (code that reads
  the rank) fail alike, naming the first node that differs.

Simulated ranks (LocalTensorMode) and the fake process group have nothing to wait for.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from sptransform.graph.fingerprint import GraphFingerprint
from sptransform.graph.nodes import describe
from sptransform.runtime.checks import gather_fingerprints, stable_hash
from sptransform.torch_internals import local_tensor_mode


def rendezvous_groups(mesh) -> list[dist.ProcessGroup]:
    """The groups ``parallelize`` meets on: the whole process group when it will build the mesh
    itself (before any group is created), else the given mesh's groups; none when there is
    nothing to wait for (no group, one rank, simulated ranks, the fake backend)."""
    if local_tensor_mode() is not None or not dist.is_available() or not dist.is_initialized():
        return []
    if mesh is None:
        groups = [dist.group.WORLD]
    elif mesh.ndim == 1:
        groups = [mesh.get_group()]
    else:
        groups = [mesh.get_group(d) for d in range(mesh.ndim - 1, -1, -1)]
    return [g for g in groups if dist.get_world_size(g) > 1 and dist.get_backend(g) != "fake"]


def rendezvous(groups: Sequence[dist.ProcessGroup], parts: Mapping[str, object], device: torch.device) -> None:
    """Meet every rank of ``groups``; raise on every rank if one is missing or called differently."""
    if not groups:
        return
    row = torch.tensor([0] + [stable_hash(value) for value in parts.values()], dtype=torch.int64,
                       device=device if device.type != "meta" else "cpu")
    start = time.monotonic()
    try:
        table = gather_fingerprints([row], groups, simulated=False)
    except Exception as err:  # a timeout, or a peer that closed its connection
        waited = time.monotonic() - start
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise RuntimeError(
            f"sptransform.parallelize: rank {dist.get_rank()} waited {waited:.1f} s for the other ranks of its "
            f"process group to call parallelize, and they did not ({type(err).__name__}: {first}). Every rank of "
            "the group must call parallelize, with the same model and options, at the same point of the program: "
            "a rank that skipped it, raised earlier or is busy elsewhere leaves the others waiting until the "
            "process group's timeout (init_process_group(..., timeout=datetime.timedelta(...)); torch's default "
            "is 30 minutes) ends the wait"
        ) from err
    differing = [name for i, name in enumerate(parts, start=1) if len({r[i] for r in table}) > 1]
    if differing:
        raise ValueError(
            f"the ranks called parallelize with different {', '.join(differing)}: every rank must pass the same "
            "model (parameter names, shapes and dtypes), the same options and example inputs of the same shapes"
        )


def agree_on_graph(groups: Sequence[dist.ProcessGroup], ranks: Sequence[int], fingerprint: GraphFingerprint | None,
                   device: torch.device) -> None:
    """Check that every rank of ``groups`` captured the same graph from the model (``ranks``: the
    global ranks in the order ``gather_fingerprints`` returns them). The passes pair collectives by
    their place in the graph, so a forward that traces differently on some rank (code that reads
    the rank, a flag or config set per rank) would run another function there without an error.
    Called right after every rank built its first graph in ``parallelize``, where all are present.
    On a mismatch every rank saw the same table, so all enter the second gather (each rank's node
    hashes) and all raise; each names the first of its own nodes that differs."""
    if not groups or fingerprint is None:
        return
    where = device if device.type != "meta" else torch.device("cpu")
    row = torch.tensor([0, fingerprint.digest, len(fingerprint.hashes)], dtype=torch.int64, device=where)
    try:
        table = gather_fingerprints([row], groups, simulated=False)
    except Exception as err:  # a timeout, or a peer that closed its connection
        raise RuntimeError(
            f"sptransform.parallelize: rank {dist.get_rank()} built its first graph and waited for the other ranks "
            f"to finish theirs, and they did not ({type(err).__name__}: {str(err).strip()[:200]}): a rank that raised "
            "while capturing or transforming the model (its own error says why) leaves the others waiting until the "
            "process group's timeout") from err
    if len({tuple(r[1:]) for r in table}) == 1:
        return
    longest = max(r[2] for r in table)
    own = torch.full((longest,), -1, dtype=torch.int64, device=where)
    own[:len(fingerprint.hashes)] = torch.tensor(fingerprint.hashes, dtype=torch.int64)
    hashes = gather_fingerprints([own], groups, simulated=False)
    me = list(ranks).index(dist.get_rank())
    kinds: dict[int, list[int]] = {}
    for i, r in enumerate(table):
        kinds.setdefault(r[1], []).append(ranks[i])
    other = next(i for i, r in enumerate(table) if r[1] != table[me][1])
    # a node's hash covers what it is computed from: the first of this rank's nodes that the other
    # rank does not compute is where the two start to differ (whatever order each traced in)
    theirs = set(hashes[other])
    first = next((i for i, h in enumerate(fingerprint.hashes) if h not in theirs), len(fingerprint.hashes))
    if first < len(fingerprint.nodes):
        where = (f"first differs from rank {ranks[other]}'s at its node {first}, which rank {ranks[other]} does not "
                 f"compute: here it is {describe(fingerprint.nodes[first])}")
    else:
        where = f"is all computed by rank {ranks[other]} too, whose graph has more"
    raise ValueError(
        "the ranks captured different graphs from the model: ranks "
        + " vs ".join(str(sorted(rs)) for rs in kinds.values())
        + f" ({', '.join(str(r[2]) for r in table)} nodes). This rank's ({dist.get_rank()}) graph {where}. "
        "Every rank must trace the same program: the forward may not "
        "depend on the rank (dist.get_rank(), the device index, environment variables), and the model's config, "
        "flags and submodules must be the same on every rank; the parallel model would otherwise compute another "
        "function on some ranks without an error")
