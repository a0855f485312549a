"""sptransform: graph passes that parallelize an unmodified single-device transformer.

    model = sptransform.parallelize(model, tp=8)
"""

from .api import ParallelOptions, parallelize
from .verify import VerifyReport, verify

__all__ = ["parallelize", "ParallelOptions", "verify", "VerifyReport"]
