"""fastgrpo's co-located GRPO trainer: the same model samples, is scored, and is updated, step after step.

Launch (torchrun only; one process needs no flags)::

    torchrun fastgrpo/train.py                                      # the `tiny` demo on CPU: a few minutes
    torchrun --nproc_per_node 2 fastgrpo/train.py --recipe tiny     # two processes (DDP, gloo on CPU)
    torchrun fastgrpo/train.py --recipe tiny train.max_steps=20 grpo.num_generations=4 rollout.max_new_tokens=8
    torchrun --nproc_per_node 8 fastgrpo/train.py --recipe deepscaler-1.5b \\
        model.path=/models/DeepSeek-R1-Distill-Qwen-1.5B data.path=/data/deepscaler.jsonl \\
        data.eval_path=/data/aime24.jsonl
    torchrun fastgrpo/train.py --config my.yaml logging.output_dir=runs/mine checkpoint.resume=auto

One GRPO step (see DESIGN.md): each rank takes its share of ``grpo.num_prompts_per_step`` prompts → the generation
engine samples ``grpo.num_generations`` completions per prompt with the policy's own parameters → reward functions
→ group advantages → packed micro-batches → old / reference log-probs when needed → clipped-surrogate update(s) →
one metrics row in ``<run dir>/metrics.jsonl`` → a checkpoint every ``checkpoint.every_steps``. Validation (avg@k
on the held-out prompts) runs at the start, every ``eval.every_steps`` and at the end, logged as
``eval/accuracy``. ``stages`` raise ``rollout.max_new_tokens`` (and may change lr / beta / epsilon_high) at a step.
Ctrl-C saves a checkpoint when the model is between steps, then stops.
"""

from __future__ import annotations

import os
import sys

# Run as a script, Python puts this file's directory (fastgrpo/) first on sys.path, where config.py, data.py and
# metrics.py would shadow unrelated top-level modules of those names: drop it before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fastgrpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from fastgrpo.config import Config, load_config, stage_settings  # noqa: E402
from fastgrpo.data import PromptSampler, load_datasets, sft_completion  # noqa: E402
from fastgrpo.distributed import (  # noqa: E402
    all_reduce,
    broadcast_object,
    destroy,
    fsdp_root,
    init_distributed,
    print0,
    reduce_metrics,
    unwrap_model,
    wrap_model,
)
from fastgrpo.eval import evaluate  # noqa: E402
from fastgrpo.generation import GenerationEngine, SamplingParams  # noqa: E402
from fastgrpo.grpo import PolicyUpdate, Sample, compute_advantages, packed_forward, sft_step  # noqa: E402
from fastgrpo.metrics import MetricsLogger, ProgressBar, Timer, peak_memory_gib, plot_metrics  # noqa: E402
from fastgrpo.models import eos_token_ids, load_model, set_cpu_threads  # noqa: E402
from fastgrpo.rewards import RewardSet  # noqa: E402

SEED_STRIDE = 1_000_003  # separates the per-(step, rank) sampling seeds


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row (a checkpoint was saved first)."""


def parse_args(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    parser = argparse.ArgumentParser(description="fastgrpo: co-located GRPO training (launch with torchrun)")
    parser.add_argument("--recipe", default=None, help="shipped recipe name (default: tiny)")
    parser.add_argument("--config", default=None, help="YAML config file instead of a recipe")
    parser.add_argument("overrides", nargs="*", help="group.field=value overrides, e.g. train.lr=1e-5")
    args = parser.parse_intermixed_args(argv)
    return args.recipe, args.config, args.overrides


@contextmanager
def full_weights(model):
    """Under FSDP2, gather every sharded module's full parameters for generation; otherwise nothing to do."""
    root = fsdp_root(model)
    if root is None:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    shards = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in shards:
        m.unshard()
    try:
        yield
    finally:
        for m in shards:
            m.reshard()


