"""The router's load-balancing loss in SFT, DPO and distillation (``fastgrpo.algorithms.moe.RouterAuxLoss``; GRPO's is
``test_moe_models.test_grpo_update_adds_the_aux_loss_as_trl_does``), against transformers' ``load_balancing_loss_func``.

Each algorithm runs one step twice on the same tiny MoE model and data, with ``model.moe.router_aux_loss_coef`` 0 (off,
TRL's ``aux_loss_enabled`` False: no ``moe/aux_loss``) and ``coef``, its optimizer plain SGD at lr 0 so the gradients
stay readable. Per step of M micro-batches (several, all ranks: one here), against transformers' own model on the same
weights (eager experts, SDPA), each micro-batch's sequences as one right-padded batch with its attention mask:

- ``moe/aux_loss`` = the mean over micro-batches of transformers' ``aux_loss``;
- the step's ``loss`` grows by ``coef · moe/aux_loss``;
- every parameter's gradient grows by ``coef / M · ∇ Σ_mb aux_mb`` (the router's, and through the router logits the
  layers below it).

Tolerances: fp32 on both sides, packed against padded and summed in other orders: ``64 · eps32`` times the largest
magnitude in play (the loss, the parameter's gradient). ``coef`` is large (2) so the term is of the size of the rest.
"""

import math

import pytest
import torch
from checks import EPS32, one_thread  # noqa: F401  (an autouse fixture)
from test_moe_models import hf_aux_loss, hf_reference

from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.moe import METRICS, router_aux_loss
from fastgrpo.config import load_config
from fastgrpo.distributed import init_distributed, wrap_model
from fastgrpo.models.loading import load_model
from fastgrpo.models.packing import plan_microbatches

COEF = 2.0
MOE = ["model.moe.tiny_num_experts=4", "model.tiny_hidden_size=32", "model.tiny_intermediate_size=64",
       "model.moe.tiny_moe_intermediate_size=16", "model.tiny_initializer_range=0.3"]
QWEN2_MOE = ["model.moe.tiny_shared_expert_intermediate_size=24"]


