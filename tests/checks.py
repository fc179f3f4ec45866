"""Checks shared by the tests: flash-attn's tolerance rule, the kernels' test device, a total-variation bound, the
margin a discontinuous metric needs before two computations of it may be compared.

Imported as ``from checks import ...``: loading ``tests/conftest.py`` puts ``tests/`` on sys.path (the folder has
no ``__init__.py``, pytest's default "prepend" import mode), for the tests under ``tests/kernels/`` too.
"""

import math

import pytest
import torch

EPS32 = torch.finfo(torch.float32).eps  # 2⁻²³


def assert_flash(name: str, got: torch.Tensor, ref32: torch.Tensor, ref_lowp: torch.Tensor, atol: float) -> None:
    """flash-attn's rule: ``max|got − ref32| ≤ 2 · max|ref_lowp − ref32| + atol`` (ref_lowp: the reference run in
    the kernel's precision, so the bound grows with the rounding that precision cannot avoid).

    For fp32 inputs ``ref_lowp`` is ``ref32`` (or, one level up, ``ref32`` against an fp64 ``ref``), and its own
    error is whatever one host's kernels happened to give: ``atol`` must then carry the whole bound and follow from
    the inputs' scale (what fp32 cannot resolve at that scale), never from one run's accuracy."""
    assert got.shape == ref32.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref32.shape)}"
    err = (got.float() - ref32.float()).abs().max().item()
    bound = 2 * (ref_lowp.float() - ref32.float()).abs().max().item() + atol
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def attention_floor(scores_max: float, v: torch.Tensor, do: torch.Tensor | None = None) -> float:
    """What fp32 attention cannot resolve at these inputs' scale. A score rounds at its magnitude, at most
    ``scores_max = max|scale · q·k|`` over the queries and keys that meet, so each probability carries a relative
    ``eps32 · scores_max``: the output ``Σ p v`` moves by up to that times ``max|v|``, the gradients by that times
    ``max|do|`` as well; times 8 for the roundings in a row (the score, the max, the exponential, the sum)."""
    upstream = 1.0 if do is None else max(1.0, do.detach().float().abs().max().item())
    return 8 * EPS32 * scores_max * v.detach().float().abs().max().item() * upstream


class IndecisiveCase(AssertionError):
    """A case whose comparison rounding could decide (:func:`assert_decisive`): a fixed test fails on it (its case
    must change), a hypothesis harness draws another (``hypothesis.reject``)."""


def assert_decisive(name: str, values: torch.Tensor, thresholds, margin: float) -> None:
    """Guard for a discontinuous metric (an accuracy, a count over a threshold, an argmax) compared between two
    computations that differ by rounding: every value it thresholds must lie at least ``margin`` from every
    threshold, so that rounding cannot move one across. Raises :class:`IndecisiveCase` naming the closest value:
    then the case, not the code, must change (another seed), and the comparison would otherwise be decided by the
    CPU's kernels."""
    values = values.detach().double().flatten()
    gaps = torch.stack([(values - float(t)).abs() for t in thresholds])  # [thresholds, n]
    worst = gaps.min(0).values.argmin()
    if gaps.min() < margin:
        raise IndecisiveCase(f"{name}: value {values[worst].item():.9g} lies {gaps.min().item():.3g} from a "
                             f"threshold (< {margin:g}): rounding could decide the comparison")


def assert_is_decisive(old: torch.Tensor, samp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float,
                       low: float, margin: float = 1e-4) -> None:
    """``assert_decisive`` for ``sampling/is_clipped_fraction``: the rollout IS log-ratios (padded ``[B, T]``;
    per token, or summed per sequence in the ``sequence_*`` modes, as ``kernels/rollout_is.py`` states) lie at
    least ``margin`` nats from ``log cap`` and ``log low``."""
    delta_BT = torch.where(mask.bool(), old.double() - samp.double(), 0.0)
    values = delta_BT[mask.bool()] if mode.startswith("token") else delta_BT.sum(-1)[mask.bool().any(-1)]
    bounds = [math.log(cap)] + ([math.log(low)] if low > 0 else [])
    assert_decisive(f"{mode} log-ratio", values, bounds, margin)


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


def assert_published(got, knob: str, key: str, value, where: str) -> None:
    """A recipe's setting ``got`` equals its anchor's published ``value`` (``key`` in ``where``); floats to
    pytest.approx's default (1e-6 relative: the values are written decimals, not computed)."""
    ok = got == pytest.approx(value) if isinstance(got, float) else got == value
    assert ok, f"{knob}: fastgrpo {got!r}, NeMo-RL {key} = {value!r} ({where})"


def assert_departure(cfg, row) -> None:
    """A parity table's departure row ``(knob, the anchor's setting, holds(cfg), why)`` holds for ``cfg``."""
    knob, nemo_rl, holds, why = row
    assert holds(cfg), f"{knob}: the table says fastgrpo departs from NeMo-RL ({nemo_rl}) because {why}"


class ScriptedEngine:
    """Stands in for the generation engine where the sampler is not under test: prompt ``p`` gets the first
    ``params.n`` entries of ``script[p]``, each a text (finished by EOS) or a ``(text, finish_reason)`` pair (a
    ``"length"`` completion gets no EOS), with the constant sampling log-prob ``logprob`` per token.

    Multi-turn (``turns``, the engine's TurnHandler): an entry may be a list of turn texts, each finished by EOS and
    handed to ``turns.start``; the handler's answer is appended (loss mask 0) before the next turn, or ends the
    trajectory (its finish reason), as the engine does. A trajectory whose script runs out of turns while the
    handler wants more ends with "length"; one that reaches ``params.max_turns`` with "max_turns"."""

    def __init__(self, tok, script, logprob=0.0):
        self.tok, self.script, self.logprob = tok, script, logprob
        self.last_stats = None

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _trajectory(self, key, entry, params, turns):
        from fastgrpo.engine.engine import Completion

        eos = self.tok.eos_token_id
        ids, mask = [], []
        for t, text in enumerate(entry):
            turn = self._ids(text) + [eos]
            ids, mask = ids + turn, mask + [1] * len(turn)
            turns.start(key, turn, self.tok.decode(turn))
            answers = []
            while not answers:
                answers = turns.ready(block=True)
            ((got, result),) = answers  # one trajectory at a time: the answer is this one's
            assert got == key
            if result.finish is not None:
                return Completion(ids, [self.logprob if m else 0.0 for m in mask], result.finish, mask, t + 1)
            if t + 1 == params.max_turns:
                return Completion(ids, [self.logprob if m else 0.0 for m in mask], "max_turns", mask, t + 1)
            ids, mask = ids + list(result.append_ids), mask + [0] * len(result.append_ids)
        return Completion(ids, [self.logprob if m else 0.0 for m in mask], "length", mask, len(entry))

    def generate(self, prompts, params, *, on_group_done=None, turns=None):
        from fastgrpo.engine.engine import Completion

        out = []
        for p in range(len(prompts)):
            group = []
            for j, entry in enumerate(self.script[p][: params.n]):
                if isinstance(entry, list):
                    group.append(self._trajectory((p, j), entry, params, turns))
                    continue
                text, reason = (entry, "stop") if isinstance(entry, str) else entry
                ids = self._ids(text)
                ids = ids + [self.tok.eos_token_id] if reason == "stop" else ids
                group.append(Completion(ids, [self.logprob] * len(ids), reason, [1] * len(ids)))
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
