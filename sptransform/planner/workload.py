"""What one training iteration processes, and how many bytes each parameter costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EmaPlacement = Literal["none", "gpu", "host"]


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter of each kind of model state.

    The default is mixed precision with Adam as ZeRO (Rajbhandari et al.) counts it:
    16-bit weights and gradients, and K = 12 bytes of optimizer state (fp32 master
    weights, momentum and variance)."""

    weights: float = 2
    gradients: float = 2
    optimizer: float = 12
    """ZeRO's K."""
    ema: float = 4
    """An fp32 exponential moving average of the weights, when one is kept."""

    def __post_init__(self):
        for name in ("weights", "gradients", "optimizer", "ema"):
            if getattr(self, name) < 0:
                raise ValueError(f"StateBytes.{name}={getattr(self, name)} must not be negative")


MIXED_PRECISION_ADAM = StateBytes()
FP16_ADAM_WITH_FP32_GRADIENTS = StateBytes(gradients=2 + 4)
"""The tutorial's accounting: it also keeps an fp32 copy of the gradients, so a
parameter costs 2 + 4 + (2 + 4) + 4 + 4 = 20 bytes."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The batch one iteration trains on and where the state lives."""

    global_batch: int
    """Sequences per iteration, over all data-parallel replicas."""
    seq_len: int
    state_bytes: StateBytes = MIXED_PRECISION_ADAM
    activation_bytes: int = 2
    """Bytes per activation element (16-bit training)."""
    ema: EmaPlacement = "none"
    """Keep an fp32 EMA of the weights: not at all, in GPU memory, or in host memory."""

    def __post_init__(self):
        if self.global_batch < 1 or self.seq_len < 1:
            raise ValueError(
                f"global_batch={self.global_batch} and seq_len={self.seq_len} must be at least 1"
            )
        if self.ema not in ("none", "gpu", "host"):
            raise ValueError(f"ema={self.ema!r} is not a placement; use 'none', 'gpu' or 'host'")
