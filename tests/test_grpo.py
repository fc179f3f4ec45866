"""GRPO: advantages against hand-computed values, packing of rollouts, the update's normalisation across
micro-batches against an unpacked fp32 reference, skipped non-finite steps, and 1 vs 2 torchrun processes."""

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import assert_is_decisive
from fastgrpo.kernels.reference import grpo_loss_ref
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.algorithms.advantages import ADV_EPS, LOO_STD_EPS, compute_advantages, overlong_penalty, scale_rewards
from fastgrpo.algorithms.batch import Sample, make_microbatch
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.update import PolicyUpdate
from fastgrpo.config import load_config
from fastgrpo.distributed import init_distributed, wrap_model
from fastgrpo.models.loading import enable_activation_checkpointing, load_model
from fastgrpo.models.vlm import data_dependent_module
from fastgrpo.precision import MasterAdamW, make_optimizer


def test_advantages_mean_baseline_group_scale():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv, zero = compute_advantages(r, "mean", "group")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased: sqrt(1/3)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    expected[0] /= std + ADV_EPS
    torch.testing.assert_close(adv, expected)
    assert zero.tolist() == [False, True]


def test_advantages_leave_one_out_and_other_scales():
    r = torch.tensor([[3.0, 0.0, 0.0], [1.0, 2.0, 6.0]])
    adv, _ = compute_advantages(r, "leave_one_out", "none")
    # r_i - mean of the others
    torch.testing.assert_close(adv, torch.tensor([[3.0, -1.5, -1.5], [-3.0, -1.5, 4.5]]))
    # with group scaling (the DeepScaleR recipe): divided by the whole group's unbiased std, r_i included
    adv_g, _ = compute_advantages(r, "leave_one_out", "group")
    std_P1 = torch.tensor([[3.0**0.5], [7.0**0.5]])  # [3, 0, 0]: var (4+1+1)/2; [1, 2, 6]: var (4+1+9)/2
    torch.testing.assert_close(adv_g, torch.tensor([[3.0, -1.5, -1.5], [-3.0, -1.5, 4.5]]) / (std_P1 + ADV_EPS))
    adv_b, _ = compute_advantages(r, "mean", "batch")
    centred = r - r.mean(1, keepdim=True)
    torch.testing.assert_close(adv_b, centred / (r.std() + ADV_EPS))
    adv_given, _ = compute_advantages(r, "mean", "batch", batch_std=2.0)
    torch.testing.assert_close(adv_given, centred / (2.0 + ADV_EPS))
    with pytest.raises(ValueError, match="rewards_PG must be"):
        compute_advantages(torch.ones(3), "mean", "group")


def loo_advantages_ref(rewards: list[list[float]], valid: list[list[bool]]) -> list[list[float]]:
    """NeMo-RL's GRPO advantage with ``use_leave_one_out_baseline`` and ``normalize_rewards``, one group and one
    completion at a time in exact arithmetic (``statistics``): the others are the group's other valid
    completions; A = (r − mean(others)) / (stdev(others) + 1e-6) where that stdev is > 0, else undivided;
    a group with ≤ 1 valid completion (and an invalid completion) gets 0."""
    out = []
    for rs, vs in zip(rewards, valid):
        row = []
        for i, (r, ok) in enumerate(zip(rs, vs)):
            others = [x for j, (x, o) in enumerate(zip(rs, vs)) if o and j != i]
            if not ok or sum(vs) <= 1:
                row.append(0.0)
                continue
            a = r - statistics.fmean(others)
            sd = statistics.stdev(others) if len(others) > 1 else 0.0
            row.append(a / (sd + 1e-6) if sd > 0 else a)
        out.append(row)
    return out


