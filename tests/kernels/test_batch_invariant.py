"""The batch-invariant ops (``numerics.batch_invariant``): each op's value for a row is the same bits whatever else
shares the call (random row counts, positions, splits, padding, dtypes, threads), and each is accurate against an
fp64 reference within a bound that follows from its grids and the output's rounding.

Bounds (``b``: the grid bits of the op, ``eps``: the output dtype's unit roundoff):

- product ``x Wᵀ``: rounding row ``x_m`` to ``b`` bits below its largest moves the sum by at most
  ``2^-b max|x_m| Σ_k|w_nk|``, and ``W``'s rows alike; then one rounding to the output: ``eps |ref|``;
- RMSNorm's mean: the terms on ``53 − ⌈log₂ n⌉`` bits, then fp32: ``eps |ref|`` with a factor for the division;
- attention (``checks.attention_floor`` carries fp32's own rounding of the scores): the q/k grids move each score by
  ``scale 2^-b (max|q| Σ|k| + max|k| Σ|q|)``, the probabilities' grid (2^-24 each, L of them over a sum ≥ 1) and the
  values' grid add ``(2 L 2^-24 + 2^-26) max|v|``;
- log-probs: the logits' own rounding at their magnitude through the temperature, twice (the target's and the
  log-sum-exp's), plus the product bound.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from checks import EPS32, attention_floor
from fastgrpo.kernels import batch_invariant as bi
from fastgrpo.kernels import batch_invariant_attention as ba
from hypothesis import given, settings
from hypothesis import strategies as st

EPS = {torch.float32: EPS32 / 2, torch.bfloat16: 2.0**-8}


def _rows_alone_equal(fn, x, *args):
    """``fn`` on all rows of ``x`` at once equals ``fn`` on random splits and permutations of its rows."""
    whole = fn(x, *args)
    g = torch.Generator().manual_seed(x.shape[0])
    perm = torch.randperm(x.shape[0], generator=g)
    assert torch.equal(fn(x[perm], *args), whole[perm])
    cut = int(torch.randint(1, max(x.shape[0], 2), (1,), generator=g))
    assert torch.equal(torch.cat([fn(x[:cut], *args), fn(x[cut:], *args)]), whole)
    assert torch.equal(fn(x[-1:], *args), whole[-1:])  # one row: a gemv for a plain BLAS
    return whole


@settings(max_examples=10)
@given(M=st.integers(1, 40), n=st.integers(1, 90), bits=st.sampled_from([19, 23, 24, 26, 47]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), dim=st.sampled_from([-1, 0]),
       seed=st.integers(0, 1000))
def test_grid_is_the_closed_form(M, n, bits, dtype, dim, seed):
    """``to_grid`` (an add and a subtract of 1.5 · 2^52 · u in fp64) rounds each slice to ``u · round(x / u)``, half to
    even, ``u = 2^(e − bits)`` with ``2^(e−1) ≤ max|x| < 2^e`` (``e ≥ −125``): computed here with frexp and a division
    by ``u``. Rows spread over 2^±60 (2^±6 in fp16), an all-zero row and a row below fp32's normal range."""
    g = torch.Generator().manual_seed(seed)
    span = 6 if dtype == torch.float16 else 60
    x = torch.randn(M, n, generator=g) * 2.0 ** torch.randint(-span, span, (M, 1), generator=g).float()
    x[0] = 0.0
    if dtype != torch.float16 and M > 1:
        x[1] = torch.randn(n, generator=g) * 2.0**-130  # subnormal fp32: the 2^-126 floor of the grid
    x = x.to(dtype)
    xd = x.double()
    e = torch.frexp(xd.abs().amax(dim, keepdim=True)).exponent.clamp(min=-125)
    u = torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e - bits)  # 2^(e - bits), exact
    assert torch.equal(bi.to_grid(x, dim, bits), torch.round(xd / u) * u)


