"""fastgrpo vs TRL's GRPOTrainer: seconds per GRPO step on the same model, prompts, batch, G, length and loss.

    python bench/bench_vs_trl.py            # tiny recipe sizes: 32 prompts x 8 generations, 8 new tokens
    python bench/bench_vs_trl.py --quick    # fewer steps, one seed
    python bench/bench_vs_trl.py --prompts 16 --generations 8 --max-new-tokens 32 --steps 6
    python bench/bench_vs_trl.py --lora     # both sides train LoRA adapters (the same peft_config) on the frozen start

Both sides start from the same checkpoint: the ``tiny`` recipe's Qwen2-shaped model (fp32) after ``--sft-steps``
supervised warm-up steps of fastgrpo (untimed), so that answers are partly right, rewards vary within groups and
every step really trains (a random model scores 0 everywhere, and a trainer may then skip the update). Then the
same formatted prompt strings of the synthetic addition task, the math reward (``fastgrpo.rewards.math_reward``),
``P`` prompts x ``G`` generations per step, mean baseline with group std scaling and no filtering, one AdamW step
per rollout at the same learning rate and clipping, loss ``dapo``, beta 0, epsilon 0.2 / 0.28, temperature 1, no
validation, no checkpoints, the same number of CPU threads. TRL's flags are those of the README's "Which TRL flags"
paragraph: the KL weighting is set on both sides (TRL's ``use_bias_correction_kl=True``, fastgrpo's
``grpo.kl_weight=ratio``; with beta 0 there is no KL term), ``importance_sampling_level="token"``,
``top_entropy_quantile=1.0``, ``mask_truncated_completions=False``, no ``off_policy_mask_threshold`` and no
``delta`` (TRL's defaults and fastgrpo's), no vLLM (so no ``vllm_importance_sampling_correction``; fastgrpo's
``grpo.rollout_is=none``), one process without gradient accumulation. Each side runs in its own process:

- fastgrpo: ``python fastgrpo/train.py --recipe tiny ...``; a step's time is the ``time/step`` it logs (rollout,
  reward, update, metric reduction).
- TRL: ``GRPOTrainer`` (``use_cpu`` on CPU, transformers ``generate``); a step's time is ``on_step_begin`` →
  ``on_step_end`` of a callback (generation, reward, update and optimizer step happen in between); its reward
  time is measured around the reward function.

The reward (math-verify on every ``\\boxed{}`` answer) is the same function on both sides: ``reward_s`` shows how
much of a step it takes, and ``no_reward_vs_fastgrpo`` compares the rest (the trainers' own work). TRL scores in
the step, after generation. fastgrpo scores in worker processes while it decodes; its ``reward_s`` is the step's
wait for the last scores after generation (``time/reward_wait``), ``reward_busy_s`` the scoring's span from the first
group submitted to the last score (``time/reward``, overlapping the decode). fastgrpo's breakdown of a step:
``generation_s`` + ``reward_s`` + ``update_s`` (+ metrics and bookkeeping).

Each side runs once per seed (``--seeds``: the sampling seed, and the prompt order, of both trainers), and the
first ``--warmup`` steps of each run are dropped; the table shows the median of the rest, pooled over the seeds.
Several seeds matter for the reward's share: its time is almost all math-verify calls on the distinct boxed answers
the fast paths cannot settle (``\\boxed{1qx6}`` goes to sympy; a plain number is settled at once), and how many such
answers a step holds depends on where the sampled trajectory drifts, on either side: with one seed, one side's
reward time may be a multiple of the other's by chance (figures in docs/benchmarks.md). The 1-minute load
average is recorded with the rows: on a machine busier than its cores, multi-threaded CPU runs stall in OpenMP
barriers (seconds per step instead of fractions) and only ``--threads 1`` gives comparable figures. TRL is not a
dependency of fastgrpo: without it only fastgrpo runs, with a message (``pip install trl``; ``--trl-path DIR``
adds a directory holding trl and its dependencies to the TRL process's ``PYTHONPATH``).

``--lora``: both sides train LoRA adapters on the frozen shared start with the same PEFT configuration (r =
``--lora-r``, alpha = 2r, dropout 0, the seven attention and MLP projections; ``lora-tiny``'s shape): fastgrpo with
``model.lora.*`` (the engine reads base + adapters unmerged), TRL with ``GRPOTrainer(peft_config=LoraConfig(...))``
(transformers ``generate`` of the PeftModel). ``peak_rss_gib`` is each side's process resident high-water mark
(``VmHWM``, imports included: TRL's process also imports datasets and accelerate), read once at the end, so the
timed steps run in the default allocator state (bench/common.py's rule): a process figure, not a per-call one.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LR = 1e-3  # the tiny recipe's GRPO learning rate
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fastgrpo's own breakdown of a step: column <- time/<phase> in its metrics
PHASES = {"generation_s": "generation", "reward_s": "reward_wait", "reward_busy_s": "reward", "update_s": "update"}


def _threads(requested: int) -> int:
    if requested:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _train(args, out_dir: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, str(ROOT / "fastgrpo" / "train.py"), "--recipe", "tiny", *overrides,
           f"train.num_threads={args.threads}", f"train.device={args.device}", "eval.at_start=false",
           "eval.at_end=false", "eval.every_steps=0", "checkpoint.every_steps=0", "checkpoint.resume=never",
           f"logging.output_dir={out_dir}", "logging.progress_bar=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"fastgrpo failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def warm_start(args, out_dir: Path) -> Path:
    """The shared starting point: fastgrpo's supervised warm-up only (no GRPO step), saved as a checkpoint."""
    from fastgrpo.checkpoint import latest_checkpoint

    _train(args, out_dir, ["train.max_steps=0", f"sft.warmup_steps={args.sft_steps}",
                           "checkpoint.save_final=true"])
    path = latest_checkpoint(out_dir)
    if path is None:
        raise RuntimeError(f"the warm-up wrote no checkpoint in {out_dir}")
    return path


