"""grpo_loss against the eager torch composition (reference-style ops), side by side in one run.

    python bench/bench_grpo_loss.py            # CPU: B=64, T=4096 fp32; GPU: B=256, T=8192
    python bench/bench_grpo_loss.py --quick    # smaller shapes, for a smoke run

Inputs as a trainer has them: fp32 ``logprobs`` (what ``fused_linear_logprobs`` returns, requiring grad), fp32
``old_logprobs`` and ``ref_logprobs``, bool ``mask`` with random completion lengths, per-sequence advantages.
Two configurations: token level ``dapo`` with β = 0.04 and clip-higher (DAPO/DeepScaleR), and sequence level
``grpo`` with β = 0.04 (GSPO: the kernel reads each sequence twice). "fwd" is the forward of a training step
(grad enabled, so the eager composition keeps what its backward needs); "fwd+bwd" adds ``backward()``.
Baselines: ``grpo_loss_ref`` run eagerly and, on GPU, ``torch.compile`` of it for the token-level configuration
(compiled before timing; one compile keeps the whole run near 40 s). GPU figures in GB/s: the bytes the fused
kernels must move (token level: forward reads logp, old, ref (4 B each) and mask (1 B) per token, backward reads
them again and writes the fp32 gradient; ``bytes_moved`` has the sequence level's count) against the copy
bandwidth measured in this run. Peak extra memory includes the loss, the saved tensors and, for fwd+bwd, the gradient.
Rows go to ``bench/results/grpo_loss.csv``.
CPU: the chunked plain-torch path of ``grpo_loss`` (no Triton on CPU outside the interpreter) against the same
eager ops, one thread (``OMP_NUM_THREADS=1`` is advised: the machine's cores are shared, and contended OpenMP
barriers make multi-threaded timings of small elementwise ops meaningless).
End to end (config ``fused_linear``): ``fused_linear_grpo_loss`` from the last hidden state against the eager
composition ``hidden @ weightᵀ`` → fp32 ``log_softmax`` → gather → ``grpo_loss_ref``, forward+backward to hidden
and weight (CPU: B=4, T=512, H=128, V=16000 fp32; GPU: B=8, T=1024, H=1536, V=151936 bf16).
"""

from __future__ import annotations

import argparse
import os

import torch
from common import append_rows, copy_bandwidth_gbps, device_name, median_ms, peak_extra_bytes, print_table, sync

os.environ.pop("TRITON_INTERPRET", None)  # on CPU this benchmark measures the plain-torch path

from fastgrpo.kernels.grpo_loss import grpo_loss  # noqa: E402
from fastgrpo.kernels.linear_grpo_loss import fused_linear_grpo_loss  # noqa: E402
from fastgrpo.kernels.reference import grpo_loss_ref  # noqa: E402

CONFIGS = {
    "dapo/token": dict(loss_type="dapo", importance_sampling_level="token", beta=0.04, epsilon_high=0.28),
    "grpo/sequence": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
}


def make_inputs(B, T, device):
    g = torch.Generator(device=device).manual_seed(0)
    logp = -torch.rand(B, T, device=device, generator=g) * 3  # [B, T]
    old = logp + 0.3 * torch.randn(B, T, device=device, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), device=device, generator=g)
    mask = torch.arange(T, device=device)[None, :] < lengths[:, None]  # [B, T] bool
    return logp.requires_grad_(), old, ref, adv, mask


def bytes_moved(B, T, level):
    """(forward, forward + backward) bytes the fused kernels must move for fp32 logp/old/ref and a bool mask."""
    if level == "sequence":  # fwd: (logp, old, mask) then (logp, ref, mask); bwd: logp, ref, mask, write grad
        per_token_fwd, per_token_bwd = 9 + 9, 9 + 4
    else:  # fwd: logp, old, ref, mask; bwd: the same, write grad
        per_token_fwd, per_token_bwd = 13, 13 + 4
    return B * T * per_token_fwd, B * T * (per_token_fwd + per_token_bwd)


