"""The replica check's verdicts and which errors count as a collective's failure (in process;
the waits, timeouts and killed peers are on real gloo ranks in tests/integration/test_faults_gloo.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from simulate import one_rank
from sptransform.runtime.faults import PeerFailure, _from_collective, _raise_if_replicas_disagree, naming_failures


def _row(failed=0, grad=1, mode=7, ran=1, shapes=0) -> list[int]:
    return [failed, grad, mode, ran, shapes]


def test_replicas_that_agree_pass_and_a_grad_mode_difference_names_both_sides():
    _raise_if_replicas_disagree({0: _row(), 2: _row()}, 0)
    with pytest.raises(ValueError, match=r"data-parallel ranks \[rank 0\] vs \[rank 2\] differ in gradients enabled"):
        _raise_if_replicas_disagree({0: _row(), 2: _row(grad=0)}, 2)
    with pytest.raises(ValueError, match=r"differ in train/eval modes"):
        _raise_if_replicas_disagree({0: _row(), 2: _row(mode=8)}, 0)


def test_expert_parallel_replicas_with_inputs_of_other_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"ranks \[rank 0\] vs \[rank 2\] pass inputs of different shapes .* ep > 1"):
        _raise_if_replicas_disagree({0: _row(shapes=5), 2: _row(shapes=6)}, 0)


def test_a_replica_whose_inputs_failed_makes_the_others_raise_and_raises_its_own():
    with pytest.raises(RuntimeError, match=r"rejected on data-parallel rank\(s\) 2 .* rank 0 raises too"):
        _raise_if_replicas_disagree({0: _row(), 2: _row(failed=1)}, 0)
    _raise_if_replicas_disagree({0: _row(), 2: _row(failed=1)}, 2)  # its own error is raised by the caller


def test_only_errors_of_torch_distributed_are_named_as_collective_failures():
    with one_rank() as group:
        with pytest.raises(RuntimeError, match="out of memory") as caught:  # the model's arithmetic: unchanged
            with naming_failures(lambda: "x", lambda: [0]):
                raise RuntimeError("out of memory")
        assert type(caught.value) is RuntimeError and not _from_collective(caught.value)
        with pytest.raises(PeerFailure, match=r"rank 0: the test's all-gather failed after .*Peers: \. A rank"):
            with naming_failures(lambda: "the test's all-gather", lambda: [0]):
                raise dist.DistBackendError("Connection reset by peer")
        assert group