def run_fastgrpo(args, out_dir: Path, model_path: Path, seed: int) -> dict:
    """Run the trainer in a subprocess and read its per-step rows back from metrics.jsonl."""
    from fastgrpo.metrics import read_jsonl

    _train(args, out_dir, [
        f"model.path={model_path}", "model.dtype=float32",
        f"train.max_steps={args.warmup + args.steps}", "sft.warmup_steps=0", f"train.lr={LR}",
        "train.weight_decay=0.0", "train.warmup_steps=0", "train.max_grad_norm=1.0",
        "train.sequences_per_optimizer_step=0",
        f"grpo.num_prompts_per_step={args.prompts}", f"grpo.num_generations={args.generations}",
        "grpo.loss_type=dapo", "grpo.beta=0.0", "grpo.kl_weight=ratio", "grpo.epsilon_low=0.2",
        "grpo.epsilon_high=0.28",
        "grpo.baseline=mean", "grpo.scale=group", "grpo.mask_zero_std_groups=false",
        "grpo.mask_truncated_completions=false",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        "rollout.top_k=0", "checkpoint.save_final=false", f"train.seed={seed}",
        *([f"model.lora.r={args.lora_r}", f"model.lora.alpha={2.0 * args.lora_r}", "model.lora.dropout=0.0",
           f"model.lora.target_modules={json.dumps(LORA_TARGETS)}"] if args.lora else []),
    ])
    rows = [r for r in read_jsonl(out_dir / "metrics.jsonl") if "time/step" in r]
    out = {"step_s": [r["time/step"] for r in rows], "length": [r["response_length/mean"] for r in rows],
           "reward": [r["reward/mean"] for r in rows], "peak_rss_gib": [max(r["peak_memory_gib"] for r in rows)]}
    for column, phase in PHASES.items():
        out[column] = [r.get(f"time/{phase}", float("nan")) for r in rows]
    return out


