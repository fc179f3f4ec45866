"""fastgrpo.kernels: Triton kernels for RL post-training, each with a plain-torch path and reference.

Knows nothing of the trainer; other trainers (TRL, hand-written loops) import these functions directly.
"""
