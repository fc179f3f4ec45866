"""paged_decode_attention against ``decode_attention_ref`` (explicit masked scores over each sequence's keys, laid
out contiguously by a plain loop over its block table) by flash-attn's rule.

Kernel (Triton under the interpreter on CPU, compiled on GPU) in the test dtype, reference in the same dtype,
reference in fp32; the plain-torch path (page gather + masked SDPA) the same way, and ``masked_attention`` on
strided row-cache views. Pages are shuffled and shared between
sequences (as prompt pages are), tables are wider than the longest sequence, page counts are odd, one sequence has a
single live key (the later splits of the split-K kernel are empty), and the page pool is a strided view.
"""

import importlib

import pytest
import torch
from checks import assert_flash, attention_floor, kernel_device
from fastgrpo.kernels.decode_attention import paged_decode_attention
from fastgrpo.kernels.reference import decode_attention_ref

da = importlib.import_module("fastgrpo.kernels.decode_attention")  # the module, even if the package re-exports the op

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}  # summation order; plus attention_floor (the scores' scale)


def _inputs(S, Hkv, G, D, page, P, dtype, device, seed=0):
    """q, k/v pages, a block table [S, P] of shuffled pages (page 1 shared by every sequence), lengths."""
    g = torch.Generator().manual_seed(seed)
    pages = S * P + 3
    q = torch.randn(S, Hkv, G, D, generator=g).to(device, dtype)
    pool_k = torch.randn(pages, page, Hkv, D + 5, generator=g).to(device, dtype)[..., :D]  # strided view
    pool_v = torch.randn(pages, page, Hkv, D + 5, generator=g).to(device, dtype)[..., :D]
    table = torch.randperm(pages - 2, generator=g)[: S * P].view(S, P).to(torch.int32) + 2
    table[:, 0] = 1  # a shared first page
    length = torch.randint(1, P * page + 1, (S,), generator=g, dtype=torch.int32)
    length[0] = 1  # a single live key: the later splits are empty
    return q, pool_k, pool_v, table.to(device), length.to(device)


