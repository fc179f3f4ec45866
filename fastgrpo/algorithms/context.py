"""What an algorithm is built on: :class:`AlgorithmContext`, the run's components, made by the trainer.

An algorithm class (``GRPO``, ``DPO``, ``SFT``, ``Distill``) is constructed as ``Algorithm(ctx)`` and reaches the
run only through this object: the config, the distributed state, the policy (plain and wrapped), its tokenizer,
optimizer and scheduler, the co-located generation engine, the run directory, the step timer and the shared avg@k
validation. It never sees the trainer, so an algorithm cannot drive the loop above it (see
``docs/architecture.md``, "The algorithm interface").

Two fields change during the run, and only the trainer writes them: ``step`` (completed steps, read by the
algorithms for seeds, stage boundaries and log lines) and ``sampler`` (the data order, set once the algorithm has
loaded its training rows, since its length is theirs). ``in_update`` is written by :meth:`updating` and read by the
trainer: an interruption inside an update cannot save a consistent checkpoint. ``tables`` is filled by an algorithm's
step and emptied by the trainer once it has sent them to the metrics writers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastgrpo.config import Config
from fastgrpo.data.prompts import PromptDataset, PromptSampler
from fastgrpo.distributed import DistState, full_weights, unwrap_model
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.metrics import Timer


@dataclass(eq=False)
class AlgorithmContext:
    """The components of one run that an algorithm uses (module docstring).

    - ``model``: the policy as built (the engine runs it; LoRA's adapter switches act on it);
    - ``wrapped``: the same parameters under DDP / FSDP2 (``fastgrpo.distributed.wrap_model``): every training and
      no-grad forward of the policy goes through it;
    - ``optimizer`` / ``scheduler``: fp32 AdamW (master weights for a bf16 model) and the per-optimizer-step
      scheduler whose learning rate the trainer sets before each step;
    - ``accuracy_eval(prompts)``: avg@k / pass@k on held-out prompts as ``eval/...`` metrics (``fastgrpo.eval``,
      with the algorithm's ``eval_sampler`` when it has one).
    """

    cfg: Config
    state: DistState
    model: torch.nn.Module
    wrapped: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: GenerationEngine | None  # None: an algorithm that generates nothing (rm)
    run_dir: Path
    timer: Timer
    accuracy_eval: Callable[[PromptDataset], dict[str, float]]
    sampler: PromptSampler | None = None
    step: int = 0
    in_update: bool = False
    tables: dict[str, list[dict]] = field(default_factory=dict)
    """Rows an algorithm's step hands to the metrics writers as tables (name -> rows with the same keys; the trainer
    sends them to TensorBoard / W&B after the step's metrics row, then clears them)."""

    def coll_device(self) -> torch.device:
        """Where host values are reduced: the device under NCCL, else the CPU."""
        return self.state.device if self.state.backend == "nccl" else torch.device("cpu")

    @contextmanager
    def updating(self):
        """Marks the weights as mid-update: an interruption inside cannot save a consistent checkpoint."""
        self.in_update = True
        try:
            yield
        finally:
            self.in_update = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, on_group_done=None, turns=None):
        """The co-located engine's completions of ``prompts`` with the policy's own (gathered) weights;
        ``on_group_done(prompt_index, completions)`` as each prompt's samples finish; ``turns``: the multi-turn
        handler (``fastgrpo.environments.EnvTurns``)."""
        with full_weights(self.wrapped):
            return self.engine.generate(prompts, params, on_group_done=on_group_done, turns=turns)

    @torch.no_grad()
    def copy_policy_into(self, module: torch.nn.Module) -> None:
        """Copy the policy's full (gathered) weights into ``module``, a plain copy of the same architecture."""
        with full_weights(self.wrapped):
            for dst, src in zip(module.parameters(), unwrap_model(self.wrapped).parameters(), strict=True):
                dst.copy_(src)
