"""The batch-invariant MoE ops (``fastgrpo.kernels.batch_invariant_moe``, the overrides of ``sigmoid`` and
``_softmax``): a token's value is the same bits whatever other tokens share the call (splits, permutations, one
token alone), and accurate against fp64 within a bound that follows from the inputs' magnitudes.

Bounds (``eps``: fp32's unit roundoff 2^-24):

- sigmoid: ``1 / (1 + exp(−x))``: exp's error (≤ 1 ulp here), the add, the reciprocal: ``4 eps σ(x)``;
- softmax: ``z − max`` rounded once (exp's relative error ``eps |z − max|``), each ``exp`` within 2 eps, their sum
  exact then rounded once, the division: ``(4 + |z − max|) eps p``, plus fp32's subnormal spacing twice;
- router weights: the logits rounded once and ``z − max`` once (``eps |z|`` each, moving every ``p`` by
  ``e^{2 eps max|z|}``), the softmax's own, the renormalisation's sum and division: ``(16 + 8 max|z|) eps w``;
- experts: the products' inputs on ≥ 24-bit grids (K ≤ 32 here) and their outputs rounded to fp32, SiLU's few
  roundings, the weighted sum over k: ``16 eps Σ_k |w_k| (A_k |D_e|ᵀ)`` with ``A_k = (|x| |G_e|ᵀ) ⊙ (|x| |U_e|ᵀ)``, the
  magnitude every intermediate is bounded by (|silu(g)| ≤ 1.1 |g|, |silu'| ≤ 1.1).
"""

import pytest
import torch
from checks import EPS32
from fastgrpo.kernels import batch_invariant as bi
from fastgrpo.kernels import batch_invariant_moe as bim
from fastgrpo.kernels.moe import moe_experts
from hypothesis import given, settings
from hypothesis import strategies as st

EPS = EPS32 / 2  # fp32's unit roundoff


def in_forward(fn, *args):
    with bi.invariant_ops(), bi.invariant_forward():
        return fn(*args)


