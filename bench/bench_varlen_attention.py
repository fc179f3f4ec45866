"""Benchmark packed causal GQA attention (``varlen_attention``) against PyTorch's own kernels.

The packed row holds whole documents (GPU: 32768 tokens from documents of 16K, 8K, 4K, 2K, 1K, 512 and 512 tokens),
causal within each document. Methods, all measured in the same run on the same data:

- ``fastgrpo``: :func:`fastgrpo.kernels.varlen_attention.varlen_attention` (Triton on GPU, per-sequence SDPA on CPU).
- ``torch varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside PyTorch; GPU, when the
  installed torch has it).
- ``flex``: ``flex_attention`` compiled, with a block mask ``same document and q ≥ k`` (GPU).
- ``padded sdpa``: every document padded to the longest, ``[B, H, T_max, D]``, ``scaled_dot_product_attention``
  with ``is_causal`` (flash backend on GPU); k/v expanded to the query heads; the padding itself is not timed.

Useful FLOPs only (padding and masked-out scores are not counted): a causal document of L tokens has
``P = L(L + 1)/2`` visible (query, key) pairs per query head; forward ``4·D·P`` (QKᵀ and PV), backward ``10·D·P``
(QKᵀ recomputed, dV, dP, dQ, dK), both ``14·D·P``, summed over heads and documents. ``bwd`` times the backward alone
(a retained graph); ``fwd`` runs without autograd. GPU ceiling: the bf16 matmul rate measured in the same run.

    python bench/bench_varlen_attention.py            # GPU: (Hq, Hkv, D) = (12, 2, 128) and (32, 8, 128), bf16
                                                      # CPU: 2048 tokens, (12, 2, 64), fp32: torch path vs padded
    python bench/bench_varlen_attention.py --quick    # CPU: 528 tokens
    python bench/bench_varlen_attention.py --no-flex  # skip FlexAttention (its compile takes a while)

Rows go to ``bench/results/varlen_attention.csv`` (appended after each method, so a timeout keeps what finished).
Targets (issue 6): GPU fwd+bwd ≥ 1.0× torch varlen (aim 1.3×); forward ≥ 45% of the bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F
from common import append_rows, matmul_tflops, median_ms, peak_extra_bytes, print_table
from fastgrpo.kernels._utils import pad_packed, seq_index
from fastgrpo.kernels.varlen_attention import varlen_attention

GPU_DOCS = [16384, 8192, 4096, 2048, 1024, 512, 512]  # 32768 tokens
CPU_DOCS = [1024, 512, 256, 128, 64, 64]  # 2048 tokens
CPU_QUICK_DOCS = [256, 128, 64, 32, 32, 16]  # 528 tokens


def causal_flops(lengths, Hq, D):
    """(forward, backward) useful FLOPs of causal attention over the documents."""
    pairs = sum(L * (L + 1) // 2 for L in lengths)
    return 4 * D * pairs * Hq, 10 * D * pairs * Hq


def _torch_varlen():
    """``varlen_attn`` with causal masking and GQA, adapted to the installed signature; None when absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal_kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in params

    def run(q, k, v, cu, max_len):
        if native_gqa:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, enable_gqa=True, **causal_kw)
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal_kw)

    return run


def _flex(cu, T, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = seq_index(cu, T)  # [T] document of every token

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, None, None, T, T, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)


