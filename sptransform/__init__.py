"""sptransform: graph passes that parallelize an unmodified single-device transformer.

    model = sptransform.parallelize(model, tp=8)
"""

from sptransform.api import ParallelOptions, parallelize

__all__ = ["parallelize", "ParallelOptions"]
