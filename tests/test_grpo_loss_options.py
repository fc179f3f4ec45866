"""The loss options of the ``grpo`` config group (issue 22): validated at start-up with their dotted names against
the kernels' names, and passed by the trainer's update to the loss as one ``GRPOLossOptions``
(``fastgrpo.algorithms.update.loss_options``), with each loss type's own normalisation across micro-batches (sapo as
grpo, cispo as dapo) against the unpacked fp32 reference (``test_grpo.py``'s setting)."""

import dataclasses

import pytest
import torch
from fastgrpo.kernels import GRPOLossOptions, grpo_loss, names
from fastgrpo.kernels.reference import grpo_loss_ref
from test_grpo import TINY, make_samples, run_update, teacher_forced, teacher_forced_at

from fastgrpo import config
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.update import PolicyUpdate, loss_options
from fastgrpo.config import load_config
from fastgrpo.distributed import init_distributed, wrap_model
from fastgrpo.models.loading import load_model


@pytest.mark.parametrize("name", ["LOSS_TYPES", "CLIPPED_LOSS_TYPES", "IS_LEVELS", "KL_ESTIMATORS", "KL_WEIGHTS",
                                  "ROLLOUT_IS_MODES", "DPO_LOSS_TYPES"])
def test_config_checks_against_the_kernels_names(name):
    """config.py checks its fields against the kernels' lists themselves (``fastgrpo.kernels.names``), not copies."""
    assert getattr(config, name) is getattr(names, name)


