"""The cost of ``numerics.batch_invariant`` (issue 35): the mode on against off, measured in one run.

Run: ``python bench/bench_batch_invariant.py`` (CPU, a few minutes; ``--smoke``: seconds, records nothing;
``--device cuda``: the GPU rows; ``bench/gpu_check.sh`` runs ``--device cuda --quick --steps 1 --repeats 1``,
bounded at 40 s).

- **GRPO step** of the ``tiny`` recipe (its 130K-parameter Qwen2, 32 prompts × 8 samples, 8 new tokens, one thread
  as the recipe sets), without the warm-up and with ``grpo.mask_zero_std_groups=false`` so that every step runs the
  full update whatever the rewards: two trainers built alike, one per mode, their steps interleaved (off, on, off,
  ...), the first step of each left out, medians of ``time/step``, ``time/generation``, ``time/update``. Twice: the
  recipe's one optimizer step per rollout, and ``train.sequences_per_optimizer_step=64`` (4 optimizer steps per
  rollout), where the mode off runs the old-log-prob forward the mode on saves. Then the ``moe-tiny`` recipe (its
  Qwen3-MoE: 8 experts of width 64, top-2, router replay, the gap without replay measured) with one optimizer step.
- **Generation** tokens/s of ``GenerationEngine.generate`` with ``batch_invariant`` off / on, alternating, medians:
  the tiny recipe's model and shape, and bench_generation's ~10M-parameter Qwen2 (8 prompts × 4, 128 new tokens; and
  with 400-token prompts, 96 new: the attention over 400-500 keys).
- **Micro rows**, each side by side in one run (medians): a projection (``F.linear`` vs the exact product, decode and
  training row counts), attention (the trainer's CPU varlen path vs the invariant one on packed batches of 64 to 2048
  tokens a sequence; one decode query per row over a cache of 256, 1024 and 4096 keys, the big blocks' value grids
  kept as the engine's row cache keeps them), the log-probs (``fused_linear_logprobs``' torch path vs the invariant
  one).

``--device cuda`` (``bench/gpu_check.sh``; each part appended as soon as it is measured, so a step limit loses only
what was still running): the micro rows at DeepSeek-R1-Distill-Qwen-1.5B's widths in bf16 (its MLP product at decode
and training row counts, packed attention with 12 query and 2 key-value heads of 128 against the trainer's Triton
varlen kernel, a decode step against SDPA, log-probs over 65,536 vocabulary entries against the Triton kernel), the
~10M Qwen2's generation in bf16 (mode off: the engine's defaults on CUDA, compiled elementwise ops and CUDA graphs;
on: eager) and the ``tiny`` recipe's GRPO step on the GPU (one optimizer step per rollout), run in the order GRPO
step, micro rows, generation. ``--quick`` (the gpu_check step): the micro rows cut to the decode-row product and the
decode step at 4096 keys (the pairs that compile no Triton kernel), 16 new tokens in the generation row.

``--decode-ops``: the ATen ops of a 1.5B decode step's attention with the CPU's and with CUDA's split (counted on
CPU tensors; each op a launch on a GPU), the figures the README's CUDA cost rests on.

The ratio is on / off (> 1: the mode costs that much more). Rows go to ``bench/results/batch_invariant.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from functools import partial
from unittest import mock

import torch
import torch.nn.functional as F
from bench_generation import CPU_CONFIG, build_model, make_prompts
from common import append_rows, assert_timing_state, median_ms, print_table
from fastgrpo.kernels import batch_invariant as bi
from fastgrpo.kernels import batch_invariant_attention as ba
from fastgrpo.kernels.linear_logprobs import fused_linear_logprobs
from fastgrpo.kernels.varlen_attention import varlen_attention, varlen_attention_torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastgrpo.config import load_config
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.metrics import MetricsLogger
from fastgrpo.models.attention import ATTN_IMPLEMENTATION
from fastgrpo.models.batch_invariant import enable_batch_invariant
from fastgrpo.models.loading import load_model

STEP_OVERRIDES = ["sft.warmup_steps=0", "grpo.mask_zero_std_groups=false", "eval.at_start=false",
                  "eval.at_end=false", "checkpoint.every_steps=0", "checkpoint.save_final=false",
                  "logging.progress_bar=false", "logging.completions_to_print=0"]


def grpo_steps(steps: int, extra: list[str], out_dir: str, recipe: str | None = None) -> dict:
    """Medians of the step's times per mode (module docstring) of ``recipe`` (None: tiny), steps interleaved; the
    mode-on trainer's switch (its invariant ops, its kept weight grids) is on only around its own steps (so the
    mode-off steps run PyTorch's kernels untouched)."""
    from fastgrpo.trainer import Trainer

    trainers = {}
    for mode in (False, True):
        cfg = load_config(recipe, overrides=[*STEP_OVERRIDES, *extra, f"numerics.batch_invariant={str(mode).lower()}",
                                     f"logging.output_dir={out_dir}/{mode}"])
        trainers[mode] = Trainer(cfg)
    trainers[True].numerics.close()  # registered again around each of its steps below
    logger = MetricsLogger(out_dir, enabled=False)
    times = {mode: [] for mode in trainers}
    try:
        for i in range(steps + 1):
            for mode, trainer in trainers.items():
                with enable_batch_invariant(trainer.model, ATTN_IMPLEMENTATION) if mode else contextlib.nullcontext():
                    assert_timing_state()
                    m = trainer.train_step(logger)
                if i:  # the first step of each compiles nothing, but pays first-touch costs
                    times[mode].append({k: m[k] for k in ("time/step", "time/generation", "time/update")})
                    times[mode][-1]["diff"] = m["sampling/sampling_logp_difference/max"]
    finally:
        for trainer in trainers.values():
            trainer.close()
    return {mode: {**{k: statistics.median(r[k] for r in rows) for k in rows[0]},
                   "diff_max": max(r["diff"] for r in rows)} for mode, rows in times.items()}


