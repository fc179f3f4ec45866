"""End to end on one GPU: the tiny demo for a few steps, then 2 GRPO steps of a 1.5B-shaped model at ~4K tokens.

Run: ``python bench/bench_e2e_gpu.py`` on a CUDA machine (bench/gpu_check.sh runs it under its time limit);
``python bench/bench_e2e_gpu.py --cpu-smoke`` runs both parts at toy sizes on CPU (tests/test_bench_e2e.py).

1. **demo**: ``fastgrpo.train`` with the ``tiny`` recipe as shipped (fp32) for a few GRPO steps after a short
   warm-up, no evaluation: it must run through (kernels compiled for the GPU, generation, update, checkpoint).
2. **grpo-1.5b**: a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2 (28 layers, hidden 1536, vocab 151936) built from
   its config with random bf16 weights (no download), the ``deepscaler-1.5b`` recipe's training settings (bf16
   compute with fp32 master weights, activation checkpointing, dapo loss): 2 GRPO steps of 8 prompts × 4
   completions, each sequence a 3584-token random prompt + 512 sampled tokens = ~4K tokens. A step = generation
   with the policy's own weights + random rewards → group advantages + the policy update (one optimizer step).
   Printed per step: time (generation / update), tokens/s = (prompt + completion tokens) / step time, and the
   measured peak memory (``torch.cuda.max_memory_allocated``) next to the memory plan's prediction for the same
   settings when ``fastgrpo.plan`` exists (``python -m fastgrpo.plan``, from the config alone).

GPU rows go to ``bench/results/e2e_gpu.csv``; the CPU smoke writes nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import append_rows, print_table, sync

from fastgrpo.algorithms.advantages import compute_advantages
from fastgrpo.algorithms.batch import Sample
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.update import PolicyUpdate
from fastgrpo.config import load_config
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.models.loading import enable_activation_checkpointing
from fastgrpo.precision import make_optimizer

R1_DISTILL_QWEN_15B = dict(  # DeepSeek-R1-Distill-Qwen-1.5B's config.json (the fields that shape compute)
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=131072, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=151646, eos_token_id=151643,
)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1)
GPU_SIZES = dict(prompts=8, generations=4, prompt_tokens=3584, new_tokens=512, microbatch_tokens=16384)
CPU_SIZES = dict(prompts=2, generations=2, prompt_tokens=40, new_tokens=8, microbatch_tokens=64)


def run_demo(device: str, steps: int, warmup: int) -> dict:
    """The tiny recipe through the trainer's entry point (``fastgrpo.train.main``) for ``steps`` GRPO steps."""
    from fastgrpo.train import main

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        main(["--recipe", "tiny", f"train.device={device}", f"train.max_steps={steps}",
              f"sft.warmup_steps={warmup}", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
              "checkpoint.every_steps=0", "logging.progress_bar=false", f"logging.output_dir={out}",
              "checkpoint.resume=never"])
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "time/step" in r][-1]
    return {"part": "demo", "steps": steps, "wall_s": wall, "step_s": last["time/step"],
            "tokens_per_s": last["tokens_per_second"], "reward": last["reward/mean"]}


