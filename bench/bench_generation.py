"""GenerationEngine vs Hugging Face ``generate`` on the same sampling workload: tokens/s, decode step, roofline.

Run: ``python bench/bench_generation.py`` (CPU sizes without CUDA, the issue's GPU sizes with it; ``--quick``
shrinks either). Figures:

- tokens/s = generated tokens / wall time of the whole call (prefill included), engine and HF side by side; the
  median of ``--repeats`` calls each (3 on CPU, 1 on GPU), engine and HF alternating.
- GPU: time per decode step = (time of the full call − time of the same call with max_new_tokens=1) / the
  remaining steps, against the memory-bandwidth roofline of one step: every weight read once plus the K/V of
  every live sequence at its current length, divided by the device-to-device copy bandwidth measured in this
  run (``common.copy_bandwidth_gbps``). HF runs fewer new tokens on GPU to bound the time; its per-token rate is
  then an upper bound for the full length (its per-step cost grows with the cache), so the ratio is a lower bound.
- CPU: the matmul floor = the time of the weight matmuls alone for the batch, × the steps; both implementations
  pay it, so it bounds the achievable speedup (``x_floor`` = seconds / floor). The attention floor = the time of
  the decode attention alone: at every step and layer one SDPA of the batch's queries over its live K/V (a cache
  padded to the longest live row, the shorter rows masked: what a batched attention reads, ~0.8 of a step's bytes
  here next to the weights). ``x_floors`` = seconds / (matmul floor + attention floor): what is left is everything
  else of a step (norms, rotary, cache writes, sampling, bookkeeping, per-op dispatch).
- Peak extra memory of each call (the engine's KV cache is freed when it returns), measured after the timing on one
  more call (on CPU in a forked child, ``common.peak_extra_bytes``), so every timed call runs with the default
  allocator.
- GPU: the paged decode-attention kernel alone against a contiguous-cache reference and the memory roofline
  (:func:`paged_attention_rows`), rows in ``bench/results/decode_attention.csv``.
- CPU: ``--cpu-packed 0,1,auto`` times one engine per setting of its MKL-packed products (plain, packed, the
  engine's own per-host choice: ``fastgrpo.engine.workspace``), alternating in the same run, one row each with the
  groups it packed (``packed_groups``) and, for auto, the products' timings that chose them (``product_ms``). The
  token hash (CRC-32 of every completion's token ids) is printed per setting: the paths differ by fp32 rounding
  only, so their tokens should be identical. Rows carry the CPU model (``device``) and torch's CPU capability
  (``isa``).

``--logprob-gap`` instead measures the bf16 sampling gap (issue 9): a ~4-layer Qwen2-shaped model in bf16 on CPU,
8 prompts × 4 samples of 32 tokens at temperature 1; the engine's log-probs against the trainer's packed forward
(``fastgrpo.algorithms.grpo.packed_logprobs``, the same bf16 weights): mean and max |Δ log p| over the sampled tokens.

Workloads (issue 4): CPU, a ~10M-parameter Qwen2-shaped model, 8 prompts × n=4 of 32–64 tokens, 128 new tokens;
GPU, a Qwen2.5-1.5B-shaped model with random bf16 weights, 32 prompts × n=8 of 256 tokens, 1024 new tokens.
Sampling at temperature 1 with no top-k/top-p and no EOS (every completion runs to the limit).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import zlib

import torch
import torch.nn.functional as F
from common import append_rows, assert_timing_state, copy_bandwidth_gbps, median_ms, peak_extra_bytes, print_table, sync
from transformers import Qwen2Config, Qwen2ForCausalLM

from fastgrpo.engine.engine import GenerationEngine, SamplingParams

CPU_CONFIG = dict(  # ~10M parameters (tied embeddings: 4.2M embedding + 8 × 0.74M layers)
    vocab_size=16384,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
QWEN25_15B_CONFIG = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)


def build_model(config: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config, initializer_range=0.3 if device == "cpu" else 0.02))
    return model.to(dtype).eval()


def make_prompts(num: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def timed(fn, device) -> tuple[float, object]:
    """(seconds, result) of one call, in the default process state (memory is measured apart: ``peak_extra_bytes``)."""
    assert_timing_state()
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


CPU_PACKED = {"0": False, "1": True, "auto": None}  # --cpu-packed settings -> GenerationEngine(cpu_packed=)


def token_hash(out) -> int:
    """CRC-32 of every completion's token ids, in order: equal hashes, equal tokens."""
    return zlib.crc32(torch.tensor([t for comps in out for c in comps for t in c.token_ids]).numpy().tobytes())


