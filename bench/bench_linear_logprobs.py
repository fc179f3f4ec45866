"""fused_linear_logprobs against the eager composition (materialised logits), side by side in one run.

    python bench/bench_linear_logprobs.py            # CPU: N=4096, H=256, V=32000 fp32; GPU: the issue's sizes
    python bench/bench_linear_logprobs.py --quick    # smaller shapes, for a smoke run

CPU (plain-torch chunked path): forward (no grad, as for old/reference log-probs) and forward+backward, median
time and peak extra resident memory against ``hidden @ weightᵀ`` → ``log_softmax`` → gather.
GPU (Triton kernel): N=16384, H=1536, V=151936 bf16 forward+backward; effective TFLOP/s counting four
N×H×V matmuls (forward, recompute, grad hidden, grad weight: 8·N·H·V FLOPs) against ``torch.mm`` of the same
``[N, H] @ [H, V]`` measured in this run, against eager torch and against ``torch.compile`` of a chunked torch
version (token chunks; logits, softmax and both grads of each chunk formed in the compiled function, as
Liger-Kernel's chunked loss does). Peak extra memory includes the gradients every variant returns.
Both: the accuracy effect of ``grad_filter_eps`` on a confident (low-entropy) distribution.
Rows go to ``bench/results/linear_logprobs.csv``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from common import append_rows, device_name, median_ms, peak_extra_bytes, print_table, sync

os.environ.pop("TRITON_INTERPRET", None)  # on CPU this benchmark measures the plain-torch path

from fastgrpo.kernels.linear_logprobs import fused_linear_logprobs  # noqa: E402
from fastgrpo.kernels.reference import linear_logprobs_ref  # noqa: E402

FILTER_EPS = 2.0**-12  # Cut Cross-Entropy's default for bf16: below bf16's resolution next to 1


def eager_logprobs(hidden, weight, targets):
    """What a trainer does without fusion: full logits, fp32 log-softmax, gather."""
    logits = hidden @ weight.t()  # [N, V]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def make_chunked_compiled(chunk):
    """Liger-style chunked torch: per token chunk, the compiled function forms logp and both grads in closed form."""

    @torch.compile(dynamic=False)
    def chunk_fwd_bwd(h_cH, w_VH, y_c, g_c):
        logits = (h_cH @ w_VH.t()).float()  # [c, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp_c = logp_all.gather(-1, y_c[:, None]).squeeze(-1)
        onehot = torch.zeros_like(logits).scatter_(-1, y_c[:, None], 1.0)
        dz = (g_c[:, None] * (onehot - logp_all.exp())).to(h_cH.dtype)  # [c, V]
        return logp_c, dz @ w_VH, (dz.t() @ h_cH).float()

    def run(hidden, weight, targets, g):
        gw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        logps, ghs = [], []
        for n0 in range(0, hidden.shape[0], chunk):
            logp_c, gh_c, gw_c = chunk_fwd_bwd(hidden[n0:n0 + chunk], weight, targets[n0:n0 + chunk],
                                               g[n0:n0 + chunk])
            logps.append(logp_c)
            ghs.append(gh_c)
            gw += gw_c
        return torch.cat(logps), torch.cat(ghs), gw.to(weight.dtype)

    return run


def fwd_bwd(fn, h, w, y, g):
    """Forward and backward through autograd; returns (logp, grad_h, grad_w)."""
    logp = fn(h, w, y)
    gh, gw = torch.autograd.grad(logp, (h, w), grad_outputs=g)
    return logp, gh, gw


def confident_inputs(N, H, V, dtype, device, scale):
    """A low-entropy distribution like a trained LM's: hidden rows aligned with their target's head row."""
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(V, H, device=device, generator=g) / math.sqrt(H)
    y = torch.randint(0, V, (N,), device=device, generator=g)
    h = scale * w[y] + torch.randn(N, H, device=device, generator=g) / math.sqrt(H)
    return h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(), y


def filter_accuracy(N, H, V, dtype, device, scale):
    """Relative max error of the grads with the filter on, its time ratio, and the distribution's mean entropy."""
    h, w, y = confident_inputs(N, H, V, dtype, device, scale)
    g = torch.randn(N, device=device)
    with torch.no_grad():
        _, ent = fused_linear_logprobs(h, w, y, return_entropy=True)
    exact = fwd_bwd(fused_linear_logprobs, h, w, y, g)

    def filtered_fn(hh, ww, yy):
        return fused_linear_logprobs(hh, ww, yy, grad_filter_eps=FILTER_EPS)

    filt = fwd_bwd(filtered_fn, h, w, y, g)
    rel = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(filt[1:], exact[1:])]
    t_exact = median_ms(lambda: fwd_bwd(fused_linear_logprobs, h, w, y, g), device, rep=3)
    t_filt = median_ms(lambda: fwd_bwd(filtered_fn, h, w, y, g), device, rep=3)
    return dict(mean_entropy=ent.mean().item(), rel_err_grad_h=rel[0], rel_err_grad_w=rel[1],
                filter_speedup=t_exact / t_filt)


