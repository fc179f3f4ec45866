"""decode_attention against ``decode_attention_ref`` (explicit masked scores) by flash-attn's rule.

Kernel (Triton under the interpreter on CPU, compiled on GPU) in the test dtype, reference in the same dtype,
reference in fp32. Inputs are views of a larger cache (strided, longer than T), as the engine passes them; one
slot has a single live key so the later splits of the split-K kernel are empty.
"""

import importlib

import pytest
import torch
from checks import assert_flash, kernel_device
from fastgrpo.kernels.decode_attention import decode_attention
from fastgrpo.kernels.reference import decode_attention_ref

da = importlib.import_module("fastgrpo.kernels.decode_attention")  # the module, even if the package re-exports the op

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def _inputs(S, Hkv, G, D, T, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, Hkv, G, D, generator=g).to(device, dtype)
    cache_k = torch.randn(S + 1, Hkv, T + 9, D, generator=g).to(device, dtype)
    cache_v = torch.randn(S + 1, Hkv, T + 9, D, generator=g).to(device, dtype)
    length = torch.randint(1, T + 1, (S,), generator=g, dtype=torch.int32).to(device)
    length[0] = 1  # a single live key: the later splits are empty
    return q, cache_k[:S, :, :T], cache_v[:S, :, :T], length


def _check(S, Hkv, G, D, T, dtype, device, fn=decode_attention, seed=0):
    q, k, v, length = _inputs(S, Hkv, G, D, T, dtype, device, seed)
    out = fn(q, k, v, length, softmax_scale=0.7 * D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    ref32 = decode_attention_ref(q, k, v, length, softmax_scale=0.7 * D**-0.5)
    ref_lowp = decode_attention_ref(q, k, v, length, softmax_scale=0.7 * D**-0.5, upcast=False)
    assert_flash("out", out, ref32, ref_lowp, ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S,Hkv,G,D,T", [(5, 2, 3, 8, 200), (3, 1, 1, 24, 70), (2, 2, 6, 64, 129)])
def test_matches_reference(dtype, S, Hkv, G, D, T):
    _check(S, Hkv, G, D, T, dtype, kernel_device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path_matches_reference(dtype):
    """The plain-torch path (SDPA with a length mask), which runs on CPU without the interpreter."""
    _check(4, 2, 3, 16, 37, dtype, "cpu", fn=lambda *a, softmax_scale: da._decode_attention_torch(*a, softmax_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("S,Hkv,G,T", [(1, 2, 6, 4097), (64, 8, 4, 1000), (256, 2, 6, 300)])
def test_matches_reference_gpu_d128(S, Hkv, G, T):
    """Qwen2.5-1.5B's head layout (D=128, G=6) in bf16: one slot (many splits) to a full batch (one split)."""
    _check(S, Hkv, G, 128, T, torch.bfloat16, "cuda", seed=S)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v, n: (q.double(), k, v, n), r"q must have dtype"),
        (lambda q, k, v, n: (q, k[:, :1], v[:, :1], n), r"k has shape"),
        (lambda q, k, v, n: (q, k, v[:, :, :-1], n), r"k and v must have the same shape"),
        (lambda q, k, v, n: (q, k, v.transpose(2, 3).contiguous().transpose(2, 3), n), r"v must have unit stride"),
        (lambda q, k, v, n: (q, k, v, n[:-1]), r"lengths has shape"),
        (lambda q, k, v, n: (q, k, v, n.float()), r"lengths must have dtype"),
    ],
    ids=["q-dtype", "k-heads", "v-length", "v-stride", "lengths-shape", "lengths-dtype"],
)
def test_bad_input_raises(change, match):
    q, k, v, length = _inputs(3, 2, 2, 8, 20, torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        decode_attention(*change(q, k, v, length))
