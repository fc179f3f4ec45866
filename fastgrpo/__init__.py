"""fastgrpo: a kernel-centric, single-node GRPO trainer.

The drop-in losses and kernels live in :mod:`fastgrpo.kernels` and are re-exported here::

    from fastgrpo import grpo_loss, logprobs_from_logits, dpo_loss, fused_linear_grpo_loss

They load on first use (PEP 562), so a process that needs only the light modules (a reward worker: config,
rewards) starts without importing torch and Triton.
"""

import importlib
import os
import sys

__version__ = "0.1.0"


def _drop_checkout_root() -> None:
    """``python -m fastgrpo.<command>`` (plan, eval, export_merged, rollouts) run from a source checkout puts the
    checkout's root first on sys.path, where its top-level kernels/ folder (installed as fastgrpo.kernels) shadows the
    PyPI package ``kernels`` that transformers imports: drop that entry, as fastgrpo/train.py drops its own folder.
    sys.argv[0] is "-m" only while the command's package is imported; a checkout's root holds setup.py and kernels/."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = all(os.path.isfile(os.path.join(root, *f)) for f in (("setup.py",), ("kernels", "__init__.py")))
    if sys.argv[:1] == ["-m"] and checkout:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]


_drop_checkout_root()


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
