"""fused_linear_logprobs / fused_linear_cross_entropy against the fp32 torch reference (materialised logits).

Two paths on CPU: the Triton kernel under the interpreter (``kernel``) and the chunked plain-torch path (``torch``,
forced by patching ``use_triton``, with small chunks so several token and vocabulary chunks are streamed).
Tolerance (flash-attn's rule, max over elements): ``|out − ref_fp32| ≤ 2·|ref_lowp − ref_fp32| + atol``, where
``ref_lowp`` is the reference computed in the inputs' dtype. For fp32 inputs ``ref_lowp = ref_fp32`` and only
``atol`` remains: fp32 accumulation-order error, ~1e-6 relative, so ``atol = 1e-4 · max|ref|``.
"""

import math

import pytest
import torch
from checks import assert_flash
from fastgrpo.kernels import linear_logprobs as L
from fastgrpo.kernels.linear_logprobs import fused_linear_cross_entropy, fused_linear_logprobs
from fastgrpo.kernels.reference import cross_entropy_ref, linear_logprobs_ref
from hypothesis import given, settings
from hypothesis import strategies as st

# atol = max(rel · max|ref|, floor). fp32: accumulation order, ~1e-6 relative (module docstring). bf16: the grads are
# rounded to bf16 at the end, one ulp (2⁻⁸) of the largest value; the floor only keeps an all-zero grad well posed.
ATOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2**-8, 1e-6)}


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The kernel (interpreted on CPU tensors; a CUDA machine runs these CPU tests without the interpreter, where
    "kernel" would silently be the torch path again) or the chunked torch path with small chunks."""
    if request.param == "kernel" and not L.use_triton(torch.empty(1)):
        pytest.skip("the kernel path on CPU tensors needs TRITON_INTERPRET=1 (set by conftest.py without CUDA)")
    if request.param == "torch":
        monkeypatch.setattr(L, "use_triton", lambda t: False)
        monkeypatch.setattr(L, "TORCH_CHUNK_N", 16)
        monkeypatch.setattr(L, "TORCH_CHUNK_V", 256)
    return request.param


def _inputs(N, H, V, dtype, *, bias=False, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * scale / math.sqrt(H)).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, b, y


def _leaves(*xs):
    return [x for x in xs if x is not None]


def _value_and_grads(fn, leaves, upstream):
    """Outputs of ``fn()`` and the grads of ``leaves`` for ``Σ out·upstream`` (random upstream gradients)."""
    for x in leaves:
        x.grad = None
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((o.float() * u).sum() for o, u in zip(outs, upstream)), torch.zeros(())).backward()
    grads = [x.grad.float().clone() for x in leaves]
    for x in leaves:
        x.grad = None
    return [o.detach().float() for o in outs], grads


def _check_flash(got, ref32, reflow, dtype, what):
    for i, (a, r, lo) in enumerate(zip(got, ref32, reflow)):
        rel, floor = ATOL[dtype]
        assert_flash(f"{what}[{i}]", a, r, lo, max(rel * r.abs().max().item(), floor))


def _compare(fn, ref, leaves, upstream, dtype):
    out, grads = _value_and_grads(fn, leaves, upstream)
    out32, grads32 = _value_and_grads(lambda: ref(True), leaves, upstream)
    outlo, gradslo = _value_and_grads(lambda: ref(False), leaves, upstream)
    _check_flash(out, out32, outlo, dtype, "output")
    _check_flash(grads, grads32, gradslo, dtype, "grad")


@pytest.mark.parametrize(
    "dtype, bias, entropy, temperature, scale",
    [
        (torch.float32, False, False, 1.0, 1.0),
        (torch.float32, True, True, 0.7, 8.0),  # peaked: logits std ~8/0.7, the online LSE must rescale
        (torch.bfloat16, True, True, 1.3, 2.0),
        (torch.bfloat16, False, False, 0.7, 1.0),
    ],
)
def test_matches_reference(path, dtype, bias, entropy, temperature, scale):
    N, H, V = 41, 123, 1271  # none a multiple of a block: masked token, vocabulary and K loops
    h, w, b, y = _inputs(N, H, V, dtype, bias=bias, scale=scale)
    upstream = [torch.randn(N), torch.randn(N)]

    def fn():
        return fused_linear_logprobs(h, w, y, bias=b, temperature=temperature, return_entropy=entropy)

    def ref(upcast):
        return linear_logprobs_ref(h, w, y, bias=b, temperature=temperature, return_entropy=entropy, upcast=upcast)

    _compare(fn, ref, _leaves(h, w, b), upstream, dtype)


def test_strided_targets_and_bias(path):
    """Packed targets and bias that are strided views (the kernels read both with unit stride after a copy)."""
    N, H, V = 19, 24, 150
    h, w, _, _ = _inputs(N, H, V, torch.float32)
    g = torch.Generator().manual_seed(4)
    b_big = torch.randn(V, 2, generator=g).requires_grad_()
    y = torch.randint(0, V, (N, 3), generator=g)[:, 1]  # [N], stride 3
    upstream = [torch.randn(N, generator=g)]

    def fn():
        return fused_linear_logprobs(h, w, y, bias=b_big[:, 0])

    def ref(upcast):
        return linear_logprobs_ref(h, w, y, bias=b_big[:, 0], upcast=upcast)

    _compare(fn, ref, [h, w, b_big], upstream, torch.float32)


def test_padded_strided_input_and_entropy_only_grad(path):
    """``[B, T, H]`` hidden that is a non-contiguous view, a strided weight, a mask on the result; grad of H only."""
    B, T, H, V = 3, 7, 40, 300
    g = torch.Generator().manual_seed(1)
    h_big = torch.randn(B, T, 2 * H, generator=g, requires_grad=True)
    w_big = (torch.randn(H, V, generator=g) / math.sqrt(H)).requires_grad_()
    h, w = h_big[..., ::2], w_big.t()  # [B, T, H] and [V, H], both non-contiguous
    y = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    up = torch.randn(B, T, generator=g)

    def fn():
        return fused_linear_logprobs(h, w, y, return_entropy=True)[1] * mask

    def ref(upcast):
        return linear_logprobs_ref(h, w, y, return_entropy=True, upcast=upcast)[1] * mask

    _compare(fn, ref, [h_big, w_big], [up], torch.float32)


def test_tied_weights_accumulate(path):
    """The head is the input embedding: both uses' gradients add up in ``weight.grad``."""
    N, H, V = 20, 32, 200
    g = torch.Generator().manual_seed(2)
    emb = torch.nn.Embedding(V, H)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    ids = torch.randint(0, V, (N,), generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    proj = torch.randn(H, H, generator=g)

    def loss(op):
        h = torch.tanh(emb(ids) @ proj)  # [N, H], depends on the same weight
        return -op(h, emb.weight, y).mean()

    loss(fused_linear_logprobs).backward()
    got = emb.weight.grad.clone()
    emb.weight.grad = None
    loss(linear_logprobs_ref).backward()
    assert (got - emb.weight.grad).abs().max().item() <= 1e-4 * emb.weight.grad.abs().max().item()


def test_frozen_head(path):
    """Only ``hidden`` needs a gradient (a frozen or LoRA-adapted head): the same grad, none for the head."""
    h, w, b, y = _inputs(20, 33, 300, torch.float32, bias=True)
    w.requires_grad_(False)
    b.requires_grad_(False)
    up = [torch.randn(20)]
    _compare(lambda: fused_linear_logprobs(h, w, y, bias=b), lambda upcast: linear_logprobs_ref(h, w, y, bias=b),
             [h], up, torch.float32)
    fused_linear_logprobs(h, w, y, bias=b).sum().backward()
    assert w.grad is None and b.grad is None


def test_grad_filter_within_dropped_mass(path):
    """With ``grad_filter_eps``, the forward is exact and each grad differs from the exact one by at most the
    contribution of entries with ``p < eps`` that are not targets (the only ones a skipped tile can hold):
    ``|Δgrad_h| ≤ |dz|_S @ |W|``, ``|Δgrad_W| ≤ |dz|_Sᵀ @ |h|``. The filter must also skip something here."""
    N, H, V, eps, T = 41, 48, 1271, 1e-4, 0.8
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).requires_grad_()
    b = (0.1 * torch.randn(V, generator=g)).requires_grad_()
    y = torch.randint(0, 64, (N,), generator=g)  # confident predictions of tokens in the first vocabulary tile
    h = (20 * w.detach()[y] + 0.1 * torch.randn(N, H, generator=g)).requires_grad_()
    y[-6:] = torch.randint(64, V, (6,), generator=g)  # unlikely targets: their tiles must not be skipped
    up = [torch.randn(N), torch.randn(N)]
    leaves = [h, w, b]

    def run(filter_eps):
        return _value_and_grads(lambda: fused_linear_logprobs(h, w, y, bias=b, temperature=T, return_entropy=True,
                                                              grad_filter_eps=filter_eps), leaves, up)

    (lp_f, ent_f), (gh_f, gw_f, gb_f) = run(eps)
    (lp, ent), (gh, gw, gb) = run(None)
    assert torch.equal(lp_f, lp) and torch.equal(ent_f, ent)

    with torch.no_grad():  # exact dz from the fp32 reference formulas
        logp_NV = torch.log_softmax((h @ w.t() + b) / T, dim=-1)
        p_NV = logp_NV.exp()
        onehot = torch.nn.functional.one_hot(y, V).float()
        H_N = -(p_NV * logp_NV).sum(-1)
        dz = (up[0][:, None] * (onehot - p_NV) - up[1][:, None] * p_NV * (logp_NV + H_N[:, None])) / T
        dz_S = dz.abs() * ((p_NV < eps) & (onehot == 0))  # entries a skipped tile may drop
        slack = 1e-4
        assert ((gh_f - gh).abs() <= dz_S @ w.abs() + slack).all()
        assert ((gw_f - gw).abs() <= dz_S.t() @ h.abs() + slack).all()
        assert ((gb_f - gb).abs() <= dz_S.sum(0) + slack).all()
    assert not torch.equal(gw_f, gw), "the filter skipped nothing: the test would not see a wrong skip"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(path, reduction):
    B, T, H, V = 2, 9, 40, 300
    g = torch.Generator().manual_seed(4)
    h = torch.randn(B, T, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :4] = -100
    y[1, -1] = -100
    up = [torch.randn(B, T, generator=g) if reduction == "none" else torch.ones(())]

    def fn():
        return fused_linear_cross_entropy(h, w, y, bias=b, reduction=reduction)

    def ref(upcast):
        return cross_entropy_ref(h, w, y, bias=b, reduction=reduction, upcast=upcast)

    _compare(fn, ref, [h, w, b], up, torch.float32)


