"""gumbel_sample against the closed form: the returned log-prob is ``log_softmax(logits / T)[token]``, a row's seed
fixes its draw whatever the other rows are, and (GPU, many rows) the tokens follow ``softmax(logits / T)``; each path
equals ``gumbel_sample_ref`` on the uniforms ``uniform_rows`` gives for the same seeds; ``inverse_cdf_sample`` against
the exact counts of a grid of uniforms and against every boundary of an exactly representable CDF."""

import itertools
import random

import pytest
import torch
from checks import kernel_device, total_variation
from fastgrpo.kernels import sampling
from fastgrpo.kernels.reference import gumbel_sample_ref
from fastgrpo.kernels.sampling import gumbel_sample
from hypothesis import given, settings
from hypothesis import strategies as st

LOGP_ATOL = 1e-5  # fp32 log-sum-exp over a few thousand entries, different summation order



def sample_rows(device, rows, V, temperature, fn=gumbel_sample):
    """``rows`` copies of one row of V logits (V > 2 048: several inner blocks of the kernel): checks the log-prob
    against the closed form and that the seed determines the draw; returns the tokens and softmax(logits / T)."""
    g = torch.Generator().manual_seed(3)
    logits_V = 3 * torch.randn(V, generator=g)
    logits_SV = logits_V.expand(rows, V).to(device)
    seeds = 12345 + 7919 * torch.arange(rows, device=device)
    tok, logp = fn(logits_SV, temperature, seeds)
    assert tok.dtype == torch.int64 and logp.dtype == torch.float32 and tok.shape == logp.shape == (rows,)
    ref = torch.log_softmax(logits_V / temperature, dim=-1)[tok.cpu()]
    torch.testing.assert_close(logp.cpu(), ref, atol=LOGP_ATOL, rtol=0)
    tok2, _ = fn(logits_SV, temperature, seeds)
    assert torch.equal(tok, tok2)  # the seeds determine the draw
    tok3, _ = fn(logits_SV[1:].flip(0), temperature, seeds[1:].flip(0))
    assert torch.equal(tok3.flip(0), tok[1:])  # a row's draw depends on its own seed, not on its index or batch
    return tok.cpu(), torch.softmax(logits_V.double() / temperature, dim=-1)


def test_kernel_logprobs_and_seed():
    """On CUDA, or under the interpreter (slow: 24 rows only); the distribution is the GPU test's."""
    tok, _ = sample_rows(kernel_device(), 24, 2500, 0.7)
    assert len(set(tok.tolist())) > 1  # rows draw independently


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_equals_reference_on_uniform_rows(path):
    """Each path is the reference formula on the uniforms ``uniform_rows`` gives for the same seeds (the torch path:
    a generator seeded with ``seeds[r] mod 2^31`` per row)."""
    device = kernel_device() if path == "kernel" else "cpu"
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3000, generator=g).to(device, torch.bfloat16)
    seeds = torch.tensor([77, 3, 2**40 + 77, 9, 77, 2**31 - 1], device=device)
    if path == "kernel":
        tok, logp = gumbel_sample(logits, 0.8, seeds)
        u = sampling.uniform_rows(seeds, 3000)
    else:
        tok, logp = sampling._gumbel_sample_torch(logits, 0.8, seeds)
        u = sampling.uniform_rows_torch(seeds, 3000)
        row0 = torch.rand(3000, generator=torch.Generator().manual_seed(77))
        assert torch.equal(u[0], row0)
    assert torch.equal(u[0], u[2]) and torch.equal(u[0], u[4]) and not torch.equal(u[0], u[1])
    assert ((u >= 0) & (u < 1)).all()
    ref_tok, ref_logp = gumbel_sample_ref(logits, 0.8, u)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logp, ref_logp, atol=LOGP_ATOL, rtol=0)