def hf_generate(model, prompts, n, max_new_tokens, device):
    """HF sampling with the same settings: left-padded batch, n return sequences, no EOS."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p, device=device)
        mask[i, T - len(p) :] = 1
    return model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=n,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )


def matmul_floor_s(model, rows: int, steps: int, device) -> float:
    """Time of the weight matmuls alone (every nn.Linear, LM head included) for ``rows`` tokens, × ``steps``: the
    decode compute any implementation pays (engine and HF alike), measured in this run."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator(device=device).manual_seed(0)
    x = {w.shape[1]: torch.randn(rows, w.shape[1], device=device, dtype=w.dtype, generator=gen) for w in weights}
    with torch.inference_mode():
        ms = median_ms(lambda: [F.linear(x[w.shape[1]], w) for w in weights], device)
    return ms * steps / 1e3


def attention_floor_s(model, prompts, n, max_new_tokens, device) -> float:
    """Time of the decode attention alone (see the module docstring): every step after the first, every layer's
    SDPA of the ``[S, Hkv, G, D]`` queries over its own ``[S, Hkv, T, D]`` keys and values (one cache per layer,
    so they are read cache-cold as in a step), T the longest live row, the rest masked; the median of 3 runs."""
    cfg = model.config
    Hq, Hkv, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    D = cfg.hidden_size // Hq
    lengths = torch.tensor([len(p) for p in prompts for _ in range(n)], device=device)
    S = lengths.numel()
    gen = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(L, 2, S, Hkv, int(lengths.max()) + max_new_tokens, D, device=device, generator=gen)
    q = torch.randn(S, Hkv, Hq // Hkv, D, device=device, generator=gen)
    masks = []
    for step in range(1, max_new_tokens):
        T = int(lengths.max()) + step
        masks.append((torch.arange(T, device=device) < (lengths + step)[:, None]).view(S, 1, 1, T))

    def attend():
        for mask in masks:
            T = mask.shape[-1]
            for li in range(L):
                F.scaled_dot_product_attention(q, kv[li, 0, :, :, :T], kv[li, 1, :, :, :T], attn_mask=mask)

    with torch.inference_mode():
        return median_ms(attend, device, warmup=1, rep=3) / 1e3


def decode_roofline_s(model, prompts, n, max_new_tokens, gbps) -> float:
    """Bytes one full run must read at least (weights once per step + live K/V at its length), over bandwidth."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    kv_per_token *= elem
    steps = max_new_tokens - 1  # the first token comes from the prefill
    kv_tokens_read = sum(n * (len(p) + s) for p in prompts for s in range(1, steps + 1))
    return (steps * weight_bytes + kv_tokens_read * kv_per_token) / (gbps * 1e9)


def paged_attention_rows(gbps: float) -> list[dict]:
    """GPU: the paged decode-attention kernel at Qwen2.5-1.5B's heads (Hkv=2, G=6, D=128, bf16, 64-token pages),
    every sequence at its full length: pages in shuffled order, the same kernel over pages laid out contiguously (an
    identity block table), and SDPA on a contiguous cache (the contiguous reference). GB/s = live K/V bytes read /
    time, against the device-to-device copy bandwidth of this run (the memory roofline)."""
    from fastgrpo.kernels.decode_attention import paged_decode_attention

    Hkv, G, D, page, dt = 2, 6, 128, 64, torch.bfloat16
    rows = []
    for S, T in ((16, 16384), (64, 4096), (256, 2048)):
        P = T // page
        gen = torch.Generator(device="cuda").manual_seed(0)
        # the engine's head-major pool [Hkv, pages, page, D], passed as its [pages, page, Hkv, D] view; page 0 unused
        k = torch.randn(Hkv, S * P + 1, page, D, device="cuda", dtype=dt, generator=gen).permute(1, 2, 0, 3)
        v = torch.randn(Hkv, S * P + 1, page, D, device="cuda", dtype=dt, generator=gen).permute(1, 2, 0, 3)
        q = torch.randn(S, Hkv, G, D, device="cuda", dtype=dt, generator=gen)
        lengths = torch.full((S,), T, dtype=torch.int32, device="cuda")
        shuffled = (torch.randperm(S * P, device="cuda", generator=gen) + 1).view(S, P).to(torch.int32)
        identity = (torch.arange(S * P, device="cuda") + 1).view(S, P).to(torch.int32)
        k_c = k[1:].reshape(S, T, Hkv, D).transpose(1, 2).contiguous()  # [S, Hkv, T, D]
        v_c = v[1:].reshape(S, T, Hkv, D).transpose(1, 2).contiguous()
        kv_bytes = 2 * S * T * Hkv * D * k.element_size()
        cases = {
            "paged_shuffled": functools.partial(paged_decode_attention, q, k, v, shuffled, lengths),
            "paged_contiguous": functools.partial(paged_decode_attention, q, k, v, identity, lengths),
            "sdpa_contiguous": functools.partial(F.scaled_dot_product_attention, q, k_c, v_c),
        }
        for impl, fn in cases.items():
            ms = median_ms(fn, "cuda")
            achieved = kv_bytes / ms / 1e6
            rows.append({"impl": impl, "shape": f"S{S} T{T} Hkv{Hkv} G{G} D{D} page{page} bf16", "ms": ms,
                         "gbps": achieved, "roofline_fraction": achieved / gbps, "copy_gbps": gbps})
    return rows


def logprob_gap(initializer_range: float) -> None:
    """Print mean and max |engine log p − trainer log p| for bf16 weights (see the module docstring)."""
    from fastgrpo.algorithms.batch import Sample, pack_microbatches
    from fastgrpo.algorithms.forward import packed_forward, packed_logprobs
    from fastgrpo.distributed import ForwardWrapper

    config = dict(CPU_CONFIG, num_hidden_layers=4, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config, initializer_range=initializer_range)).to(torch.bfloat16).eval()
    prompts = make_prompts(8, 16, 48, config["vocab_size"])
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=64)
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=32, seed=0))
    samples = [Sample(p, c.token_ids, c.logprobs, 0.0) for p, comps in zip(prompts, out) for c in comps]
    forward = ForwardWrapper(model, packed_forward)
    gaps = []
    with torch.no_grad():
        for mb in pack_microbatches(samples, 4096, torch.device("cpu")):
            trained = mb.mask != 0
            gaps.append((packed_logprobs(forward, mb, 1.0)[trained] - mb.sample_logprobs[trained]).abs())
    gap = torch.cat(gaps)
    print(f"bf16, initializer_range {initializer_range}: {gap.numel()} tokens, "
          f"mean |dlogp| {gap.mean():.3e}, max {gap.max():.3e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per implementation, alternating; the median is reported (default: 3 on CPU, "
                             "1 on GPU)")
    parser.add_argument("--logprob-gap", action="store_true", help="measure the bf16 engine-vs-trainer gap instead")
    parser.add_argument("--cpu-packed", default="auto",
                        help="CPU: comma-separated settings of the engine's MKL-packed products, one engine each, "
                             "alternating: 0 (plain), 1 (packed), auto (its own per-host choice; default)")
    args = parser.parse_args()
    modes = args.cpu_packed.split(",")
    if not modes or any(m not in CPU_PACKED for m in modes) or len(set(modes)) < len(modes):
        parser.error(f"--cpu-packed: distinct settings among {sorted(CPU_PACKED)}, got {args.cpu_packed!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.logprob_gap:
        for init in (0.02, 0.3):
            logprob_gap(init)
        return
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        config, dtype = QWEN25_15B_CONFIG, torch.bfloat16
        num_prompts, n, lo, hi, new = (8, 8, 256, 256, 256) if args.quick else (32, 8, 256, 256, 1024)
        hf_new = min(new, 128)
    else:
        config, dtype = CPU_CONFIG, torch.float32
        num_prompts, n, lo, hi, new = (4, 4, 32, 64, 32) if args.quick else (8, 4, 32, 64, 128)
        hf_new = new
    model = build_model(config, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    prompts = make_prompts(num_prompts, lo, hi, config["vocab_size"])
    modes = ["auto"] if cuda else modes  # the packed products are the CPU step's
    engines = {m: GenerationEngine(model, eos_token_ids=[], max_batch_size=num_prompts * n, cpu_packed=CPU_PACKED[m])
               for m in modes}
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, seed=0)

    load_start = os.getloadavg()[0]  # recorded with the rows: a machine busier than its cores stalls threaded runs
    for engine in engines.values():  # warm-up (first-call costs: at the timed calls' row count, the packing choice)
        engine.generate(prompts, SamplingParams(n=n, max_new_tokens=4, seed=0))
    hf_generate(model, prompts[:2], 2, 4, device)
    repeats = args.repeats or (1 if cuda else 3)
    eng_runs, hf_runs, hashes = {m: [] for m in modes}, [], {}
    for _ in range(repeats):  # alternating, so a slow phase of a shared machine hits every side
        for m, engine in engines.items():
            eng_s, out = timed(functools.partial(engine.generate, prompts, params), device)
            assert all(len(c.token_ids) == new for comps in out for c in comps)
            eng_runs[m].append(eng_s)
            hashes[m] = token_hash(out)
        hf_s, hf_out = timed(lambda: hf_generate(model, prompts, n, hf_new, device), device)
        assert hf_out.shape[0] == num_prompts * n
        hf_runs.append(hf_s)
    del out, hf_out
    hf_s = statistics.median(hf_runs)
    hf_tps = num_prompts * n * hf_new / hf_s
    shape = f"{num_prompts}x{n} prompts {lo}-{hi} new {new} params {n_params / 1e6:.1f}M {str(dtype).split('.')[-1]}"
    if not cuda:
        shape += f" threads {torch.get_num_threads()}"
    rows = []
    for m, engine in engines.items():
        eng_s = statistics.median(eng_runs[m])
        stats = engine.last_stats
        # memory after the timing, one more call each (on CPU in a forked child: the timed calls above never ran
        # with its allocator setting)
        eng_peak = peak_extra_bytes(functools.partial(engine.generate, prompts, params), device)
        eng_tps = num_prompts * n * new / eng_s
        rows.append({"impl": "engine", "shape": shape, "new_tokens": new, "seconds": eng_s, "tokens_per_s": eng_tps,
                     "peak_extra_MiB": eng_peak / 2**20, "speedup_vs_hf": eng_tps / hf_tps, "repeats": repeats})
        if not cuda:
            packed = "+".join(g for g, on in stats["cpu_packed"].items() if on) or "none"
            ms = " ".join(f"{g}:{a:.2f}/{b:.2f}" for g, (a, b) in stats["cpu_product_ms"].items())
            rows[-1].update(cpu_packed=m, packed_groups=packed, product_ms=ms, token_hash=f"{hashes[m]:08x}")
    hf_peak = peak_extra_bytes(lambda: hf_generate(model, prompts, n, hf_new, device), device)
    rows.append({"impl": "hf_generate", "shape": shape, "new_tokens": hf_new, "seconds": hf_s, "tokens_per_s": hf_tps,
                 "peak_extra_MiB": hf_peak / 2**20, "speedup_vs_hf": 1.0, "repeats": repeats})
    if not cuda:
        floor_s = matmul_floor_s(model, num_prompts * n, new, device)
        attn_s = attention_floor_s(model, prompts, n, new, device)
        for r in rows:
            r.update(matmul_floor_s=floor_s, x_floor=r["seconds"] / floor_s, attention_floor_s=attn_s,
                     x_floors=r["seconds"] / (floor_s + attn_s))
    for r in rows:
        r.update(loadavg_start=round(load_start, 2), loadavg_end=round(os.getloadavg()[0], 2))
        if not cuda:
            r.update(isa=torch.backends.cpu.get_cpu_capability())
    if cuda:
        one = SamplingParams(n=n, temperature=1.0, max_new_tokens=1, seed=0)
        prefill_s, _ = timed(lambda: engines["auto"].generate(prompts, one), device)
        step_ms = (rows[0]["seconds"] - prefill_s) / (new - 1) * 1e3
        gbps = copy_bandwidth_gbps()
        roof_ms = decode_roofline_s(model, prompts, n, new, gbps) / (new - 1) * 1e3
        rows[0].update(prefill_s=prefill_s, decode_step_ms=step_ms, roofline_step_ms=roof_ms,
                       roofline_fraction=roof_ms / step_ms, copy_gbps=gbps)
    print_table(rows, f"generation on {device}")
    if not cuda:
        for m in modes:
            print(f"cpu_packed={m}: engine {statistics.median(eng_runs[m]):.3f} s (runs "
                  f"{', '.join(f'{t:.3f}' for t in eng_runs[m])}), token hash {hashes[m]:08x}")
        print("token hashes identical across settings:", len(set(hashes.values())) == 1)
    path = append_rows("generation", rows, device)
    print(f"rows appended to {path}")
    if cuda:
        attn = paged_attention_rows(gbps)
        print_table(attn, "paged decode attention (bf16)")
        print(f"rows appended to {append_rows('decode_attention', attn, device)}")


if __name__ == "__main__":
    main()