def test_cross_entropy_all_ignored():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    b = torch.randn(30, requires_grad=True)
    loss = fused_linear_cross_entropy(h, w, torch.full((5,), -100), bias=b)
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any() and not b.grad.any()


@settings(max_examples=8, deadline=None)
@given(N=st.integers(1, 40), H=st.integers(1, 70), V=st.integers(2, 400), entropy=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_shapes_kernel(N, H, V, entropy, seed):
    h, w, b, y = _inputs(N, H, V, torch.float32, bias=seed % 2 == 0, scale=3.0, seed=seed)
    upstream = [torch.randn(N), torch.randn(N)]
    _compare(lambda: fused_linear_logprobs(h, w, y, bias=b, return_entropy=entropy),
             lambda upcast: linear_logprobs_ref(h, w, y, bias=b, return_entropy=entropy, upcast=upcast),
             _leaves(h, w, b), upstream, torch.float32)


@pytest.mark.slow
def test_real_vocabulary_kernel():
    N, H, V = 8, 32, 151936
    h, w, b, y = _inputs(N, H, V, torch.bfloat16, scale=4.0)
    upstream = [torch.randn(N), torch.randn(N)]
    _compare(lambda: fused_linear_logprobs(h, w, y, return_entropy=True),
             lambda upcast: linear_logprobs_ref(h, w, y, return_entropy=True, upcast=upcast),
             [h, w], upstream, torch.bfloat16)


def _bad_calls():
    h, w, b, y = torch.randn(4, 8), torch.randn(10, 8), torch.randn(10), torch.randint(0, 10, (4,))
    return [
        ("hidden", lambda: fused_linear_logprobs(h.long(), w, y)),
        ("hidden", lambda: fused_linear_logprobs(h[0], w, y)),
        ("hidden", lambda: fused_linear_logprobs(h[:0], w, y[:0])),
        ("weight", lambda: fused_linear_logprobs(h, w.double(), y)),
        ("weight", lambda: fused_linear_logprobs(h, w[:, :7], y)),
        ("weight", lambda: fused_linear_logprobs(h, w.to("meta"), y)),
        ("bias", lambda: fused_linear_logprobs(h, w, y, bias=b[:9])),
        ("bias", lambda: fused_linear_logprobs(h, w, y, bias=b.half())),
        ("targets", lambda: fused_linear_logprobs(h, w, y[:3])),
        ("targets", lambda: fused_linear_logprobs(h, w, y.float())),
        ("targets", lambda: fused_linear_logprobs(h, w, y + 10)),  # every id >= V = 10
        ("targets", lambda: fused_linear_logprobs(h, w, y - 10)),  # every id < 0
        ("temperature", lambda: fused_linear_logprobs(h, w, y, temperature=0.0)),
        ("temperature", lambda: fused_linear_logprobs(h, w, y, temperature=float("nan"))),
        ("grad_filter_eps", lambda: fused_linear_logprobs(h, w, y, grad_filter_eps=1.5)),
        ("targets", lambda: fused_linear_cross_entropy(h, w, y.masked_fill(y == y[0], -1))),
        ("reduction", lambda: fused_linear_cross_entropy(h, w, y, reduction="avg")),
    ]


@pytest.mark.parametrize("name, call", _bad_calls())
def test_bad_input_names_argument(name, call):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.gpu
def test_gpu_qwen_vocabulary():
    """N=4096, H=1536, V=151936 (Qwen2.5-1.5B's head) in bf16 on the compiled kernel."""
    N, H, V = 4096, 1536, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 3 / math.sqrt(H)).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    upstream = [torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)]
    out, grads = _value_and_grads(lambda: fused_linear_logprobs(h, w, y, return_entropy=True), [h, w], upstream)
    out32, grads32 = _value_and_grads(lambda: linear_logprobs_ref(h, w, y, return_entropy=True), [h, w], upstream)
    outlo, gradslo = _value_and_grads(lambda: linear_logprobs_ref(h, w, y, return_entropy=True, upcast=False),
                                      [h, w], upstream)
    _check_flash(out, out32, outlo, torch.bfloat16, "output")
    _check_flash(grads, grads32, gradslo, torch.bfloat16, "grad")
