"""grpo_loss's KL options, sapo / cispo / cispo_clamp and NeMo-RL's IS modes, against two independent fp32 references.

- ``grpo_loss_ref`` (TRL 1.16's ``_compute_loss``, written line by line from it): the TRL options, with TRL's flag
  ``use_bias_correction_kl`` both ways (``kl_weight="ratio"`` ↔ True, ``"none"`` ↔ False); the other KL options
  through its ``_calculate_kl_ref`` (NeMo-RL's ``calculate_kl``).
- ``clipped_pg_loss_nemo_ref`` (NeMo-RL's ``ClippedPGLossFn.__call__``, from its formulas): every NeMo-RL key this
  library maps (``NEMO_TO_FASTGRPO`` below), run with NeMo-RL's own keys and values.

Both paths run (the Triton kernels under the interpreter, the chunked torch path), padded and packed, value and
gradient (a random upstream gradient), randomised with hypothesis (derandomized in tests/conftest.py). Tolerance:
fp32 inputs, so flash-attn's rule reduces to its ``atol``: ``1e-5·max(1, |ref|)`` (sums in another order, ≤ 1e3
terms of fp32 rounding ~1e-7 each; test_grpo_loss.py's argument).
"""

import itertools

import pytest
import torch
from fastgrpo.kernels.grpo_loss import grpo_loss
from fastgrpo.kernels.linear_grpo_loss import fused_linear_grpo_loss
from fastgrpo.kernels.names import IS_LEVELS, LOSS_TYPES
from fastgrpo.kernels.reference import clipped_pg_loss_nemo_ref, grpo_loss_ref, linear_logprobs_ref
from fastgrpo.kernels.utils import pad_packed, unpad_padded
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grpo_loss import BF16_ULP, TP, G, _assert_close, _compare, _inputs, _run, _sampling

KL_OPTIONS = st.fixed_dictionaries({
    "kl_estimator": st.sampled_from(["k1", "k2", "k3"]),
    "kl_weight": st.sampled_from(["none", "ratio", "score", "sampling_ratio"]),
    # small clamps so that they fire on these inputs (|ref − logp| ~ 0.6, k3 values ~ 0.2), or NeMo-RL's
    "kl_input_clamp": st.sampled_from([None, 0.4, 20.0]),
    "kl_output_clamp": st.sampled_from([None, 0.05, 10.0]),
})


def _case(B, T, seed, per_token_adv, packed):
    """A random case, padded (``cu`` None) or packed, with a hole in one mask and the sampler's log-probs."""
    logp, old, ref, adv, mask = _inputs(B, T, per_token_adv=per_token_adv, seed=seed, spread=0.6)
    samp = _sampling(old, seed + 1, spread=0.3)
    lengths = mask.sum(-1).tolist()  # right padding: the packed sequences' lengths
    long_seq = max(range(B), key=lambda b: lengths[b])
    if lengths[long_seq] > 2:
        mask[long_seq, lengths[long_seq] // 2] = False
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32) if packed else None
    return (logp, old, ref, adv, mask, samp), cu


def _repad(g_N, cu, T):
    """Packed gradient ``[N]`` → ``[B, T]`` (zeros past each sequence)."""
    g = pad_packed(g_N, cu)
    return torch.nn.functional.pad(g, (0, T - g.shape[1]))


def _fastgrpo(kw, tensors, cu, per_token, up, torch_path):
    """grpo_loss's (loss, metrics, padded gradient) on the case: packed when ``cu`` is given, on the chosen path."""
    logp, old, ref, adv, mask, samp = tensors
    with pytest.MonkeyPatch.context() as mp:
        if torch_path:
            mp.setattr(G, "use_triton", lambda t: False)
            mp.setattr(TP, "TORCH_CHUNK", 8)
        if cu is None:
            return _run(grpo_loss, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                        sampling_logprobs=samp, **kw)
        flat = [unpad_padded(x, cu) for x in (logp, old, ref, mask, samp)]
        loss, metrics, g = _run(grpo_loss, flat[0], up, old_logprobs=flat[1],
                                advantages=unpad_padded(adv, cu) if per_token else adv, mask=flat[3],
                                ref_logprobs=flat[2], sampling_logprobs=flat[4], cu_seqlens=cu,
                                per_token_advantages=per_token, **kw)
        return loss, metrics, _repad(g, cu, logp.shape[1])


