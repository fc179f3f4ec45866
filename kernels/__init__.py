"""fastgrpo.kernels: Triton kernels for RL post-training, each with a plain-torch path and reference.

Knows nothing of the trainer; other trainers (TRL, hand-written loops) import these functions directly.
Each function runs Triton on CUDA tensors, the Triton kernel under the interpreter when ``TRITON_INTERPRET=1``
was set before import, and otherwise a plain-torch path with the same memory promise.
"""

from .distill_loss import fused_linear_distill_loss
from .dpo_loss import dpo_loss, fused_linear_dpo_loss
from .grpo_loss import grpo_loss
from .linear_grpo_loss import fused_linear_grpo_loss
from .linear_logprobs import fused_linear_cross_entropy, fused_linear_logprobs
from .logprobs import logprobs_from_logits
from .varlen_attention import varlen_attention

__all__ = [
    "dpo_loss",
    "fused_linear_cross_entropy",
    "fused_linear_distill_loss",
    "fused_linear_dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_logprobs",
    "grpo_loss",
    "logprobs_from_logits",
    "varlen_attention",
]
