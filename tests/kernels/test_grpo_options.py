"""``GRPOLossOptions``: ``options=`` is the option keywords of ``grpo_loss`` and ``fused_linear_grpo_loss`` packed in
one value. The same options give the same loss, metrics and gradient to the bit (the same computation), on both
paths, padded and packed (randomised with hypothesis, derandomized in tests/conftest.py); an option keyword away
from its default given with ``options`` is an error naming it; a bad value fails at construction with the
keyword's message."""

import dataclasses
import inspect

import pytest
import torch
from fastgrpo.kernels import GRPOLossOptions, fused_linear_grpo_loss, grpo_loss
from fastgrpo.kernels.names import IS_LEVELS, LOSS_POLICY, LOSS_TYPES
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grpo_loss import TP, G, _inputs, _sampling
from test_grpo_loss_variants import KL_OPTIONS

FIELDS = [f.name for f in dataclasses.fields(GRPOLossOptions)]
DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOLossOptions)}
# a value away from the default for every field, valid with the default others
AWAY = dict(beta=0.1, epsilon_low=0.1, epsilon_high=0.3, delta=2.0, dual_clip_c=3.0, loss_type="grpo",
            importance_sampling_level="sequence", max_completion_length=9, rollout_is="tis", rollout_is_cap=2.0,
            rollout_is_min=0.5, kl_estimator="k1", kl_weight="none", kl_input_clamp=20.0, kl_output_clamp=10.0,
            sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, off_policy_mask_threshold=0.1)


def _call(fn, x, kw, upstream):
    """(loss, metrics, gradient of loss·upstream w.r.t. x) of ``fn(x, **kw)``."""
    x = x.detach().clone().requires_grad_()
    loss, metrics = fn(x, **kw)
    (loss * upstream).backward()
    return loss.detach(), metrics, x.grad


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_every_option_keyword_is_a_field_with_its_default():
    """The keywords of both losses that are options: the fields, in the fields' order, with the same defaults."""
    for fn in (grpo_loss, fused_linear_grpo_loss):
        params = inspect.signature(fn).parameters
        assert [p for p in params if p in FIELDS] == FIELDS
        assert {p: params[p].default for p in FIELDS} == DEFAULTS
        assert params["options"].default is None and list(params)[-1] == "options"
    assert set(AWAY) == set(FIELDS)


@settings(max_examples=20, deadline=None)
@given(
    B=st.integers(2, 4), T=st.integers(1, 20), seed=st.integers(0, 2**16), per_token=st.booleans(),
    loss_type=st.sampled_from(LOSS_TYPES), level=st.sampled_from(IS_LEVELS), kl=KL_OPTIONS,
    beta=st.sampled_from([0.0, 0.3]), clip=st.sampled_from([{}, {"delta": 1.5}, {"dual_clip_c": 2.0}]),
    epsilon_high=st.sampled_from([None, 0.28]), rollout_is=st.sampled_from(["none", "icepop", "sequence_mask"]),
    opsm=st.sampled_from([None, 0.05]), packed=st.booleans(), torch_path=st.booleans(),
)
def test_options_equal_the_keywords(B, T, seed, per_token, loss_type, level, kl, beta, clip, epsilon_high,
                                    rollout_is, opsm, packed, torch_path):
    if LOSS_POLICY[loss_type].startswith("cispo"):
        level = "token"
    if LOSS_POLICY[loss_type] != "clipped":
        clip = {}
    logp, old, ref, adv, mask = _inputs(B, T, per_token_adv=per_token, seed=seed)
    samp = _sampling(old, seed + 1)
    opts = dict(beta=beta, epsilon_high=epsilon_high, loss_type=loss_type, importance_sampling_level=level,
                max_completion_length=T, rollout_is=rollout_is, rollout_is_cap=1.4, rollout_is_min=0.8,
                off_policy_mask_threshold=opsm, **clip, **kl)
    call = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, sampling_logprobs=samp)
    if packed:
        lengths = mask.sum(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        logp = logp[mask]
        call.update(old_logprobs=old[mask], mask=mask[mask], ref_logprobs=ref[mask], sampling_logprobs=samp[mask],
                    advantages=adv[mask] if per_token else adv, cu_seqlens=cu, per_token_advantages=per_token)
    up = torch.randn(())
    with pytest.MonkeyPatch.context() as mp:
        if torch_path:
            mp.setattr(G, "use_triton", lambda t: False)
            mp.setattr(TP, "TORCH_CHUNK", 8)
        want = _call(grpo_loss, logp, {**call, **opts}, up)
        got = _call(grpo_loss, logp, {**call, "options": GRPOLossOptions(**opts)}, up)
    _assert_same(got, want)


def _linear_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T, H, V = 2, 5, 8, 24
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [3]])
    return hidden, weight, targets, mask, torch.randn(B, generator=g)


