"""fastgrpo vs TRL's GRPOTrainer: seconds per GRPO step on the same model, prompts, batch, G, length and loss.

    python bench/bench_vs_trl.py            # tiny recipe sizes: 32 prompts x 8 generations, 8 new tokens
    python bench/bench_vs_trl.py --quick    # fewer steps
    python bench/bench_vs_trl.py --prompts 16 --generations 8 --max-new-tokens 32 --steps 6

Both sides get the ``tiny`` recipe's model (a Qwen2-shaped model built from the recipe with the same seed, so the
same initial weights, fp32), the same formatted prompt strings of the synthetic addition task, the math reward
(``fastgrpo.rewards.math_reward``), ``P`` prompts x ``G`` generations per step, one AdamW step per rollout at the
same learning rate and clipping, loss ``dapo``, beta 0, epsilon 0.2 / 0.28, temperature 1, no warm-up, no
validation, no checkpoints, the same number of CPU threads. Each side runs in its own process:

- fastgrpo: ``python fastgrpo/train.py --recipe tiny ...``; a step's time is the ``time/step`` it logs (rollout,
  reward, update, metric reduction).
- TRL: ``GRPOTrainer`` (``use_cpu`` on CPU, transformers ``generate``); a step's time is ``on_step_begin`` →
  ``on_step_end`` of a callback (generation, reward, update and optimizer step happen in between).

The first ``--warmup`` steps of each are dropped; the table shows the median of the rest. The 1-minute load
average is recorded with the rows: on a machine busier than its cores, multi-threaded CPU runs stall in OpenMP
barriers (seconds per step instead of fractions) and only ``--threads 1`` gives comparable figures. TRL is not a
dependency of fastgrpo: without it only fastgrpo runs, with a message (``pip install trl``; ``--trl-path DIR``
adds a directory holding trl and its dependencies to the TRL process's ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LR = 1e-3  # the tiny recipe's GRPO learning rate
PHASES = ("generation", "reward", "update")  # fastgrpo's own breakdown of a step (time/<phase> in its metrics)


def _threads(requested: int) -> int:
    if requested:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_fastgrpo(args, out_dir: Path) -> dict:
    """Run the trainer in a subprocess and read its per-step rows back from metrics.jsonl."""
    from fastgrpo.metrics import read_jsonl

    overrides = [
        f"train.max_steps={args.warmup + args.steps}", "train.sft_warmup_steps=0", f"train.lr={LR}",
        f"train.num_threads={args.threads}", f"train.device={args.device}",
        f"grpo.num_prompts_per_step={args.prompts}", f"grpo.num_generations={args.generations}",
        "grpo.loss_type=dapo", "grpo.beta=0.0", "grpo.epsilon_low=0.2", "grpo.epsilon_high=0.28",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0",
        "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
        "checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.resume=never",
        f"logging.output_dir={out_dir}", "logging.progress_bar=false",
    ]
    cmd = [sys.executable, str(ROOT / "fastgrpo" / "train.py"), "--recipe", "tiny", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"fastgrpo failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [r for r in read_jsonl(out_dir / "metrics.jsonl") if "time/step" in r]
    out = {"step_s": [r["time/step"] for r in rows], "length": [r["response_length/mean"] for r in rows],
           "reward": [r["reward/mean"] for r in rows]}
    for phase in PHASES:
        out[f"{phase}_s"] = [r.get(f"time/{phase}", float("nan")) for r in rows]
    return out


def prepare_trl_inputs(args, out_dir: Path) -> None:
    """Save the tiny model (same seed as the trainer's) with its tokenizer, and the formatted training prompts."""
    import torch

    from fastgrpo.config import load_config
    from fastgrpo.data import format_prompt, synthetic_rows
    from fastgrpo.models import build_tiny_model, build_tiny_tokenizer

    cfg = load_config("tiny", None, [])
    tok = build_tiny_tokenizer()
    model = build_tiny_model(cfg.model, tok, seed=cfg.train.seed).to(torch.float32)
    model.save_pretrained(out_dir / "model")
    tok.save_pretrained(out_dir / "model")
    train_rows, _ = synthetic_rows(cfg.data)
    with open(out_dir / "prompts.jsonl", "w") as f:
        for row in train_rows:
            f.write(json.dumps({"prompt": format_prompt(row["prompt"], tok, cfg.data), "answer": row["answer"]}) + "\n")


def run_trl(args, out_dir: Path) -> dict | None:
    """The TRL side in its own process (``--trl-worker``); None when trl cannot be imported there."""
    env = dict(os.environ)
    if args.trl_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.trl_path, env.get("PYTHONPATH", "")) if p)
    probe = subprocess.run([sys.executable, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True, env=env)
    if probe.returncode != 0:
        return None
    prepare_trl_inputs(args, out_dir)
    cmd = [sys.executable, __file__, "--trl-worker", str(out_dir), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--max-new-tokens", str(args.max_new_tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads((out_dir / "trl_result.json").read_text())
    result["version"] = probe.stdout.strip()
    return result


def trl_worker(args) -> None:
    """Train with TRL's GRPOTrainer and write per-step times to ``trl_result.json``."""
    import time

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fastgrpo.rewards import math_reward

    out = Path(args.trl_worker)
    torch.set_num_threads(args.threads)
    use_cpu = args.device == "cpu" or not torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out / "model")
    data = load_dataset("json", data_files=str(out / "prompts.jsonl"), split="train")

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.start, self.step_s, self.length, self.reward = 0.0, [], [], []

        def on_step_begin(self, *a, **k):
            if not use_cpu:
                torch.cuda.synchronize()  # sync: the previous step's kernels must not count towards this one
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if not use_cpu:
                torch.cuda.synchronize()  # sync: the step ends when its kernels do
            self.step_s.append(time.perf_counter() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.length.append(logs["completions/mean_length"])
                self.reward.append(logs.get("reward", float("nan")))

    cfg = GRPOConfig(
        output_dir=str(out / "trl_run"), per_device_train_batch_size=args.prompts * args.generations,
        gradient_accumulation_steps=1, num_generations=args.generations, max_completion_length=args.max_new_tokens,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo",
        beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0, top_p=1.0, scale_rewards="group",
        num_iterations=1, max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=use_cpu, bf16=False, fp16=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    (out / "trl_result.json").write_text(json.dumps({"step_s": timer.step_s, "length": timer.length,
                                                     "reward": timer.reward}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (tiny recipe: 32)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt, G (tiny recipe: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="longest completion (tiny recipe: 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for each side (0: the visible cores)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="3 timed steps")
    parser.add_argument("--trl-path", default="", help="directory with trl (and deps) to put on PYTHONPATH")
    parser.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.threads = _threads(args.threads)
    if args.trl_worker:
        trl_worker(args)
        return
    if args.quick:
        args.steps = 3
    import torch
    from common import append_rows, print_table

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    load = os.getloadavg()[0]
    if load > args.threads and device == "cpu":
        print(f"warning: load average {load:.1f} is above the {args.threads} thread(s) used: timings are unreliable "
              f"(try --threads 1 on a shared machine)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"fastgrpo: {args.warmup} + {args.steps} steps of {args.prompts} prompts x {args.generations} "
              f"generations, {args.max_new_tokens} new tokens, {args.threads} threads, {device}", flush=True)
        fg = run_fastgrpo(args, tmp / "fastgrpo")
        print("TRL ...", flush=True)
        trl = run_trl(args, tmp)
    sides = {"fastgrpo": fg}
    if trl is None:
        print("trl is not installed: TRL's side is skipped (pip install trl, or --trl-path DIR with trl in it)")
    else:
        sides[f"trl {trl.pop('version')}"] = trl
    rows = []
    for name, res in sides.items():
        timed = res["step_s"][args.warmup:]
        if len(timed) < 1:
            raise RuntimeError(f"{name}: only {len(res['step_s'])} steps recorded")
        rows.append({"impl": name, "prompts": args.prompts, "generations": args.generations,
                     "max_new_tokens": args.max_new_tokens, "loss_type": "dapo", "threads": args.threads,
                     "timed_steps": len(timed), "loadavg_1min": round(load, 2), "s_per_step": statistics.median(timed),
                     "s_per_step_min": min(timed), "response_length": statistics.mean(res["length"][args.warmup:])})
        for key in (f"{phase}_s" for phase in PHASES):
            if key in res:
                rows[-1][key] = statistics.median(res[key][args.warmup:])
    for r in rows:
        r["vs_fastgrpo"] = r["s_per_step"] / rows[0]["s_per_step"]
    print_table(rows, "seconds per GRPO step (median of the timed steps); vs_fastgrpo = time / fastgrpo's time")
    if len(rows) == 2:
        print(f"fastgrpo takes {1 / rows[1]['vs_fastgrpo']:.3f} of TRL's time per step (target <= 0.333)")
    path = append_rows("vs_trl", rows, device)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
