"""sptransform: graph passes that parallelize an unmodified single-device transformer.

    report = sptransform.verify(model, tp=8)       # on 8 gloo processes: equal to the original?
    model = sptransform.parallelize(model, tp=8)   # on every rank of a torchrun job
"""

from sptransform.api import parallelize
from sptransform.copying import faithful_deepcopy
from sptransform.equivalence import VerifyReport, verify
from sptransform.generation import generate
from sptransform.options import ParallelOptions
from sptransform.runtime.checkpoint import checkpointable, load_hf_weights
from sptransform.runtime.meta import materialize_meta_buffers, meta_parameters

__all__ = ["parallelize", "generate", "ParallelOptions", "verify", "VerifyReport", "checkpointable", "load_hf_weights", "faithful_deepcopy",
           "materialize_meta_buffers", "meta_parameters"]
