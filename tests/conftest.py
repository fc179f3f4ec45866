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
def _packed_products_forced(monkeypatch):
    """The engine's CPU step chooses per host, by timing, whether its products run on weights packed for MKL
    (``fastgrpo.engine.workspace``): a test must not depend on that draw, so every engine test (and the subprocesses it
    starts) runs the packed path wherever it can (fp32, MKL), whatever the models' size. Tests that compare the paths
    force each one (``GenerationEngine(cpu_packed=...)``); ``test_generation.py``'s choice tests set ``auto``."""
    from fastgrpo.engine.workspace import PACKED_ENV

    monkeypatch.setenv(PACKED_ENV, "1")


@pytest.hookimpl(trylast=True)  # after the deselection by -m / -k
def pytest_collection_modifyitems(config, items):
    """Without CUDA the ``gpu`` tier is skipped. The GPU compile gate (``tests/kernels/test_gpu_compile.py``) runs
    last, its compile workers started now in the background at the lowest CPU priority: they compile on the cores
    the other tests leave idle."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs this tier)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    gate = [item for item in items if "gpu_compile" in item.keywords]
    if not gate:
        return
    items[:] = [item for item in items if "gpu_compile" not in item.keywords] + gate
    for item in gate:
        if "compiled" in item.fixturenames and hasattr(item, "callspec"):
            item.module.start_workers(item.callspec.params["compiled"])


def pytest_sessionfinish(session):
    """Stop the compile gate's workers if the run ended before its tests collected them."""
    for item in session.items:
        stop = getattr(getattr(item, "module", None), "stop_workers", None)
        if stop is not None:
            stop()
            return