def _methods(lengths, Hq, Hkv, D, dtype, device, flex):
    """name → (inputs as leaves, fn(*inputs) → output): every method sees the same q/k/v values."""
    torch.manual_seed(0)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(T, Hq, D, device=device, dtype=dtype)  # [T, Hq, D]
    k = torch.randn(T, Hkv, D, device=device, dtype=dtype)  # [T, Hkv, D]
    v = torch.randn(T, Hkv, D, device=device, dtype=dtype)
    packed = [x.clone().requires_grad_() for x in (q, k, v)]
    methods = {}  # the first one is the baseline of the speedup column
    tv = _torch_varlen() if device == "cuda" else None
    if tv is not None:
        methods["torch varlen"] = (packed, lambda q, k, v: tv(q, k, v, cu, max(lengths)))
    methods["fastgrpo"] = (packed, lambda q, k, v: varlen_attention(q, k, v, cu, max(lengths)))
    group = Hq // Hkv
    padded = [pad_packed(x.repeat_interleave(n, dim=1), cu).transpose(1, 2).contiguous().requires_grad_()
              for x, n in ((q, 1), (k, group), (v, group))]  # [B, Hq, T_max, D]

    def sdpa(q, k, v):
        if device == "cuda":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    methods["padded sdpa"] = (padded, sdpa)
    if tv is None:  # no torch varlen (CPU, older torch): padded SDPA is the baseline
        methods = {"padded sdpa": methods.pop("padded sdpa"), **methods}
    if flex and device == "cuda":
        heads_first = [x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v)]  # [1,H,T,D]
        methods["flex"] = (heads_first, _flex(cu, T, device))
    return methods


def run_case(lengths, Hq, Hkv, D, dtype, device, flex, mm_tflops):
    fwd_flops, bwd_flops = causal_flops(lengths, Hq, D)
    shape = {"tokens": sum(lengths), "docs": "/".join(map(str, lengths)), "Hq": Hq, "Hkv": Hkv, "D": D,
             "dtype": str(dtype).removeprefix("torch.")}
    rows = []
    reps = {"warmup": 1, "rep": 5}
    for name, (inputs, fn) in _methods(lengths, Hq, Hkv, D, dtype, device, flex).items():
        out = fn(*inputs)
        grad_out = torch.randn_like(out)

        def fwd(fn=fn, inputs=inputs):
            with torch.no_grad():
                return fn(*inputs)

        def bwd(out=out, inputs=inputs, grad_out=grad_out):
            return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

        def fwd_bwd(fn=fn, inputs=inputs, grad_out=grad_out):
            return torch.autograd.grad(fn(*inputs), inputs, grad_out)

        times = {case: median_ms(f, device, **reps) for case, f in (("fwd", fwd), ("bwd", bwd), ("fwd+bwd", fwd_bwd))}
        del out
        peak = peak_extra_bytes(fwd_bwd, device) / 2**20
        new = []
        for case, flops in (("fwd", fwd_flops), ("bwd", bwd_flops), ("fwd+bwd", fwd_flops + bwd_flops)):
            row = {**shape, "method": name, "case": case, "ms": times[case], "TFLOP/s": flops / times[case] / 1e9,
                   "peak_extra_MiB": peak}
            if mm_tflops:
                row["matmul_TFLOP/s"] = mm_tflops
                row["frac_of_matmul"] = row["TFLOP/s"] / mm_tflops
            base = next((b for b in rows if b["case"] == case), row)
            row["baseline"] = base["method"]
            row["speedup_vs_baseline"] = base["ms"] / row["ms"]
            new.append(row)
        rows += new
        append_rows("varlen_attention", new, device)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small CPU case (528 tokens)")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline (GPU)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        mm = matmul_tflops()
        print(f"bf16 matmul {mm:.0f} TFLOP/s")
        cases = [(GPU_DOCS, 12, 2, 128, torch.bfloat16), (GPU_DOCS, 32, 8, 128, torch.bfloat16)]
    else:
        mm = None
        cases = [(CPU_QUICK_DOCS if args.quick else CPU_DOCS, 12, 2, 64, torch.float32)]
    for lengths, Hq, Hkv, D, dtype in cases:
        rows = run_case(lengths, Hq, Hkv, D, dtype, device, not args.no_flex, mm)
        print_table(rows, f"\nvarlen_attention {sum(lengths)} tokens ({len(lengths)} documents) Hq={Hq} Hkv={Hkv} "
                          f"D={D} {dtype} causal on {device}")


if __name__ == "__main__":
    main()
