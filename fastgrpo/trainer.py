"""The :class:`Trainer`: one run's loop (data order, steps, validation, metrics, progress, checkpoints, resume,
torchrun), the same for every algorithm; ``fastgrpo/train.py`` is its command line."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import torch

from fastgrpo.algorithms.context import AlgorithmContext
from fastgrpo.algorithms.distill import Distill, teacher_recipe_config
from fastgrpo.algorithms.dpo import DPO
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.grpo import GRPO
from fastgrpo.algorithms.prerequisites import RecipeRun
from fastgrpo.algorithms.rm import RM
from fastgrpo.algorithms.sampling import sampling_params
from fastgrpo.algorithms.sft import SFT, sft_warmup
from fastgrpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fastgrpo.config import Config, stage_settings
from fastgrpo.data.prompts import PromptDataset, PromptSampler
from fastgrpo.distributed import (
    broadcast_object,
    full_weights,
    init_distributed,
    print0,
    unwrap_model,
    wrap_model,
)
from fastgrpo.engine.engine import GenerationEngine
from fastgrpo.eval import evaluate, write_eval_samples
from fastgrpo.metrics import MetricsLogger, ProgressBar, Timer, peak_memory_gib, plot_metrics
from fastgrpo.models.attention import ATTN_IMPLEMENTATION
from fastgrpo.models.batch_invariant import enable_batch_invariant
from fastgrpo.models.loading import (
    DTYPES,
    enable_activation_checkpointing,
    eos_token_ids,
    load_model,
    set_cpu_threads,
)
from fastgrpo.models.lora import BASE_DIR
from fastgrpo.models.vlm import data_dependent_module
from fastgrpo.plan import check_fits
from fastgrpo.precision import make_optimizer

ALGORITHMS = {"grpo": GRPO, "dpo": DPO, "sft": SFT, "distill": Distill, "rm": RM}


def run_recipe(run: RecipeRun) -> None:
    """An algorithm's prerequisite (:mod:`fastgrpo.algorithms.prerequisites`): a whole run of ``run.spec`` into
    ``run.output_dir``, in this process (every rank together). The caller's RNG states and CPU thread count are
    restored afterwards, so the run that asked for it does not depend on whether it was done now or earlier."""
    cfg = teacher_recipe_config(run.spec, f"logging.output_dir={run.output_dir}")
    print0(f"{run.why}: training the teacher (--recipe {run.spec}) into {run.output_dir}")
    py, threads = random.getstate(), torch.get_num_threads()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        trainer = Trainer(cfg)
        trainer.fit()
    del trainer
    random.setstate(py)
    torch.set_num_threads(threads)


def component(name: str) -> property:
    """A read-only :class:`Trainer` attribute that is the algorithms' context's ``name``."""
    return property(lambda self: getattr(self.ctx, name), doc=f"``self.ctx.{name}``")


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row (a checkpoint was saved first)."""


