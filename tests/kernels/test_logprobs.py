"""logprobs_from_logits: the Triton kernels (interpreter on CPU) and the plain-torch path against logprobs_ref.

Rule (flash-attn): ``max|out − ref_fp32| ≤ 2·max|ref_lowp − ref_fp32| + atol`` for logp, entropy and the logits
gradient under random upstream gradients, where ``ref_lowp`` is the reference computed in the input dtype. For fp32
inputs ``ref_lowp = ref_fp32`` and ``atol`` alone bounds the error (:func:`_atols`): the sums over the vocabulary in
another order (``ATOL_OUT``, ``ATOL_GRAD``; their terms are ``p ≤ 1``) plus what fp32 cannot resolve at the logits'
scale: ``log p = z − lse`` and ``H = lse − Σ p z`` round at ``|z|``, a few ulp(max|z/T|) (1.5e-5 at |z| = 150, the
shifted case, where a fixed 5e-5 would be three ulps), which the gradient multiplies by ``|g_logp|`` and by
``|g_H| (1 + log V)`` (``p |z − Σ p z| = p |log p + H|``, summed over the vocabulary, is at most ``1 + H``).
"""

import math

import fastgrpo.kernels.logprobs as lp_mod
import pytest
import torch
from checks import assert_flash
from fastgrpo.kernels.logprobs import logprobs_from_logits
from fastgrpo.kernels.reference import logprobs_ref
from fastgrpo.kernels.utils import HAS_TRITON
from hypothesis import given, settings
from hypothesis import strategies as st

