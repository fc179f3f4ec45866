"""fastgrpo's DPO step vs TRL's DPOTrainer: seconds per step and peak memory on the same model, pairs and lengths.

    python bench/bench_dpo.py                                   # dpo-tiny sizes: 64 pairs per step
    python bench/bench_dpo.py --extra-tokens 48 --pairs 32      # longer, unequal responses (packing matters more)
    python bench/bench_dpo.py --trl-python /tmp/trl-venv/bin/python   # TRL from another environment

Both sides train the same randomly initialised ``tiny`` Qwen2-shaped model (fp32, saved once with its tokenizer)
on the same conversational preference rows in TRL's format (``prompt`` / ``chosen`` / ``rejected`` message lists,
rendered by the tiny tokenizer's chat template): the synthetic addition task of ``dpo-tiny``, chosen the correct
sum, rejected a near miss, each response followed by ``--extra-tokens`` random characters on average (uniform in
``[0, 2·extra]``, so lengths differ, as real responses do). The same DPO settings: sigmoid loss, beta 0.1 (the flags
under which TRL's loss is fastgrpo's: ``loss_type="sigmoid"``; ``label_smoothing=0``, ``use_weighting=False``, no
``ld_alpha`` and no ``loss_weights``, TRL's defaults; fastgrpo's ``dpo.label_smoothing=0``, ``dpo.sft_weight=0``,
summed sequence log-probs, its defaults), AdamW at the same learning rate without weight decay, clipping at 1.0,
``--pairs`` pairs per optimizer step (no gradient accumulation), the reference computed by a frozen copy of the
model in every step (TRL's default, ``precompute_ref_log_probs=False``; fastgrpo's
``dpo.precompute_ref_logprobs=false``), fp32, the same number of CPU threads, no evaluation, no checkpoints. Both
sides also run with the reference log-probs computed once before the first step (``*-precomputed``: fastgrpo's
default ``dpo.precompute_ref_logprobs``, TRL's ``precompute_ref_log_probs=True``; that pass is not part of a step).

- fastgrpo: ``fastgrpo/train.py --recipe dpo-tiny`` in a subprocess; a step's time is the ``time/step`` it logs.
  Its micro-batches pack the pairs padding-free (one micro-batch here).
- TRL: ``DPOTrainer`` (``use_cpu``) in a subprocess of ``--trl-python``; a step's time is ``on_step_begin`` →
  ``on_step_end`` of a callback. TRL pads chosen and rejected to the longest sequence of the batch
  (``padding_free`` is forced off in its DPOTrainer).

``cpu_s_per_step`` (the figure compared): each side runs twice, ``--warmup`` steps and ``--warmup + --steps``
steps, and the difference of the two processes' user + system CPU time (``wait4``) is divided by ``--steps``: start-
up, imports and a precomputed reference pass cancel out, and unlike wall time it does not grow when the machine is
busier than its cores (waiting for a core costs no CPU time). ``s_per_step`` is the median wall time of the timed
steps (fastgrpo's logged ``time/step``; for TRL ``on_step_begin`` → ``on_step_end``). Peak memory is the longer
run's resident high-water mark (``ru_maxrss``), imports included: both sides import torch and transformers; TRL
also imports datasets and accelerate.
TRL is not a dependency of fastgrpo: without it only fastgrpo runs, with a message (install it in a separate
environment with the same torch: ``python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0
trl``, then ``--trl-python /tmp/trl-venv/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LR = 3e-4  # dpo-tiny's learning rate
BETA = 0.1


def _threads(requested: int) -> int:
    if requested:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _run(cmd: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """Run ``cmd``; returns ``(stdout + stderr tail, CPU seconds, peak RSS in GiB)`` of the child (``wait4``)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{out[-4000:]}")
    return out, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20  # ru_maxrss: KiB on Linux


def make_inputs(args, out_dir: Path) -> tuple[Path, Path]:
    """The shared model directory and the preference rows (JSONL, TRL's conversational format)."""
    from fastgrpo.config import load_config
    from fastgrpo.data.synthetic import near_miss, sft_completion, synthetic_rows
    from fastgrpo.models.loading import build_tiny_model, build_tiny_tokenizer

    cfg = load_config("dpo-tiny")
    tok = build_tiny_tokenizer()
    model_dir = out_dir / "model"
    build_tiny_model(cfg.model, tok, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rng = random.Random(0)
    rows = []
    for r in synthetic_rows(cfg.data)[0]:
        def filler():
            return "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(0, 2 * args.extra_tokens)))

        rows.append({"prompt": [{"role": "user", "content": r["prompt"]}],
                     "chosen": [{"role": "assistant", "content": sft_completion(r["answer"]) + filler()}],
                     "rejected": [{"role": "assistant", "content": sft_completion(near_miss(r["answer"], rng))
                                   + filler()}]})
    data = out_dir / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def run_fastgrpo(args, out_dir: Path, model_dir: Path, data: Path, precompute: bool, steps: int) -> dict:
    from fastgrpo.metrics import read_jsonl

    run = out_dir / f"fastgrpo-{precompute}-{steps}"
    cmd = [sys.executable, str(ROOT / "fastgrpo" / "train.py"), "--recipe", "dpo-tiny", f"model.path={model_dir}",
           "model.dtype=float32", f"data.path={data}", "data.max_length=256", "data.max_prompt_tokens=64",
           "sft.warmup_steps=0", f"dpo.batch_size={args.pairs}", f"dpo.beta={BETA}", "dpo.loss_type=sigmoid",
           "dpo.sft_weight=0", f"dpo.precompute_ref_logprobs={str(precompute).lower()}",
           f"train.max_steps={steps}", f"train.lr={LR}", "train.weight_decay=0",
           "train.max_grad_norm=1.0", "train.max_tokens_per_microbatch=65536", f"train.num_threads={args.threads}",
           "train.device=cpu", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
           "checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.resume=never",
           f"logging.output_dir={run}", "logging.progress_bar=false"]
    _, cpu_s, peak = _run(cmd)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "time/step" in r][args.warmup :]
    return {"s_per_step": statistics.median(r["time/step"] for r in rows) if rows else math.nan, "cpu_s": cpu_s,
            "peak_rss_gib": peak, "tokens_per_step": statistics.median(r["tokens"] for r in rows) if rows else 0}


