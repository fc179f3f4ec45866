"""Benchmark ``logprobs_from_logits`` against the eager composition (and ``torch.compile`` of it on GPU).

Baseline ("eager"): ``kernels.reference.logprobs_ref``, i.e. ``log_softmax(logits.float() / T).gather(...)``
(+ ``−Σ p log p`` for the entropy). Measured in the same run, forward and forward+backward (random upstream
gradients for logp and the entropy), with and without the entropy: median time and peak extra memory (outputs
and the logits gradient included), and on GPU the bandwidth in GB/s against the device-to-device copy bandwidth
measured here. Bytes counted: forward reads the logits once; forward+backward reads them twice and writes the
gradient once (3 · N · V · element size). "fastgrpo inplace" is ``inplace_backward=True``: it runs last, because
the gradient overwrites the logits (its timed calls after the first see gradient values as logits; the kernels'
cost does not depend on the values).

    python bench/bench_logprobs.py            # CPU: N=4096 V=32000 fp32 (torch path); GPU: N=16384 V=151936 bf16
    python bench/bench_logprobs.py --quick    # CPU: N=1024
    python bench/bench_logprobs.py --no-compile         # GPU: skip torch.compile
    python bench/bench_logprobs.py --compile-entropy    # GPU: also compile the entropy variant (two more compiles)

Rows go to ``bench/results/logprobs.csv``, appended after each method (a timeout keeps what finished); CPU
peak memory is ``common.peak_extra_bytes``: the RSS high-water mark, made exact for glibc's freed blocks.
Targets (issue 2): GPU fwd+bwd ≥ 85% of copy bandwidth, ≥ 3× faster than eager, ≤ 1/3 of its peak extra memory;
CPU ≤ 1/4 of eager's peak extra memory and no slower.
"""

from __future__ import annotations

import argparse

import torch
from common import append_rows, copy_bandwidth_gbps, median_ms, peak_extra_bytes, print_table
from fastgrpo.kernels.logprobs import logprobs_from_logits
from fastgrpo.kernels.reference import logprobs_ref

TEMPERATURE = 0.9


def _methods(device, entropy, compile_baseline):
    """name -> (function, backward_only); eager first (the ratios refer to it), the in-place variant last."""

    def eager(x, y):
        return logprobs_ref(x, y, temperature=TEMPERATURE, return_entropy=entropy)

    def ours(x, y):
        return logprobs_from_logits(x, y, temperature=TEMPERATURE, return_entropy=entropy)

    def ours_inplace(x, y):
        return logprobs_from_logits(x, y, temperature=TEMPERATURE, return_entropy=entropy, inplace_backward=True)

    methods = {"eager": (eager, False), "fastgrpo": (ours, False)}
    if compile_baseline and torch.device(device).type == "cuda":
        methods["torch.compile"] = (torch.compile(eager, dynamic=False), False)
    methods["fastgrpo inplace"] = (ours_inplace, True)  # the in-place variant differs only in its backward
    return methods


def run_case(N, V, dtype, device, entropy, compile_baseline, copy_gbps):
    """Time and peak memory of every method; each method's rows are appended as soon as they are measured."""
    torch.manual_seed(0)
    logits = (torch.randn(N, V, device=device) * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device=device)
    g_logp = torch.randn(N, device=device)
    g_entropy = torch.randn(N, device=device)
    elem = logits.element_size()
    rows = []
    for name, (fn, backward_only) in _methods(device, entropy, compile_baseline).items():

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(logits, targets)

        def fwd_bwd(fn=fn):
            out = fn(logits, targets)
            outs, grads = ((out[0], out[1]), (g_logp, g_entropy)) if entropy else ((out,), (g_logp,))
            return torch.autograd.grad(outs, logits, grads)

        row = {"method": name, "N": N, "V": V, "dtype": str(dtype).removeprefix("torch."), "entropy": entropy,
               "temperature": TEMPERATURE, "cpu_threads": torch.get_num_threads()}
        new = []
        if not backward_only:
            ms = median_ms(fwd, device, warmup=1, rep=3)
            new.append({"case": "fwd", **row, "ms": ms, "peak_extra_MiB": peak_extra_bytes(fwd, device) / 2**20,
                        "GB/s": N * V * elem / ms / 1e6})
        ms = median_ms(fwd_bwd, device, warmup=1, rep=3)
        new.append({"case": "fwd+bwd", **row, "ms": ms, "peak_extra_MiB": peak_extra_bytes(fwd_bwd, device) / 2**20,
                    "GB/s": 3 * N * V * elem / ms / 1e6})
        for r in new:  # ratios against eager in the same case, and against the copy bandwidth
            base = next(b for b in rows + new if b["method"] == "eager" and b["case"] == r["case"])
            r["speedup_vs_eager"] = base["ms"] / r["ms"]
            r["mem_vs_eager"] = r["peak_extra_MiB"] / max(base["peak_extra_MiB"], 1e-9)
            if copy_gbps:
                r["copy_GB/s"] = copy_gbps
                r["frac_of_copy_bw"] = r["GB/s"] / copy_gbps
        append_rows("logprobs", new, device)
        rows += new
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small CPU shape (N=1024)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline (GPU)")
    parser.add_argument("--compile-entropy", action="store_true",
                        help="torch.compile baseline for the entropy case too (GPU; by default only without entropy, "
                             "to stay within gpu_check's time limit)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        N, V, dtype = 16384, 151936, torch.bfloat16
        copy_gbps = copy_bandwidth_gbps()
        print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    else:
        N, V, dtype = (1024 if args.quick else 4096), 32000, torch.float32
        copy_gbps = None
    for entropy in (False, True):
        compile_baseline = not args.no_compile and (args.compile_entropy or not entropy)
        rows = run_case(N, V, dtype, device, entropy, compile_baseline, copy_gbps)
        print_table(rows, f"\nlogprobs_from_logits N={N} V={V} {dtype} T={TEMPERATURE} entropy={entropy} on {device}")


if __name__ == "__main__":
    main()