@pytest.mark.parametrize("override, field", [
    ("grpo.kl_estimator=k4", "grpo.kl_estimator"),
    ("grpo.kl_weight=coef_1", "grpo.kl_weight"),
    ("grpo.kl_input_clamp=0", "grpo.kl_input_clamp"),
    ("grpo.kl_output_clamp=-1", "grpo.kl_output_clamp"),
    ("grpo.sapo_temperature_pos=0", "grpo.sapo_temperature_pos"),
    ("grpo.sapo_temperature_neg=nan", "grpo.sapo_temperature_neg"),
    ("grpo.loss_type=ppo", "grpo.loss_type"),
    ("grpo.rollout_is=seq_mask_tis", "grpo.rollout_is"),
    ("grpo.off_policy_mask_threshold=inf", "grpo.off_policy_mask_threshold"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(overrides=[override])


@pytest.mark.parametrize("overrides, field", [
    (["grpo.loss_type=cispo", "grpo.delta=2"], "grpo.delta"),
    (["grpo.loss_type=sapo", "grpo.dual_clip_c=3"], "grpo.dual_clip_c"),
    (["grpo.loss_type=cispo_clamp", "grpo.importance_sampling_level=sequence"], "grpo.importance_sampling_level"),
])
def test_options_that_do_not_combine_fail_at_start_up(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_loss_options_carry_every_field_to_the_loss():
    """Every loss field set away from its default reaches the loss option of the same meaning, and grpo_loss
    accepts the options."""
    cfg = load_config(overrides=["grpo.kl_estimator=k2", "grpo.kl_weight=sampling_ratio", "grpo.kl_input_clamp=5",
                                 "grpo.kl_output_clamp=2", "grpo.loss_type=sapo", "grpo.sapo_temperature_pos=0.9",
                                 "grpo.sapo_temperature_neg=1.2", "grpo.rollout_is=icepop", "grpo.rollout_is_min=0.5",
                                 "grpo.off_policy_mask_threshold=0.1"])
    opts = loss_options(cfg)
    assert isinstance(opts, GRPOLossOptions)
    assert {k: getattr(opts, k) for k in ("kl_estimator", "kl_weight", "kl_input_clamp", "kl_output_clamp",
                                          "loss_type", "sapo_temperature_pos", "sapo_temperature_neg", "rollout_is",
                                          "rollout_is_min", "off_policy_mask_threshold")} == dict(
        kl_estimator="k2", kl_weight="sampling_ratio", kl_input_clamp=5.0, kl_output_clamp=2.0, loss_type="sapo",
        sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, rollout_is="icepop", rollout_is_min=0.5,
        off_policy_mask_threshold=0.1)
    assert (opts.beta, opts.epsilon_high, opts.max_completion_length) == (
        cfg.grpo.beta, cfg.grpo.epsilon_high, cfg.rollout.max_new_tokens)  # the base settings
    logp = -torch.rand(2, 5)
    loss, metrics = grpo_loss(logp.requires_grad_(), logp.detach() + 0.1, torch.tensor([1.0, -1.0]),
                              torch.ones(2, 5, dtype=torch.bool), ref_logprobs=logp.detach() - 0.2,
                              sampling_logprobs=logp.detach() - 0.1, options=dataclasses.replace(opts, beta=0.1))
    assert torch.isfinite(loss) and "kl" in metrics and "clip_ratio/low_mean" not in metrics  # sapo logs none


@pytest.mark.parametrize("loss_type, extra", [("sapo", []), ("luspo", []), ("cispo", ["grpo.epsilon_high=5.0"]),
                                              ("cispo_clamp", ["grpo.epsilon_high=0.28"])])
def test_update_with_new_loss_types_matches_unpacked_reference(loss_type, extra):
    """The update over several micro-batches normalises each loss type as TRL does (sapo: the mean over sequences,
    luspo: the token sum over B, cispo: the step's token count): loss and weight change equal the unpacked fp32
    reference's (fp32 sums in another order: 1e-5 relative; the argument of test_grpo.py's matching test)."""
    state = init_distributed("cpu")
    samples = make_samples()
    cfg = load_config(overrides=[*TINY, f"grpo.loss_type={loss_type}", *extra, "train.max_tokens_per_microbatch=24"])
    metrics, delta, model, before = run_update(cfg, samples, state)
    assert metrics["optimizer_steps"] == 1 and metrics["bad_steps"] == 0
    logp, mask = teacher_forced_at(model, before, samples)
    adv = torch.tensor([s.advantage for s in samples])
    ref_loss, _ = grpo_loss_ref(logp, logp.detach(), adv, mask, loss_type=loss_type,
                                epsilon_high=cfg.grpo.epsilon_high, max_completion_length=8)
    ref_loss.backward()
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kl", [
    ["grpo.kl_weight=score", "grpo.kl_input_clamp=20", "grpo.kl_output_clamp=10"],  # deepscaler-1.5b's
    ["grpo.kl_weight=sampling_ratio", "grpo.kl_estimator=k2", "grpo.kl_output_clamp=0.05"],
])
def test_update_with_kl_options_matches_unpacked_reference(kl):
    """β > 0 with a reference model: the update hands the KL options and the engine's log-probs to the loss; loss
    and weight change equal the unpacked fp32 reference given the same reference and engine log-probs (fp32 sums in
    another order: 1e-5 relative)."""
    state = init_distributed("cpu")
    samples = make_samples()
    g = torch.Generator().manual_seed(2)
    for s in samples:  # engine log-probs near -1 (the fake value of make_samples), different per token
        s.sample_logprobs = (-1.0 + 0.3 * torch.randn(len(s.completion_ids), generator=g)).tolist()
    cfg = load_config(overrides=[*TINY, *kl, "train.max_tokens_per_microbatch=24", "sft.warmup_steps=0"])
    beta = 0.3
    model, _ = load_model(cfg.model, state.device, seed=0)
    ref_model, _ = load_model(cfg.model, state.device, seed=1)  # another initialisation: ref ≠ policy
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    wrapped = wrap_model(model, state, "ddp", forward=packed_forward)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = PolicyUpdate(cfg, wrapped, opt, sched, ref_model, state.device, state.world_size).run(
        samples, beta=beta, epsilon_high=cfg.grpo.epsilon_high, max_new_tokens=cfg.rollout.max_new_tokens)
    assert metrics["optimizer_steps"] == 1
    delta = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(before[k])
        ref_lp, _ = teacher_forced(ref_model, samples)
    model.zero_grad()
    logp, mask = teacher_forced(model, samples)
    T = logp.shape[1]
    samp = torch.stack([torch.nn.functional.pad(torch.tensor(s.sample_logprobs), (0, T - len(s.sample_logprobs)))
                        for s in samples])
    adv = torch.tensor([s.advantage for s in samples])
    kw = {k: v for k, v in dataclasses.asdict(loss_options(cfg)).items() if k.startswith("kl_")}
    ref_loss, ref_metrics = grpo_loss_ref(logp, logp.detach(), adv, mask, ref_logprobs=ref_lp, beta=beta,
                                          sampling_logprobs=samp, max_completion_length=8, **kw)
    ref_loss.backward()
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    assert metrics["kl"] == pytest.approx(float(ref_metrics["kl"]), rel=1e-5, abs=1e-7)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