def run_trl(args, out_dir: Path, model_dir: Path, data: Path, precompute: bool, steps: int) -> dict | None:
    """The TRL side in a ``--trl-python`` process (``--trl-worker``); None when trl cannot be imported there."""
    probe = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return None
    result = out_dir / f"trl_result_{precompute}_{steps}.json"
    cmd = [args.trl_python, __file__, "--trl-worker", str(result), "--model", str(model_dir), "--data", str(data),
           "--pairs", str(args.pairs), "--steps", str(steps), "--threads", str(args.threads)]
    cmd += ["--precompute"] if precompute else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _, cpu_s, peak = _run(cmd, env)
    step_s = json.loads(result.read_text())["step_s"][args.warmup :]
    return {"s_per_step": statistics.median(step_s) if step_s else math.nan, "cpu_s": cpu_s, "peak_rss_gib": peak,
            "version": probe.stdout.strip()}


def trl_worker(args) -> None:
    """Train with TRL's DPOTrainer and write per-step times (runs in the TRL environment: no fastgrpo import)."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    data = load_dataset("json", data_files=args.data, split="train")

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.start, self.step_s = 0.0, []

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_s.append(time.perf_counter() - self.start)

    cfg = DPOConfig(output_dir=str(Path(args.trl_worker).parent / "trl_run"),
                    per_device_train_batch_size=args.pairs, gradient_accumulation_steps=1, learning_rate=LR,
                    lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, beta=BETA,
                    loss_type="sigmoid", max_length=256, precompute_ref_log_probs=args.precompute,
                    max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    timer = StepTimes()
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok, callbacks=[timer])
    trainer.train()
    Path(args.trl_worker).write_text(json.dumps({"step_s": timer.step_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=64, help="preference pairs per optimizer step (dpo-tiny: 64)")
    parser.add_argument("--extra-tokens", type=int, default=0, help="mean random characters after each response")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for each side (0: the visible cores)")
    parser.add_argument("--trl-python", default=sys.executable, help="python of an environment with trl installed")
    parser.add_argument("--no-csv", action="store_true", help="do not append rows to bench/results/dpo.csv")
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--precompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.threads = _threads(args.threads)
    if args.trl_worker:
        trl_worker(args)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from common import append_rows, print_table

    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as tmp:
        out = Path(tmp)
        model_dir, data = make_inputs(args, out)
        sides = {"fastgrpo": lambda n: run_fastgrpo(args, out, model_dir, data, False, n),
                 "fastgrpo-precomputed": lambda n: run_fastgrpo(args, out, model_dir, data, True, n),
                 "trl": lambda n: run_trl(args, out, model_dir, data, False, n),
                 "trl-precomputed": lambda n: run_trl(args, out, model_dir, data, True, n)}
        results = {}
        for name, run in sides.items():
            long = run(args.warmup + args.steps)
            if long is None:
                print(f"trl is not importable by {args.trl_python}: {name} skipped (see the docstring to install it)")
                continue
            short = run(args.warmup)
            # CPU seconds per step: the difference of two runs that differ only in their number of steps (start-up,
            # imports, the precomputed reference pass and the untimed steps cancel out)
            results[name] = {**long, "cpu_s_per_step": (long["cpu_s"] - short["cpu_s"]) / args.steps}
    base = results["fastgrpo"]["cpu_s_per_step"]
    load = os.getloadavg()[0]
    rows = [{"impl": name, "pairs": args.pairs, "extra_tokens": args.extra_tokens, "threads": args.threads,
             "timed_steps": args.steps, "loadavg_1min": round(load, 2), **r,
             "vs_fastgrpo": r["cpu_s_per_step"] / base} for name, r in results.items()]
    for r in rows:  # each side against TRL in the same setting
        trl_row = results.get("trl-precomputed" if r["impl"].endswith("precomputed") else "trl")
        if trl_row is not None:
            r["vs_trl"] = r["cpu_s_per_step"] / trl_row["cpu_s_per_step"]
    print_table(rows, "DPO step on CPU: fastgrpo vs TRL (vs_* = cpu_s_per_step / that side's, same setting)")
    if not args.no_csv:
        print(f"rows appended to {append_rows('dpo', rows, 'cpu')}")


if __name__ == "__main__":
    main()
