"""fastgrpo.kernels: Triton kernels for RL post-training, each with a plain-torch path and reference.

Knows nothing of the trainer; other trainers (TRL, hand-written loops) import these functions directly.
Each function runs Triton on CUDA tensors, the Triton kernel under the interpreter when ``TRITON_INTERPRET=1``
was set before import, and otherwise a plain-torch path with the same memory promise.

The names below load on first use (PEP 562), so a torch-free module of this package (``names``: the option values'
names that ``fastgrpo.config`` checks against) imports without torch and Triton.
"""

import importlib
import sys
import types

# public name -> the module of this package that defines it
EXPORTS = {
    "GRPOLossOptions": "grpo_options",
    "dpo_loss": "dpo_loss",
    "fused_linear_cross_entropy": "linear_logprobs",
    "fused_linear_distill_loss": "distill_loss",
    "fused_linear_dpo_loss": "dpo_loss",
    "fused_linear_grpo_loss": "linear_grpo_loss",
    "fused_linear_logprobs": "linear_logprobs",
    "grpo_loss": "grpo_loss",
    "load_balancing_loss": "moe",
    "logprobs_from_logits": "logprobs",
    "moe_experts": "moe",
    "moe_router": "moe",
    "sparse_moe_block": "moe",
    "varlen_attention": "varlen_attention",
}

__all__ = sorted(EXPORTS)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # The import system binds a submodule it loads to the submodule's name here; grpo_loss, dpo_loss and
        # varlen_attention are also the names of the functions those submodules define, and stay the functions.
        if isinstance(value, types.ModuleType) and EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'fastgrpo.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fastgrpo.kernels.{EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
