"""sptransform: graph passes that parallelize an unmodified single-device transformer.

    model = sptransform.parallelize(model, tp=8)
"""

from sptransform.api import parallelize
from sptransform.options import ParallelOptions

__all__ = ["parallelize", "ParallelOptions"]