def test_kept_weight_grids_follow_the_weight_version():
    """A kept weight's grid is made once per version of the weight (an AdamW step, an in-place write, a ``copy_`` as
    the fp32 masters' rounding into bf16 weights does) and dropped when the last scope ends; the products in the
    forward scope read it."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 16)
    x = torch.randn(5, 24, generator=g)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)

    def step():
        lin(x).sum().backward()
        opt.step()

    @torch.no_grad()
    def scale():
        lin.weight.mul_(3.0)

    @torch.no_grad()
    def copy():
        lin.weight.copy_(torch.randn(16, 24, generator=g))

    with bi.invariant_ops(), bi.keep_weight_grids(list(lin.parameters())), bi.keep_weight_grids([lin.weight]):
        first = bi.kept_grid(lin.weight.t())
        assert first is bi.kept_grid(lin.weight.t())  # made once
        assert torch.equal(first, bi.to_grid(lin.weight.detach().t(), -2, bi.product_bits(24)))
        for update in (step, scale, copy):
            update()
            with bi.invariant_forward():
                out = lin(x)
            assert torch.equal(out, bi.linear(x, lin.weight.detach(), lin.bias.detach()))
    assert bi.kept_grid(lin.weight.t()) is None


def test_products_of_one_input_share_its_grid_until_it_changes():
    """The q/k/v (and gate/up) products of one input reuse its grid; an in-place write to the input (a new version)
    or another input of the same address makes a new one: the products are always those of the current values."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(7, 12, generator=g), torch.randn(9, 12, generator=g)
    x = torch.randn(4, 12, generator=g)
    with bi.invariant_ops(), bi.invariant_forward():
        assert torch.equal(F.linear(x, w1), bi.linear(x, w1)) and torch.equal(F.linear(x, w2), bi.linear(x, w2))
        x.mul_(3.0)
        assert torch.equal(F.linear(x, w2), bi.linear(x, w2))
        x.view(-1)[:] = torch.randn(48, generator=g)
        assert torch.equal(F.linear(x, w1), bi.linear(x, w1))


