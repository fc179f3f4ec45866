"""fastgrpo: a kernel-centric, single-node GRPO trainer.

The drop-in losses and kernels live in :mod:`fastgrpo.kernels` and are re-exported here::

    from fastgrpo import grpo_loss, logprobs_from_logits, dpo_loss, fused_linear_grpo_loss
"""

from .kernels import *  # noqa: F403  (the public kernel API, listed in fastgrpo.kernels.__all__)
from .kernels import __all__ as __all__

__version__ = "0.1.0"
