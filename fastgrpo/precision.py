"""Mixed precision: the model computes in ``model.dtype``; the optimizer steps fp32 master weights.

Why: at the DeepScaleR learning rate (2e-6) an AdamW step moves a weight of magnitude 0.02 by ~1e-4 of itself, far
below bf16's relative resolution 2^-8: applied to bf16 weights most updates round away (the measured share is in
docs/benchmarks.md). So the optimizer keeps fp32 masters and fp32 AdamW state, and the compute weights are the
masters rounded to nearest (``w_bf16 = round(w_fp32)``) after every step.

Per strategy (``model.dtype`` = bfloat16; with float32 nothing of this exists: AdamW on the parameters themselves):

- **DDP / one process** (:class:`MasterAdamW`): the module keeps its bf16 parameters, the very tensors the
  generation engine and the training forward read. The optimizer owns an fp32 copy of each (its ``param_groups``
  hold the masters). Per micro-batch: forward and backward in bf16 under DDP's ``no_sync`` (DDP's own all-reduce
  would run in bf16), then the bf16 gradients are added into fp32 master gradients and freed
  (:meth:`MasterAdamW.fold_grads`). After the last micro-batch the fp32 master gradients are averaged over ranks
  (one all-reduce per parameter tensor, :meth:`MasterAdamW.reduce_grads`), clipped, stepped by AdamW, and copied
  back, rounded, into the bf16 parameters. Memory per parameter: 2 (bf16 weight) + 4 (master) + 8 (AdamW m, v) +
  4 (fp32 gradient) + 2 (bf16 gradient, during a micro-batch's backward) = 20 bytes; 1.5B parameters: 28 GiB/rank.
- **FSDP2**: ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on fp32 parameters
  (:func:`fastgrpo.distributed.wrap_model` upcasts them): the sharded fp32 parameters *are* the masters, and plain
  AdamW steps them. Each forward all-gathers bf16 copies; gradients are reduce-scattered in fp32 (and accumulated
  unsharded in fp32 between micro-batches). The engine reads the bf16 unsharded parameters inside
  ``unshard()``/``reshard()`` (``fastgrpo.trainer.full_weights``), as before. Per parameter and rank:
  (4 + 8 + 4) / world size (master, AdamW state, sharded gradient) + 2 (bf16 copy) while gathered + 4 (the
  unsharded fp32 gradient FSDP2 accumulates between micro-batches, freed by the reduce-scatter of the last one).

Numerics: a micro-batch's gradient is computed in bf16 (its matmuls accumulate in fp32 inside the kernels) and
rounded once to bf16; the sum over micro-batches and ranks, the clipping norm, the AdamW moments and the update are
fp32. The compute weights always equal the masters rounded to nearest (``Tensor.copy_`` rounds to nearest even).
Checkpoints store the compute-dtype weights (HF safetensors) and the masters in ``trainer_state.pt`` so a resume is
bit-exact (:mod:`fastgrpo.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn

from fastgrpo.distributed import all_reduce, gradient_sync, unwrap_model


class MasterAdamW(torch.optim.AdamW):
    """AdamW on fp32 master copies of low-precision module parameters (see the module docstring).

    ``params``: the module's parameters (any floating dtype; bf16 in practice). ``masters``: an existing
    ``MasterAdamW`` whose master tensors this one steps too (the supervised warm-up and GRPO share one set of
    masters, each with its own AdamW state); None makes fresh ones, the parameters upcast.
    Its ``param_groups`` hold the masters, so LR schedulers, gradient clipping over the optimizer's parameters and
    ``state_dict`` see fp32 tensors. ``model_param_of[id(master)]`` is the module parameter behind a master.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, masters: MasterAdamW | None = None, **adamw_kwargs):
        self.model_params = [p for p in params if p.requires_grad]
        if masters is not None:
            if [id(p) for p in masters.model_params] != [id(p) for p in self.model_params]:
                raise ValueError("masters: that optimizer's parameters are not these parameters")
            self.masters = masters.masters
        else:
            self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.model_param_of = {id(m): p for m, p in zip(self.masters, self.model_params)}
        super().__init__(self.masters, **adamw_kwargs)

    @torch.no_grad()
    def fold_grads(self) -> None:
        """Add the module's low-precision gradients into the fp32 master gradients and free them (after each
        micro-batch's backward, so at most one micro-batch's bf16 gradients exist at a time)."""
        for p, m in zip(self.model_params, self.masters):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Average the fp32 master gradients over ranks (no-op for one process). A parameter no rank touched gets
        a zero gradient, so every rank issues the same collectives."""
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            all_reduce(m.grad, "mean")

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on the masters, then the masters rounded into the module's parameters."""
        loss = super().step(closure)
        self.copy_to_model()
        return loss

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """``param = round(master)`` for every parameter (in place: the engine keeps its tensors)."""
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)

    @torch.no_grad()
    def load_masters(self, named: dict[str, torch.Tensor] | None, names: dict[int, str]) -> None:
        """Set the masters from full fp32 tensors keyed by parameter name (``names[id(model_param)]``), or from the
        module's current parameters when ``named`` is None (a checkpoint without masters); then round them into
        the module."""
        for p, m in zip(self.model_params, self.masters):
            m.copy_(p if named is None else named[names[id(p)]])
        self.copy_to_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None


