"""gumbel_sample against the closed form: the returned log-prob is ``log_softmax(logits / T)[token]``, a row's seed
fixes its draw whatever the other rows are, and (GPU, many rows) the tokens follow ``softmax(logits / T)``; each path
equals ``gumbel_sample_ref`` on the uniforms ``uniform_rows`` gives for the same seeds."""

import pytest
import torch
from checks import kernel_device, total_variation
from fastgrpo.kernels import sampling
from fastgrpo.kernels.reference import gumbel_sample_ref
from fastgrpo.kernels.sampling import gumbel_sample

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