ATOL_OUT = 5e-5  # logp and entropy (fp32 results, whatever the logits' dtype): summation order
ATOL_GRAD = 1e-4
EPS32 = torch.finfo(torch.float32).eps
PATHS = ["triton", "torch"]
BLOCK_V = lp_mod._launch_config(1 << 20, 2)[0] if HAS_TRITON else 4096  # the kernels' largest vocabulary block


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run the Triton kernels (interpreter on CPU) or the torch path, the latter in chunks of a few rows."""
    if request.param == "triton":
        if not HAS_TRITON or not lp_mod.use_triton(torch.empty(1)):
            pytest.skip("the Triton path needs triton and TRITON_INTERPRET=1 on CPU (set by conftest.py)")
    else:
        monkeypatch.setattr(lp_mod, "use_triton", lambda t: False)
        monkeypatch.setattr(lp_mod, "_CPU_CHUNK_BYTES", 12_000)  # 1 to 3 rows per chunk at these vocabularies
    return request.param


def _make_logits(shape, dtype, *, ramp=0.0, shift=0.0, seed=0):
    """Random logits ``[..., V]`` (std 3) plus a ramp over the vocabulary so the running max moves across blocks."""
    g = torch.Generator().manual_seed(seed)
    V = shape[-1]
    x = torch.randn(shape, generator=g) * 3 + torch.linspace(0, ramp, V) + shift
    return x.to(dtype)


def _run(fn, logits, targets, g_logp, g_entropy, *, return_entropy=True, **kw):
    """(logp, entropy or None, grad of logits) for ``L = Σ g_logp·logp + Σ g_entropy·H`` (None terms left out)."""
    x = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device)  # keeps gaps
    x.copy_(logits).requires_grad_()
    out = fn(x, targets, return_entropy=return_entropy, **kw)
    logp, entropy = out if return_entropy else (out, None)
    loss = sum((t * g).sum() for t, g in ((logp, g_logp), (entropy, g_entropy)) if g is not None and t is not None)
    (grad,) = torch.autograd.grad(loss, x)
    return logp, entropy, grad


def _ref(logits, targets, g_logp, g_entropy, temperature, upcast):
    def fn(x, y, return_entropy):
        return logprobs_ref(x, y, temperature=temperature, return_entropy=return_entropy, upcast=upcast)

    x = logits.float() if upcast else logits
    return _run(fn, x, targets, g_logp, g_entropy)


def _atols(logits, temperature, g_logp, g_entropy):
    """``(atol_out, atol_grad)`` for these logits and upstream gradients (the module docstring's rule)."""
    z = logits.float()
    z_max = z[z.isfinite()].abs().max().item() / temperature
    rounding = 8 * EPS32 * z_max
    g = sum(x.abs().max().item() * w for x, w in ((g_logp, 1.0), (g_entropy, 1 + math.log(z.shape[-1])))
            if x is not None and x.numel())
    return ATOL_OUT + rounding, ATOL_GRAD + rounding * g / temperature


def _check(logits, targets, *, temperature=1.0, entropy=True, upstream=("logp", "entropy"), seed=1):
    """Forward and backward of logprobs_from_logits against the fp32 and low-precision references."""
    g = torch.Generator().manual_seed(seed)
    g_logp = torch.randn(targets.shape, generator=g) if "logp" in upstream else None
    g_entropy = torch.randn(targets.shape, generator=g) if entropy and "entropy" in upstream else None
    logp, ent, grad = _run(logprobs_from_logits, logits, targets, g_logp, g_entropy, temperature=temperature,
                           return_entropy=entropy)
    r32 = _ref(logits, targets, g_logp, g_entropy, temperature, upcast=True)
    rlp = _ref(logits, targets, g_logp, g_entropy, temperature, upcast=False)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    atol_out, atol_grad = _atols(logits, temperature, g_logp, g_entropy)
    assert_flash("logp", logp, r32[0], rlp[0], atol_out)
    if entropy:
        assert ent.dtype == torch.float32 and ent.shape == targets.shape
        assert_flash("entropy", ent, r32[1], rlp[1], atol_out)
    assert_flash("grad", grad, r32[2], rlp[2], atol_grad)
    return logp, ent, grad


CASES = {  # name: (shape, temperature, return_entropy, ramp, shift)
    "41x1271": ((41, 1271), 1.0, True, 0.0, 0.0),
    "41x1271-T0.7-noent": ((41, 1271), 0.7, False, 0.0, 0.0),
    "multiblock-T1.3": ((3, 2 * BLOCK_V + 37), 1.3, True, 12.0, 0.0),
    "padded-3d": ((2, 5, 1000), 0.9, True, 0.0, 0.0),
    "shifted-150": ((5, 3000), 1.0, True, 0.0, -150.0),  # e^z underflows in fp32: only e^{z−max} is safe
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(path, case, dtype):
    shape, temperature, entropy, ramp, shift = CASES[case]
    logits = _make_logits(shape, dtype, ramp=ramp, shift=shift)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=torch.Generator().manual_seed(2))
    _check(logits, targets, temperature=temperature, entropy=entropy)


def test_row_strided_3d_and_int32_targets(path):
    """``logits[:, :-1]`` (rows that do not flatten) with int32 targets equals the flat contiguous computation."""
    full = _make_logits((3, 7, 700), torch.bfloat16)
    logits = full[:, :-1]  # [3, 6, 700], row strides (4900, 700)
    targets = torch.randint(0, 700, (3, 6), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    assert logits.stride() == (4900, 700, 1)
    logp, ent, grad = _check(logits, targets, temperature=0.8)
    flat = _check(logits.reshape(18, 700), targets.reshape(18).long(), temperature=0.8)
    torch.testing.assert_close(logp.reshape(18), flat[0], rtol=0, atol=0)
    torch.testing.assert_close(ent.reshape(18), flat[1], rtol=0, atol=0)
    torch.testing.assert_close(grad.reshape(18, 700), flat[2], rtol=0, atol=0)


@pytest.mark.parametrize("upstream", [("logp",), ("entropy",)])
def test_one_output_used(path, upstream):
    """Backward with only one of logp / entropy in the loss (the other's gradient is None)."""
    logits = _make_logits((9, 333), torch.float32)
    targets = torch.randint(0, 333, (9,), generator=torch.Generator().manual_seed(4))
    _check(logits, targets, temperature=1.5, upstream=upstream)


def test_entropy_flag_does_not_change_logp(path):
    logits = _make_logits((6, 515), torch.float32)
    targets = torch.randint(0, 515, (6,), generator=torch.Generator().manual_seed(5))
    alone = logprobs_from_logits(logits, targets)
    with_entropy, _ = logprobs_from_logits(logits, targets, return_entropy=True)
    torch.testing.assert_close(alone, with_entropy, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward(path, dtype):
    """Same gradient as the out-of-place backward, written into (and returned as) the logits' own storage."""
    targets = torch.randint(0, 777, (4, 5), generator=torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(7)
    g_logp, g_entropy = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)

    def grad_of(inplace):
        full = _make_logits((4, 6, 777), dtype).requires_grad_()
        x = full[:, 1:]  # row-strided [4, 5, 777] view, as in logits[:, 1:]
        logp, entropy = logprobs_from_logits(x, targets, temperature=0.6, return_entropy=True,
                                             inplace_backward=inplace)
        loss = (logp * g_logp).sum() + (entropy * g_entropy).sum()
        (grad,) = torch.autograd.grad(loss, x, retain_graph=True)
        return full, x, logp, grad

    _, _, _, expected = grad_of(inplace=False)
    full, x, logp, grad = grad_of(inplace=True)
    assert grad.data_ptr() == x.data_ptr() and grad.stride() == x.stride()
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(full.detach()[:, 1:], expected, rtol=0, atol=0)  # the logits buffer now holds it


def test_inplace_backward_guards(path):
    """After an in-place backward the logits are gone: a second backward, or a later backward of another op that
    saved the logits, raises instead of computing with the gradient in their place."""
    x = _make_logits((3, 50), torch.float32).requires_grad_()
    targets = torch.tensor([1, 2, 3])
    logp = logprobs_from_logits(x, targets, inplace_backward=True)
    torch.autograd.grad(logp.sum(), x, retain_graph=True)
    with pytest.raises(RuntimeError, match="overwritten"):
        torch.autograd.grad(logp.sum(), x)

    x = _make_logits((3, 50), torch.float32).requires_grad_()
    square = x * x  # saves x; created first, so its backward runs after logprobs'
    logp = logprobs_from_logits(x, targets, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + square.sum()).backward()


def test_neg_inf_logits(path):
    """Masked (−inf) logits: p = 0 there, no entropy contribution, zero gradient, everything finite."""
    logits = _make_logits((5, 600), torch.float32)
    logits[:, 100:300] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, 7] = 1.0  # one live token: logp 0 when targeted, entropy 0
    targets = torch.randint(300, 600, (5,), generator=torch.Generator().manual_seed(8))
    targets[2] = 7
    g = torch.Generator().manual_seed(9)
    g_logp, g_entropy = torch.randn(5, generator=g), torch.randn(5, generator=g)
    logp, entropy, grad = _run(logprobs_from_logits, logits, targets, g_logp, g_entropy, temperature=0.5)
    # the reference (nan entropy at −inf) on logits with −inf replaced by a value whose p underflows to 0
    r = _ref(logits.clamp(min=-1e4), targets, g_logp, g_entropy, 0.5, upcast=True)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all() and torch.isfinite(grad).all()
    atol_out, atol_grad = _atols(logits, 0.5, g_logp, g_entropy)
    torch.testing.assert_close(logp, r[0], rtol=0, atol=atol_out)
    torch.testing.assert_close(entropy, r[1], rtol=0, atol=atol_out)
    torch.testing.assert_close(grad, r[2], rtol=0, atol=atol_grad)
    assert logp[2] == 0 and entropy[2] == 0 and (grad[:, 100:300] == 0).all()


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 6),
    v=st.integers(1, 2500),
    temperature=st.floats(0.3, 3.0),
    entropy=st.booleans(),
    triton_path=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(n, v, temperature, entropy, triton_path, seed):
    """Random small shapes, temperatures and paths agree with the fp32 reference (V = 1 included: logp = H = 0)."""
    logits = _make_logits((n, v), torch.float32, seed=seed)
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    use = lp_mod.use_triton
    try:
        if not triton_path:
            lp_mod.use_triton = lambda t: False
        _check(logits, targets, temperature=temperature, entropy=entropy, seed=seed)
    finally:
        lp_mod.use_triton = use


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_real_vocabulary(path, dtype):
    """Qwen's vocabulary (151936, not a multiple of the block) on two rows."""
    logits = _make_logits((2, 151936), dtype, ramp=6.0)
    targets = torch.tensor([0, 151935])
    _check(logits, targets, temperature=0.7)


def test_torch_path_chunks_cover_all_rows(monkeypatch):
    """The torch path with several chunks per sequence and row-strided input equals one chunk for everything."""
    monkeypatch.setattr(lp_mod, "use_triton", lambda t: False)
    logits = _make_logits((3, 8, 257), torch.float32)[:, :-1]  # [3, 7, 257]
    targets = torch.randint(0, 257, (3, 7), generator=torch.Generator().manual_seed(10))
    g = torch.Generator().manual_seed(11)
    g_logp, g_entropy = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    one_chunk = _run(logprobs_from_logits, logits, targets, g_logp, g_entropy)
    monkeypatch.setattr(lp_mod, "_CPU_CHUNK_BYTES", 2 * 4 * 257)  # two rows per chunk: 4 chunks per sequence
    chunked = _run(logprobs_from_logits, logits, targets, g_logp, g_entropy)
    for a, b in zip(chunked, one_chunk):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
def test_real_vocabulary_gpu(inplace):
    """bf16 logits at Qwen's vocabulary on CUDA: compiled kernels against the fp32 reference."""
    assert lp_mod.use_triton(torch.empty(1, device="cuda"))
    logits = _make_logits((4, 64, 151936), torch.bfloat16, ramp=4.0).cuda()
    targets = torch.randint(0, 151936, (4, 64), generator=torch.Generator().manual_seed(12)).cuda()
    g = torch.Generator().manual_seed(13)
    g_logp, g_entropy = torch.randn(4, 64, generator=g).cuda(), torch.randn(4, 64, generator=g).cuda()
    logp, entropy, grad = _run(logprobs_from_logits, logits, targets, g_logp, g_entropy, temperature=0.9,
                               inplace_backward=inplace)
    r32 = _ref(logits, targets, g_logp, g_entropy, 0.9, upcast=True)
    rlp = _ref(logits, targets, g_logp, g_entropy, 0.9, upcast=False)
    atol_out, atol_grad = _atols(logits, 0.9, g_logp, g_entropy)
    assert_flash("logp", logp, r32[0], rlp[0], atol_out)
    assert_flash("entropy", entropy, r32[1], rlp[1], atol_out)
    assert_flash("grad", grad, r32[2], rlp[2], atol_grad)


def _bad_calls():
    x = torch.randn(4, 10)
    y = torch.randint(0, 10, (4,))
    return {
        "logits-not-tensor": (([[0.0]], y), {}, "logits"),
        "logits-int": ((torch.zeros(4, 10, dtype=torch.int64), y), {}, "logits"),
        "logits-1d": ((torch.randn(10), y), {}, "logits"),
        "logits-4d": ((torch.randn(1, 1, 4, 10), y), {}, "logits"),
        "logits-empty": ((torch.randn(0, 10), torch.zeros(0, dtype=torch.long)), {}, "logits"),
        "logits-vocab-stride": ((torch.randn(10, 4).t(), y), {}, "logits"),
        "targets-float": ((x, y.float()), {}, "targets"),
        "targets-int16": ((x, y.to(torch.int16)), {}, "targets"),
        "targets-shape": ((x, y[:3]), {}, "targets"),
        "targets-too-high": ((x, torch.full((4,), 10)), {}, "targets"),
        "targets-negative": ((x, torch.full((4,), -1)), {}, "targets"),
        "targets-device": ((x, y.to("meta")), {}, "targets"),
        "temperature-zero": ((x, y), {"temperature": 0.0}, "temperature"),
        "temperature-negative": ((x, y), {"temperature": -1.0}, "temperature"),
        "temperature-inf": ((x, y), {"temperature": math.inf}, "temperature"),
        "temperature-nan": ((x, y), {"temperature": math.nan}, "temperature"),
        "temperature-str": ((x, y), {"temperature": "1"}, "temperature"),
        "temperature-bool": ((x, y), {"temperature": True}, "temperature"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_value_error(case):
    args, kwargs, name = _bad_calls()[case]
    with pytest.raises(ValueError, match=name):
        logprobs_from_logits(*args, **kwargs)