@settings(max_examples=12)
@given(M=st.integers(1, 70), K=st.integers(1, 300), N=st.integers(1, 90), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_linear_rows_invariant_and_accurate(M, K, N, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    y = _rows_alone_equal(bi.linear, x, w, b)
    assert y.dtype == dtype
    perm = torch.randperm(K, generator=g)  # an exact sum does not depend on its order; a rounded one does
    assert torch.equal(bi.linear(x[:, perm], w[:, perm], b), y)
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t() + (0 if b is None else b.double())
    bits = bi.product_bits(K)
    grid = 2.0**-bits * (xd.abs().amax(1, keepdim=True) * wd.abs().sum(1) + xd.abs().sum(1, keepdim=True)
                         * wd.abs().amax(1))
    assert ((y.double() - ref).abs() <= 2 * grid + EPS[dtype] * ref.abs() + 1e-300).all()


def test_linear_inside_the_forward_scope_and_passthrough_outside():
    """In ``invariant_forward`` ``F.linear`` (aten addmm / mm) gives ``bi.linear``'s bits for any row count; outside
    it (registered) and after the registration is gone, PyTorch's own kernel's."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 48, generator=g), torch.randn(20, 48, generator=g), torch.randn(20, generator=g)
    plain = F.linear(x, w, b), F.linear(x, w)
    with bi.invariant_ops():
        assert torch.equal(F.linear(x, w, b), plain[0]) and torch.equal(F.linear(x, w), plain[1])
        with bi.invariant_forward():
            for rows in (slice(None), slice(3, 4), slice(5, 30)):
                assert torch.equal(F.linear(x[rows], w, b), bi.linear(x[rows], w, b))
                assert torch.equal(F.linear(x[rows], w), bi.linear(x[rows], w))
            assert torch.equal(torch.bmm(x[None], w.t()[None])[0], bi.linear(x, w))
    assert not bi.enabled() and torch.equal(F.linear(x, w, b), plain[0])


def test_backward_runs_pytorchs_kernels():
    """Only forward values change in the mode: the gradients of ``Σ g · linear(x)`` (which do not depend on the
    forward's output) are PyTorch's bits, in and out of the mode."""
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(24, 16)
    x, up = torch.randn(9, 24, generator=g, requires_grad=True), torch.randn(9, 16, generator=g)
    grads = []
    for mode in (False, True):
        x.grad, lin.weight.grad, lin.bias.grad = None, None, None
        with contextlib.ExitStack() as stack:
            if mode:
                stack.enter_context(bi.invariant_ops())
                with bi.invariant_forward():
                    out = lin(x)
                assert torch.equal(out, bi.linear(x.detach(), lin.weight.detach(), lin.bias.detach()))
            else:
                out = lin(x)
            (out * up).sum().backward()
        grads.append([t.grad.clone() for t in (x, lin.weight, lin.bias)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@settings(max_examples=10)
@given(n=st.integers(2, 300), at=st.integers(0, 299), special=st.sampled_from([math.inf, -math.inf, math.nan]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_a_non_finite_entry_stays_in_its_place(n, at, special, dtype, seed):
    """A slice with one ±inf or NaN: that entry stays what it is and every other entry of the slice is finite (on
    the top binade's grid, so 0 for these scales), as in PyTorch's own sums; a row of squares that overflows fp32
    (``|x| > 1.8e19``) has an infinite mean, as ``torch.mean`` gives, so RMSNorm's ``rsqrt`` makes it 0, not NaN."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, n, generator=g) * 100).to(dtype)
    x[0, at % n] = special
    grid = bi.to_grid(x, -1, 23)
    assert torch.equal(grid[0, at % n].isnan(), torch.tensor(math.isnan(special)))
    if not math.isnan(special):
        assert grid[0, at % n].item() == special
    others = torch.arange(n) != at % n
    assert torch.equal(grid[0, others], torch.zeros(n - 1, dtype=torch.float64))
    assert torch.equal(grid[1], bi.to_grid(x[1:], -1, 23)[0])  # the other row keeps its own grid
    sq = x[1:].float().pow(2)
    sq[0, at % n] = torch.tensor(1e30).pow(2)  # overflows fp32 to inf, as a square of |x| > 1.8e19 does
    assert bi.last_dim_mean(sq).item() == sq.mean().item() == math.inf


@settings(max_examples=8)
@given(M=st.integers(1, 40), n=st.integers(1, 3000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 1000))
def test_row_mean_invariant_and_accurate(M, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, n, generator=g) * torch.rand(M, 1, generator=g) * 30).to(dtype)
    sq = x.float().pow(2)
    mean = _rows_alone_equal(bi.last_dim_mean, sq)
    assert torch.equal(bi.last_dim_mean(sq[:, torch.randperm(n, generator=g)]), mean)  # exact: any order
    ref = sq.double().mean(-1, keepdim=True)
    assert ((mean.double() - ref).abs() <= 2 * EPS32 * ref + 2.0**-40 * sq.double().amax(-1, keepdim=True)).all()
    with bi.invariant_ops(), bi.invariant_forward():
        assert torch.equal(sq.mean(-1, keepdim=True), mean)
        with pytest.raises(NotImplementedError, match="mean over dims"):
            sq.mean(0)


@settings(max_examples=8)
@given(n=st.integers(1, 5000), start=st.integers(0, 40), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_silu_position_independent_and_accurate(n, start, dtype):
    """torch's own fp32 silu differs between its SIMD body and scalar tail; ``bi.silu`` gives an element the same
    bits wherever it sits (here: shifted by ``start`` and cut to ``n``)."""
    x = (torch.randn(n + 64) * 6).to(dtype)
    whole = bi.silu(x)
    assert torch.equal(bi.silu(x[start : start + n]), whole[start : start + n])
    ref = x.double() * torch.sigmoid(x.double())
    assert ((whole.double() - ref).abs() <= 4 * EPS[dtype] * ref.abs() + 1e-30).all()


def _attention_ref(q, k, v, lengths, scale):
    """fp64 causal attention per sequence of a packed batch (GQA by repeating the kv heads)."""
    out, G, s = [], q.shape[1] // k.shape[1], 0
    for n in lengths:
        qq, kk, vv = (x[s : s + n].double().transpose(0, 1) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(G, 0), vv.repeat_interleave(G, 0)
        sc = (qq @ kk.transpose(1, 2) * scale).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        out.append((torch.softmax(sc, -1) @ vv).transpose(0, 1))
        s += n
    return torch.cat(out)


@settings(max_examples=10)
@given(lengths=st.lists(st.integers(1, 150), min_size=1, max_size=4), heads=st.sampled_from([(1, 1), (4, 2), (6, 2)]),
       D=st.sampled_from([4, 8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       pairs=st.sampled_from([ba.PAIRS_PER_CALL, 60]), products=st.sampled_from([ba.BLOCK_PRODUCTS, 30]),
       chunk=st.sampled_from([ba.CHUNK_BYTES, 0]), seed=st.integers(0, 1000))
def test_attention_invariant_and_accurate(lengths, heads, D, dtype, pairs, products, chunk, seed):
    """The packed forward's attention of a token equals the same sequence's alone, the decode step's (one query,
    keys up to its position read from a cache padded with other finite values), and another split of the work
    (``PAIRS_PER_CALL``, ``BLOCK_PRODUCTS``, ``CHUNK_BYTES``: query chunks, block chunks and the running sum carried
    between them, one row a call, the diagonal key by key)."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    # values spread over 2^24 in magnitude: their sums round in fp64, so only a fixed order gives fixed bits
    q, k, v = q.to(dtype), k.to(dtype), (v * 2.0 ** torch.randint(-12, 12, (T, 1, 1), generator=g)).to(dtype)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    scale = D**-0.5
    packed = ba.varlen_attention(q, k, v, cu, scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ba, "PAIRS_PER_CALL", pairs)
        mp.setattr(ba, "BLOCK_PRODUCTS", products)
        mp.setattr(ba, "CHUNK_BYTES", chunk)
        assert torch.equal(ba.varlen_attention(q, k, v, cu, scale), packed)
    perm = torch.randperm(D, generator=g)  # the scores are exact: the order of the head dims does not matter
    assert torch.equal(ba.varlen_attention(q[..., perm], k[..., perm], v, cu, scale), packed)
    k_grid = ba.key_grid(k)
    decodes = []  # (cache K, cache V, position, the packed forward's row) of each sequence
    for i, n in enumerate(lengths):
        s = int(cu[i])
        alone = ba.varlen_attention(q[s : s + n], k[s : s + n], v[s : s + n], torch.tensor([0, n], dtype=torch.int32),
                                    scale)
        assert torch.equal(alone, packed[s : s + n])
        p = int(torch.randint(0, n, (1,), generator=g))
        width = p + 1 + int(torch.randint(0, 20, (1,), generator=g))
        kc, vc = (torch.randn(1, Hkv, width, D, generator=g).to(dtype) for _ in range(2))  # stale, finite
        kc[0, :, : p + 1], vc[0, :, : p + 1] = k_grid[s : s + p + 1].transpose(0, 1), v[s : s + p + 1].transpose(0, 1)
        one = ba.attention(q[s + p][None, :, None], kc, vc, torch.tensor([[p]]), scale)
        assert torch.equal(one[0, :, 0], packed[s + p])
        decodes.append((kc[0], vc[0], p, s + p))
    # one batched decode step over every sequence's cache (rows at other positions, zero-padded to the widest)
    width = max(kc.shape[1] for kc, _, _, _ in decodes)
    kb, vb = (torch.stack([F.pad(d[j], (0, 0, 0, width - d[j].shape[1])) for d in decodes]) for j in (0, 1))
    rows = [t for _, _, _, t in decodes]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ba, "CHUNK_BYTES", chunk)
        qpos = torch.tensor([[p] for _, _, p, _ in decodes])
        batched = ba.attention(q[rows][:, :, None], kb, vb, qpos, scale)
        # the value grids kept (the engine's row cache): the big blocks' below each query's big block, the small
        # blocks' from there on (those past its small block: stale keys' grids)
        padded = F.pad(vb, (0, 0, 0, -width % ba.BIG_BLOCK))
        below_big = torch.arange(width)[:, None] < (qpos - qpos % ba.BIG_BLOCK)[:, :, None, None]  # [B, 1, width, 1]
        v_kept = torch.where(below_big, ba.big_value_grid(padded)[:, :, :width],
                             ba.small_value_grid(padded)[:, :, :width])
        kept = ba.attention(q[rows][:, :, None], kb, vb, qpos, scale, v_kept_BHLD=v_kept)
    assert torch.equal(batched[:, :, 0], packed[rows])
    assert torch.equal(kept, batched)
    ref = _attention_ref(q, k, v, lengths, scale)
    qd, kd, vd = q.double(), k.double(), v.double()
    bits = min(bi.product_bits(D), 24)
    score_grid = scale * 2.0**-bits * 2 * qd.abs().amax() * kd.abs().sum(-1).amax()
    L = max(lengths)
    vmax = vd.abs().max().item()
    bound = (attention_floor(scale * (qd.abs().sum(-1).amax() * kd.abs().amax()).item(), v.float())
             + (4 * score_grid.item() + 2 * L * 2.0**-24 + 2.0**-26) * vmax)
    assert ((packed.double() - ref).abs() <= bound + EPS[dtype] * ref.abs()).all()


def _gradient_bounds(q, k, v, do, lengths, scale):
    """Per entry of ``(dq, dk, dv)``, the sums of the magnitudes of the terms that make it (fp64, per sequence; GQA
    by repeating the kv heads, then summing their gradients over the group): with ``P`` the probabilities, ``A_ij =
    P_ij (Σ_d |do_id v_jd| + Σ_d |do_id o_id|)`` bounds ``|dS_ij|``; ``dq`` sums ``scale A_ij |k_j|``, ``dk``
    ``scale A_ij |q_i|``, ``dv`` ``P_ij |do_i|``. A relative error ``δ`` in each ``P_ij`` (and in ``o``, and each
    term's own rounding) moves an entry by at most ``δ`` times its bound."""
    bounds, G, s = ([], [], []), q.shape[1] // k.shape[1], 0
    for n in lengths:
        qq, kk, vv, dd = (x[s : s + n].double().transpose(0, 1).abs() for x in (q, k, v, do))
        kk, vv = kk.repeat_interleave(G, 0), vv.repeat_interleave(G, 0)
        sc = (q[s : s + n].double().transpose(0, 1) @ k[s : s + n].double().transpose(0, 1).repeat_interleave(G, 0)
              .transpose(1, 2) * scale).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        P = torch.softmax(sc, -1)  # [Hq, n, n]
        A = P * (dd @ vv.transpose(1, 2) + (dd * (P @ vv)).sum(-1, keepdim=True))
        for out, t in zip(bounds, (scale * A @ kk, scale * A.transpose(1, 2) @ qq, P.transpose(1, 2) @ dd)):
            out.append((t if out is bounds[0] else t.unflatten(0, (-1, G)).sum(1)).transpose(0, 1))
        s += n
    return [torch.cat(b) for b in bounds]


@settings(max_examples=6)
@given(lengths=st.lists(st.integers(1, 150), min_size=1, max_size=4), heads=st.sampled_from([(1, 1), (4, 2), (6, 2)]),
       D=st.sampled_from([4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       pairs=st.sampled_from([ba.PAIRS_PER_CALL, 60]), seed=st.integers(0, 1000))
def test_attention_gradients_accurate(lengths, heads, D, dtype, pairs, seed):
    """The packed forward's gradients (PyTorch's CPU flash-attention backward fed the invariant forward's output and
    log-sum-exp, in the forward's groups of sequences: ``PAIRS_PER_CALL`` small splits them) against fp64 autograd
    of the reference attention, with a random upstream gradient. Bound per entry: ``δ`` times its terms' magnitudes
    (:func:`_gradient_bounds`) plus its rounding to the dtype, where ``δ`` adds the probabilities' relative errors
    (fp32 scores over ``D`` terms at their magnitude; the forward's log-sum-exp off by the q/k grids and the
    probabilities' 2^-24 grid, ``L`` of them in a sum ≥ 1), the output's rounding, and fp32 sums of ``L + D``
    terms."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v, do = (torch.randn(T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv, Hq))
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    scale = D**-0.5
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ba, "PAIRS_PER_CALL", pairs)
        grads = torch.autograd.grad(ba.varlen_attention(q, k, v, cu, scale), (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    refs = torch.autograd.grad(_attention_ref(qd, kd, vd, lengths, scale), (qd, kd, vd), do.double())
    qa, ka = qd.detach().abs(), kd.detach().abs()
    scores = scale * qa.sum(-1).amax() * ka.amax()
    score_grid = scale * 2.0 ** -min(bi.product_bits(D), 24) * 2 * qa.amax() * ka.sum(-1).amax()
    L = max(lengths)
    delta = ((D + 2) * EPS32 * scores + 4 * score_grid + 2 * L * 2.0**-24 + EPS[dtype] + (L + D) * EPS32).item()
    for got, ref, terms in zip(grads, refs, _gradient_bounds(q.detach(), k.detach(), v.detach(), do, lengths, scale)):
        assert ((got.double() - ref).abs() <= 2 * delta * terms + EPS[dtype] * ref.abs() + 1e-30).all()


@settings(max_examples=6)
@given(B=st.integers(1, 3), blocks=st.integers(1, 3), first=st.integers(0, 2), G=st.sampled_from([1, 3]),
       D=st.sampled_from([3, 16]), seed=st.integers(0, 1000))
def test_blocks_sum_in_one_order(B, blocks, first, G, D, seed):
    """The fp64 sums before the final rounding (where a change of order would show only rarely): a packed forward's
    reshaped reading of each query's own blocks (``dense_blocks``) gives the bits of the per-query reading
    (``small_blocks``, ``diagonal_block``), and the diagonal is the plain left-to-right sum from 0; values spread
    over 2^48 so that the order matters."""
    g = torch.Generator().manual_seed(seed)
    BB = ba.BIG_BLOCK
    M = blocks * BB  # whole big blocks of queries; a short call (first 0, one block): whole small blocks
    if first == 0 and blocks == 1:
        M = ba.KEY_BLOCK * int(torch.randint(1, BB // ba.KEY_BLOCK + 1, (1,), generator=g))
    L = first * BB + M
    qpos = torch.arange(first * BB, first * BB + M).expand(B, M)
    pi = (torch.rand(B, 2, G * M, L, generator=g) * 2**24).round().double()
    pi = pi.masked_fill(torch.arange(L) > qpos.repeat(1, G).view(B, 1, G * M, 1), 0.0)
    v = torch.randn(B, 2, L, D, generator=g) * 2.0 ** torch.randint(-24, 24, (B, 2, L, D), generator=g)
    small, diagonal = ba.dense_blocks(pi, v, first * BB, M)
    assert torch.equal(small, ba.small_blocks(pi, v, qpos))
    with pytest.MonkeyPatch.context() as mp:  # one small block at a time
        mp.setattr(ba, "BLOCK_PRODUCTS", 0)
        assert torch.equal(small, ba.small_blocks(pi, v, qpos))
    assert torch.equal(diagonal, ba.diagonal_block(pi, v, qpos))
    for b, m, row in ((0, 0, 0), (B - 1, M - 1, G * M - 1)):
        p = int(qpos[b, m])
        want = torch.zeros(D, dtype=torch.float64)
        for j in range(p - p % ba.KEY_BLOCK, p - p % ba.KEY_BLOCK + ba.KEY_BLOCK):
            want = want + pi[b, 1, row, j] * v[b, 1, j].double()
        assert torch.equal(diagonal[b, 1, row], want)


@settings(max_examples=10)
@given(N=st.integers(1, 30), H=st.integers(1, 48), V=st.sampled_from([7, 300, bi.VOCAB_TILE, bi.VOCAB_TILE + 5, 5000]),
       temperature=st.sampled_from([1.0, 0.7, 1.3]), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), rows=st.sampled_from([bi.ROWS_PER_CHUNK, 3]),
       seed=st.integers(0, 1000))
def test_logprobs_equal_the_engine_head_and_are_accurate(N, H, V, temperature, bias, dtype, rows, seed):
    """The trainer's ``linear_logprobs`` (one vocabulary tile at a time, rows in chunks) gives every token the bits the
    engine gets from its full logits row (``linear`` then ``logsumexp_tiles`` and ``token_logprobs``)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 3 / math.sqrt(H)).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    inv_temp = 1.0 / temperature
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bi, "ROWS_PER_CHUNK", rows)
        logp, lse, ent = bi.linear_logprobs(h, w, b, y, inv_temp, True)
    logits = bi.linear(h, w, b, out_dtype=torch.float32)
    engine_lse = bi.logsumexp_tiles(logits, inv_temp)
    assert torch.equal(engine_lse, lse)
    assert torch.equal(bi.token_logprobs(logits, y, inv_temp, engine_lse), logp)
    z = (h.double() @ w.double().t() + (0 if b is None else b.double())) * inv_temp
    ref = torch.log_softmax(z, -1)
    bits = bi.product_bits(H)
    zmax = z.abs().amax(-1)
    grid = 2.0**-bits * 2 * h.double().abs().amax(-1) * w.double().abs().sum(-1).amax() * inv_temp
    bound = 4 * EPS32 * zmax + 2 * grid + 2.0**-30
    assert ((logp.double() - ref.gather(1, y[:, None]).squeeze(1)).abs() <= bound).all()
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert ((ent.double() - ref_ent).abs() <= 8 * EPS32 * (zmax + ref_ent.abs()) + 2 * grid).all()


def test_self_check_passes_here_and_refuses_a_position_dependent_exp(monkeypatch):
    bi.self_check()
    exp = torch.exp

    def tail_differs(x):  # a kernel whose scalar tail rounds otherwise: the last element of an odd length
        out = exp(x)
        if x.numel() % 2:
            out[-1:] = torch.nextafter(out[-1:], torch.full_like(out[-1:], math.inf))
        return out

    monkeypatch.setattr(torch, "exp", tail_differs)
    with pytest.raises(RuntimeError, match="exp on cpu gives"):
        bi.self_check()


def test_invariant_forward_needs_the_ops_registered():
    assert not bi.enabled()
    with pytest.raises(RuntimeError, match="registered"), bi.invariant_forward():
        pass


@settings(max_examples=25, deadline=None)
@given(device=st.sampled_from(["cpu", "cuda"]), heads=st.sampled_from([(1, 1), (4, 2), (12, 2), (16, 8)]),
       L=st.integers(1, 1 << 16), M=st.integers(1, 512), D=st.sampled_from([64, 128]))
def test_rows_per_call_fill_the_devices_bound(device, heads, L, M, D):
    """A call's rows hold at most the device's chunk bytes of fp64 temporaries (``8 · Hkv · L · (2D + 2M · G)`` a
    row: K and V, the scores and π) and as many rows as fit, at least one; CUDA's bounds are the ``CUDA_*`` ones, not
    the CPU's (whose 16 MiB ran a 1.5B decode step's 256 rows of 4096 keys one call a row)."""
    Hq, Hkv = heads
    dev = torch.device(device)  # a device name only: no tensor is made on it
    cuda = (ba.CUDA_PAIRS_PER_CALL, ba.CUDA_BLOCK_PRODUCTS, ba.CUDA_CHUNK_BYTES)
    assert ba.split_bounds(dev) == (cuda if device == "cuda" else (ba.PAIRS_PER_CALL, ba.BLOCK_PRODUCTS,
                                                                   ba.CHUNK_BYTES))
    chunk = ba.split_bounds(dev)[2]
    per_row = 8 * Hkv * L * (2 * D + 2 * M * (Hq // Hkv))
    rows = ba.rows_per_call(dev, Hq, Hkv, L, M, D)
    assert rows >= 1 and (rows == 1 or rows * per_row <= chunk) and (rows + 1) * per_row > chunk
    # the 1.5B model's heads (12 / 2 x 128), one decode step of 256 rows at 4096 keys: calls a layer
    calls = -(-256 // ba.rows_per_call(dev, 12, 2, 4096, 1, 128))
    assert calls == (5 if device == "cuda" else 256)


@settings(max_examples=30)
@given(device=st.sampled_from(["cpu", "cuda"]), heads=st.sampled_from([(4, 2), (12, 2), (16, 8), (28, 4), (32, 8)]),
       blocks=st.integers(1, 256), D=st.sampled_from([16, 64, 128]))
def test_packed_calls_fit_the_devices_bounds(device, heads, blocks, D):
    """A packed forward's query chunk (``query_chunk``) keeps a row's fp64 temporaries within the device's chunk bytes
    and its pairs a head within the pairs bound, whatever the query heads (they grew with them: 28 heads at 2048
    tokens counted 1.8 GiB against CUDA's 1 GiB), in whole big blocks (``dense_blocks`` reads whole blocks), or
    the whole sequence when it fits."""
    Hq, Hkv = heads
    dev = torch.device(device)  # a device name only: no tensor is made on it
    L = blocks * ba.BIG_BLOCK
    pairs, _, chunk_bytes = ba.split_bounds(dev)
    chunk = ba.query_chunk(dev, L, Hkv, D, Hq)
    assert chunk == L or (chunk % ba.BIG_BLOCK == 0 and 0 < chunk < L)
    if chunk > ba.BIG_BLOCK:  # one big block is the floor
        assert 8 * Hkv * L * (2 * D + 2 * chunk * (Hq // Hkv)) <= chunk_bytes and chunk * L <= pairs
    if chunk < L:  # no larger whole-block chunk would fit
        bigger = chunk + ba.BIG_BLOCK
        assert 8 * Hkv * L * (2 * D + 2 * bigger * (Hq // Hkv)) > chunk_bytes or bigger * L > pairs


def test_empty_sequences_attend_to_nothing():
    """Sequences of length 0 in a packed batch (a group of them alone) are skipped, forward and backward: the others'
    outputs and gradients are those of the batch without them."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(300, h, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    # the two empty ones form a group of their own: 3 · 300² pairs exceed PAIRS_PER_CALL
    with_empty, alone = torch.tensor([0, 0, 0, 300], dtype=torch.int32), torch.tensor([0, 300], dtype=torch.int32)
    outs = [ba.varlen_attention(q, k, v, cu, 8**-0.5) for cu in (with_empty, alone)]
    assert torch.equal(outs[0], outs[1])
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