def needs_masters(model: nn.Module) -> bool:
    """True when ``model``'s trainable parameters are below fp32 and not FSDP2-sharded (whose sharded parameters are
    fp32 already): the optimizer must then keep fp32 masters."""
    from torch.distributed.tensor import DTensor

    params = [p for p in unwrap_model(model).parameters() if p.requires_grad]
    return any(p.dtype != torch.float32 and not isinstance(p, DTensor) for p in params)


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999),
                   share_masters_with: torch.optim.Optimizer | None = None) -> torch.optim.AdamW:
    """AdamW for the (wrapped) ``model``: :class:`MasterAdamW` when its parameters are in a low precision (not
    FSDP2), else ``torch.optim.AdamW`` on the parameters. ``share_masters_with``: an optimizer of the same model
    whose fp32 masters this one steps too (used when it is a :class:`MasterAdamW`; the warm-up shares GRPO's)."""
    kwargs = {"lr": lr, "weight_decay": weight_decay, "betas": betas}
    if needs_masters(model):
        masters = share_masters_with if isinstance(share_masters_with, MasterAdamW) else None
        return MasterAdamW(model.parameters(), masters=masters, **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


@contextmanager
def accumulate(model: nn.Module, optimizer: torch.optim.Optimizer, *, last: bool):
    """Context for one micro-batch's forward and backward in gradient accumulation.

    Plain optimizers: :func:`fastgrpo.distributed.gradient_sync` (DDP / FSDP2 reduce in the last micro-batch's
    backward). :class:`MasterAdamW`: DDP never synchronises; the bf16 gradients are folded into the fp32 masters'
    after the backward, and after the ``last`` one the fp32 gradients are averaged over ranks.
    """
    if not isinstance(optimizer, MasterAdamW):
        with gradient_sync(model, enabled=last):
            yield
        return
    with gradient_sync(model, enabled=False):
        yield
    optimizer.fold_grads()
    if last:
        optimizer.reduce_grads()


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer steps (fp32 masters under :class:`MasterAdamW`): what gradient clipping sees."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@contextmanager
def train_mode(model: nn.Module, training: bool = True):
    """``model.train(training)`` for the block, then the previous mode back. Updates run in training mode (HF's
    activation checkpointing only acts then); generation and no-grad forwards in eval mode."""
    inner = unwrap_model(model)
    was = inner.training
    inner.train(training)
    try:
        yield
    finally:
        inner.train(was)