def _contiguous(pool, table, length):
    """[S, Hkv, T, D] of each sequence's keys in order (T = the longest), zero past its length, by a plain loop."""
    S, page = table.shape[0], pool.shape[1]
    T = int(length.max())
    out = torch.zeros(S, pool.shape[2], T, pool.shape[3], dtype=pool.dtype, device=pool.device)
    for s in range(S):
        for j in range(int(length[s])):
            out[s, :, j] = pool[int(table[s, j // page]), j % page]
    return out


def _scores_max(q_SkGD, k_SkTD, scale):
    """The largest |score| over every query and key of a sequence's head group (keys past a length included)."""
    return (torch.einsum("skgd,sktd->skgt", q_SkGD.float(), k_SkTD.float()).abs().max().item() * scale)


def _check(S, Hkv, G, D, page, P, dtype, device, fn=paged_decode_attention, seed=0):
    q, pool_k, pool_v, table, length = _inputs(S, Hkv, G, D, page, P, dtype, device, seed)
    out = fn(q, pool_k, pool_v, table, length, softmax_scale=0.7 * D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    k, v = _contiguous(pool_k, table, length), _contiguous(pool_v, table, length)
    ref32 = decode_attention_ref(q, k, v, length, softmax_scale=0.7 * D**-0.5)
    ref_lowp = decode_attention_ref(q, k, v, length, softmax_scale=0.7 * D**-0.5, upcast=False)
    assert_flash("out", out, ref32, ref_lowp, ATOL[dtype] + attention_floor(_scores_max(q, k, 0.7 * D**-0.5), v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "S,Hkv,G,D,page,P",
    [(5, 2, 3, 8, 16, 13), (3, 1, 1, 24, 7, 11), (2, 2, 6, 64, 64, 3), (4, 2, 2, 16, 1, 9)],
    ids=["gqa3-page16", "mha-page7", "gqa6-page64", "page1"],
)
def test_kernel_matches_reference(dtype, S, Hkv, G, D, page, P):
    _check(S, Hkv, G, D, page, P, dtype, kernel_device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path_matches_reference(dtype):
    """The plain-torch path (page gather + masked SDPA), which runs on CPU without the interpreter."""
    _check(4, 2, 3, 16, 5, 9, dtype, "cpu", fn=da.paged_decode_attention_torch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_attention_on_row_cache_views(dtype):
    """masked_attention as the engine's CPU row cache calls it: q a feature-major view (the step's q/k/v buffer),
    k/v the first S rows and T keys of a wider joint cache ``[R, 2, Hkv, T_max, D]`` (strided views), the keys past
    each length holding other values; the reference's output by flash-attn's rule, and the engine's additive fp32
    mask (0 / -inf) gives exactly the boolean mask's output."""
    S, Hkv, G, D, T, T_max, R = 5, 2, 3, 16, 11, 17, 8
    g = torch.Generator().manual_seed(9)
    q = torch.randn(Hkv * G * D, S, generator=g).to(dtype).t().view(S, Hkv, G, D)
    kv_rows = torch.randn(R, 2, Hkv, T_max, D, generator=g).to(dtype)
    length = torch.randint(1, T + 1, (S,), generator=g)
    length[0] = 1
    live = (torch.arange(T) < length[:, None]).view(S, 1, 1, T)
    k, v = kv_rows[:S, 0, :, :T], kv_rows[:S, 1, :, :T]
    out = da.masked_attention(q, k, v, live, 0.7 * D**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    ref32 = decode_attention_ref(q, k, v, length, softmax_scale=0.7 * D**-0.5)
    ref_lowp = decode_attention_ref(q, k, v, length, softmax_scale=0.7 * D**-0.5, upcast=False)
    assert_flash("out", out, ref32, ref_lowp, ATOL[dtype] + attention_floor(_scores_max(q, k, 0.7 * D**-0.5), v))
    additive = torch.zeros(S, 1, 1, T).masked_fill_(~live, float("-inf"))
    assert torch.equal(da.masked_attention(q, k, v, additive, 0.7 * D**-0.5), out)


def test_kernel_matches_torch_path():
    """Interpreter (or GPU) kernel against the engine's CPU path on the same pages, fp32."""
    q, pool_k, pool_v, table, length = _inputs(6, 2, 4, 32, 16, 5, torch.float32, kernel_device(), seed=3)
    got = paged_decode_attention(q, pool_k, pool_v, table, length)
    want = da.paged_decode_attention_torch(q, pool_k, pool_v, table, length)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("S,Hkv,G,P", [(1, 2, 6, 65), (64, 8, 4, 16), (256, 2, 6, 5)])
def test_matches_reference_gpu_d128(S, Hkv, G, P):
    """Qwen2.5-1.5B's head layout (D=128, G=6) in bf16 with 64-token pages: one sequence (many splits) to a full
    batch (one split)."""
    _check(S, Hkv, G, 128, 64, P, torch.bfloat16, "cuda", seed=S)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v, t, n: (q.double(), k, v, t, n), r"q must have dtype"),
        (lambda q, k, v, t, n: (q, k[:, :, :1], v[:, :, :1], t, n), r"k_pages has shape"),
        (lambda q, k, v, t, n: (q, k, v[:-1], t, n), r"k_pages and v_pages must have the same shape"),
        (lambda q, k, v, t, n: (q, k, v.transpose(1, 3).contiguous().transpose(1, 3), t, n), r"v_pages must have unit"),
        (lambda q, k, v, t, n: (q, k, v, t.long(), n), r"block_table must have dtype"),
        (lambda q, k, v, t, n: (q, k, v, t[:-1], n), r"block_table has shape"),
        (lambda q, k, v, t, n: (q, k, v, t, n[:-1]), r"lengths has shape"),
        (lambda q, k, v, t, n: (q, k, v, t, n.float()), r"lengths must have dtype"),
    ],
    ids=["q-dtype", "k-heads", "v-pages", "v-stride", "table-dtype", "table-shape", "lengths-shape", "lengths-dtype"],
)
def test_bad_input_raises(change, match):
    q, k, v, table, length = _inputs(3, 2, 2, 8, 4, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(*change(q, k, v, table, length))