def test_advantages_group_loo_by_hand():
    # binary rewards, G = 4: the lone correct completion's others tie at 0 (σ_−i = 0: undivided, A = 1); a wrong
    # one's others are [1, 0, 0] (mean 1/3, unbiased std sqrt(1/3)); a tied group gets 0 everywhere
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, zero = compute_advantages(r, "leave_one_out", "group_loo")
    wrong = -(1 / 3) / (3 ** -0.5 + LOO_STD_EPS)
    torch.testing.assert_close(adv, torch.tensor([[1.0, wrong, wrong, wrong], [0.0, 0.0, 0.0, 0.0]]))
    assert zero.tolist() == [False, True]
    # ≤ 1 valid completion: baseline = the reward itself, A = 0 (NeMo-RL's rule); invalid completions get 0
    valid = torch.tensor([[True, False, False, False], [True, True, False, True]])
    adv, zero = compute_advantages(torch.tensor([[5.0, 1.0, 2.0, 3.0], [1.0, 0.0, 9.0, 0.0]]), "leave_one_out",
                                   "group_loo", valid_PG=valid)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.0, 0.0],
                                                  [1.0, -0.5 / (0.5**0.5 + LOO_STD_EPS), 0.0,
                                                   -0.5 / (0.5**0.5 + LOO_STD_EPS)]]))
    assert zero.tolist() == [True, False]


@given(st.data())
def test_advantages_group_loo_match_the_formula(data):
    P = data.draw(st.integers(1, 4), label="P")
    G = data.draw(st.integers(2, 9), label="G")
    # a few values drawn again and again make ties (whole groups, and a completion's others), plus any float
    value = st.one_of(st.sampled_from([0.0, 1.0, 0.1, -0.5, 2.5]),
                      st.floats(-10, 10, allow_nan=False, width=32))
    rewards = data.draw(st.lists(st.lists(value, min_size=G, max_size=G), min_size=P, max_size=P), label="r")
    valid = data.draw(st.one_of(st.none(), st.lists(st.lists(st.booleans(), min_size=G, max_size=G),
                                                    min_size=P, max_size=P)), label="valid")
    valid_PG = None if valid is None else torch.tensor(valid)
    adv, zero = compute_advantages(torch.tensor(rewards, dtype=torch.float64), "leave_one_out", "group_loo",
                                   valid_PG=valid_PG)
    valid = valid or [[True] * G] * P
    expected = torch.tensor(loo_advantages_ref(rewards, valid), dtype=torch.float64)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-6)  # adv is float32: 6e-8 relative
    assert zero.tolist() == [len({x for x, o in zip(rs, vs) if o}) <= 1 for rs, vs in zip(rewards, valid)]


def test_group_loo_needs_the_leave_one_out_baseline():
    with pytest.raises(ValueError, match="scale 'group_loo' needs baseline 'leave_one_out'"):
        compute_advantages(torch.ones(2, 4), "mean", "group_loo")
    with pytest.raises(ValueError, match="valid_PG must be a bool tensor of shape"):
        compute_advantages(torch.ones(2, 4), "leave_one_out", "group_loo", valid_PG=torch.ones(2, 4))


@given(st.data())
def test_overlong_penalty_is_trl_soft_overlong_punishment(data):
    """Up to the limit the penalty (p = 1) equals TRL 1.16's ``get_soft_overlong_punishment`` (trl/rewards/
    other_rewards.py: 0 up to L_max - L_cache, then (L_max - L_cache - L) / L_cache); past it TRL gives -1 and
    NeMo-RL's formula keeps its slope: -(L - (L_max - B)) / B."""
    from trl.rewards import get_soft_overlong_punishment

    limit = data.draw(st.integers(1, 64), label="L_max")
    buffer = data.draw(st.integers(1, limit), label="B")
    lengths = data.draw(st.lists(st.integers(0, 2 * limit), min_size=1, max_size=20), label="L")
    trl = get_soft_overlong_punishment(max_completion_len=limit, soft_punish_cache=buffer)([[7] * n for n in lengths])
    for n, want in zip(lengths, trl):
        got = overlong_penalty(n, limit, buffer, 1.0)
        if n <= limit:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (n, limit, buffer)
        else:
            assert want == -1.0 and got == pytest.approx(-(n - (limit - buffer)) / buffer, rel=1e-12)
    penalty = data.draw(st.floats(0, 4), label="p")
    assert overlong_penalty(limit, limit, buffer, penalty) == pytest.approx(-penalty)  # -p at the limit