def test_torch_path_distribution():
    """4 000 draws of the plain-torch path against softmax(logits / T) by total variation."""
    tok, want = sample_rows("cpu", 4000, 50, 0.6, fn=sampling._gumbel_sample_torch)
    tv, expected_tv = total_variation(tok, want)
    assert tv < 4 * expected_tv


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_kernel_distribution(temperature):
    """20 000 draws against softmax(logits / T) by total variation."""
    tok, want = sample_rows("cuda", 20_000, 5000, temperature)
    tv, expected_tv = total_variation(tok, want)
    assert tv < 4 * expected_tv


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logits=torch.zeros(2, 3, dtype=torch.long)), r"logits must have dtype"),
        (dict(logits=torch.zeros(3, 2).t()), r"logits must have unit stride"),
        (dict(temperature=0.0), r"temperature must be a positive number"),
        (dict(seeds=torch.tensor([1, 2, 3])), r"seeds has shape"),
        (dict(seeds=torch.tensor([1, 2], dtype=torch.int32)), r"seeds must have dtype"),
    ],
    ids=["logits-dtype", "logits-stride", "temperature", "seeds-shape", "seeds-dtype"],
)
def test_bad_input_raises(kwargs, match):
    args = dict(logits=torch.zeros(2, 3), temperature=1.0, seeds=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=match):
        gumbel_sample(**{**args, **kwargs})


