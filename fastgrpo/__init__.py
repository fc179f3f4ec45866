"""fastgrpo: a kernel-centric, single-node GRPO trainer.

The drop-in losses and kernels live in :mod:`fastgrpo.kernels` and are re-exported here::

    from fastgrpo import grpo_loss, logprobs_from_logits, dpo_loss, fused_linear_grpo_loss

They load on first use (PEP 562), so a process that needs only the light modules (a reward worker: config,
rewards) starts without importing torch and Triton.
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'fastgrpo' has no attribute {name!r}")
    kernels = importlib.import_module("fastgrpo.kernels")  # not `from . import`: that probes this hook again
    if name == "__all__":
        return kernels.__all__
    try:
        return getattr(kernels, name)
    except AttributeError:
        raise AttributeError(f"module 'fastgrpo' has no attribute {name!r}") from None