class Trainer:
    """Holds the run's state; :meth:`fit` is the whole run."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.state = init_distributed(cfg.train.device)
        st = self.state
        if st.device.type == "cpu":
            set_cpu_threads(cfg.train.num_threads, st.world_size)
        self._check_divisibility()
        random.seed(cfg.train.seed + st.rank)
        torch.manual_seed(cfg.train.seed + st.rank)

        self.run_dir = self._run_dir()
        self.model, self.tokenizer = load_model(cfg.model, st.device, seed=cfg.train.seed)
        self.train_data, self.held_out = load_datasets(cfg.data, self.tokenizer)
        self.sampler = PromptSampler(len(self.train_data), seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.rewards = RewardSet(cfg.reward)
        needs_ref = cfg.grpo.beta > 0 or any((s.beta or 0) > 0 for s in cfg.stages)
        self.ref_model = None
        if needs_ref:  # the frozen reference: the initial weights (before any warm-up), loaded again
            self.ref_model, _ = load_model(cfg.model, st.device, seed=cfg.train.seed)
            self.ref_model.requires_grad_(False).eval()

        self.wrapped = wrap_model(self.model, st, cfg.train.strategy, forward=packed_forward)
        self.engine = GenerationEngine(unwrap_model(self.wrapped), eos_token_ids=eos_token_ids(self.model,
                                                                                               self.tokenizer),
                                       max_batch_size=cfg.rollout.max_batch_size,
                                       max_total_tokens=cfg.rollout.max_total_tokens or None)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.wrapped.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                           betas=(t.adam_beta1, t.adam_beta2))
        warm = t.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.update = PolicyUpdate(cfg, self.wrapped, self.optimizer, self.scheduler, self.ref_model, st.device,
                                   st.world_size)
        self.timer = Timer(st.device)
        self.step = 0
        self.bad_in_a_row = 0
        self.total_bad = 0
        self.in_update = False
        self.last_saved = -1

    # ------------------------------------------------------------------ set-up

    def _check_divisibility(self):
        cfg, w = self.cfg, self.state.world_size
        if cfg.grpo.num_prompts_per_step % w:
            raise ValueError(f"grpo.num_prompts_per_step={cfg.grpo.num_prompts_per_step} must be a multiple of the "
                             f"number of processes ({w})")
        seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations
        per_step = cfg.train.sequences_per_optimizer_step
        if per_step and (seqs % per_step or per_step % w):
            raise ValueError(f"train.sequences_per_optimizer_step={per_step} must divide the rollout's {seqs} "
                             f"sequences (grpo.num_prompts_per_step x grpo.num_generations) and be a multiple of "
                             f"the number of processes ({w})")

    def _run_dir(self) -> Path:
        if self.cfg.logging.output_dir:
            path = Path(self.cfg.logging.output_dir)
        else:
            stamp = broadcast_object(time.strftime("%Y%m%d-%H%M%S"))
            path = Path("runs") / f"{self.cfg.name}-{stamp}"
        if self.state.is_main:
            path.mkdir(parents=True, exist_ok=True)
        return path

    def _resume(self) -> int | None:
        """Load the checkpoint ``checkpoint.resume`` asks for; returns its step, or None for a fresh start."""
        how = self.cfg.checkpoint.resume
        if how == "never":
            return None
        path = latest_checkpoint(self.run_dir) if how == "auto" else Path(how)
        if path is None:
            return None
        ts = load_checkpoint(path, model=self.wrapped, optimizer=self.optimizer, scheduler=self.scheduler,
                             state=self.state)
        self.step = int(ts["step"])
        self.sampler.load_state_dict(ts["sampler"])
        self.bad_in_a_row, self.total_bad = int(ts["bad_in_a_row"]), int(ts["total_bad"])
        self.last_saved = self.step
        print0(f"resumed from {path} at step {self.step}")
        return self.step

    def save(self) -> Path:
        path = save_checkpoint(self.run_dir, self.step, model=self.wrapped, tokenizer=self.tokenizer,
                               optimizer=self.optimizer, scheduler=self.scheduler,
                               trainer_state={"sampler": self.sampler.state_dict(), "bad_in_a_row": self.bad_in_a_row,
                                              "total_bad": self.total_bad},
                               keep_last=self.cfg.checkpoint.keep_last, state=self.state)
        self.last_saved = self.step
        return path

    # ------------------------------------------------------------------ phases

    def sft_warmup(self):
        """Optional supervised warm-up through the packed forward and ``fused_linear_cross_entropy``."""
        t, st = self.cfg.train, self.state
        if not t.sft_warmup_steps:
            return
        opt = torch.optim.AdamW(self.wrapped.parameters(), lr=t.sft_lr, weight_decay=0.0)
        rng = random.Random(t.seed)  # the same examples on every rank; each takes its share
        rows, ids = self.train_data.rows, self.train_data.prompt_ids
        eos = [self.tokenizer.eos_token_id]
        start = time.perf_counter()
        for s in range(t.sft_warmup_steps):
            picks = [rng.randrange(len(rows)) for _ in range(t.sft_batch_size)]
            answers = [rows[rng.randrange(len(rows))]["answer"] if rng.random() < t.sft_answer_noise
                       else rows[i]["answer"] for i in picks]
            mine = list(range(st.rank, len(picks), st.world_size))
            pairs = [(ids[picks[j]], self.tokenizer(sft_completion(answers[j]), add_special_tokens=False)["input_ids"]
                      + eos) for j in mine]
            loss = sft_step(self.wrapped, opt, pairs, t.max_tokens_per_microbatch, st.device, st.world_size)
            if (s + 1) % max(1, t.sft_warmup_steps // 4) == 0 or s + 1 == t.sft_warmup_steps:
                print0(f"warm-up step {s + 1}/{t.sft_warmup_steps}: loss {loss:.4f}")
        print0(f"warm-up done in {time.perf_counter() - start:.1f} s")

    def validate(self, logger: MetricsLogger) -> float | None:
        e = self.cfg.eval
        if self.held_out is None:
            return None
        start = time.perf_counter()
        with full_weights(self.wrapped):
            res = evaluate(unwrap_model(self.wrapped), self.tokenizer, self.held_out, e.k, temperature=e.temperature,
                           top_p=e.top_p, max_new_tokens=e.max_new_tokens or stage_settings(self.cfg, self.step)[
                               "max_new_tokens"], seed=self.cfg.train.seed + 7, num_prompts=e.num_prompts,
                           engine=self.engine, timeout_s=self.cfg.reward.timeout_s)
        acc = res[f"avg@{e.k}"]
        logger.log(self.step, {"eval/accuracy": acc, f"eval/pass@{e.k}": res[f"pass@{e.k}"],
                               "eval/response_length": res["response_length/mean"],
                               "eval/num_prompts": int(res["num_prompts"]),
                               "time/eval": time.perf_counter() - start})
        print0(f"step {self.step}: eval/accuracy (avg@{e.k} on {int(res['num_prompts'])} held-out prompts) "
               f"{acc:.3f}, pass@{e.k} {res[f'pass@{e.k}']:.3f}")
        return acc

    def rollout(self, settings: dict) -> tuple[list[Sample], dict[str, float]]:
        """Sample, score and compute advantages for this rank's share of the step's prompts."""
        cfg, st, g = self.cfg, self.state, self.cfg.grpo
        per_rank = g.num_prompts_per_step // st.world_size
        idx = self.sampler.next(g.num_prompts_per_step)[st.rank * per_rank : (st.rank + 1) * per_rank]
        prompts = [self.train_data.prompt_ids[i] for i in idx]
        G = g.num_generations
        params = SamplingParams(n=G, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, max_new_tokens=settings["max_new_tokens"],
                                seed=(cfg.train.seed * SEED_STRIDE + self.step) * 1024 + st.rank)
        with self.timer("generation"), full_weights(self.wrapped):
            outs = self.engine.generate(prompts, params)
        completions = [c for group in outs for c in group]  # [P * G], prompt-major
        with self.timer("reward"):
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
            prompt_texts = [text for p in prompts for text in [self.tokenizer.decode(p)] * G]  # decoded once each
            columns = {k: [v for v in vals for _ in range(G)] for k, vals in self.train_data.columns(idx).items()}
            result = self.rewards.score(prompt_texts, texts, columns)
        r_PG = torch.tensor(result.total, dtype=torch.float64).view(len(prompts), G)
        batch_std = None
        if g.scale == "batch":
            s = all_reduce(torch.tensor([r_PG.sum(), (r_PG**2).sum(), r_PG.numel()], dtype=torch.float64,
                                        device=self._coll_device())).cpu().tolist()
            batch_std = math.sqrt(max(s[1] - s[0] ** 2 / s[2], 0.0) / max(s[2] - 1, 1))
        adv_PG, zero_std_P = compute_advantages(r_PG, g.baseline, g.scale, batch_std)
        adv, zero_std = adv_PG.view(-1).tolist(), zero_std_P.tolist()  # CPU tensors: Python lists once
        samples = []
        for j, c in enumerate(completions):
            p = j // G
            keep = not (g.mask_truncated_completions and c.finish_reason == "length")
            keep = keep and not (g.dynamic_sampling and zero_std[p])
            samples.append(Sample(prompts[p], list(c.token_ids), list(c.logprobs), adv[j], keep))
        lengths = [len(c.token_ids) for c in completions]
        correct = result.per_function.get("math", [float(x > 0) for x in result.total])
        m = {
            "reward/sum": float(r_PG.sum()), "reward_sq/sum": float((r_PG**2).sum()), "completions/sum": len(lengths),
            "accuracy": sum(c == 1.0 for c in correct) / len(correct),
            "response_length/mean": sum(lengths) / len(lengths), "response_length/max": float(max(lengths)),
            "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "frac_reward_zero_std": float(zero_std_P.double().mean()),
            "tokens/sum": float(sum(lengths) + G * sum(len(p) for p in prompts)),
            **result.metrics(),
        }
        return samples, m

    def _coll_device(self) -> torch.device:
        return self.state.device if self.state.backend == "nccl" else torch.device("cpu")

    def train_step(self, logger: MetricsLogger) -> dict[str, float]:
        cfg = self.cfg
        settings = stage_settings(cfg, self.step)
        # the stage's learning rate, times the warm-up factor of the scheduler's current position
        self.scheduler.base_lrs = [settings["lr"]] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = settings["lr"] * factor(self.scheduler.last_epoch)
        step_start = time.perf_counter()
        samples, local = self.rollout(settings)
        self.in_update = True
        with self.timer("update"):
            upd = self.update.run(samples, beta=settings["beta"], epsilon_high=settings["epsilon_high"],
                                  max_new_tokens=settings["max_new_tokens"])
        self.in_update = False
        # every rank has the same keys: metrics a rank lacks (no optimizer step succeeded) are NaN there
        for key in ("loss", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean", "mismatch/logprob_abs_diff") + (("kl",) if settings["beta"] else ()):
            upd.setdefault(key, math.nan)
        local.update(upd)
        local["bad_steps/sum"] = local.pop("bad_steps")
        local["optimizer_steps/max"] = local.pop("optimizer_steps")
        local.update(self.timer.pop(prefix="time/"))
        m = reduce_metrics(local)
        n = m.pop("completions/sum")
        mean = m.pop("reward/sum") / n
        m["reward/mean"] = mean
        m["reward/std"] = math.sqrt(max(m.pop("reward_sq/sum") / n - mean**2, 0.0) * n / max(n - 1, 1))
        m["tokens"] = m.pop("tokens/sum")
        step_time = time.perf_counter() - step_start
        m["time/step"] = step_time
        m["tokens_per_second"] = m["tokens"] / step_time
        m["lr"] = self.optimizer.param_groups[0]["lr"]
        m["max_new_tokens"] = settings["max_new_tokens"]
        m["peak_memory_gib"] = peak_memory_gib(self.state.device)
        bad = int(m.pop("bad_steps/sum"))
        self.total_bad += bad
        self.bad_in_a_row = self.bad_in_a_row + bad if bad else 0
        m["bad_steps"] = self.total_bad
        self.step += 1
        logger.log(self.step, m)
        return m

    # ------------------------------------------------------------------ the run

    def fit(self) -> dict:
        cfg, st = self.cfg, self.state
        resumed = self._resume()
        if st.is_main:
            print0("resolved config:\n" + cfg.to_yaml())
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        logger = MetricsLogger(self.run_dir, enabled=st.is_main, tensorboard=cfg.logging.tensorboard,
                               wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, run_name=cfg.name,
                               config=cfg.to_dict(), resume_step=resumed)
        dropped = self.train_data.num_dropped + (self.held_out.num_dropped if self.held_out else 0)
        print0(f"run directory: {self.run_dir}  |  {len(self.train_data)} training prompts"
               + (f", {len(self.held_out)} held-out" if self.held_out else "")
               + (f", {dropped} dropped (longer than data.max_prompt_tokens)" if dropped else "")
               + f"  |  {st.world_size} process(es) on {st.device}")
        result = {"start_accuracy": None, "end_accuracy": None}
        start = time.perf_counter()
        bar = None
        try:
            if resumed is None:
                self.sft_warmup()
                if cfg.eval.at_start:
                    result["start_accuracy"] = self.validate(logger)
            bar = ProgressBar(cfg.train.max_steps, initial=self.step, enabled=st.is_main and cfg.logging.progress_bar)
            while self.step < cfg.train.max_steps:
                m = self.train_step(logger)
                bar.update(self.step, reward=m["reward/mean"], acc=m["accuracy"])
                if self.bad_in_a_row >= cfg.train.max_bad_steps:
                    path = self.save()
                    raise TrainingAborted(f"{self.bad_in_a_row} optimizer steps in a row had a non-finite loss or "
                                       f"gradient (train.max_bad_steps={cfg.train.max_bad_steps}); saved {path}")
                every = cfg.checkpoint.every_steps
                if every and self.step % every == 0 and self.step < cfg.train.max_steps:
                    self.save()
                if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0 and self.step < cfg.train.max_steps:
                    self.validate(logger)
            bar.close()
            if cfg.eval.at_end:
                result["end_accuracy"] = self.validate(logger)
            path = self.save() if cfg.checkpoint.save_final and self.last_saved != self.step else None
        except BaseException as exc:
            if bar is not None:
                bar.close()
            # Save only where every rank gets here together (Ctrl-C reaches all of torchrun's processes; another
            # error may hit one rank alone, and a collective save would then hang) and the weights match a
            # completed GRPO step (not in the middle of a rollout's optimizer steps, nor of the warm-up).
            safe = not self.in_update and self.step > max(self.last_saved, 0) and (
                isinstance(exc, KeyboardInterrupt) or st.world_size == 1)
            if safe and not isinstance(exc, TrainingAborted):
                print0(f"interrupted ({type(exc).__name__}): saved {self.save()}")
            logger.close()
            raise
        logger.close()
        if st.is_main:
            png = plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")
            print0(f"done: {self.step} GRPO steps in {time.perf_counter() - start:.1f} s")
            if result["start_accuracy"] is not None and result["end_accuracy"] is not None:
                print0(f"held-out accuracy: {result['start_accuracy']:.3f} at the start of GRPO -> "
                       f"{result['end_accuracy']:.3f} at the end")
            print0(f"metrics:    {self.run_dir / 'metrics.jsonl'}\nplot:       {png}\n"
                   f"checkpoint: {path or self.run_dir / 'checkpoints'}")
        result["run_dir"] = str(self.run_dir)
        return result


def main(argv: list[str] | None = None) -> dict:
    recipe, config_file, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(recipe, config_file, overrides)
    try:
        return Trainer(cfg).fit()
    finally:
        destroy()


if __name__ == "__main__":
    main()