def write_prompts(model_path: Path, out_file: Path) -> None:
    """The training prompts formatted exactly as fastgrpo formats them (chat template of the saved tokenizer)."""
    from transformers import AutoTokenizer

    from fastgrpo.config import load_config
    from fastgrpo.data.prompts import format_prompt
    from fastgrpo.data.synthetic import synthetic_rows

    cfg = load_config("tiny", None, [])
    tok = AutoTokenizer.from_pretrained(model_path)
    train_rows, _ = synthetic_rows(cfg.data)
    with open(out_file, "w") as f:
        for row in train_rows:
            f.write(json.dumps({"prompt": format_prompt(row["prompt"], tok, cfg.data), "answer": row["answer"]}) + "\n")


def run_trl(args, out_dir: Path, model_path: Path, seed: int) -> dict | None:
    """The TRL side in its own process (``--trl-worker``); None when trl cannot be imported there."""
    env = dict(os.environ)
    if args.trl_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.trl_path, env.get("PYTHONPATH", "")) if p)
    probe = subprocess.run([sys.executable, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True, env=env)
    if probe.returncode != 0:
        return None
    write_prompts(model_path, out_dir / "prompts.jsonl")
    cmd = [sys.executable, __file__, "--trl-worker", str(out_dir), "--model", str(model_path),
           "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--max-new-tokens", str(args.max_new_tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--device", args.device, "--seed", str(seed),
           *(["--lora", "--lora-r", str(args.lora_r)] if args.lora else [])]
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
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    data = load_dataset("json", data_files=str(out / "prompts.jsonl"), split="train")

    reward_clock = [0.0]

    @functools.wraps(math_reward)  # TRL names the reward column after the function
    def timed_reward(*a, **k):
        t0 = time.perf_counter()
        try:
            return math_reward(*a, **k)
        finally:
            reward_clock[0] += time.perf_counter() - t0

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.start, self.step_s, self.reward_s, self.length, self.reward = 0.0, [], [], [], []

        def on_step_begin(self, *a, **k):
            if not use_cpu:
                torch.cuda.synchronize()  # sync: the previous step's kernels must not count towards this one
            self.start = time.perf_counter()
            reward_clock[0] = 0.0

        def on_step_end(self, *a, **k):
            if not use_cpu:
                torch.cuda.synchronize()  # sync: the step ends when its kernels do
            self.step_s.append(time.perf_counter() - self.start)
            self.reward_s.append(reward_clock[0])

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.length.append(logs["completions/mean_length"])
                self.reward.append(logs.get("reward", float("nan")))

    cfg = GRPOConfig(
        output_dir=str(out / "trl_run"), per_device_train_batch_size=args.prompts * args.generations,
        gradient_accumulation_steps=1, num_generations=args.generations, max_completion_length=args.max_new_tokens,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo",
        beta=0.0, use_bias_correction_kl=True, epsilon=0.2, epsilon_high=0.28, temperature=1.0, top_p=1.0,
        scale_rewards="group", num_iterations=1, max_steps=args.warmup + args.steps, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=use_cpu, bf16=False, fp16=False, seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    timer = StepTimes()
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2.0 * args.lora_r, lora_dropout=0.0,
                                 target_modules=LORA_TARGETS, bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=timed_reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[timer], peft_config=peft_config)
    trainer.train()
    from fastgrpo.metrics import peak_memory_gib

    (out / "trl_result.json").write_text(json.dumps({"step_s": timer.step_s, "reward_s": timer.reward_s,
                                                     "length": timer.length, "reward": timer.reward,
                                                     "peak_rss_gib": [peak_memory_gib("cpu")]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (tiny recipe: 32)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt, G (tiny recipe: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="longest completion (tiny recipe: 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for each side (0: the visible cores)")
    parser.add_argument("--sft-steps", type=int, default=100, help="untimed supervised warm-up of the shared start")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--seeds", type=int, default=3, help="runs of each side, with seeds 0 .. SEEDS-1")
    parser.add_argument("--quick", action="store_true", help="3 timed steps, one seed")
    parser.add_argument("--trl-path", default="", help="directory with trl (and deps) to put on PYTHONPATH")
    parser.add_argument("--lora", action="store_true", help="both sides train LoRA adapters (the same peft_config)")
    parser.add_argument("--lora-r", type=int, default=32, help="LoRA rank with --lora (alpha = 2r)")
    parser.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.threads = _threads(args.threads)
    if args.trl_worker:
        trl_worker(args)
        return
    if args.quick:
        args.steps, args.seeds = 3, 1
    import torch
    from common import append_rows, print_table

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    load = os.getloadavg()[0]
    if load > args.threads and device == "cpu":
        print(f"warning: load average {load:.1f} is above the {args.threads} thread(s) used: timings are unreliable "
              f"(try --threads 1 on a shared machine)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"shared start: {args.sft_steps} supervised warm-up steps ...", flush=True)
        start = warm_start(args, tmp / "warm")
        sides: dict[str, list[dict]] = {"fastgrpo": []}
        with_trl = True
        for seed in range(args.seeds):
            print(f"seed {seed}: fastgrpo {args.warmup} + {args.steps} steps of {args.prompts} prompts x "
                  f"{args.generations} generations, {args.max_new_tokens} new tokens, {args.threads} threads, {device}",
                  flush=True)
            sides["fastgrpo"].append(run_fastgrpo(args, tmp / f"fastgrpo{seed}", start, seed))
            if not with_trl:
                continue
            print(f"seed {seed}: TRL ...", flush=True)
            trl = run_trl(args, tmp, start, seed)
            if trl is None:
                print("trl is not installed: TRL's side is skipped (pip install trl, or --trl-path DIR with trl in it)")
                with_trl = False
                continue
            sides.setdefault(f"trl {trl.pop('version')}", []).append(trl)
    rows = []
    for name, runs in sides.items():
        peak = max(v for run in runs for v in run.pop("peak_rss_gib"))
        res = {k: [v for run in runs for v in run[k][args.warmup:]] for k in runs[0]}  # timed steps of every seed
        timed = res["step_s"]
        if len(timed) < 1:
            raise RuntimeError(f"{name}: no timed step recorded")
        rest = [s - r for s, r in zip(res["step_s"], res["reward_s"])]
        rows.append({"impl": name, "prompts": args.prompts, "generations": args.generations,
                     "max_new_tokens": args.max_new_tokens, "loss_type": "dapo", "threads": args.threads,
                     "seeds": len(runs), "timed_steps": len(timed), "loadavg_1min": round(load, 2),
                     "s_per_step": statistics.median(timed), "s_per_step_min": min(timed),
                     "no_reward_s": statistics.median(rest), "response_length": statistics.mean(res["length"]),
                     "reward_mean": statistics.mean(res["reward"]), "sft_steps": args.sft_steps,
                     "lora_r": args.lora_r if args.lora else 0, "peak_rss_gib": peak})
        for key in PHASES:
            if key in res:
                rows[-1][key] = statistics.median(res[key])
    for r in rows:
        r["vs_fastgrpo"] = r["s_per_step"] / rows[0]["s_per_step"]
        r["no_reward_vs_fastgrpo"] = r["no_reward_s"] / rows[0]["no_reward_s"]
    print_table(rows, "seconds per GRPO step (median of the timed steps); vs_fastgrpo = time / fastgrpo's time")
    if len(rows) == 2:
        print(f"fastgrpo takes {1 / rows[1]['vs_fastgrpo']:.3f} of TRL's time per step (the CPU goal: <= 0.5); "
              f"{1 / rows[1]['no_reward_vs_fastgrpo']:.3f} without the (shared) reward function")
    if args.lora and len(rows) == 2:
        print(f"peak resident memory: fastgrpo {rows[0]['peak_rss_gib']:.2f} GiB, "
              f"TRL {rows[1]['peak_rss_gib']:.2f} GiB")
    path = append_rows("vs_trl_lora" if args.lora else "vs_trl", rows, device)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
