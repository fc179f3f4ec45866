"""fastgrpo: a kernel-centric, single-node GRPO trainer.

The drop-in losses and kernels live in :mod:`fastgrpo.kernels` and are re-exported here::

    from fastgrpo import grpo_loss, logprobs_from_logits, dpo_loss, fused_linear_grpo_loss
"""

from .kernels import (
    dpo_loss,
    fused_linear_cross_entropy,
    fused_linear_dpo_loss,
    fused_linear_grpo_loss,
    fused_linear_logprobs,
    grpo_loss,
    logprobs_from_logits,
    varlen_attention,
)

__version__ = "0.1.0"

__all__ = [
    "dpo_loss",
    "fused_linear_cross_entropy",
    "fused_linear_dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_logprobs",
    "grpo_loss",
    "logprobs_from_logits",
    "varlen_attention",
]