def _both(kw, tensors, cu, per_token, up, torch_path):
    """(grpo_loss, grpo_loss_ref) on the same case: grpo_loss packed when ``cu`` is given, on the chosen path."""
    logp, old, ref, adv, mask, samp = tensors
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                sampling_logprobs=samp, **kw)
    return _fastgrpo(kw, tensors, cu, per_token, up, torch_path), want


def _policy_kw(loss_type, level):
    kw = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=40)
    if loss_type == "cispo":
        kw["epsilon_high"] = 1.3  # TRL's absolute cap (5.0 recommended; 1.3 so that the random ratios cross it)
    elif loss_type == "cispo_clamp":
        kw["epsilon_high"] = 0.28
    return kw


@pytest.mark.parametrize("use_bias_correction_kl", [True, False])
@pytest.mark.parametrize("loss_type, level", [(t, lv) for t in LOSS_TYPES for lv in IS_LEVELS
                                               if not (t.startswith("cispo") and lv == "sequence")])
def test_trl_literal_kl_flag_both_ways(path, use_bias_correction_kl, loss_type, level):
    """TRL's KL term with its ``use_bias_correction_kl`` flag both ways, every loss type TRL shares, both paths."""
    (logp, old, ref, adv, mask, samp), _ = _case(4, 23, seed=101, per_token_adv=False, packed=False)
    up = torch.randn(())
    kw = dict(beta=0.3, kl_weight="ratio" if use_bias_correction_kl else "none", **_policy_kw(loss_type, level))
    got = _run(grpo_loss, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, **kw)
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, **kw)
    _compare(got, want, f"{path} {loss_type}/{level} use_bias_correction_kl={use_bias_correction_kl}")
    flag = {"cispo": "cispo_clip_ratio", "cispo_clamp": "clip_ratio/region_mean"}.get(loss_type)
    if flag:  # the case crosses CISPO's caps, so the detached clamp acts
        assert 0 < want[1][flag] < 1


def test_kl_weights_differ_as_the_math_says():
    """On the same off-policy inputs (k3, token level): ``ratio`` = r·k3 in value, ``score`` = k3 in value with the
    gradient β(logp − ref)/N, ``none`` = k3 with the gradient β(1 − e^(ref − logp))/N (dapo, A = 0 isolates the KL)."""
    (logp, old, ref, _, mask, samp), _ = _case(3, 17, seed=103, per_token_adv=False, packed=False)
    adv = torch.zeros(3)
    m = mask.float()
    x = ref - logp
    k3 = torch.exp(x) - 1 - x
    beta = 0.5
    grads = {}
    for weight in ("none", "ratio", "score", "sampling_ratio"):
        loss, metrics, grad = _run(grpo_loss, logp, torch.tensor(1.0), old_logprobs=old, advantages=adv, mask=mask,
                                   ref_logprobs=ref, beta=beta, kl_weight=weight, sampling_logprobs=samp)
        w = {"none": 1.0, "score": 1.0, "ratio": torch.exp(logp - old), "sampling_ratio": torch.exp(logp - samp)}
        torch.testing.assert_close(metrics["kl"], (w[weight] * k3 * m).sum() / m.sum())
        grads[weight] = grad
    torch.testing.assert_close(grads["score"], beta * m * (logp - ref) / m.sum())
    torch.testing.assert_close(grads["none"], beta * m * (1 - torch.exp(x)) / m.sum())
    r = torch.exp(logp - old)
    torch.testing.assert_close(grads["ratio"], beta * m * r * (logp - ref) / m.sum())


