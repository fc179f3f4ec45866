"""Test set-up: run the Triton kernels under the interpreter on machines without a GPU.

``TRITON_INTERPRET`` must be set before triton (and so fastgrpo) is imported: the interpreter is chosen when
``@triton.jit`` runs. On a CUDA machine the kernels run compiled and the ``gpu`` tier is collected.
"""

import os
import random

import numpy as np
import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastgrpo  # noqa: E402,F401  (after TRITON_INTERPRET)

# Property tests draw the same examples on every run (a CI failure is then reproducible, never a coin toss);
# `pytest --hypothesis-profile=explore` searches afresh.
settings.register_profile("repeatable", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("repeatable")


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test draws its random inputs from the same seeded streams, so a CI run is repeatable."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _packed_products_on_tiny_models(monkeypatch):
    """The engine's CPU step packs its weights for MKL only for models of a few MiB and more (``engine_cache``); the
    tests' models are far smaller, so the bound is lowered here and every in-process engine test runs the packed
    path (the buffered one: ``test_packed_or_buffered_products_give_hf_results``, bf16, and the end-to-end runs,
    which are subprocesses with the defaults)."""
    import fastgrpo.engine_cache

    monkeypatch.setattr(fastgrpo.engine_cache, "PACKED_WEIGHTS_MIN_BYTES", 0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs this tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