def test_overlong_penalty_and_reward_scaling_by_hand():
    """TRL's docstring example (90 tokens, limit 100, cache 20: -0.5); NeMo-RL's DAPO recipe (limit 14336, buffer
    2048): 0 at 12288 tokens, -0.5 at 13312, -1 at 14336, -2 at 16384. reward_scaling [0, 1] -> [-1, 1] with
    clamping (NeMo-RL's scale_rewards)."""
    from fastgrpo.config import RewardScalingConfig

    assert overlong_penalty(90, 100, 20, 1.0) == -0.5
    assert [overlong_penalty(n, 14336, 2048, 1.0) for n in (100, 12288, 13312, 14336, 16384)] == [0, 0, -0.5, -1, -2]
    scaling = RewardScalingConfig(enabled=True, target_min=-1.0)
    assert scale_rewards([0.0, 0.25, 1.0, 3.0, -2.0], scaling) == [-1.0, -0.5, 1.0, 1.0, -1.0]
    assert scale_rewards([0.0, 3.0], RewardScalingConfig(target_min=-1.0)) == [0.0, 3.0]  # disabled
    with pytest.raises(ValueError, match="reward_scaling.source_max must be > reward_scaling.source_min=1.0"):
        load_config(overrides=["reward_scaling.source_min=1.0"])
    with pytest.raises(ValueError, match="reward_shaping.overlong_buffer_length must be <= the shortest "
                                         "max_new_tokens 6"):
        load_config(overrides=["reward_shaping.enabled=true", "reward_shaping.overlong_buffer_length=7",
                               "stages=[{at_step: 3, max_new_tokens: 6}]"])
    with pytest.raises(ValueError, match="reward_shaping.overlong_buffer_length must be <= reward_shaping.max_resp"):
        load_config(overrides=["reward_shaping.overlong_buffer_length=70", "reward_shaping.max_response_length=64"])


def test_microbatch_targets_and_mask():
    mb = make_microbatch([Sample([5, 6, 7], [8, 9], [-0.5, -0.25], 1.5),
                          Sample([5], [4], [-1.0], -1.0, train=False)], torch.device("cpu"))
    assert mb.batch.input_ids.tolist() == [5, 6, 7, 8, 9, 5, 4]
    assert mb.targets.tolist() == [6, 7, 8, 9, 0, 4, 0]
    assert mb.mask.tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert mb.completion_mask.tolist() == [False, False, True, True, False, True, False]
    assert mb.sample_logprobs.tolist() == [0, 0, -0.5, -0.25, 0, -1.0, 0]
    assert mb.advantages.tolist() == [1.5, -1.0]