@pytest.mark.parametrize("packed", [False, True])
def test_kl_clamps_fire_and_stop_the_gradient(path, packed):
    """With the input clamp at 0.4 and the output clamp at 0.05 both fire on some tokens; where either fires the
    token's KL gradient is 0 (the weight detached), elsewhere the reference's."""
    tensors, cu = _case(4, 19, seed=107, per_token_adv=False, packed=packed)
    logp, old, ref, adv, mask, samp = tensors
    up = torch.randn(())
    for weight in ("score", "ratio", "sampling_ratio"):
        kw = dict(beta=0.7, loss_type="dapo", kl_weight=weight, kl_input_clamp=0.4, kl_output_clamp=0.05)
        got, want = _both(kw, tensors, cu, False, up, path == "torch")
        _compare(got, want, f"{path} clamps {weight}")
        x = (ref - logp)[mask]
        assert (x.abs() > 0.4).any() and (x.abs() < 0.4).any()
    kw = dict(beta=0.7, loss_type="dapo", kl_weight="score", kl_input_clamp=0.4, kl_output_clamp=0.05)
    zero_pg = dict(kw, epsilon_low=0.0)
    (_, _, g_kl), _ = _both(dict(zero_pg), (logp, logp, ref, torch.zeros_like(adv), mask, samp), cu, False,
                            torch.tensor(1.0), path == "torch")
    xs = ref - logp
    kl = torch.exp(xs.clamp(-0.4, 0.4)) - 1 - xs.clamp(-0.4, 0.4)
    fired = mask & ((xs.abs() > 0.4) | (kl.abs() > 0.05))
    assert fired.any() and (mask & ~fired).any()
    assert (g_kl[fired] == 0).all() and (g_kl[mask & ~fired] != 0).all()


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(2, 5), T=st.integers(2, 30), seed=st.integers(0, 2**16), per_token=st.booleans(),
    loss_type=st.sampled_from(LOSS_TYPES), level=st.sampled_from(IS_LEVELS), kl=KL_OPTIONS,
    beta=st.sampled_from([0.0, 0.2]), packed=st.booleans(), torch_path=st.booleans(),
    rollout_is=st.sampled_from(["none", "tis", "icepop", "seq-mask-tis", "sequence_truncate"]),
    opsm=st.sampled_from([None, 0.0, 0.05]),
)
def test_property_variants_match_reference(B, T, seed, per_token, loss_type, level, kl, beta, packed, torch_path,
                                           rollout_is, opsm):
    if loss_type.startswith("cispo"):
        level = "token"  # CISPO is token level only (validated)
    tensors, cu = _case(B, T, seed, per_token, packed)
    kw = dict(beta=beta, rollout_is=rollout_is, rollout_is_cap=1.4, rollout_is_min=0.8, **kl,
              off_policy_mask_threshold=opsm, **_policy_kw(loss_type, level))
    got, want = _both(kw, tensors, cu, per_token, torch.randn(()), torch_path)
    _compare(got, want, f"{loss_type}/{level} {kl} {rollout_is}")


# ---- NeMo-RL: its keys and values, mapped to grpo_loss's, against clipped_pg_loss_nemo_ref ----------------------

def nemo_to_fastgrpo(nemo: dict, n_tokens: float) -> dict:
    """grpo_loss keywords for NeMo-RL loss_fn keys (the mapping the README's table states)."""
    level_loss = nemo.get("token_level_loss", True)
    kw = dict(
        beta=nemo.get("reference_policy_kl_penalty", 0.0), kl_estimator=nemo.get("reference_policy_kl_type", "k3"),
        kl_input_clamp=nemo.get("kl_input_clamp_value", 20.0), kl_output_clamp=nemo.get("kl_output_clamp_value", 10.0),
        kl_weight="sampling_ratio" if nemo.get("use_on_policy_kl_approximation") else "score",
        epsilon_low=nemo.get("ratio_clip_min", 0.2), epsilon_high=nemo.get("ratio_clip_max", 0.2),
        dual_clip_c=nemo.get("ratio_clip_c"),
        loss_type="cispo_clamp" if nemo.get("use_cispo") else ("dapo" if level_loss else "grpo"),
        num_items_in_batch=n_tokens if level_loss else None,
    )
    if nemo.get("use_importance_sampling_correction"):
        tis = nemo.get("truncated_importance_sampling_type")
        if tis is None:  # the plain ratio: a bound it never reaches
            kw.update(rollout_is="token_truncate", rollout_is_cap=1e30)
        else:
            kw.update(rollout_is=tis, rollout_is_cap=nemo["truncated_importance_sampling_ratio"],
                      rollout_is_min=nemo.get("truncated_importance_sampling_ratio_min") or 0.0)
    return kw


