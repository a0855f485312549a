"""sptransform: graph passes that parallelize an unmodified single-device transformer.

    report = sptransform.verify(model, tp=8)       # simulated ranks: equal to the original?
    model = sptransform.parallelize(model, tp=8)   # on every rank of a torchrun job
"""

from sptransform.api import parallelize
from sptransform.equivalence import VerifyReport, verify
from sptransform.options import ParallelOptions

__all__ = ["parallelize", "ParallelOptions", "verify", "VerifyReport"]