class Trainer:
    """Holds the run's state; :meth:`fit` is the whole run.

    The loop (data order, steps, validation, metrics, progress, checkpoints, resume, torchrun) is the same for
    every algorithm. The algorithm (``config.algorithm``: ``fastgrpo.algorithms.grpo.GRPO``,
    ``fastgrpo.algorithms.dpo.DPO``, ``fastgrpo.algorithms.sft.SFT``, ``fastgrpo.algorithms.distill.Distill``,
    ``fastgrpo.algorithms.rm.RM``) is
    built on the run's components (:class:`fastgrpo.algorithms.context.AlgorithmContext`, ``self.ctx``), never on
    the trainer, and supplies:

    - ``rows_per_step``: training rows one step draws from the data sampler (all ranks together);
    - ``step(indices, settings) -> metrics``: one training step on those rows, metrics reduced over ranks, with
      ``tokens`` (all ranks) and ``bad_steps`` (non-finite optimizer steps in this step);
    - ``validate() -> metrics`` (``eval/...``; empty when there is nothing to validate on);
    - ``state_dict()`` / ``load_state_dict()``: what a resume needs beyond weights, optimizer and data position;
      optionally ``rank_state_dict()`` / ``load_rank_state_dict(state or None)``: each rank's own (async GRPO's
      sequences in flight);
    - ``check_world_size(cfg, world_size)`` (static): its batch splits over the processes;
    - ``prerequisites(cfg)`` (static): recipe runs to complete before it is built (:func:`run_recipe`);
    - ``warmup_examples()``: the supervised warm-up's examples (``fastgrpo.algorithms.sft.sft_warmup``);
      ``begin()``: once the warm-up is done, on a fresh run (DPO fixes its reference there); ``describe_data()``;
      ``progress``: the progress bar's fields;
    - optionally ``close()``: stop what it runs beside the trainer (GRPO's reward workers); :meth:`fit` calls it
      at the end of the run, also on Ctrl-C and errors;
    - optionally ``load_model(model_cfg, device, seed=)`` (static) -> ``(model, tokenizer)`` and ``forward`` (the
      wrapped model's forward) in place of the causal LM and :func:`fastgrpo.algorithms.forward.packed_forward`, and
      ``generates = False``: no generation engine is built (``ctx.engine`` is None). The reward model's (``RM``).
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.state = init_distributed(cfg.train.device)
        st = self.state
        if st.device.type == "cpu":
            set_cpu_threads(cfg.train.num_threads, st.world_size)
        algorithm = ALGORITHMS[cfg.algorithm]
        algorithm.check_world_size(cfg, st.world_size)
        for run in algorithm.prerequisites(cfg):
            run_recipe(run)
        check_fits(cfg, st.world_size, st.device)  # on CUDA: stop before loading weights when the plan does not fit
        random.seed(cfg.train.seed + st.rank)
        torch.manual_seed(cfg.train.seed + st.rank)

        run_dir = self._run_dir()
        # with model.lora on the tiny model its base is saved once in <run dir>/base (the adapters' base_model_name)
        if hasattr(algorithm, "load_model"):
            model, tokenizer = algorithm.load_model(cfg.model, st.device, seed=cfg.train.seed)
        else:
            model, tokenizer = load_model(cfg.model, st.device, seed=cfg.train.seed, base_dir=run_dir / BASE_DIR)
        model.eval()  # generation and no-grad forwards; the updates switch to train() (fastgrpo.precision)
        if cfg.train.activation_checkpointing:
            enable_activation_checkpointing(model)
        wrapped = wrap_model(model, st, cfg.train.strategy, forward=getattr(algorithm, "forward", packed_forward),
                             whole=data_dependent_module(model))  # a VLM's tower: not sharded block by block
        self.numerics = contextlib.ExitStack()  # numerics.batch_invariant: its ops registered until close()
        if cfg.numerics.batch_invariant:
            self.numerics.enter_context(enable_batch_invariant(model, ATTN_IMPLEMENTATION))
        engine = None
        if getattr(algorithm, "generates", True):
            engine = GenerationEngine(unwrap_model(wrapped), eos_token_ids=eos_token_ids(model, tokenizer),
                                      max_batch_size=cfg.rollout.max_batch_size, tokenizer=tokenizer,
                                      max_total_tokens=cfg.rollout.max_total_tokens or None,
                                      record_routing=cfg.model.moe.router_replay,
                                      batch_invariant=cfg.numerics.batch_invariant)
        t = cfg.train
        # fp32 AdamW; with model.dtype=bfloat16 it steps fp32 master weights (fastgrpo.precision)
        optimizer = make_optimizer(wrapped, lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2))
        # The lr is a function of the GRPO step (stage_settings: the stage's lr times the warm-up factor, counted per
        # GRPO step as NeMo-RL's scheduler is), set before each step; the scheduler, stepped per optimizer step,
        # holds it there.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        self.bad_in_a_row = 0
        self.total_bad = 0
        self.last_saved = -1
        self.ctx = AlgorithmContext(cfg=cfg, state=st, model=model, wrapped=wrapped, tokenizer=tokenizer,
                                    optimizer=optimizer, scheduler=scheduler, engine=engine, run_dir=run_dir,
                                    timer=Timer(st.device), accuracy_eval=self.accuracy_eval)
        self.algorithm = algorithm(self.ctx)
        self.ctx.sampler = PromptSampler(len(self.algorithm.train_data), seed=cfg.train.seed,
                                         shuffle=cfg.data.shuffle)

    # The run's components live on the algorithms' context (one copy: replace one there, ``trainer.ctx.engine =``).
    model = component("model")
    wrapped = component("wrapped")
    tokenizer = component("tokenizer")
    optimizer = component("optimizer")
    scheduler = component("scheduler")
    engine = component("engine")
    run_dir = component("run_dir")
    timer = component("timer")
    sampler = component("sampler")

    @property
    def step(self) -> int:
        """Completed steps (held by the algorithms' context, which reads it)."""
        return self.ctx.step

    @step.setter
    def step(self, value: int) -> None:
        self.ctx.step = value

    # ------------------------------------------------------------------ set-up

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
        self.algorithm.load_state_dict(ts.get("algorithm", {}))
        if hasattr(self.algorithm, "load_rank_state_dict"):
            self.algorithm.load_rank_state_dict(ts["rank_state"])
        self.last_saved = self.step
        print0(f"resumed from {path} at step {self.step}")
        return self.step

    def save(self) -> Path:
        path = save_checkpoint(self.run_dir, self.step, model=self.wrapped, tokenizer=self.tokenizer,
                               optimizer=self.optimizer, scheduler=self.scheduler,
                               trainer_state={"sampler": self.sampler.state_dict(), "bad_in_a_row": self.bad_in_a_row,
                                              "total_bad": self.total_bad,
                                              "algorithm": self.algorithm.state_dict()},
                               keep_last=self.cfg.checkpoint.keep_last, state=self.state,
                               dtype=DTYPES[self.cfg.model.dtype],
                               rank_state=getattr(self.algorithm, "rank_state_dict", lambda: None)())
        self.last_saved = self.step
        return path

    def close(self) -> None:
        """Stop the algorithm's helpers (GRPO's reward worker processes) and unregister numerics.batch_invariant's
        ops; safe to call more than once."""
        close = getattr(self.algorithm, "close", None)
        if close is not None:
            close()
        self.numerics.close()

    # ------------------------------------------------------------------ the shared validation

    def accuracy_eval(self, prompts: PromptDataset) -> dict[str, float]:
        """avg@k / pass@k, and maj@k / cons@k with the math verifier (``eval.*`` settings), on held-out ``prompts``, as
        ``eval/...`` metrics; with ``logging.log_rollouts``, every sample in ``<run dir>/rollouts/eval/step_<N>.jsonl``
        (N: the completed steps, as the metrics row has it)."""
        e = self.cfg.eval
        start = time.perf_counter()
        settings = stage_settings(self.cfg, self.step)  # validation has the stage's length budgets (as NeMo-RL's)
        with full_weights(self.wrapped):
            seed = (self.cfg.train.seed + 7) * 1000 + self.state.rank
            params = sampling_params(self.cfg, settings, n=e.k, seed=seed, validation=True)
            rows = [] if self.cfg.logging.log_rollouts else None
            res = evaluate(unwrap_model(self.wrapped), self.tokenizer, prompts, params, num_prompts=e.num_prompts,
                           engine=self.engine, timeout_s=self.cfg.reward.timeout_s,
                           sample=getattr(self.algorithm, "eval_sampler", lambda: None)(), rows=rows)
        if rows is not None:
            write_eval_samples(self.run_dir / "rollouts" / "eval", self.step, rows, self.state.rank,
                               self.state.world_size, self.cfg.logging.rollouts_keep)
        acc = res[f"avg@{e.k}"]
        print0(f"step {self.step}: eval/accuracy (avg@{e.k} on {int(res['num_prompts'])} held-out prompts) "
               f"{acc:.3f}, pass@{e.k} {res[f'pass@{e.k}']:.3f}")
        out = {"eval/accuracy": acc, f"eval/pass@{e.k}": res[f"pass@{e.k}"],
               "eval/response_length": res["response_length/mean"], "eval/num_prompts": int(res["num_prompts"]),
               "time/eval": time.perf_counter() - start}
        if f"maj@{e.k}" in res:  # the math verifier's votes (an environment's scores have none)
            print0(f"step {self.step}: eval/maj@{e.k} {res[f'maj@{e.k}']:.3f}, "
                   f"eval/cons@{e.k} {res[f'cons@{e.k}']:.3f}")
            out.update({f"eval/maj@{e.k}": res[f"maj@{e.k}"], f"eval/cons@{e.k}": res[f"cons@{e.k}"]})
        if "tool_call_rate" in res:
            print0(f"step {self.step}: eval/tool_call_rate {res['tool_call_rate']:.3f}")
            out["eval/tool_call_rate"] = res["tool_call_rate"]
        return out

    # ------------------------------------------------------------------ phases

    def validate(self, logger: MetricsLogger) -> float | None:
        """The algorithm's validation, logged; returns ``eval/accuracy`` when it has one, else the held-out pairs'
        ``eval/preference_accuracy`` (a reward model's)."""
        m = self.algorithm.validate()
        if not m:
            return None
        logger.log(self.step, m)
        return m.get("eval/accuracy", m.get("eval/preference_accuracy"))

    def train_step(self, logger: MetricsLogger) -> dict[str, float]:
        cfg = self.cfg
        settings = stage_settings(cfg, self.step)
        lr = settings["lr"] * settings["warmup_factor"]  # the stage's learning rate at this step of the warm-up
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if any(s.reset_optimizer and s.at_step == self.step for s in cfg.stages):
            self.optimizer.state.clear()  # AdamW's moments and step counts start again, as in a new run
        step_start = time.perf_counter()
        m = self.algorithm.step(self.sampler.next(self.algorithm.rows_per_step), settings)
        step_time = time.perf_counter() - step_start
        m["time/step"] = step_time
        m["tokens_per_second"] = m["tokens"] / step_time
        m["lr"] = self.optimizer.param_groups[0]["lr"]
        m["peak_memory_gib"] = peak_memory_gib(self.state.device)
        bad = int(m.pop("bad_steps"))
        self.total_bad += bad
        self.bad_in_a_row = self.bad_in_a_row + bad if bad else 0
        m["bad_steps"] = self.total_bad
        self.step += 1
        logger.log(self.step, m)
        for name, rows in self.ctx.tables.items():  # e.g. the step's completions, for TensorBoard / W&B
            logger.log_table(self.step, name, rows)
        self.ctx.tables.clear()
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
        print0(f"run directory: {self.run_dir}  |  {self.algorithm.describe_data()}"
               f"  |  {st.world_size} process(es) on {st.device}")
        result = {"start_accuracy": None, "end_accuracy": None}
        start = time.perf_counter()
        bar = None
        try:
            if resumed is None:
                if cfg.sft.warmup_steps:
                    sft_warmup(self.ctx, *self.algorithm.warmup_examples())
                self.algorithm.begin()
                if cfg.eval.at_start:
                    result["start_accuracy"] = self.validate(logger)
            bar = ProgressBar(cfg.train.max_steps, initial=self.step, enabled=st.is_main and cfg.logging.progress_bar,
                              desc=cfg.algorithm)
            while self.step < cfg.train.max_steps:
                m = self.train_step(logger)
                bar.update(self.step, **{label: m[key] for label, key in self.algorithm.progress.items()})
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
            safe = not self.ctx.in_update and self.step > max(self.last_saved, 0) and (
                isinstance(exc, KeyboardInterrupt) or st.world_size == 1)
            if safe and not isinstance(exc, TrainingAborted):
                print0(f"interrupted ({type(exc).__name__}): saved {self.save()}")
            logger.close()
            raise
        finally:
            self.close()
        logger.close()
        if st.is_main:
            png = plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")
            print0(f"done: {self.step} {cfg.algorithm.upper()} steps in {time.perf_counter() - start:.1f} s")
            if result["start_accuracy"] is not None and result["end_accuracy"] is not None:
                print0(f"held-out accuracy: {result['start_accuracy']:.3f} at the start of {cfg.algorithm.upper()} -> "
                       f"{result['end_accuracy']:.3f} at the end")
            print0(f"metrics:    {self.run_dir / 'metrics.jsonl'}\nplot:       {png}\n"
                   f"checkpoint: {path or self.run_dir / 'checkpoints'}")
        result["run_dir"] = str(self.run_dir)
        return result