def generation(model, prompts, params, repeats: int) -> dict:
    """Median tokens/s per mode, calls alternating."""
    engines = {mode: GenerationEngine(model, eos_token_ids=[], max_batch_size=256, batch_invariant=mode)
               for mode in (False, True)}
    seconds = {mode: [] for mode in engines}
    tokens = 0
    for i in range(repeats + 1):
        for mode, engine in engines.items():
            assert_timing_state()
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            if i:
                seconds[mode].append(time.perf_counter() - t0)
            tokens = sum(len(c.token_ids) for comps in out for c in comps)
    return {mode: tokens / statistics.median(s) for mode, s in seconds.items()}


def micro_rows(smoke: bool) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []

    def pair(what, shape, default, invariant):
        rep = 3 if smoke else 7
        off, on = median_ms(default, "cpu", rep=rep), median_ms(invariant, "cpu", rep=rep)
        rows.append(dict(part="micro", what=what, shape=shape, off_ms=off, on_ms=on, ratio=on / off))

    for M, K, N in ((64, 256, 704), (4096, 256, 704), (1024, 1536, 1536)):
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        pair("matmul x Wᵀ (weight grid kept)", f"M={M} K={K} N={N}", partial(F.linear, x, w),
             partial(bi.linear, x, w, grid=bi.weight_grid(w)))
    for B, L in ((64, 64), (8, 512), (2, 2048)):
        q, k, v = (torch.randn(B * L, h, 32, generator=g) for h in (8, 2, 2))
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32)
        pair("attention, packed causal (trainer)", f"{B}x{L} tokens, Hq=8 Hkv=2 D=32",
             partial(varlen_attention_torch, q, k, v, cu, L), partial(ba.varlen_attention, q, k, v, cu, 32**-0.5))
    S = 64
    for L in (256, 1024, 4096):  # the value grids kept as the engine's row cache keeps them (KeptValueGrids)
        q, k, v = (torch.randn(S, h, n, 32, generator=g) for h, n in ((8, 1), (2, L), (2, L)))
        kept = torch.cat((ba.big_value_grid(v[:, :, : L - 64]), ba.small_value_grid(v[:, :, L - 64 :])), 2)
        pair("attention, decode step (one query per row)", f"S={S} L={L}, Hq=8 Hkv=2 D=32",
             partial(F.scaled_dot_product_attention, q.view(S, 2, 4, 32), k, v, scale=32**-0.5),
             partial(ba.attention, q, ba.key_grid(k), v, torch.full((S, 1), L - 1), 32**-0.5, v_kept_BHLD=kept))
    N, H, V = (256, 256, 16384)
    h, w, y = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 16, torch.randint(0, V, (N,))
    pair("log-probs from hidden states", f"N={N} H={H} V={V}", partial(fused_linear_logprobs, h, w, y),
         partial(bi.linear_logprobs, h, w, None, y, 1.0, False))  # the CPU trainer's torch path vs the invariant one
    return rows