def plan_prediction(model_config: dict, overrides: list[str]) -> str:
    """``python -m fastgrpo.plan`` on the same settings (config.json only), or why there is none."""
    if importlib.util.find_spec("fastgrpo.plan") is None:
        return "no memory plan: fastgrpo.plan is not in this checkout"
    from transformers import Qwen2Config

    with tempfile.TemporaryDirectory() as path:
        Qwen2Config(**model_config).save_pretrained(path)
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 24
        cmd = [sys.executable, "-m", "fastgrpo.plan", "--recipe", "deepscaler-1.5b", f"model.path={path}",
               *overrides, "--nproc", "1", "--gpu-memory-gib", f"{gib:.0f}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return (proc.stdout + proc.stderr).strip()


def run_grpo(device: torch.device, part: str, model_config: dict, sizes: dict, steps: int = 2) -> tuple[list, str]:
    """``steps`` GRPO steps (generation + update) of a random-weight bf16 Qwen2 under the deepscaler settings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.distributed import init_distributed, wrap_model
    from fastgrpo.models.attention import enable_packed_attention

    P, G = sizes["prompts"], sizes["generations"]
    overrides = [f"grpo.num_prompts_per_step={P}", f"grpo.num_generations={G}", "stages=[]",  # one budget
                 f"rollout.max_new_tokens={sizes['new_tokens']}", f"rollout.max_batch_size={P * G}",
                 f"rollout.max_sequence_tokens={sizes['prompt_tokens'] + sizes['new_tokens']}",
                 f"data.max_prompt_tokens={sizes['prompt_tokens']}", "train.sequences_per_optimizer_step=0",
                 f"train.max_tokens_per_microbatch={sizes['microbatch_tokens']}", "train.strategy=none",
                 f"train.device={device.type}"]
    cfg = load_config("deepscaler-1.5b", overrides=overrides)
    state = init_distributed(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**model_config)).to(torch.bfloat16)
    enable_packed_attention(model)
    enable_activation_checkpointing(model)
    model.eval()
    wrapped = wrap_model(model, state, cfg.train.strategy, forward=packed_forward)
    t = cfg.train
    opt = make_optimizer(wrapped, lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    update = PolicyUpdate(cfg, wrapped, opt, sched, None, device, 1)
    engine = GenerationEngine(model, eos_token_ids=model_config["eos_token_id"], max_batch_size=P * G)
    gen = torch.Generator().manual_seed(0)
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for step in range(steps):
        prompts = torch.randint(2, model_config["vocab_size"], (P, sizes["prompt_tokens"]), generator=gen).tolist()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(n=G, temperature=cfg.rollout.temperature,
                                                       max_new_tokens=sizes["new_tokens"], seed=step))
        sync(device)
        t1 = time.perf_counter()
        rewards_PG = torch.rand(P, G, generator=gen).round()  # a 0/1 "verifier": random, so advantages are not 0
        adv_PG, _ = compute_advantages(rewards_PG, cfg.grpo.baseline, cfg.grpo.scale)
        samples = [Sample(prompts[p], list(c.token_ids), list(c.logprobs), float(adv_PG[p, j]))
                   for p, group in enumerate(outs) for j, c in enumerate(group)]
        m = update.run(samples, beta=0.0, epsilon_high=cfg.grpo.epsilon_high, max_new_tokens=sizes["new_tokens"])
        sync(device)
        t2 = time.perf_counter()
        tokens = sum(len(s.tokens) for s in samples)
        rows.append({"part": part, "step": step + 1,
                     "params_M": n_params / 1e6, "sequences": len(samples), "tokens": tokens,
                     "tokens_per_seq": tokens / len(samples), "step_s": t2 - t0, "generation_s": t1 - t0,
                     "update_s": t2 - t1, "tokens_per_s": tokens / (t2 - t0), "grad_norm": m["grad_norm"],
                     "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0})
    return rows, plan_prediction(model_config, overrides)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="both parts at toy sizes on CPU")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, part, model_config, sizes, demo = torch.device("cpu"), "grpo-toy", TOY, CPU_SIZES, (2, 2)
    elif torch.cuda.is_available():
        device, part, model_config, sizes = torch.device("cuda", 0), "grpo-1.5b", R1_DISTILL_QWEN_15B, GPU_SIZES
        demo = (3, 20)
    else:
        print("no CUDA device: run with --cpu-smoke")
        return 2
    failed = []
    rows = []
    for name, fn in (("demo", lambda: [run_demo(device.type, *demo)]),
                     ("grpo", lambda: run_grpo(device, part, model_config, sizes))):
        try:
            out = fn()
        except Exception as e:  # report the part that failed and still run the other one
            failed.append(name)
            print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        out, plan = out if name == "grpo" else (out, None)
        rows += out
        print_table(out, f"e2e {name} on {device}")
        if plan is not None:
            print("memory plan for the same settings (to compare with the measured peak_gib above):\n" + plan)
    if rows and not args.cpu_smoke:
        append_rows("e2e_gpu", rows, device)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
