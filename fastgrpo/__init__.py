"""fastgrpo: a kernel-centric, single-node GRPO trainer.

The drop-in losses and kernels live in :mod:`fastgrpo.kernels` and are re-exported here.
"""

__version__ = "0.1.0"
