"""Test set-up: run the Triton kernels under the interpreter on machines without a GPU.

``TRITON_INTERPRET`` must be set before triton (and so fastgrpo) is imported: the interpreter is chosen when
``@triton.jit`` runs. On a CUDA machine the kernels run compiled and the ``gpu`` tier is collected.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastgrpo  # noqa: E402,F401  (after TRITON_INTERPRET)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs this tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
