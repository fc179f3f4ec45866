"""Fixtures shared by the GRPO-loss test files."""

import importlib

import pytest


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Both paths of grpo_loss on CPU: the Triton kernels under the interpreter, or the chunked torch path (forced
    by patching ``use_triton``, with small chunks: rows of padded input, token ranges of packed)."""
    if request.param == "torch":
        monkeypatch.setattr(importlib.import_module("fastgrpo.kernels.grpo_loss"), "use_triton", lambda t: False)
        monkeypatch.setattr(importlib.import_module("fastgrpo.kernels.grpo_torch"), "TORCH_CHUNK", 16)
    return request.param