@pytest.mark.parametrize("layout", ["row-major", "vocab-major"])
@pytest.mark.parametrize("V", [1, 7, 300, 1024], ids=["V1", "V7", "V300", "V1024"])
def test_inverse_cdf_sample_on_a_grid_of_uniforms(V, layout):
    """A deterministic grid of N uniforms u = (i + ½)/N over one row of weights (zeros included, V not a multiple of
    the block): token v is drawn for the u in [C[v−1], C[v]) / C[V−1], an interval of length p_v, so its count is
    within 1 of N·p_v (exact, no sampling noise); zero weights are never drawn, u → 1 draws the last positive weight,
    and the returned total is Σ w. Row-major weights, or vocabulary-major (a transposed ``[V, N]`` tensor, as the
    engine's CPU logits are)."""
    g = torch.Generator().manual_seed(V)
    w = torch.rand(V, generator=g) ** 4  # from ~1 down to tiny weights
    w[torch.randperm(V, generator=g)[: V // 3]] = 0.0
    w[-1] = 0.0 if V > 1 else 1.0  # a zero tail: the last draw must skip it
    N = 20_000
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    w_NV = w.expand(N, V) if layout == "row-major" else w[:, None].repeat(1, N).t()
    tok, total = sampling.inverse_cdf_sample(w_NV, u)
    assert tok.dtype == torch.int64 and tok.shape == (N,)
    torch.testing.assert_close(total, w.double().sum().expand(N), rtol=1e-6, atol=0)
    counts = torch.bincount(tok, minlength=V).double()
    p = w.double() / w.double().sum()
    assert (counts[p == 0] == 0).all()
    assert ((counts - N * p).abs() <= 1.0 + 1e-6).all()
    assert torch.equal(tok.diff() >= 0, torch.ones(N - 1, dtype=torch.bool))  # monotone in u
    last, _ = sampling.inverse_cdf_sample(w[None], torch.tensor([1.0 - 2.0**-53], dtype=torch.float64))
    assert last.item() == int(torch.nonzero(w).max())


def test_inverse_cdf_sample_is_scale_free():
    """Weights of 1e-30 alone in their row split the draws in proportion (no absolute threshold); each row is drawn
    from its own weights and uniform."""
    w = torch.tensor([[0.0, 1e-30, 0.0, 3e-30], [0.0, 1e-30, 0.0, 3e-30], [0.0, 0.0, 3.0, 0.0]])
    u = torch.tensor([0.2, 0.3, 0.999], dtype=torch.float64)
    tok, _ = sampling.inverse_cdf_sample(w, u)
    assert tok.tolist() == [1, 3, 2]  # C / total = [0, 0.25, 0.25, 1]


@settings(max_examples=40)
@given(V=st.sampled_from([1, 2, 3, 7, 64, 300, 1025]), seed=st.integers(0, 2**32 - 1),
       zeros=st.sampled_from([0.0, 0.3, 0.8]), run=st.booleans(), ends=st.booleans(),
       layout=st.sampled_from(["row-major", "vocab-major"]))
def test_inverse_cdf_sample_on_exact_boundaries(V, seed, zeros, run, ends, layout):
    """Uniforms exactly on the CDF's boundaries. Integer weights (zeros scattered, in a run that may cover whole
    blocks of the two-level CDF, first and last) with a power-of-two total ``P``: every cumulative sum is exact in
    fp32 and fp64, and so are ``u = C_k / P`` and ``u · P = C_k``. Token v owns ``[C_{v−1}, C_v)``, so ``u · P = C_k``
    must draw the first v with ``C_v > C_k`` (Python integers): the next positive weight, never a zero weight, at
    every boundary (``u = 0``, each block's end, the start of the last positive weight) and at ``u = 1 − 2⁻⁵³``."""
    rng = random.Random(seed)
    w = [0 if rng.random() < zeros else rng.randint(1, 60) for _ in range(V)]
    if run:
        a, b = sorted(rng.sample(range(V + 1), 2))
        w[a:b] = [0] * (b - a)
    if ends:
        w[0] = w[-1] = 0
    if not any(w):
        w[rng.randrange(V)] = 1
    P = 1 << (sum(w) - 1).bit_length()
    w[rng.choice([v for v in range(V) if w[v]])] += P - sum(w)  # total P (< 2^24: fp32 sums of the blocks exact)
    C = [0, *itertools.accumulate(w)]  # C[k]: the weight of tokens < k
    bounds = sorted({c for c in C if c < P})
    want = [next(v for v in range(V) if C[v + 1] > c) for c in bounds] + [max(v for v in range(V) if w[v])]
    u = torch.tensor([c / P for c in bounds] + [1.0 - 2.0**-53], dtype=torch.float64)
    w_V = torch.tensor(w, dtype=torch.float32)
    N = len(u)
    w_NV = w_V.expand(N, V) if layout == "row-major" else w_V[:, None].repeat(1, N).t()
    tok, total = sampling.inverse_cdf_sample(w_NV, u)
    assert all(w[t] > 0 for t in tok.tolist()), "a zero weight was drawn"
    assert tok.tolist() == want
    assert (total == P).all()


def test_inverse_cdf_sample_boundary_inside_a_block():
    """V = 7 (blocks of 2): block 0 holds [1, 48], mass 49, total 64. u = 1/64 lies on C_0 = 1, the start of token 1;
    as a fraction of the block, (1 / 49) · 49 rounds below 1 in fp64 and would draw token 0."""
    w = torch.tensor([[1.0, 48.0, 0.0, 0.0, 15.0, 0.0, 0.0]])
    tok, _ = sampling.inverse_cdf_sample(w, torch.tensor([1 / 64], dtype=torch.float64))
    assert tok.tolist() == [1]


@settings(max_examples=10)
@given(S=st.integers(1, 6), V=st.integers(2, 3000), bad=st.sampled_from([float("nan"), float("inf")]),
       seed=st.integers(0, 1000))
def test_inverse_cdf_sample_names_non_finite_rows(S, V, bad, seed):
    """A row whose weights hold a NaN or an inf (the logits of an overflowed model) raises a ValueError naming it,
    instead of an out-of-range index; the finite rows alone still draw."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(S, V, generator=g)
    row = seed % S
    w[row, seed % V] = bad
    u = torch.rand(S, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"non-finite weights \(logits\) in rows \[{row}\]"):
        sampling.inverse_cdf_sample(w, u)
    keep = torch.arange(S) != row
    if keep.any():
        tokens, _ = sampling.inverse_cdf_sample(w[keep], u[keep])
        assert ((tokens >= 0) & (tokens < V)).all()