NEMO_KEYS = st.fixed_dictionaries({
    "reference_policy_kl_penalty": st.sampled_from([0.0, 0.01, 0.5]),
    "reference_policy_kl_type": st.sampled_from(["k1", "k2", "k3"]),
    "kl_input_clamp_value": st.sampled_from([None, 0.4, 20.0]),
    "kl_output_clamp_value": st.sampled_from([None, 0.05, 10.0]),
    "use_on_policy_kl_approximation": st.booleans(),
    "ratio_clip_min": st.sampled_from([0.2, 0.1]),
    "ratio_clip_max": st.sampled_from([0.2, 0.28]),
    "ratio_clip_c": st.sampled_from([None, 3.0]),
    "use_cispo": st.booleans(),
    "use_importance_sampling_correction": st.booleans(),
    "truncated_importance_sampling_type": st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]),
    "token_level_loss": st.booleans(),
})


def _nemo_case(nemo, tensors, cu, up, torch_path):
    logp, old, ref, adv, mask, samp = tensors
    if nemo["use_cispo"]:  # NeMo-RL asserts: no dual clip, token-level loss
        nemo.update(ratio_clip_c=None, token_level_loss=True)
    if nemo["truncated_importance_sampling_type"] is not None:
        nemo.update(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.4,
                    truncated_importance_sampling_ratio_min=0.8)
    loss_ref = clipped_pg_loss_nemo_ref
    x = logp.clone().requires_grad_()
    want = loss_ref(x, old, adv, mask, generation_logprobs=samp, reference_policy_logprobs=ref, **nemo)
    (want * up).backward()
    kw = nemo_to_fastgrpo(nemo, float(mask.sum()))
    return _fastgrpo(kw, tensors, cu, False, up, torch_path), (want.detach(), x.grad)


@settings(max_examples=30, deadline=None)
@given(nemo=NEMO_KEYS, B=st.integers(2, 5), T=st.integers(2, 30), seed=st.integers(0, 2**16), packed=st.booleans(),
       torch_path=st.booleans())
def test_property_matches_nemo_rl_reference(nemo, B, T, seed, packed, torch_path):
    """NeMo-RL's loss and gradient from its own keys (``clipped_pg_loss_nemo_ref``) = grpo_loss with the mapped
    keywords, on both paths, padded and packed."""
    tensors, cu = _case(B, T, seed, False, packed)
    got, want = _nemo_case(nemo, tensors, cu, torch.randn(()), torch_path)
    _assert_close(got[0], want[0], what=f"loss {nemo}")
    _assert_close(got[2], want[1], what=f"grad {nemo}")


def test_nemo_rl_seq_mask_tis_masks_whole_sequences():
    """seq-mask-tis with bounds that keep some sequences and drop others (geometric means on both sides)."""
    tensors, _ = _case(6, 25, seed=109, per_token_adv=False, packed=False)
    logp, old, ref, adv, mask, samp = tensors
    samp = old + torch.linspace(-0.3, 0.3, 6)[:, None] + 0.02 * torch.randn(old.shape)  # geo means 0.74 … 1.35
    nemo = dict(reference_policy_kl_penalty=0.0, use_cispo=False, use_importance_sampling_correction=True,
                truncated_importance_sampling_type="seq-mask-tis", ratio_clip_c=None, token_level_loss=True)
    got, want = _nemo_case(nemo, (logp, old, ref, adv, mask, samp), None, torch.tensor(1.0), False)
    _assert_close(got[0], want[0], what="loss")
    _assert_close(got[2], want[1], what="grad")
    frac = got[1]["sampling/is_clipped_fraction"]
    assert 0 < frac < 1  # some sequences masked, some kept


