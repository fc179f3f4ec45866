"""The cost of ``numerics.batch_invariant`` (issue 35): the mode on against off, measured in one run.

Run: ``python bench/bench_batch_invariant.py`` (CPU, a few minutes; ``--smoke``: seconds, records nothing).

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

The ratio is on / off (> 1: the mode costs that much more). Rows go to ``bench/results/batch_invariant.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from bench_generation import CPU_CONFIG, build_model, make_prompts
from common import append_rows, assert_timing_state, median_ms, print_table
from fastgrpo.kernels import batch_invariant as bi
from fastgrpo.kernels import batch_invariant_attention as ba
from fastgrpo.kernels.linear_logprobs import fused_linear_logprobs
from fastgrpo.kernels.varlen_attention import varlen_attention_torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a repeat each, nothing recorded")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps timed per mode and configuration")
    args = parser.parse_args()
    torch.set_num_threads(1)
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
        rate = generation(model, prompts, params, 1 if args.smoke else 3)
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
