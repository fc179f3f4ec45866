"""Checks shared by the tests: flash-attn's tolerance rule, the kernels' test device, a total-variation bound.

Imported as ``from checks import ...``: loading ``tests/conftest.py`` puts ``tests/`` on sys.path (the folder has
no ``__init__.py``, pytest's default "prepend" import mode), for the tests under ``tests/kernels/`` too.
"""

import pytest
import torch


def assert_flash(name: str, got: torch.Tensor, ref32: torch.Tensor, ref_lowp: torch.Tensor, atol: float) -> None:
    """flash-attn's rule: ``max|got − ref32| ≤ 2 · max|ref_lowp − ref32| + atol`` (ref_lowp: the reference run in
    the kernel's precision, so the bound grows with the rounding that precision cannot avoid)."""
    assert got.shape == ref32.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref32.shape)}"
    err = (got.float() - ref32.float()).abs().max().item()
    bound = 2 * (ref_lowp.float() - ref32.float()).abs().max().item() + atol
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def kernel_device() -> str:
    """Where the kernel tests run: CUDA when present, else CPU (the kernels under TRITON_INTERPRET=1)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def total_variation(samples: torch.Tensor, want_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TV distance between the empirical distribution of ``samples`` and ``want_V``, and its expectation under
    ``want_V``: E[TV] ≈ ½ Σ sqrt(2 p (1 - p) / (π N)) (each count ≈ normal). The tests allow 4 × E[TV]: over
    4 standard deviations of TV even when only two tokens carry the mass, and with a fixed seed.
    """
    N = samples.numel()
    got = torch.bincount(samples, minlength=want_V.numel()).double() / N
    expected_tv = 0.5 * (2 * want_V * (1 - want_V) / (torch.pi * N)).sqrt().sum()
    return 0.5 * (got - want_V).abs().sum(), expected_tv


class ScriptedEngine:
    """Stands in for the generation engine where the sampler is not under test: prompt ``p`` gets the first
    ``params.n`` entries of ``script[p]``, each a text (finished by EOS) or a ``(text, finish_reason)`` pair (a
    ``"length"`` completion gets no EOS), with the constant sampling log-prob ``logprob`` per token."""

    def __init__(self, tok, script, logprob=0.0):
        self.tok, self.script, self.logprob = tok, script, logprob

    def generate(self, prompts, params, *, on_group_done=None):
        from fastgrpo.generation import Completion

        out = []
        for p in range(len(prompts)):
            group = []
            for entry in self.script[p][: params.n]:
                text, reason = (entry, "stop") if isinstance(entry, str) else entry
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                ids = ids + [self.tok.eos_token_id] if reason == "stop" else ids
                group.append(Completion(ids, [self.logprob] * len(ids), reason))
            out.append(group)
        if on_group_done is not None:
            for p in reversed(range(len(out))):  # groups finish in any order, not the prompts'
                on_group_done(p, out[p])
        return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Imported by a test module, runs its tests on one thread: the engine and Hugging Face's forward then sum in
    the same order every run (and 2 threads gain nothing on these tiny models)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