def test_bad_variant_options_name_the_argument():
    logp, old, ref, adv, mask = _inputs(2, 5, seed=31)
    base = dict(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=0.1)
    for name, kw in [
        ("kl_estimator", dict(kl_estimator="k4")),
        ("kl_weight", dict(kl_weight="coef")),
        ("sampling_logprobs", dict(kl_weight="sampling_ratio")),
        ("kl_input_clamp", dict(kl_input_clamp=0.0)),
        ("kl_output_clamp", dict(kl_output_clamp=float("inf"))),
        ("delta", dict(loss_type="cispo", delta=2.0)),
        ("dual_clip_c", dict(loss_type="sapo", dual_clip_c=3.0)),
        ("importance_sampling_level", dict(loss_type="cispo_clamp", importance_sampling_level="sequence")),
        ("sapo_temperature_neg", dict(loss_type="sapo", sapo_temperature_neg=0.0)),
        ("rollout_is", dict(sampling_logprobs=old, rollout_is="seq_mask_tis")),
    ]:
        with pytest.raises(ValueError, match=name):
            grpo_loss(**base, **kw)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("loss_type, kl", [
    ("sapo", dict(kl_weight="ratio")),
    ("cispo_clamp", dict(kl_weight="score", kl_input_clamp=0.4, kl_output_clamp=0.05)),
    ("cispo", dict(kl_weight="sampling_ratio", kl_estimator="k2")),
])
def test_fused_linear_variants(path, packed, loss_type, kl):
    """fused_linear_grpo_loss passes the variant options through: loss and gradients of hidden / weight / bias equal
    the fp32 reference (linear_logprobs_ref → grpo_loss_ref), off-policy, with β > 0."""
    B, T, H, V, lengths = 3, 9, 16, 41, [9, 0, 6]
    g = torch.Generator().manual_seed(113)
    hidden, weight, bias = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) / 4, torch.randn(V)
    targets = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        logp0 = linear_logprobs_ref(hidden, weight, targets, bias=bias)  # [B, T]
    old, ref, samp = (logp0 + 0.5 * torch.randn(B, T, generator=g) for _ in range(3))
    adv = torch.randn(B, generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    kw = dict(beta=0.3, **_policy_kw(loss_type, "token"), **kl)
    up = torch.randn((), generator=g)

    def fused(h, w, b):
        if packed:
            return fused_linear_grpo_loss(unpad_padded(h, cu), w, unpad_padded(targets, cu), unpad_padded(old, cu),
                                          adv, unpad_padded(mask, cu), bias=b, ref_logprobs=unpad_padded(ref, cu),
                                          sampling_logprobs=unpad_padded(samp, cu), cu_seqlens=cu, **kw)
        return fused_linear_grpo_loss(h, w, targets, old, adv, mask, bias=b, ref_logprobs=ref, sampling_logprobs=samp,
                                      **kw)

    def reference(h, w, b):
        lp = linear_logprobs_ref(h, w, targets, bias=b)
        return grpo_loss_ref(lp, old, adv, mask, ref_logprobs=ref, sampling_logprobs=samp, **kw)

    outs = []
    for fn in (fused, reference):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        loss, _ = fn(*leaves)
        (loss * up).backward()
        outs.append([loss.detach(), *(x.grad for x in leaves)])
    for name, a, r in zip(("loss", "hidden", "weight", "bias"), *outs):
        _assert_close(a, r, what=f"{loss_type} {name}")


@pytest.mark.parametrize("behaviour", ["sampler", "old"])
def test_off_policy_mask_drops_negative_far_sequences(path, behaviour):
    """TRL's off_policy_mask_threshold: a threshold between the sequences' mean log-ratios keeps some negative-
    advantage sequences and drops others (positive ones always stay); loss and gradient of the TRL-literal
    reference, with the sampler's log-probs or (without them) the old ones as the behaviour policy."""
    (logp, old, ref, _, mask, samp), _ = _case(6, 21, seed=127, per_token_adv=False, packed=False)
    adv = torch.tensor([-1.0, -0.5, -2.0, 1.0, -1.5, 0.7])
    behave = samp if behaviour == "sampler" else old
    m = mask.float()
    avg = ((behave - logp) * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
    neg = avg[adv < 0]
    threshold = float(neg.median())
    dropped = (adv < 0) & (avg > threshold)
    assert dropped.any() and ((adv < 0) & ~dropped).any()
    up = torch.randn(())
    kw = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=0.1, loss_type="dapo",
              off_policy_mask_threshold=threshold, sampling_logprobs=samp if behaviour == "sampler" else None)
    got = _run(grpo_loss, logp, up, **kw)
    _compare(got, _run(grpo_loss_ref, logp, up, **kw), f"{path} opsm {behaviour}")
    off = _run(grpo_loss, logp, up, **dict(kw, off_policy_mask_threshold=None))
    changed = (got[2] - off[2]).abs().sum(-1) > 0  # [B]: only the dropped sequences' gradients change
    assert torch.equal(changed, dropped & (m.sum(-1) > 0))



@pytest.mark.parametrize("loss_type, level, kl", [
    ("sapo", "sequence", dict(kl_weight="ratio")),
    ("cispo", "token", dict(kl_weight="sampling_ratio", kl_estimator="k1")),
    ("cispo_clamp", "token", dict(kl_weight="score", kl_input_clamp=0.4, kl_output_clamp=0.05)),
    ("luspo", "sequence", dict(kl_weight="none", kl_estimator="k2")),
])
def test_bf16_inputs_flash_rule(path, loss_type, level, kl):
    """bf16 log-probs: within twice the bf16 reference's error of the fp32 reference (plus one bf16 ulp of the
    gradient, which is stored in bf16: test_grpo_loss.py's BF16_ULP)."""
    (logp, old, ref, adv, mask, samp), _ = _case(4, 37, seed=131, per_token_adv=False, packed=False)
    low = [x.to(torch.bfloat16) for x in (logp, old, ref, adv, samp)]
    up = torch.randn(())
    kw = dict(old_logprobs=low[1], advantages=low[3], mask=mask, ref_logprobs=low[2], sampling_logprobs=low[4],
              beta=0.2, **kl, **_policy_kw(loss_type, level))
    l1, m1, g1 = _run(grpo_loss, low[0], up, **kw)
    l32, m32, g32 = _run(grpo_loss_ref, low[0], up, **kw)
    llo, mlo, glo = _run(grpo_loss_ref, low[0], up, upcast=False, **kw)
    _assert_close(l1, l32, llo, what=f"{loss_type} loss")
    _assert_close(g1, g32, glo, atol_rel=BF16_ULP, what=f"{loss_type} grad")
    _assert_close(m1["kl"], m32["kl"], mlo["kl"], what=f"{loss_type} kl")


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type, level, kl", [
    ("dapo", "token", dict(kl_weight="score", kl_input_clamp=20.0, kl_output_clamp=10.0)),  # deepscaler-1.5b
    ("sapo", "sequence", dict(kl_weight="ratio")),
    ("cispo_clamp", "token", dict(kl_weight="sampling_ratio", kl_estimator="k2", kl_output_clamp=0.05)),
    ("luspo", "sequence", dict(kl_weight="none", kl_input_clamp=0.4)),
])
def test_gpu_variants_match_reference(loss_type, level, kl):
    """The compiled kernels (bench/gpu_check.sh) at a realistic length, packed, fp32: the fp32 reference's loss and
    gradient (atol 1e-4 of the largest value: 64 × 3000 terms summed in another order)."""
    (logp, old, ref, adv, mask, samp), _ = _case(64, 3000, seed=137, per_token_adv=False, packed=False)
    lengths = mask.sum(-1)
    mask = torch.arange(3000)[None, :] < lengths[:, None]  # right padding only: pack exactly the kept tokens
    cu = torch.tensor([0, *itertools.accumulate(lengths.tolist())], dtype=torch.int32)
    up = torch.randn(())
    kw = dict(beta=0.1, rollout_is="icepop", rollout_is_cap=1.4, rollout_is_min=0.8, off_policy_mask_threshold=0.05,
              **kl, **_policy_kw(loss_type, level))
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                sampling_logprobs=samp, **kw)
    flat = [unpad_padded(t, cu).cuda() for t in (logp, old, ref, mask, samp)]
    loss, metrics, g = _run(grpo_loss, flat[0], up.cuda(), old_logprobs=flat[1], advantages=adv.cuda(),
                            mask=flat[3], ref_logprobs=flat[2], sampling_logprobs=flat[4], cu_seqlens=cu.cuda(), **kw)
    got = (loss.cpu(), {k: v.cpu() for k, v in metrics.items()}, _repad(g.cpu(), cu, 3000))
    _assert_close(got[0], want[0], atol_rel=1e-4, what=f"gpu {loss_type} loss")
    _assert_close(got[2], want[2], atol_rel=1e-4, what=f"gpu {loss_type} grad")