@pytest.mark.parametrize("opts", [dict(loss_type="grpo", delta=1.5, epsilon_high=0.28),
                                  dict(loss_type="sapo", beta=0.2, kl_weight="score", kl_output_clamp=0.1)])
def test_fused_linear_options_equal_the_keywords(opts):
    hidden, weight, targets, mask, adv = _linear_case()
    ref = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 3
    results = []
    for kw in (opts, {"options": GRPOLossOptions(**opts)}):
        h = hidden.clone().requires_grad_()
        loss, metrics = fused_linear_grpo_loss(h, weight, targets, None, adv, mask, ref_logprobs=ref,
                                               return_entropy=True, **kw)
        loss.backward()
        results.append((loss.detach(), metrics, h.grad))
    _assert_same(*results)


@pytest.mark.parametrize("name", FIELDS)
def test_options_with_an_option_keyword_name_it(name):
    logp, old, ref, adv, mask = _inputs(2, 4)
    samp = _sampling(old, 1)
    with pytest.raises(ValueError, match=rf"^{name}="):
        grpo_loss(logp, old, adv, mask, ref_logprobs=ref, sampling_logprobs=samp, options=GRPOLossOptions(),
                  **{name: AWAY[name]})
    hidden, weight, targets, mask, adv = _linear_case()
    with pytest.raises(ValueError, match=rf"^{name}="):
        fused_linear_grpo_loss(hidden, weight, targets, None, adv, mask, options=GRPOLossOptions(),
                               **{name: AWAY[name]})


def test_options_with_keywords_at_their_defaults_are_the_options():
    logp, old, ref, adv, mask = _inputs(2, 4)
    opts = GRPOLossOptions(loss_type="bnpo", epsilon_low=0.1)
    up = torch.tensor(1.0)
    _assert_same(_call(grpo_loss, logp, dict(old_logprobs=old, advantages=adv, mask=mask, options=opts,
                                             loss_type="dapo", beta=0.0, epsilon_high=None), up),
                 _call(grpo_loss, logp, dict(old_logprobs=old, advantages=adv, mask=mask, options=opts), up))


@pytest.mark.parametrize("bad", [
    dict(beta=float("nan")), dict(epsilon_low=-0.1), dict(epsilon_high=True), dict(loss_type="ppo"),
    dict(importance_sampling_level="tokens"), dict(delta=1.1), dict(loss_type="cispo", dual_clip_c=3.0),
    dict(loss_type="cispo", importance_sampling_level="sequence"), dict(dual_clip_c=1.0),
    dict(max_completion_length=0), dict(max_completion_length=2.0), dict(rollout_is="seq_mask_tis"),
    dict(rollout_is_min=-1.0), dict(rollout_is_cap=0.5, rollout_is_min=0.5), dict(kl_estimator="k4"),
    dict(kl_weight="coef_1"), dict(kl_input_clamp=0.0), dict(kl_output_clamp=-1.0), dict(sapo_temperature_pos=0.0),
    dict(sapo_temperature_neg=float("inf")), dict(off_policy_mask_threshold=float("inf")),
])
def test_a_bad_option_fails_at_construction_as_its_keyword_does(bad):
    with pytest.raises(ValueError) as built:
        GRPOLossOptions(**bad)
    logp, old, ref, adv, mask = _inputs(2, 4)
    with pytest.raises(ValueError) as called:
        grpo_loss(logp, old, adv, mask, ref_logprobs=ref, **bad)
    assert str(built.value) == str(called.value)


def test_options_must_be_options():
    logp, old, _, adv, mask = _inputs(2, 4)
    with pytest.raises(ValueError, match="options must be a GRPOLossOptions"):
        grpo_loss(logp, old, adv, mask, options={"beta": 0.1})


def test_options_are_frozen_floats():
    opts = GRPOLossOptions(beta=1, delta=2, rollout_is_cap=3)
    assert (opts.beta, opts.delta, opts.rollout_is_cap) == (1.0, 2.0, 3.0) and isinstance(opts.beta, float)
    assert opts.eps_high == 0.2 and GRPOLossOptions(epsilon_high=0.3).eps_high == 0.3
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.beta = 0.5