@settings(max_examples=8)
@given(n=st.integers(1, 3000), start=st.integers(0, 40), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sigmoid_position_independent_accurate_and_the_override(n, start, dtype):
    """torch's fp32 sigmoid differs between its SIMD body and tail (410 of 10,000 single elements moved on an AVX-512
    host); ``bi.sigmoid`` does not, and is what ``torch.sigmoid`` computes in a forward on the invariant ops."""
    x = (torch.randn(n + 64) * 6).to(dtype)
    whole = bi.sigmoid(x)
    assert torch.equal(bi.sigmoid(x[start : start + n]), whole[start : start + n])
    for i in range(start, start + n, max(n // 17, 1)):
        assert torch.equal(bi.sigmoid(x[i : i + 1]), whole[i : i + 1])
    ref = torch.sigmoid(x.double())
    tol = 4 * EPS * ref if dtype == torch.float32 else 2.0**-8 * ref  # bf16: the final cast
    assert ((whole.double() - ref).abs() <= tol).all()
    assert torch.equal(in_forward(torch.sigmoid, x), whole)


@settings(max_examples=8)
@given(T=st.integers(1, 40), E=st.integers(1, 300), scale=st.sampled_from([0.1, 3.0, 30.0]), seed=st.integers(0, 99))
def test_softmax_rows_invariant_exact_sum_and_the_override(T, E, scale, seed):
    """Each row's probabilities are its own (splits, permutations, alone), its sum exact (a permutation of the row's
    entries permutes the bits), accurate against fp64; ``torch.softmax(z, -1, dtype=float32)`` in the forward is it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, E, generator=g) * scale
    p = bi.softmax(z)
    whole = torch.cat([bi.softmax(z[i : i + 1]) for i in range(T)])
    assert torch.equal(p, whole) and torch.equal(bi.softmax(z[1:]), p[1:])
    perm = torch.randperm(E, generator=g)
    assert torch.equal(bi.softmax(z[:, perm]), p[:, perm])
    ref = torch.softmax(z.double(), -1)
    shift = (z - z.amax(-1, keepdim=True)).double().abs()  # z − max is rounded once: exp's relative error eps·|z − max|
    assert ((p.double() - ref).abs() <= (4 + shift) * EPS * ref + 2.0**-148).all()  # subnormals: absolute 2^-149
    assert torch.equal(in_forward(lambda t: torch.softmax(t, -1, dtype=torch.float32), z.bfloat16().float()),
                       bi.softmax(z.bfloat16().float()))
    with bi.invariant_ops(), bi.invariant_forward(), pytest.raises(NotImplementedError, match="_softmax over dim"):
        torch.softmax(z, 0)


def random_block(g, T, H, E, I, K):
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    router = torch.randn(E, H, generator=g)
    return x, gate_up, down, router


def route_and_experts(x, gate_up, down, router, K, norm):
    logits = x @ router.t()
    w, ids = bim.route(logits, K, norm)
    return bim.experts(x, gate_up, down, ids, w), w, ids


@settings(max_examples=8)
@given(T=st.integers(1, 30), E=st.integers(1, 9), K=st.integers(1, 4), norm=st.booleans(), seed=st.integers(0, 99))
def test_route_and_experts_rows_invariant_and_accurate(T, E, K, norm, seed):
    """A token's experts, weights and output are its own: the call on all tokens equals the calls on a split, a
    permutation and each token alone (other tokens share its experts or not). The ids are the top-K of the fp64
    softmax (largest first) wherever its gaps exceed the fp32 rounding, the weights and outputs within the bounds."""
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    H, I = 16, 8
    x, gate_up, down, router = random_block(g, T, H, E, I, K)
    out, w, ids = in_forward(route_and_experts, x, gate_up, down, router, K, norm)
    perm = torch.randperm(T, generator=g)
    cut = int(torch.randint(0, T + 1, (1,), generator=g))
    alone = torch.randperm(T, generator=g)[:3].tolist()  # a few tokens alone (each a call of its own)
    for rows in (perm, slice(0, cut), slice(cut, T), *[slice(t, t + 1) for t in alone]):
        part = in_forward(route_and_experts, x[rows], gate_up, down, router, K, norm)
        assert all(torch.equal(a, b[rows]) for a, b in zip(part, (out, w, ids)))
    z64 = x.double() @ router.double().t()
    p64 = torch.softmax(z64, -1)
    top = p64.sort(-1, descending=True)
    gaps = (top.values[:, :-1] - top.values[:, 1:]).abs()
    clear = gaps.min(-1).values > 1e-5 if E > 1 else torch.ones(T, dtype=torch.bool)
    assert torch.equal(ids[clear], top.indices[clear, :K])
    w64 = p64.gather(1, ids)
    w64 = w64 / w64.sum(-1, keepdim=True) if norm else w64
    zmax = z64.abs().amax(-1, keepdim=True)  # the logits' and z − max's roundings: eps·|z| each, into every p
    assert ((w.double() - w64).abs() <= (16 + 8 * zmax) * EPS * w64).all()
    G, U, D = gate_up[:, :I].double(), gate_up[:, I:].double(), down.double()
    ref = torch.zeros(T, H, dtype=torch.float64)
    bound = torch.zeros(T, H, dtype=torch.float64)
    xd = x.double()
    for k in range(K):
        e = ids[:, k]
        gk, uk = torch.einsum("th,tih->ti", xd, G[e]), torch.einsum("th,tih->ti", xd, U[e])
        a = torch.nn.functional.silu(gk) * uk
        ref += w64[:, k, None] * torch.einsum("ti,thi->th", a, D[e])
        A = torch.einsum("th,tih->ti", xd.abs(), G[e].abs()) * torch.einsum("th,tih->ti", xd.abs(), U[e].abs())
        bound += w64[:, k, None].abs() * torch.einsum("ti,thi->th", A, D[e].abs())
    assert ((out.double() - ref).abs() <= 16 * EPS * bound).all()


def test_route_ties_replay_and_the_order_of_k():
    """Equal probabilities go to the lower expert first; replaying ``route``'s own ids gives its weights bit for bit;
    the output is ``Σ_k w_k y_k`` summed in the router's order (a reordered k moves bits on this input)."""
    z = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, -1.0, 2.0, 2.0]])
    w, ids = in_forward(bim.route, z, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 3]]
    w2, ids2 = in_forward(bim.route, z, 3, True, ids)
    assert torch.equal(w2, w) and torch.equal(ids2, ids)
    w_sum = in_forward(bim.route, z, 3, False)[0]
    assert torch.equal(w, w_sum / bim.ordered_sum(w_sum)[:, None])
    g = torch.Generator().manual_seed(3)
    x, gate_up, down, router = random_block(g, 64, 16, 6, 8, 3)
    w, ids = in_forward(bim.route, x @ router.t(), 3, False)
    out = in_forward(bim.experts, x, gate_up, down, ids, w)
    y = [in_forward(bim.experts, x, gate_up, down, ids[:, k : k + 1], torch.ones(64, 1)) for k in range(3)]  # y_k
    assert torch.equal(out, (w[:, :1] * y[0] + w[:, 1:2] * y[1]) + w[:, 2:] * y[2])
    flipped = in_forward(bim.experts, x, gate_up, down, ids.flip(-1), w.flip(-1))
    assert not torch.equal(out, flipped)  # the same terms in another order: other bits (the rule is one order)


def test_gradients_are_the_fast_paths():
    """The backward is autograd over PyTorch's kernels (outside the forward scope): the gradients of x, both expert
    weights and the routing weights agree with ``kernels.moe.moe_experts``' (fp32, other summation orders) within
    ``64 eps`` of each gradient's largest entry."""
    g = torch.Generator().manual_seed(5)
    x, gate_up, down, router = random_block(g, 24, 16, 5, 8, 2)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(24)])
    w = torch.rand(24, 2, generator=g)
    up = torch.randn(24, 16, generator=g)
    grads = []
    for fast in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down, w)]
        if fast:
            out = moe_experts(*leaves[:3], ids, leaves[3], kernel=False)
        else:
            out = in_forward(bim.experts, *leaves[:3], ids, leaves[3])
        (out * up).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert ((a - b).abs() <= 64 * EPS * b.abs().max()).all()


def test_outside_the_forward_scope_refused():
    with pytest.raises(RuntimeError, match="invariant_forward"):
        bim.route(torch.zeros(2, 4), 2, True)