def test_microbatch_loss_mask_and_token_advantages():
    """Observation tokens (loss_mask 0) get no loss; token advantages ride on the sequence's advantage."""
    mb = make_microbatch([Sample([5, 6], [8, 9, 10], [-0.5, 0.0, -0.25], 1.5, loss_mask=[1, 0, 1],
                                 token_advantages=[0.25, 0.5, -2.0]),
                          Sample([5], [4], [-1.0], -1.0)], torch.device("cpu"))
    assert mb.mask.tolist() == [0, 1, 0, 1, 0, 1, 0]
    assert mb.num_loss_tokens == 3
    assert mb.per_token_advantages
    assert mb.advantages.tolist() == [0, 1.75, 2.0, -0.5, 0, -1.0, 0]
    with pytest.raises(ValueError, match="Sample.loss_mask has 2 values for 3 completion tokens"):
        Sample([5], [1, 2, 3], [0.0] * 3, 0.0, loss_mask=[1, 0])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_update_with_loss_mask_and_token_advantages_matches_reference(loss_type):
    """A multi-turn-like batch: random observation spans (loss_mask 0) and per-token advantages. Expected: the
    unpacked fp32 reference given the per-token advantages ``[B, T]`` and the mask with the observations zeroed."""
    state = init_distributed("cpu")
    g = torch.Generator().manual_seed(3)
    samples = make_samples()
    for s in samples:
        c = len(s.completion_ids)
        s.loss_mask = (torch.rand(c, generator=g) < 0.6).int().tolist()
        s.token_advantages = torch.randn(c, generator=g).tolist()
    cfg = load_config(overrides=[*TINY, f"grpo.loss_type={loss_type}", "train.max_tokens_per_microbatch=24"])
    metrics, delta, model, before = run_update(cfg, samples, state)
    logp, mask = teacher_forced_at(model, before, samples)
    adv = torch.zeros_like(logp)
    for b, s in enumerate(samples):
        c = len(s.completion_ids)
        mask[b, :c] *= torch.tensor(s.loss_mask, dtype=torch.float32)
        adv[b, :c] = s.advantage + torch.tensor(s.token_advantages)
    assert 0 < mask.sum() < sum(len(s.completion_ids) for s in samples)  # some observations, some sampled tokens
    ref_loss, _ = grpo_loss_ref(logp, logp.detach(), adv, mask, loss_type=loss_type, max_completion_length=8)
    ref_loss.backward()
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def make_samples(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(5, 40, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(5, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(p, c, [-1.0] * len(c), float(torch.randn((), generator=g)), train=i != 3))
    return out


def full(t):
    """A parameter's full value (FSDP2 shards parameters as DTensors)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()


def run_update(cfg, samples, state, *, seed=0, strategy="ddp", lr=1.0):
    """One rollout's update with SGD: returns the metrics and the parameter change (= minus lr x the gradient for
    one optimizer step). With ``train.activation_checkpointing`` the model recomputes its layers in backward."""
    model, _ = load_model(cfg.model, state.device, seed=seed)
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    wrapped = wrap_model(model, state, strategy, forward=packed_forward, whole=data_dependent_module(model))
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = PolicyUpdate(cfg, wrapped, opt, sched, None, state.device, state.world_size).run(
        samples, beta=0.0, epsilon_high=cfg.grpo.epsilon_high, max_new_tokens=cfg.rollout.max_new_tokens)
    delta = {k: before[k] - full(v) for k, v in model.named_parameters()}
    return metrics, delta, model, before


def run_mixed(cfg, samples, state, *, strategy="ddp"):
    """One rollout's update in bf16 with the trainer's optimizer (fp32 masters): the metrics and the fp32 gradients
    the optimizer stepped, by parameter name (the masters' under DDP, the sharded fp32 parameters' under FSDP2)."""
    model, _ = load_model(cfg.model, state.device)
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    wrapped = wrap_model(model, state, strategy, forward=packed_forward)
    opt = make_optimizer(wrapped, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = PolicyUpdate(cfg, wrapped, opt, sched, None, state.device, state.world_size).run(
        samples, beta=0.0, epsilon_high=cfg.grpo.epsilon_high, max_new_tokens=cfg.rollout.max_new_tokens)
    if isinstance(opt, MasterAdamW):
        names = {id(p): n for n, p in model.named_parameters()}
        grads = {names[id(p)]: m.grad.clone() for p, m in zip(opt.model_params, opt.masters)}
    else:
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
    assert all(g.dtype == torch.float32 for g in grads.values())
    return metrics, grads


TINY = ["model.tiny_hidden_size=32", "model.tiny_intermediate_size=64", "train.max_grad_norm=0",
        "rollout.max_new_tokens=8"]


def teacher_forced(model, samples):
    """Each sequence alone through the HF forward: completion log-probs ``[B, T]`` (right-padded with 0) and the
    loss mask ``[B, T]`` (0 for padding and for samples not trained on)."""
    T = max(len(s.completion_ids) for s in samples)
    mask = torch.zeros(len(samples), T)
    rows = []
    for b, s in enumerate(samples):
        ids = torch.tensor([s.tokens])
        logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].float()  # [C, V]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        rows.append(lp)
        mask[b, : len(lp)] = float(s.train)
    return torch.stack([torch.nn.functional.pad(r, (0, T - len(r))) for r in rows]), mask


def teacher_forced_at(model, before, samples):
    """``teacher_forced`` at the weights ``before`` (an update's starting point): the model is reset to them and its
    gradients cleared, so that a reference loss's backward leaves the reference gradient in ``p.grad``."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(before[k])
    model.zero_grad()
    return teacher_forced(model, samples)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_update_matches_unpacked_reference_across_microbatches(loss_type):
    state = init_distributed("cpu")
    samples = make_samples()
    cfg = load_config(overrides=[*TINY, f"grpo.loss_type={loss_type}", "train.max_tokens_per_microbatch=24"])
    metrics, delta, model, before = run_update(cfg, samples, state)
    assert metrics["optimizer_steps"] == 1 and metrics["bad_steps"] == 0

    # reference: the original weights, each sequence alone through the HF forward, padded fp32 loss
    logp, mask = teacher_forced_at(model, before, samples)
    adv = torch.tensor([s.advantage for s in samples])
    ref_loss, _ = grpo_loss_ref(logp, logp.detach(), adv, mask, loss_type=loss_type, max_completion_length=8)
    ref_loss.backward()
    # fp32 on both sides, summed in different orders (packed chunks vs padded rows): ~1e-6 relative apart. The
    # weight change (lr = 1) is a difference of weights of size <= ~1 (norm weights are 1): <= 1.2e-7 absolute.
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_update_rollout_is_uses_the_engine_logprobs(mode):
    """``grpo.rollout_is``: the update weighs each micro-batch's policy term by the ratio of its own (on-policy)
    log-probs to the engine's, which travel packed with the samples. Expected: the unpacked fp32 reference given
    the engine log-probs as ``sampling_logprobs``; the sampling/ metrics (token means over micro-batches,
    extremes over micro-batches) equal the reference's over the whole batch."""
    state = init_distributed("cpu")
    samples = make_samples()
    cfg = load_config(overrides=[*TINY, f"grpo.rollout_is={mode}", "grpo.rollout_is_cap=2",
                                 "grpo.rollout_is_min=0.5", "train.max_tokens_per_microbatch=24"])
    model0, _ = load_model(cfg.model, state.device, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logp0, _ = teacher_forced(model0, samples)
    for b, s in enumerate(samples):  # an engine whose log-probs are off by up to ~1 nat per token
        noise = torch.randn(len(s.completion_ids), generator=g) * 0.5
        s.sample_logprobs = (logp0[b, : len(s.completion_ids)] + noise).tolist()
    metrics, delta, model, before = run_update(cfg, samples, state)
    logp, mask = teacher_forced_at(model, before, samples)
    samp = torch.stack([torch.nn.functional.pad(torch.tensor(s.sample_logprobs), (0, logp.shape[1] -
                                                len(s.sample_logprobs))) for s in samples])
    adv = torch.tensor([s.advantage for s in samples])
    ref_loss, ref_metrics = grpo_loss_ref(logp, logp.detach(), adv, mask, sampling_logprobs=samp, rollout_is=mode,
                                          rollout_is_cap=2.0, rollout_is_min=0.5)
    ref_loss.backward()
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    keys = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/is_clipped_fraction"]
    if mode.startswith("token"):  # sequence modes: TRL's stats are over sequences, the log's over micro-batches
        keys += [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
    assert_is_decisive(logp.detach(), samp, mask, mode, cap=2.0, low=0.5)  # the clipped fraction is no tie
    for key in keys:
        assert metrics[key] == pytest.approx(float(ref_metrics[key]), rel=1e-5, abs=1e-6), key
    assert 0 < metrics["sampling/is_clipped_fraction"] < 1


def test_several_optimizer_steps_per_rollout_use_old_logprobs():
    state = init_distributed("cpu")
    cfg = load_config(overrides=[*TINY, "train.sequences_per_optimizer_step=4", "grpo.num_prompts_per_step=4",
                                 "grpo.num_generations=2"])
    metrics, delta = run_update(cfg, make_samples(), state)[:2]
    assert metrics["optimizer_steps"] == 2
    assert metrics["sampling/sampling_logp_difference/mean"] > 0  # the engine log-probs here are fake (-1)
    assert metrics["sampling/sampling_logp_difference/max"] >= metrics["sampling/sampling_logp_difference/mean"]
    assert any(d.abs().max() > 0 for d in delta.values())


def test_non_finite_loss_skips_the_step():
    state = init_distributed("cpu")
    samples = make_samples()
    samples[0].advantage = float("nan")
    cfg = load_config(overrides=TINY)
    metrics, delta = run_update(cfg, samples, state)[:2]
    assert metrics["bad_steps"] == 1 and metrics["optimizer_steps"] == 0
    assert all(float(d.abs().max()) == 0 for d in delta.values())


def _torchrun(nproc, out, tmp_path, mode="ddp"):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), str(out), mode]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


def _torchrun_two_nodes(out, tmp_path):
    """Two torchrun launches of one process each, as two "nodes" on localhost (c10d rendezvous, the README's
    multi-node command)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=test", str(Path(__file__).resolve()), str(out), "ddp"]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(log[-3000:] for log in logs)
    return torch.load(out)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One torchrun of 2 processes for both tests below: the shares of test_two_processes_match_one_process, then
    those of test_fsdp2_several_optimizer_steps_match_ddp (a process start-up each saved)."""
    tmp = tmp_path_factory.mktemp("two")
    return _torchrun(2, tmp / "two.pt", tmp, "both")


def test_two_processes_match_one_process(two_processes, tmp_path):
    """The same global batch (8 sequences) on 1 process and split over 2 (on one node, and on two "nodes" of one
    process each): same loss, same gradients; in fp32, with activation checkpointing, and in bf16 with fp32 masters.
    """
    one = _torchrun(1, tmp_path / "one.pt", tmp_path)["ddp"]
    two = two_processes["ddp"]
    for loss_type in ("dapo", "grpo", "dapo_ac"):
        a, b = one[loss_type], two[loss_type]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        for k in a["delta"]:
            torch.testing.assert_close(a["delta"][k], b["delta"][k], rtol=1e-4, atol=1e-6)
    for res in (one, two):  # checkpointing recomputes the same ops: fp32 rounding apart at most
        assert res["dapo_ac"]["loss"] == pytest.approx(res["dapo"]["loss"], rel=1e-6)
        for k in res["dapo"]["delta"]:
            torch.testing.assert_close(res["dapo_ac"]["delta"][k], res["dapo"]["delta"][k], rtol=1e-5, atol=1e-7)
    # bf16: each rank packs its own micro-batches, so matmuls of other shapes round differently in bf16; the
    # fp32-accumulated gradients then differ by a few bf16 ulps (2^-8 relative) of the larger entries.
    a, b = one["bf16"], two["bf16"]
    assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
    for k in a["grads"]:
        scale = float(a["grads"][k].abs().max())
        torch.testing.assert_close(b["grads"][k], a["grads"][k], rtol=2e-2, atol=2e-2 * scale)
    nodes = _torchrun_two_nodes(tmp_path / "nodes.pt", tmp_path)["ddp"]  # the same ranks and shards: the same numbers
    for case in ("dapo", "grpo", "bf16"):
        assert nodes[case]["loss"] == two[case]["loss"], case
        got, want = nodes[case].get("delta", nodes[case].get("grads")), two[case].get("delta", two[case].get("grads"))
        assert all(torch.equal(got[k], want[k]) for k in want), case


def test_fsdp2_several_optimizer_steps_match_ddp(two_processes):
    """2 processes, 2 optimizer steps per rollout (old log-probs through the sharded model), micro-batch counts
    that differ between ranks: FSDP2 gives DDP's losses, gradient norms and weights. Both reduce the same fp32
    gradients in a different order (all-reduce vs reduce-scatter), a relative difference near 1e-7 that one more
    step through the updated weights may amplify a little: hence rtol 1e-5 on metrics and 1e-4 on weights."""
    res = two_processes["fsdp"]
    ddp, fsdp = res["ddp"], res["fsdp2"]
    assert ddp["metrics"]["optimizer_steps"] == fsdp["metrics"]["optimizer_steps"] == 2
    assert res["counts"][0] != res["counts"][1]  # rank 0 and rank 1 hold different numbers of micro-batches
    for key in ("loss", "grad_norm", "sampling/sampling_logp_difference/mean",
                "sampling/sampling_logp_difference/max", "clip_ratio/region_mean", "entropy"):
        assert fsdp["metrics"][key] == pytest.approx(ddp["metrics"][key], rel=1e-5, abs=1e-7), key
    for k in ddp["delta"]:
        torch.testing.assert_close(fsdp["delta"][k], ddp["delta"][k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(res["fsdp2_ac"]["delta"][k], ddp["delta"][k], rtol=1e-4, atol=1e-6)
    # bf16 compute, fp32 masters (DDP: MasterAdamW; FSDP2: fp32 shards, bf16 gather, fp32 reduce), checkpointing on:
    # both compute each micro-batch's bf16 gradient alike and sum it in fp32; the sums differ in order only.
    ddp, fsdp = res["ddp_bf16"], res["fsdp2_bf16"]
    assert fsdp["metrics"]["loss"] == pytest.approx(ddp["metrics"]["loss"], rel=1e-5)
    for k in ddp["grads"]:
        torch.testing.assert_close(fsdp["grads"][k], ddp["grads"][k], rtol=1e-4, atol=1e-6)


def _fsdp_shares(state) -> dict:
    """test_fsdp2_several_optimizer_steps_match_ddp's part of a torchrun process: the same shares under DDP and
    FSDP2."""
    from fastgrpo.algorithms.batch import pack_microbatches
    from fastgrpo.distributed import all_reduce

    samples = make_samples(16)
    share = len(samples) // state.world_size
    mine = samples[state.rank * share : (state.rank + 1) * share]
    cfg_overrides = [*TINY, "train.sequences_per_optimizer_step=8", "grpo.num_prompts_per_step=8",
                     "grpo.num_generations=2", "train.max_tokens_per_microbatch=16"]
    cfg = load_config(overrides=cfg_overrides)
    counts = torch.zeros(2, dtype=torch.long)
    counts[state.rank] = len(pack_microbatches(mine[:4], 16, state.device))  # the first optimizer step's micro-batches
    result = {"counts": all_reduce(counts).tolist()}
    for strategy in ("ddp", "fsdp2"):
        metrics, delta = run_update(cfg, mine, state, strategy=strategy, lr=0.1)[:2]
        result[strategy] = {"metrics": metrics, "delta": delta}
    ac = load_config(overrides=[*cfg_overrides, "train.activation_checkpointing=true"])
    metrics, delta = run_update(ac, mine, state, strategy="fsdp2", lr=0.1)[:2]
    result["fsdp2_ac"] = {"metrics": metrics, "delta": delta}
    bf16 = load_config(overrides=[*cfg_overrides, "model.dtype=bfloat16", "train.activation_checkpointing=true"])
    for strategy in ("ddp", "fsdp2"):
        metrics, grads = run_mixed(bf16, mine, state, strategy=strategy)
        result[f"{strategy}_bf16"] = {"metrics": metrics, "grads": grads}
    return result


def _ddp_shares(state) -> dict:
    """test_two_processes_match_one_process's part of a torchrun process: each rank trains on its share of the
    batch."""
    samples = make_samples()
    share = len(samples) // state.world_size
    mine = samples[state.rank * share : (state.rank + 1) * share]
    result = {}
    for case in ("dapo", "grpo", "dapo_ac"):
        cfg = load_config(overrides=[*TINY, f"grpo.loss_type={case[:4]}", "train.max_tokens_per_microbatch=24",
                                     f"train.activation_checkpointing={case.endswith('_ac')}"])
        metrics, delta = run_update(cfg, mine, state)[:2]
        result[case] = {"loss": metrics["loss"], "delta": delta}
    bf16 = load_config(overrides=[*TINY, "model.dtype=bfloat16", "train.max_tokens_per_microbatch=24"])
    metrics, grads = run_mixed(bf16, mine, state)
    result["bf16"] = {"loss": metrics["loss"], "grads": grads}
    return result


def _worker(out: str, mode: str) -> None:
    """torchrun entry: mode "ddp" runs :func:`_ddp_shares`, "both" then :func:`_fsdp_shares` too (rank 0 saves
    ``{"ddp": ..., "fsdp": ...}``)."""
    from fastgrpo.distributed import barrier, destroy

    state = init_distributed("cpu")
    torch.set_num_threads(1)
    result = {"ddp": _ddp_shares(state)}
    if mode == "both":
        result["fsdp"] = _fsdp_shares(state)
    if state.rank == 0:
        torch.save(result, out)
    barrier()  # no rank tears the process group down while another still uses it
    destroy()  # no wrapped model is referenced here any more: destroy() frees FSDP2's cycles, then the group


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