def sgd_at_zero(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_against_transformers(runs, ref, groups):
    """``runs``: ``(metrics, gradients)`` at coef 0 and at ``COEF``; ``ref``: transformers' model on the weights of
    the step; ``groups``: each micro-batch's sequences (module docstring)."""
    (m0, g0), (m1, g1) = runs
    assert METRICS[0] not in m0  # coef 0: no term, no metric
    aux = torch.stack([hf_aux_loss(ref, seqs) for seqs in groups])  # [M]
    want = aux.mean()
    assert len(groups) > 1 and m1[METRICS[0]] == pytest.approx(want.item(), abs=64 * EPS32 * want.item())
    assert m1["loss"] - m0["loss"] == pytest.approx(COEF * m1[METRICS[0]], abs=64 * EPS32 * abs(m1["loss"]))
    (COEF * want).backward()
    assert g0.keys() == g1.keys()
    moved = 0
    for n, p in ref.named_parameters():
        want_g = torch.zeros_like(g1[n]) if p.grad is None else p.grad
        torch.testing.assert_close(g1[n] - g0[n], want_g, atol=64 * EPS32 * g1[n].abs().max().item(), rtol=0,
                                   msg=lambda s, n=n: f"{n}: {s}")
        moved += bool(want_g.abs().max() > 0)
    assert moved > 4  # the routers and, through their logits, the layers below them


@pytest.mark.parametrize("family", [[], QWEN2_MOE], ids=["qwen3-moe", "qwen2-moe"])
def test_sft_adds_the_aux_loss_as_trl_does(family):
    """``sft_backward`` (an ``algorithm: sft`` step's and the warm-up's) over 6 examples in several micro-batches."""
    from fastgrpo.algorithms.sft import sft_backward
    from fastgrpo.data.responses import SFTExample

    state = init_distributed("cpu")
    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(6):
        n_prompt, n_resp = 3 + i % 3, 2 + i % 4
        ids = torch.randint(5, 40, (n_prompt + n_resp,), generator=g).tolist()
        examples.append(SFTExample(ids, [False] * n_prompt + [True] * n_resp))
    runs = []
    for coef in (0.0, COEF):
        cfg = load_config("sft-tiny", overrides=[*MOE, *family, f"model.moe.router_aux_loss_coef={coef}"])
        model, _ = load_model(cfg.model, state.device, seed=0)
        opt, _ = sgd_at_zero(model)
        wrapped = wrap_model(model, state, "none", forward=packed_forward)
        loss, _, metrics = sft_backward(wrapped, opt, examples, 16, state.device, 1, examples[0],
                                        router_aux_loss(cfg, model))
        runs.append(({"loss": loss, **metrics}, grads(model)))
    groups = [[examples[i].input_ids for i in group] for group in plan_microbatches([len(e.input_ids) for e in
                                                                                     examples], 16)]
    check_against_transformers(runs, hf_reference(model, torch.float32), groups)


def test_dpo_adds_the_aux_loss_as_trl_does(tmp_path):
    """``DPO.step`` over 6 pairs of the synthetic task in micro-batches of 4 and 2 pairs (the term is a mean over
    micro-batches, not weighted by their pairs as the DPO loss is), the reference on the fly; a Qwen2-MoE policy."""
    from fastgrpo.algorithms.dpo import pair_examples, plan_pairs
    from fastgrpo.trainer import Trainer

    indices = [5, 17, 3, 40, 9, 25]
    runs = []
    for coef in (0.0, COEF):
        t = Trainer(load_config("dpo-tiny", overrides=[
            *MOE, *QWEN2_MOE, f"model.moe.router_aux_loss_coef={coef}", "dpo.batch_size=6", "sft.warmup_steps=0",
            "dpo.precompute_ref_logprobs=false", "data.max_length=24", "train.max_tokens_per_microbatch=80",
            "data.synthetic_num_terms=2", "data.synthetic_eval_size=8", "eval.every_steps=0", "eval.at_start=false",
            "eval.at_end=false", "train.max_grad_norm=0", "logging.progress_bar=false", "train.num_threads=1",
            f"logging.output_dir={tmp_path / str(coef)}"]))
        try:
            t.ctx.optimizer, t.ctx.scheduler = sgd_at_zero(t.wrapped)
            t.algorithm.begin()
            m = t.algorithm.step(indices, {})
            runs.append((m, grads(t.model)))
            pairs = [t.algorithm.train_data.items[i] for i in indices]
            ref = hf_reference(t.model, torch.float32)
        finally:
            t.close()
    assert runs[1][0]["bad_steps"] == 0
    groups = [[e.input_ids for e in pair_examples([pairs[j] for j in group])] for group in plan_pairs(pairs, 80)]
    check_against_transformers(runs, ref, groups)


def test_distillation_adds_the_aux_loss_in_full_mode(tmp_path):
    """``DistillUpdate`` (full mode, the divergence against a dense teacher) over 8 sampled sequences in several
    micro-batches: the MoE student's loss gets the same term as GRPO's. Sampled-token mode is GRPO's update."""
    from test_grpo import make_samples

    from fastgrpo.algorithms.distill import DistillUpdate, load_teacher
    from fastgrpo.config import ModelConfig

    state = init_distributed("cpu")
    teacher, tok = load_model(ModelConfig(tiny_hidden_size=32, tiny_intermediate_size=64), state.device, seed=3)
    teacher.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    samples = make_samples()
    runs = []
    for coef in (0.0, COEF):
        cfg = load_config("distill-tiny", overrides=[
            *MOE, f"model.moe.router_aux_loss_coef={coef}", f"distill.teacher_path={tmp_path}",
            "distill.teacher_recipe=", "train.max_tokens_per_microbatch=24", "train.max_grad_norm=0"])
        model, tok = load_model(cfg.model, state.device, seed=0)
        wrapped = wrap_model(model, state, "none", forward=packed_forward)
        opt, sched = sgd_at_zero(wrapped)
        t_model, vocab = load_teacher(cfg, state, tok)
        m = DistillUpdate(cfg, wrapped, opt, sched, t_model, vocab, state.device, 1).run(
            samples, beta=0.0, epsilon_high=None, max_new_tokens=8)
        runs.append(({k: v for k, v in m.items() if not (k == METRICS[0] and math.isnan(v))}, grads(model)))
    groups = [[samples[i].tokens for i in group] for group in plan_microbatches([len(s.tokens) for s in samples], 24)]
    check_against_transformers(runs, hf_reference(model, torch.float32), groups)