def run(B, T, device, compile_baseline):
    logp, old, ref, adv, mask = make_inputs(B, T, device)
    bw = copy_bandwidth_gbps() if device == "cuda" else None
    rows = []
    for cname, cfg in CONFIGS.items():
        def fused(cfg=cfg):
            return grpo_loss(logp, old, adv, mask, ref_logprobs=ref, **cfg)[0]

        def eager(cfg=cfg):
            return grpo_loss_ref(logp, old, adv, mask, ref_logprobs=ref, **cfg)[0]

        variants = {"fused": fused, "eager": eager}
        if compile_baseline and cname == "dapo/token":  # one compile keeps the run inside gpu_check's budget
            variants["compiled"] = torch.compile(eager, dynamic=False)
        for fn in variants.values():  # compile, autotune and warm up outside the timing
            fn().backward()
        sync(device)
        fwd_bytes, total_bytes = bytes_moved(B, T, cfg["importance_sampling_level"])
        for mode in ("fwd", "fwd+bwd"):
            res = {}
            for name, fn in variants.items():
                if mode == "fwd":
                    call = fn
                else:
                    def call(fn=fn):
                        loss = fn()
                        loss.backward()
                        return loss
                ms = median_ms(call, device)
                logp.grad = None  # so that every peak counts allocating the gradient, none accumulates into it
                res[name] = (ms, peak_extra_bytes(call, device))
                logp.grad = None
            tf, mf = res["fused"]
            row = dict(B=B, T=T, config=cname, mode=mode, fused_ms=tf, fused_peak_mib=mf / 2**20)
            if bw is not None:
                gbps = (fwd_bytes if mode == "fwd" else total_bytes) / tf / 1e6
                row.update(fused_gbps=gbps, copy_gbps=bw, frac_of_copy=gbps / bw)
            for name in [n for n in variants if n != "fused"]:
                t, m = res[name]
                row.update({f"{name}_ms": t, f"speedup_vs_{name}": t / tf, f"{name}_peak_mib": m / 2**20,
                            f"peak_ratio_vs_{name}": mf / m if m else float("nan")})
            rows.append(row)
        with torch.no_grad():
            err = (grpo_loss(logp, old, adv, mask, ref_logprobs=ref, **cfg)[0]
                   - grpo_loss_ref(logp, old, adv, mask, ref_logprobs=ref, **cfg)[0]).abs().item()
        rows[-1]["max_abs_err_loss"] = err
    return rows


def run_fused_linear(B, T, H, V, device, dtype):
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(B, T, H, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=device, generator=g) / H**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), device=device, generator=g)
    _, _, _, adv, mask = make_inputs(B, T, device)
    with torch.no_grad():
        base = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    old = base + 0.3 * torch.randn(B, T, device=device, generator=g)
    ref = base + 0.3 * torch.randn(B, T, device=device, generator=g)
    cfg = CONFIGS["dapo/token"]

    def fused():
        loss = fused_linear_grpo_loss(hidden, weight, targets, old, adv, mask, ref_logprobs=ref, **cfg)[0]
        loss.backward()
        return loss

    def eager():
        logp = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
        loss = grpo_loss_ref(logp, old, adv, mask, ref_logprobs=ref, **cfg)[0]
        loss.backward()
        return loss

    res = {}
    for name, fn in (("fused", fused), ("eager", eager)):
        fn()
        sync(device)
        ms = median_ms(fn, device, warmup=1, rep=3)
        hidden.grad = weight.grad = None
        res[name] = (ms, peak_extra_bytes(fn, device))
        hidden.grad = weight.grad = None
    (tf, mf), (te, me) = res["fused"], res["eager"]
    return dict(B=B, T=T, config=f"fused_linear H={H} V={V}", mode="fwd+bwd", fused_ms=tf, fused_peak_mib=mf / 2**20,
                eager_ms=te, speedup_vs_eager=te / tf, eager_peak_mib=me / 2**20, peak_ratio_vs_eager=mf / me)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes for a smoke run")
    args = ap.parse_args()
    if torch.cuda.is_available():
        device = "cuda"
        B, T = (64, 2048) if args.quick else (256, 8192)
        rows = run(B, T, device, compile_baseline=True)
        rows.append(run_fused_linear(*((2, 1024, 1536, 32768) if args.quick else (8, 1024, 1536, 151936)), device,
                                     torch.bfloat16))
    else:
        device = "cpu"
        B, T = (16, 1024) if args.quick else (64, 4096)
        rows = run(B, T, device, compile_baseline=False)
        rows.append(run_fused_linear(*((2, 256, 64, 4000) if args.quick else (4, 512, 128, 16000)), device,
                                     torch.float32))
    print_table(rows, f"grpo_loss on {device_name(device)}")
    path = append_rows("grpo_loss", rows, device)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