def run_cpu(N, H, V):
    dtype, device = torch.float32, "cpu"
    g0 = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g0).requires_grad_()
    w = (torch.randn(V, H, generator=g0) / math.sqrt(H)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g0)
    g = torch.randn(N, generator=g0)
    shape = dict(N=N, H=H, V=V, dtype="fp32")
    variants = {"eager": eager_logprobs, "fused": fused_linear_logprobs}
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        res = {}
        for name, fn in variants.items():
            if mode == "fwd":
                def call(fn=fn):
                    with torch.no_grad():
                        return fn(h, w, y)
            else:
                def call(fn=fn):
                    return fwd_bwd(fn, h, w, y, g)
            res[name] = (median_ms(call, device, warmup=1, rep=3), peak_extra_bytes(call, device))
        (te, me), (tf, mf) = res["eager"], res["fused"]
        rows.append(dict(**shape, mode=mode, eager_ms=te, fused_ms=tf, speedup=te / tf, eager_peak_mib=me / 2**20,
                         fused_peak_mib=mf / 2**20, peak_ratio=mf / me))
    acc = filter_accuracy(N, H, V, dtype, device, scale=13.0)
    rows.append(dict(**shape, mode="grad_filter", filter_eps=FILTER_EPS, **acc))
    load = os.getloadavg()[0]  # the machine is shared: a loaded one slows the many-op chunked path most
    return [dict(r, threads=torch.get_num_threads(), loadavg=load) for r in rows]


def run_gpu(N, H, V):
    dtype, device = torch.bfloat16, "cuda"
    g0 = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, H, device=device, generator=g0).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g0) / math.sqrt(H)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (N,), device=device, generator=g0)
    g = torch.randn(N, device=device, generator=g0)
    shape = dict(N=N, H=H, V=V, dtype="bf16")
    flops = 8 * N * H * V

    h_d = h.detach()
    wt = w.detach().t().contiguous()  # [H, V]
    mm_ms = median_ms(lambda: torch.mm(h_d, wt), device)
    mm_tflops = 2 * N * H * V / mm_ms / 1e9

    def measure(call):
        call()  # compile outside the timing
        sync(device)
        return median_ms(call, device), peak_extra_bytes(call, device)

    tf, mf = measure(lambda: fwd_bwd(fused_linear_logprobs, h, w, y, g))
    te, me = measure(lambda: fwd_bwd(eager_logprobs, h, w, y, g))
    with torch.no_grad():
        ref = linear_logprobs_ref(h[:2048], w, y[:2048])
        err = (fused_linear_logprobs(h[:2048], w, y[:2048]) - ref).abs().max().item()
    row = dict(**shape, mode="fwd+bwd", fused_ms=tf, fused_tflops=flops / tf / 1e9, mm_tflops=mm_tflops,
               frac_of_mm=flops / tf / 1e9 / mm_tflops, fused_peak_mib=mf / 2**20, eager_ms=te, speedup=te / tf,
               eager_peak_mib=me / 2**20, peak_ratio=mf / me, max_abs_err_logp=err)
    acc = filter_accuracy(N // 4, H, V, dtype, device, scale=14.0)
    report([row, dict(**shape, mode="grad_filter", filter_eps=FILTER_EPS, **acc)], device)

    # Last, as torch.compile may take long: the rows above are already written.
    chunked = make_chunked_compiled(chunk=4096)
    tc, mc = measure(lambda: chunked(h.detach(), w.detach(), y, g))
    report([dict(**shape, mode="fwd+bwd", fused_ms=tf, compiled_chunked_ms=tc, speedup=tc / tf,
                 compiled_chunked_peak_mib=mc / 2**20, peak_ratio=mf / mc)], device)


def report(rows, device):
    print_table(rows, f"fused_linear_logprobs on {device_name(device)}")
    print(f"rows appended to {append_rows('linear_logprobs', rows, device)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes for a smoke run")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if torch.cuda.is_available():
        run_gpu(*((2048, 1536, 32768) if args.quick else (16384, 1536, 151936)))
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        report(run_cpu(*((1024, 128, 8000) if args.quick else (4096, 256, 32000))), "cpu")


if __name__ == "__main__":
    main()
