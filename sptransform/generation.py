"""``sptransform.generate``: generation from a parallel module or any causal LM, with or without
HF's ``GenerationMixin`` (``runtime.generate`` runs the loop)."""

from __future__ import annotations

import torch
import torch.nn as nn

from sptransform.pipeline.module import PipelinedModule
from sptransform.runtime.generate import generate_tokens
from sptransform.runtime.module import ParallelModule


def generate(model: nn.Module, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """``input_ids`` [batch, prompt] followed by the generated tokens, as HF ``generate`` returns them.

    ``model``: a ``ParallelModule`` (same as ``model.generate(...)``) or a single-device causal LM
    whose forward returns logits [batch, length, vocab] (a tensor, ``.logits``, or a tuple that
    starts with them). Keywords: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
    ``top_p``, ``eos_token_id``, ``pad_token_id``, ``attention_mask``, ``use_cache`` (a parallel
    module's KV cache, split by heads), ``generation_config``."""
    if isinstance(model, ParallelModule):
        return model.generate(input_ids, **kwargs)
    if isinstance(model, PipelinedModule):
        raise TypeError(
            "generate() does not run pipeline-parallel modules (pp > 1): each step would cross every stage; "
            "parallelize a copy with pp=1 to generate"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"generate() takes an nn.Module, got {type(model).__name__}")
    return generate_tokens(model, input_ids, source=model, **kwargs)