class _OpCount(TorchDispatchMode):
    """Counts the ATen ops run under it (each a kernel launch from Python on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def decode_op_counts() -> None:
    """The ops of one decode step's attention at DeepSeek-R1-Distill-Qwen-1.5B's heads (12 / 2 x 128, bf16, 28
    layers), rows of ``S`` queries over ``L`` keys, run on CPU tensors with the CPU's and with CUDA's split
    (``batch_invariant_attention.split_bounds``): the calls a layer and the ops a step that the README's CUDA cost
    rests on (the largest case takes about 15 GB of host memory, a minute)."""
    Hq, Hkv, D, layers = 12, 2, 128, 28
    g = torch.Generator().manual_seed(0)
    for device, cases in (("cpu", ((64, 1024), (64, 4096))), ("cuda", ((64, 1024), (64, 4096), (256, 4096),
                                                                      (256, 16384)))):
        for S, L in cases:
            q = torch.randn(S, Hq, 1, D, generator=g).to(torch.bfloat16)
            k, v = (torch.randn(S, Hkv, L, D, generator=g).to(torch.bfloat16) for _ in range(2))
            k = ba.key_grid(k)
            bounds, pos = ba.split_bounds(torch.device(device)), torch.full((S, 1), L - 1)
            with mock.patch.object(ba, "split_bounds", lambda _device, b=bounds: b), _OpCount() as count:
                ba.attention(q, k, v, pos, D**-0.5)
            rows = ba.rows_per_call(torch.device(device), Hq, Hkv, L, 1, D)
            print(f"{device} split: S={S} L={L}: {rows} rows a call, {-(-S // rows)} calls a layer, "
                  f"{count.ops * layers} ops a decode step", flush=True)
            del q, k, v


def micro_rows_cuda(quick: bool) -> list[dict]:
    """The micro rows on the GPU (module docstring), bf16, each pair timed in one run (CUDA events); ``quick``: the
    decode-row product and the decode step at 4096 keys only (no Triton compile)."""
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf16)

    def pair(what, shape, default, invariant):
        off, on = median_ms(default, dev), median_ms(invariant, dev)
        rows.append(dict(part="micro", what=what, shape=shape, off_ms=off, on_ms=on, ratio=on / off))

    w = randn(8960, 1536)
    grid = bi.weight_grid(w)
    for M in (64,) if quick else (64, 8192):
        x = randn(M, 1536)
        pair("matmul x Wᵀ (weight grid kept)", f"M={M} K=1536 N=8960", partial(F.linear, x, w),
             partial(bi.linear, x, w, grid=grid))
    del grid
    for B, L in () if quick else ((8, 512), (2, 2048)):
        q, k, v = (randn(B * L, h, 128) for h in (12, 2, 2))
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=dev)
        pair("attention, packed causal (trainer)", f"{B}x{L} tokens, Hq=12 Hkv=2 D=128",
             partial(varlen_attention, q, k, v, cu, L), partial(ba.varlen_attention, q, k, v, cu, 128**-0.5))
    S = 64
    for L in (4096,) if quick else (1024, 4096):  # the engine's CUDA decode reads the pages: no kept value grids
        q, k, v = randn(S, 12, 1, 128), randn(S, 2, L, 128), randn(S, 2, L, 128)
        pos = torch.full((S, 1), L - 1, device=dev)
        pair("attention, decode step (one query per row)", f"S={S} L={L}, Hq=12 Hkv=2 D=128",
             partial(F.scaled_dot_product_attention, q.view(S, 2, 6, 128), k, v, scale=128**-0.5),
             partial(ba.attention, q, ba.key_grid(k), v, pos, 128**-0.5))
    if quick:
        return rows
    N, H, V = 2048, 1536, 65536
    h, w, y = randn(N, H), randn(V, H, scale=1 / 32), torch.randint(0, V, (N,), generator=g, device=dev)
    pair("log-probs from hidden states", f"N={N} H={H} V={V}", partial(fused_linear_logprobs, h, w, y),
         partial(bi.linear_logprobs, h, w, None, y, 1.0, False))
    return rows


def main_cuda(args) -> None:
    """The GPU rows (module docstring), each part appended when measured: the GRPO step first (the issue's 1.3x
    goal and the 0.0 gate), then the micro rows, then the generation (its mode-off engine compiles its elementwise
    ops and captures CUDA graphs: the slowest part to start)."""
    parts = []

    def record(rows: list[dict]) -> None:
        print_table(rows, "numerics.batch_invariant on vs off (CUDA)")
        if not args.smoke:
            print(f"rows appended to {append_rows('batch_invariant', rows, 'cuda')}")
        parts.extend(rows)

    small = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4"] if args.smoke else []
    t = grpo_steps(args.steps, ["train.device=cuda", *small], "/tmp/bench_batch_invariant_cuda", "tiny")
    label = "1 optimizer step per rollout"
    record([*(dict(part="grpo step (tiny)", what=f"{part} ({label})", off_s=t[False][part], on_s=t[True][part],
                   ratio=t[True][part] / t[False][part]) for part in ("time/step", "time/generation", "time/update")),
            dict(part="grpo step (tiny)", what=f"sampling_logp_difference/max ({label})", off=t[False]["diff_max"],
                 on=t[True]["diff_max"])])
    record(micro_rows_cuda(args.quick))
    model = build_model(CPU_CONFIG, "cuda", torch.bfloat16)
    params = SamplingParams(n=4, max_new_tokens=16 if args.smoke or args.quick else 128, seed=0)
    rate = generation(model, make_prompts(8, 32, 64, CPU_CONFIG["vocab_size"]), params, args.repeats)
    record([dict(part="generation", what="~10M Qwen2 bf16 (bench_generation)",
                 shape=f"8x4, {params.max_new_tokens} new", off_tokens_per_s=rate[False], on_tokens_per_s=rate[True],
                 ratio=rate[False] / rate[True])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a repeat each, nothing recorded")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps timed per mode and configuration")
    parser.add_argument("--repeats", type=int, default=3, help="generation calls timed per mode and model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model and the ops run")
    parser.add_argument("--quick", action="store_true", help="cuda: 2 micro rows (no Triton compile), 16 new tokens")
    parser.add_argument("--decode-ops", action="store_true", help="count a 1.5B decode step's attention ops, only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.decode_ops:
        return decode_op_counts()
    if args.device == "cuda":
        return main_cuda(args)
    rows = micro_rows(args.smoke)
    tiny_model, _ = load_model(load_config().model, torch.device("cpu"), seed=0)
    cases = [("tiny (the recipe's model)", tiny_model, make_prompts(32, 6, 12, tiny_model.config.vocab_size),
              SamplingParams(n=8, temperature=1.0, max_new_tokens=8, seed=0)),
             ("~10M Qwen2 (bench_generation)", build_model(CPU_CONFIG, "cpu", torch.float32),
              make_prompts(8, 32, 64, CPU_CONFIG["vocab_size"]),
              SamplingParams(n=4, max_new_tokens=16 if args.smoke else 128, seed=0)),
             ("~10M Qwen2, 400-token prompts", build_model(CPU_CONFIG, "cpu", torch.float32),
              make_prompts(8, 392, 400, CPU_CONFIG["vocab_size"]), SamplingParams(n=4, max_new_tokens=16 if args.smoke
                                                                                  else 96, seed=0))]
    for name, model, prompts, params in cases:
        rate = generation(model, prompts, params, 1 if args.smoke else args.repeats)
        rows.append(dict(part="generation", what=name, shape=f"{len(prompts)}x{params.n}, {params.max_new_tokens} new",
                         off_tokens_per_s=rate[False], on_tokens_per_s=rate[True], ratio=rate[False] / rate[True]))
    small = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4"] if args.smoke else []
    four_steps = [f"train.sequences_per_optimizer_step={4 if args.smoke else 64}"]
    for recipe, label, extra in (("tiny", "1 optimizer step per rollout", []),
                                 ("tiny", "4 optimizer steps per rollout", four_steps),
                                 ("moe-tiny", "1 optimizer step per rollout", [])):
        t = grpo_steps(1 if args.smoke else args.steps, extra + small, "/tmp/bench_batch_invariant", recipe)
        for part in ("time/step", "time/generation", "time/update"):
            rows.append(dict(part=f"grpo step ({recipe})", what=f"{part} ({label})", off_s=t[False][part],
                             on_s=t[True][part], ratio=t[True][part] / t[False][part]))
        rows.append(dict(part=f"grpo step ({recipe})", what=f"sampling_logp_difference/max ({label})",
                         off=t[False]["diff_max"], on=t[True]["diff_max"]))
    print_table(rows, "numerics.batch_invariant on vs off (CPU, 1 thread)")
    if not args.smoke:
        print(f"rows appended to {append_rows('batch_invariant', rows, 'cpu')}")


if __name__ == "__main__":
    main()
