"""grpo_loss / fused_linear_grpo_loss against the fp32 torch reference (``grpo_loss_ref``, TRL 1.16's math).

Two paths on CPU: the Triton kernels under the interpreter (``kernel``) and the chunked plain-torch path (``torch``,
forced by patching ``use_triton``, with small chunks). Both implement the gradient in closed form; the reference
gets its gradient from autograd, so the tests check the closed forms (tie rules of ``min`` and ``clamp`` included).
Tolerance (flash-attn's rule, max over elements): ``|out − ref_fp32| ≤ 2·|ref_lowp − ref_fp32| + atol`` with
``ref_lowp`` the reference computed in the inputs' dtype. For fp32 inputs only ``atol`` remains: the sums run in a
different order (fp32, ~1e-7 relative over ≤ 1e4 terms), so ``atol = 1e-5·max(1, |ref|)``. The clip-ratio metrics
count threshold crossings: on random data no ratio lies within rounding of a threshold, so one flipped token
(≥ 1/count ≫ atol) fails the test. Every check uses a random upstream gradient on the loss.
"""

import importlib
import itertools

import pytest
import torch
from checks import assert_is_decisive
from fastgrpo.kernels.grpo_loss import grpo_loss
from fastgrpo.kernels.linear_grpo_loss import fused_linear_grpo_loss
from fastgrpo.kernels.names import IS_LEVELS
from fastgrpo.kernels.reference import grpo_loss_ref, linear_logprobs_ref
from fastgrpo.kernels.utils import pad_packed, unpad_padded
from hypothesis import given, settings
from hypothesis import strategies as st

# the modules themselves (``fastgrpo.kernels.grpo_loss`` as an attribute is the re-exported function)
G = importlib.import_module("fastgrpo.kernels.grpo_loss")
K = importlib.import_module("fastgrpo.kernels.grpo_kernels")
TP = importlib.import_module("fastgrpo.kernels.grpo_torch")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")  # the loss types with the clipped surrogate (delta, dual clip apply)

# The gradient is returned in logp's dtype: two fp32 values equal to rounding may round to adjacent bf16 values,
# one bf16 ulp apart (≤ 2^-7 of the largest gradient).
BF16_ULP = 2.0**-7
OPTIONS = {"plain": {}, "delta": {"delta": 1.4}, "dual": {"dual_clip_c": 1.5}}


def _lengths_to_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # [B, T] bool, right padding


def _inputs(B, T, *, dtype=torch.float32, per_token_adv=False, lengths=None, seed=0, spread=0.4):
    """Random log-probs with ratios spread around 1 (so every clip region is hit), one empty sequence."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3  # [B, T]
    old = logp + torch.randn(B, T, generator=g) * spread
    ref = logp + torch.randn(B, T, generator=g) * spread
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
        lengths[min(1, B - 1)] = 0
    mask = _lengths_to_mask(lengths, T)
    return [x.to(dtype) for x in (logp, old, ref, adv)] + [mask]


def _run(fn, logp, upstream, **kw):
    """Loss, metrics and d(loss·upstream)/d logp (fp32) of ``fn(logp, ...)``."""
    x = logp.detach().clone().requires_grad_()
    loss, metrics = fn(x, **kw)
    (loss * upstream).backward()
    return loss.detach().float(), {k: v.float() for k, v in metrics.items()}, x.grad.float()


def _assert_close(got, ref32, reflow=None, *, atol_rel=1e-5, what=""):
    atol = atol_rel * max(1.0, ref32.abs().max().item())
    bound = atol if reflow is None else 2 * (reflow - ref32).abs().max().item() + atol
    err = (got - ref32).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g}"


def _compare(got, want, what=""):
    (l1, m1, g1), (l2, m2, g2) = got, want
    assert set(m1) == set(m2), what
    _assert_close(l1, l2, what=f"{what} loss")
    _assert_close(g1, g2, what=f"{what} grad")
    for k in m2:
        _assert_close(m1[k], m2[k], what=f"{what} {k}")


@pytest.mark.parametrize("loss_type, level", list(itertools.product(CLIPPED, IS_LEVELS)))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("option", OPTIONS)
def test_matches_reference(loss_type, level, beta, option):
    logp, old, ref, adv, mask = _inputs(3, 37, seed=len(loss_type))
    up = torch.randn(())
    kw = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=beta, loss_type=loss_type,
              importance_sampling_level=level, epsilon_high=0.28, **OPTIONS[option])
    _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), f"{loss_type}/{level}")


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_torch_path_matches_reference(path, level, per_token_adv):
    logp, old, ref, adv, mask = _inputs(4, 29, per_token_adv=per_token_adv, seed=3)
    up = torch.randn(())
    for loss_type, option in [("grpo", "dual"), ("dapo", "delta"), ("bnpo", "plain"), ("dr_grpo", "plain")]:
        kw = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=0.1, loss_type=loss_type,
                  importance_sampling_level=level, **OPTIONS[option])
        _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), f"{path} {loss_type}")


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_packed_equals_padded(path, level, per_token_adv):
    lengths = [5, 0, 17, 1, 9, 13]
    B, T = len(lengths), max(lengths)
    logp, old, ref, adv, mask = _inputs(B, T, per_token_adv=per_token_adv, lengths=lengths, seed=5)
    mask[2, 3] = False  # a hole inside a packed sequence
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = [unpad_padded(x, cu) for x in (logp, old, ref, mask)]
    adv_packed = unpad_padded(adv, cu) if per_token_adv else adv
    up = torch.randn(())
    for loss_type in ("grpo", "dr_grpo"):  # per-sequence and global normalisers; the others share their code
        kw = dict(ref_logprobs=ref, beta=0.05, loss_type=loss_type, importance_sampling_level=level, dual_clip_c=2.0,
                  max_completion_length=20)
        l1, m1, g1 = _run(grpo_loss, logp, up, old_logprobs=old, advantages=adv, mask=mask, **kw)
        kw["ref_logprobs"] = packed[2]
        l2, m2, g2 = _run(grpo_loss, packed[0], up, old_logprobs=packed[1], advantages=adv_packed, mask=packed[3],
                          cu_seqlens=cu, **kw)
        _compare((l2, m2, pad_packed(g2, cu)), (l1, m1, g1), f"packed {loss_type}")
        assert (g1[~_lengths_to_mask(lengths, T)] == 0).all()  # padding receives no gradient


def test_ambiguous_packed_advantages_n_equals_b():
    lengths = [2, 0, 1]  # N == B == 3
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    logp, old, ref, adv_b, mask = _inputs(3, 2, lengths=lengths, seed=7)
    packed = [unpad_padded(x, cu) for x in (logp, old, mask)]
    adv_n = torch.tensor([0.5, -1.5, 2.0])
    up = torch.randn(())
    kw = dict(loss_type="bnpo", cu_seqlens=cu)
    # default rule: a length-B advantage vector is per sequence
    got = _run(grpo_loss, packed[0], up, old_logprobs=packed[1], advantages=adv_n, mask=packed[2], **kw)
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv_n, mask=mask, loss_type="bnpo")
    _compare((got[0], got[1], pad_packed(got[2], cu)), want, "per sequence")
    # per_token_advantages=True: the same vector is per token
    got = _run(grpo_loss, packed[0], up, old_logprobs=packed[1], advantages=adv_n, mask=packed[2],
               per_token_advantages=True, **kw)
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=pad_packed(adv_n, cu), mask=mask,
                loss_type="bnpo")
    _compare((got[0], got[1], pad_packed(got[2], cu)), want, "per token")
    assert not torch.allclose(got[0], _run(grpo_loss, packed[0], up, old_logprobs=packed[1], advantages=adv_n,
                                           mask=packed[2], **kw)[0])


@pytest.mark.parametrize("level", IS_LEVELS)
def test_bf16_inputs_flash_rule(level):
    logp, old, ref, adv, mask = _inputs(4, 53, seed=11)
    low = [x.to(torch.bfloat16) for x in (logp, old, ref, adv)]
    up = torch.randn(())
    for loss_type in CLIPPED:
        kw = dict(old_logprobs=low[1], advantages=low[3], mask=mask, ref_logprobs=low[2], beta=0.04,
                  loss_type=loss_type, importance_sampling_level=level, delta=1.5)
        l1, m1, g1 = _run(grpo_loss, low[0], up, **kw)
        l32, m32, g32 = _run(grpo_loss_ref, low[0], up, **kw)  # upcast: fp32 math on the bf16 values
        llo, mlo, glo = _run(grpo_loss_ref, low[0], up, upcast=False, **kw)
        _assert_close(l1, l32, llo, atol_rel=1e-5, what=f"{loss_type} loss")
        _assert_close(g1, g32, glo, atol_rel=BF16_ULP, what=f"{loss_type} grad")
        _assert_close(m1["kl"], m32["kl"], mlo["kl"], what="kl")


def test_many_chunks_and_sequences(monkeypatch):
    """Token level splits sequences into chunks of several blocks and the finaliser loops over several blocks of
    sequences (sizes shrunk so that small inputs take the loops that real sizes (T > 1024, B > 128) take)."""
    monkeypatch.setattr(K, "MAX_BLOCK", 16)
    monkeypatch.setattr(K, "TARGET_PROGRAMS", 16)  # 5 sequences × 10 blocks → chunks of 3 blocks, 4 per sequence
    monkeypatch.setattr(K, "FINALIZE_BLOCK_B", 2)
    assert K.launch_config(150, 5)[1:3] == (48, 4)  # chunk length, chunks per sequence
    up = torch.randn(())
    logp, old, ref, adv, mask = _inputs(5, 150, per_token_adv=True, lengths=[150, 0, 70, 64, 129], seed=13)
    for loss_type in ("grpo", "bnpo"):
        kw = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=0.1, loss_type=loss_type)
        _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), f"chunks {loss_type}")
    logp, old, ref, adv, mask = _inputs(5, 40, seed=17)
    for loss_type, level in (("grpo", "token"), ("dapo", "sequence")):
        kw = dict(old_logprobs=old, advantages=adv, mask=mask, loss_type=loss_type, importance_sampling_level=level)
        _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), f"B=200 {loss_type}")


@pytest.mark.parametrize("mask_kind", ["float_weights", "int64"])
def test_mask_dtypes(path, mask_kind):
    """Integer masks act as 0/1, float masks weigh tokens (TRL multiplies by the mask)."""
    logp, old, ref, adv, mask = _inputs(3, 19, seed=59)
    if mask_kind == "int64":
        mask = mask.long()
    else:
        mask = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(61))
    up = torch.randn(())
    for loss_type, level in (("grpo", "token"), ("bnpo", "sequence")):
        kw = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=0.1, loss_type=loss_type,
                  importance_sampling_level=level)
        _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), f"{mask_kind} {loss_type}")


@pytest.mark.parametrize("num_items", [7, 1000.0, torch.tensor(123.0), torch.tensor([0])])
def test_dapo_num_items_in_batch(num_items):
    logp, old, _, adv, mask = _inputs(3, 20, seed=19)
    up = torch.randn(())
    kw = dict(old_logprobs=old, advantages=adv, mask=mask, loss_type="dapo", num_items_in_batch=num_items)
    _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), "num_items")


def test_metrics_are_detached_fp32_scalars():
    logp, old, ref, adv, mask = _inputs(3, 16, seed=23)
    x = logp.clone().requires_grad_()
    loss, metrics = grpo_loss(x, old, adv, mask)
    assert set(metrics) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    loss, metrics = grpo_loss(x, old, adv, mask, ref_logprobs=ref, beta=0.1)
    assert "kl" in metrics and loss.dim() == 0 and loss.dtype == torch.float32 and loss.requires_grad
    for v in metrics.values():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad
    assert metrics["clip_ratio/region_mean"] > 0  # the random ratios do cross the thresholds


def test_garbage_in_padding_is_ignored(path):
    logp, old, ref, adv, mask = _inputs(3, 21, seed=29)
    dirty = [x.masked_fill(~mask, v) for x, v in ((logp, -1e4), (old, 1e4), (ref, 1e4))]
    up = torch.randn(())
    kw = dict(advantages=adv, mask=mask, beta=0.1, loss_type="grpo")
    got = _run(grpo_loss, dirty[0], up, old_logprobs=dirty[1], ref_logprobs=dirty[2], **kw)
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, ref_logprobs=ref, **kw)
    _compare(got, want, "dirty padding")


def test_length_one_completions_use_the_mask():
    """T == 1: TRL (and the reference) read a ``[B, 1]`` tensor as "one value per sequence" and drop the mask from
    the kl and clip-ratio means; here the mask always applies. Expected: the reference on the same data padded to
    T = 2 with a masked-out column, where its shape test takes the token path."""
    logp, old, ref, adv, mask = _inputs(4, 1, lengths=[1, 0, 1, 0], seed=47)
    pad = [torch.cat([x, torch.zeros_like(x)], dim=1) for x in (logp, old, ref, mask)]
    up = torch.randn(())
    kw = dict(advantages=adv, beta=0.2, loss_type="bnpo")
    got = _run(grpo_loss, logp, up, old_logprobs=old, mask=mask, ref_logprobs=ref, **kw)
    want = _run(grpo_loss_ref, pad[0], up, old_logprobs=pad[1], mask=pad[3], ref_logprobs=pad[2], **kw)
    _compare((got[0], got[1], torch.cat([got[2], torch.zeros_like(got[2])], 1)), want, "T=1")


@settings(max_examples=10, deadline=None)
@given(
    B=st.integers(1, 5), T=st.integers(2, 40), seed=st.integers(0, 2**16), per_token=st.booleans(),
    loss_type=st.sampled_from(CLIPPED), level=st.sampled_from(IS_LEVELS), beta=st.sampled_from([0.0, 0.3]),
    option=st.sampled_from(sorted(OPTIONS)), eps=st.floats(0.0, 0.5),
)
def test_property_random_shapes(B, T, seed, per_token, loss_type, level, beta, option, eps):
    logp, old, ref, adv, mask = _inputs(B, T, per_token_adv=per_token, seed=seed)
    up = torch.randn(())
    opts = dict(OPTIONS[option])
    if "delta" in opts:
        opts["delta"] = 1.0 + eps + 0.5
    kw = dict(old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref, beta=beta, loss_type=loss_type,
              importance_sampling_level=level, epsilon_low=eps, **opts)
    _compare(_run(grpo_loss, logp, up, **kw), _run(grpo_loss_ref, logp, up, **kw), "property")


def _bad_cases():
    logp, old, ref, adv, mask = _inputs(2, 5, seed=31)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    flat = logp[0].repeat(1)
    base = dict(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask)
    return [
        ("logprobs", dict(base, logprobs=logp.long())),
        ("logprobs", dict(base, logprobs=logp[None])),
        ("logprobs", dict(base, logprobs=flat)),
        ("old_logprobs", dict(base, old_logprobs=old[:, :4])),
        ("mask", dict(base, mask=mask[:1])),
        ("mask", dict(base, mask=mask.to(torch.complex64))),
        ("advantages", dict(base, advantages=adv[:1])),
        ("advantages", dict(base, advantages=adv.long())),
        ("ref_logprobs", dict(base, beta=0.1)),
        ("ref_logprobs", dict(base, beta=0.1, ref_logprobs=ref[:, :2])),
        ("epsilon_low", dict(base, epsilon_low=-0.1)),
        ("epsilon_high", dict(base, epsilon_high=-0.1)),
        ("delta", dict(base, delta=1.1)),
        ("dual_clip_c", dict(base, dual_clip_c=1.0)),
        ("loss_type", dict(base, loss_type="ppo")),
        ("importance_sampling_level", dict(base, importance_sampling_level="group")),
        ("max_completion_length", dict(base, loss_type="dr_grpo", max_completion_length=0)),
        ("max_completion_length", dict(logprobs=logp[0], old_logprobs=old[0], advantages=adv, mask=mask[0],
                                       cu_seqlens=cu, loss_type="dr_grpo")),
        ("cu_seqlens", dict(logprobs=logp[0], old_logprobs=old[0], advantages=adv, mask=mask[0],
                            cu_seqlens=cu.long())),
        ("cu_seqlens", dict(logprobs=logp[0], old_logprobs=old[0], advantages=adv, mask=mask[0],
                            cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))),
        ("logprobs", dict(base, cu_seqlens=cu)),
        ("advantages", dict(logprobs=logp[0], old_logprobs=old[0], advantages=adv[:1], mask=mask[0], cu_seqlens=cu)),
        ("per_token_advantages", dict(logprobs=logp[0], old_logprobs=old[0], advantages=adv, mask=mask[0],
                                      cu_seqlens=cu, per_token_advantages=True)),
        ("per_token_advantages", dict(base, per_token_advantages=True)),
        ("num_items_in_batch", dict(base, num_items_in_batch=torch.ones(2))),
        ("num_items_in_batch", dict(base, num_items_in_batch=-1)),
        ("beta", dict(base, beta=float("nan"), ref_logprobs=ref)),
        ("rollout_is", dict(base, sampling_logprobs=old, rollout_is="token")),
        ("sampling_logprobs", dict(base, rollout_is="sequence_mask")),
        ("sampling_logprobs", dict(base, sampling_logprobs=old[:, :3])),
        ("sampling_logprobs", dict(base, sampling_logprobs=old.long())),
        ("rollout_is_min", dict(base, sampling_logprobs=old, rollout_is="token_mask", rollout_is_min=-0.1)),
        ("rollout_is_cap", dict(base, sampling_logprobs=old, rollout_is="token_mask", rollout_is_cap=0.5,
                                rollout_is_min=0.5)),
        ("rollout_is_cap", dict(base, sampling_logprobs=old, rollout_is="token_mask", rollout_is_cap=float("inf"))),
    ]


@pytest.mark.parametrize("name, kwargs", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_names_the_argument(name, kwargs):
    with pytest.raises(ValueError, match=name):
        grpo_loss(**kwargs)


# ---- rollout importance sampling (sampling_logprobs, rollout_is): against the reference's TRL-literal math ----------

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _sampling(old, seed, spread=0.5):
    """Sampler log-probs near ``old``: per-token ratios ``exp(old − sampling)`` on both sides of [0.5, 2], and
    sequence products (sums of up to T log-ratios) often far outside it."""
    g = torch.Generator().manual_seed(seed)
    return (old.float() + torch.randn(old.shape, generator=g) * spread).to(old.dtype)


def _packed_case(lengths, seed, per_token_adv=False):
    """The same random case padded ``[B, T]`` and packed ``[N]`` (+ ``cu_seqlens``), with a hole in one mask."""
    B, T = len(lengths), max(max(lengths), 2)
    logp, old, ref, adv, mask = _inputs(B, T, per_token_adv=per_token_adv, lengths=lengths, seed=seed)
    samp = _sampling(old, seed + 1)
    long_seq = max(range(B), key=lambda b: lengths[b])
    mask[long_seq, lengths[long_seq] // 2] = False  # a hole inside a sequence
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return (logp, old, ref, adv, mask, samp), cu


@pytest.mark.parametrize("mode", ("none", *IS_MODES))
@pytest.mark.parametrize("packed", [False, True])
def test_rollout_is_matches_reference(path, mode, packed):
    """Every mode on both paths (Triton kernel / torch), padded and packed, both GSPO levels: loss, gradient and
    metrics of the fp32 reference. min 0.5 and cap 2 are crossed on both sides, so truncation and masking act."""
    lengths = [9, 0, 17, 1, 13]
    (logp, old, ref, adv, mask, samp), cu = _packed_case(lengths, seed=71)
    up = torch.randn(())
    for level, loss_type in (("token", "grpo"), ("sequence", "dapo")):
        kw = dict(beta=0.05, loss_type=loss_type, importance_sampling_level=level, rollout_is=mode,
                  rollout_is_cap=2.0, rollout_is_min=0.5, epsilon_high=0.28)
        want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                    sampling_logprobs=samp, **kw)
        if packed:
            l2, m2, g2 = _run(grpo_loss, unpad_padded(logp, cu), up, old_logprobs=unpad_padded(old, cu), advantages=adv,
                              mask=unpad_padded(mask, cu), ref_logprobs=unpad_padded(ref, cu),
                              sampling_logprobs=unpad_padded(samp, cu), cu_seqlens=cu, **kw)
            got = (l2, m2, pad_packed(g2, cu))
        else:
            got = _run(grpo_loss, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                       sampling_logprobs=samp, **kw)
        _compare(got, want, f"{path} {mode} {level}")
        if mode != "none":
            assert 0 < want[1]["sampling/is_clipped_fraction"] < 1, "the case must truncate/mask some tokens"
            assert_is_decisive(old, samp, mask, mode, cap=2.0, low=0.5)  # the fraction compared is not a tie


def test_rollout_is_none_leaves_the_loss_unchanged():
    """``rollout_is="none"`` with ``sampling_logprobs``: the loss and gradient of the call without them (exactly),
    plus the two logp-difference metrics only."""
    logp, old, ref, adv, mask = _inputs(3, 23, seed=73)
    up = torch.randn(())
    kw = dict(old_logprobs=old, advantages=adv, mask=mask, loss_type="bnpo")
    base = _run(grpo_loss, logp, up, **kw)
    with_s = _run(grpo_loss, logp, up, sampling_logprobs=_sampling(old, 74), **kw)
    assert torch.equal(base[0], with_s[0]) and torch.equal(base[2], with_s[2])
    assert set(with_s[1]) - set(base[1]) == {"sampling/sampling_logp_difference/mean",
                                             "sampling/sampling_logp_difference/max"}


@pytest.mark.parametrize("kl_weight", ["ratio", "none"])
def test_rollout_is_weights_the_policy_term_only(kl_weight):
    """Closed form: on-policy (old = logp, ratio 1, no clipping), dapo, the gradient of token ``t`` is
    ``−A_b · ω_t / Σ m`` from the policy term, ω the truncated token ratio, plus the KL term's, not re-weighted:
    ``β (logp − ref) / Σ m`` with the default ``kl_weight="ratio"`` (on-policy the score-function gradient, TRL's
    ``use_bias_correction_kl=True``), ``β (1 − exp(ref − logp)) / Σ m`` (plain k3's derivative) with ``"none"``."""
    logp, _, ref, adv, mask = _inputs(2, 11, seed=75)
    samp = _sampling(logp, 76, spread=1.0)
    x = logp.clone().requires_grad_()
    beta, cap = 0.2, 1.5
    loss, _ = grpo_loss(x, logp, adv, mask, ref_logprobs=ref, beta=beta, loss_type="dapo", sampling_logprobs=samp,
                        rollout_is="token_truncate", rollout_is_cap=cap, kl_weight=kl_weight)
    loss.backward()
    m = mask.float()
    omega = torch.exp(logp - samp).clamp(max=cap)
    dkl = logp - ref if kl_weight == "ratio" else 1 - torch.exp(ref - logp)
    want = m * (-adv[:, None] * omega + beta * dkl) / m.sum()
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-7)
    assert (omega[mask] == cap).any() and (omega[mask] < 1).any()


@pytest.mark.parametrize("mode", IS_MODES)
def test_rollout_is_bf16_flash_rule(mode):
    """bf16 log-probs (the IS weight is computed and applied in fp32): within twice the bf16 reference's error."""
    logp, old, ref, adv, mask = _inputs(4, 31, seed=77)
    samp = _sampling(old, 78)
    low = [x.to(torch.bfloat16) for x in (logp, old, ref, adv, samp)]
    up = torch.randn(())
    kw = dict(old_logprobs=low[1], advantages=low[3], mask=mask, ref_logprobs=low[2], beta=0.04, loss_type="grpo",
              sampling_logprobs=low[4], rollout_is=mode, rollout_is_cap=2.0, rollout_is_min=0.5)
    l1, m1, g1 = _run(grpo_loss, low[0], up, **kw)
    l32, m32, g32 = _run(grpo_loss_ref, low[0], up, **kw)
    llo, _, glo = _run(grpo_loss_ref, low[0], up, upcast=False, **kw)
    _assert_close(l1, l32, llo, what=f"{mode} loss")
    _assert_close(g1, g32, glo, atol_rel=BF16_ULP, what=f"{mode} grad")
    for k in m32:  # the metrics read the same bf16 values in fp32 on both sides
        _assert_close(m1[k], m32[k], what=k)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5), seed=st.integers(0, 2**16),
    mode=st.sampled_from(IS_MODES), level=st.sampled_from(IS_LEVELS), loss_type=st.sampled_from(CLIPPED),
    cap=st.floats(1.05, 4.0), low=st.floats(0.0, 0.95), packed=st.booleans(), torch_path=st.booleans(),
    per_token=st.booleans(),
)
def test_property_rollout_is(lengths, seed, mode, level, loss_type, cap, low, packed, torch_path, per_token):
    (logp, old, ref, adv, mask, samp), cu = _packed_case(lengths, seed, per_token_adv=per_token)
    up = torch.randn(())
    kw = dict(beta=0.1, loss_type=loss_type, importance_sampling_level=level, max_completion_length=30,
              rollout_is=mode, rollout_is_cap=cap, rollout_is_min=low)
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                sampling_logprobs=samp, **kw)
    with pytest.MonkeyPatch.context() as mp:
        if torch_path:
            mp.setattr(G, "use_triton", lambda t: False)
            mp.setattr(TP, "TORCH_CHUNK", 8)
        if packed:
            l2, m2, g2 = _run(grpo_loss, unpad_padded(logp, cu), up, old_logprobs=unpad_padded(old, cu),
                              advantages=unpad_padded(adv, cu) if per_token else adv, mask=unpad_padded(mask, cu),
                              ref_logprobs=unpad_padded(ref, cu), sampling_logprobs=unpad_padded(samp, cu),
                              cu_seqlens=cu, per_token_advantages=per_token, **kw)
            got = (l2, m2, pad_packed(g2, cu))
        else:
            got = _run(grpo_loss, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                       sampling_logprobs=samp, **kw)
    _compare(got, want, "property")


# ---- fused_linear_grpo_loss: against linear_logprobs_ref (fp32 logits) → grpo_loss_ref ----------------------------

def _fused_inputs(B, T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, bias, targets


def _fused_value_and_grads(fn, leaves, up):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    loss, metrics = fn(*leaves)
    (loss * up).backward()
    return [loss.detach().float(), *(x.grad.float() for x in leaves)], {k: v.float() for k, v in metrics.items()}


def _check_fused_linear(packed, dtype, B, T, H, V, lengths, device="cpu"):
    hidden, weight, bias, targets = (x.to(device) for x in _fused_inputs(B, T, H, V, dtype, seed=37))
    with torch.no_grad():
        logp0 = linear_logprobs_ref(hidden, weight, targets, bias=bias, temperature=0.7)  # [B, T]
    g = torch.Generator().manual_seed(41)
    old = logp0 + (torch.randn(B, T, generator=g) * 0.3).to(device)  # [B, T]
    ref = logp0 + (torch.randn(B, T, generator=g) * 0.3).to(device)  # [B, T]
    adv = torch.randn(B, generator=g).to(device)
    mask = _lengths_to_mask(lengths, T).to(device)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    targets_masked = targets.masked_fill(~mask, -100)  # masked-out targets are never read
    kw = dict(beta=0.05, loss_type="grpo", importance_sampling_level="token", delta=1.5)
    up = torch.randn(()).to(device)

    def ref_fn(h, w, b, upcast=True):
        lp = linear_logprobs_ref(h, w, targets, bias=b, temperature=0.7, return_entropy=True, upcast=upcast)
        loss, metrics = grpo_loss_ref(lp[0], old, adv, mask, ref_logprobs=ref, upcast=upcast, **kw)
        metrics["entropy"] = (lp[1].float() * mask).sum() / mask.sum()
        return loss, metrics

    def fused_fn(h, w, b):
        if packed:
            return fused_linear_grpo_loss(unpad_padded(h, cu), w, unpad_padded(targets, cu), unpad_padded(old, cu),
                                          adv, unpad_padded(mask, cu), bias=b, temperature=0.7, return_entropy=True,
                                          ref_logprobs=unpad_padded(ref, cu), cu_seqlens=cu, **kw)
        return fused_linear_grpo_loss(h, w, targets_masked, old, adv, mask, bias=b, temperature=0.7,
                                      return_entropy=True, ref_logprobs=ref, **kw)

    got, m_got = _fused_value_and_grads(fused_fn, (hidden, weight, bias), up)
    want, m_want = _fused_value_and_grads(ref_fn, (hidden, weight, bias), up)
    low, _ = _fused_value_and_grads(lambda h, w, b: ref_fn(h, w, b, upcast=False), (hidden, weight, bias), up)
    reflow = low if dtype != torch.float32 else [None] * 4
    atol_rel = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, r, lo in zip(("loss", "hidden", "weight", "bias"), got, want, reflow):
        _assert_close(a, r, lo, atol_rel=atol_rel, what=name)
    assert set(m_got) == set(m_want)
    for k in ("kl", "entropy"):
        _assert_close(m_got[k], m_want[k], atol_rel=1e-4 if dtype == torch.float32 else 2e-2, what=k)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_grpo_loss(packed, dtype):
    _check_fused_linear(packed, dtype, 3, 11, 24, 67, [11, 0, 6])


def test_fused_linear_grpo_loss_all_masked():
    """No kept row: no vocabulary work, loss 0, and backward still gives (zero) gradients to every parameter."""
    hidden, weight, bias, targets = (x.requires_grad_() if x.is_floating_point() else x
                                     for x in _fused_inputs(2, 5, 8, 13, torch.float32))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    loss, metrics = fused_linear_grpo_loss(hidden, weight, targets.fill_(-100), torch.zeros(2, 5), torch.ones(2), mask,
                                           bias=bias, return_entropy=True)
    loss.backward()
    assert loss.item() == 0.0 and metrics["entropy"].item() == 0.0
    assert all(x.grad is not None and not x.grad.any() for x in (hidden, weight, bias))


@pytest.mark.parametrize("packed", [False, True])
def test_fused_linear_grpo_loss_on_policy_returns_logprobs(packed):
    """``old_logprobs=None`` (on-policy: ratio 1) with ``return_logprobs``: loss and gradients of the fp32 reference
    with old = its own detached log-probs, and the log-probs themselves (0 where the mask is 0)."""
    B, T, H, V, lengths = 3, 7, 16, 29, [7, 0, 4]
    hidden, weight, bias, targets = _fused_inputs(B, T, H, V, torch.float32, seed=5)
    adv = torch.tensor([0.7, -1.2, 1.5])
    mask = _lengths_to_mask(lengths, T)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    kw = dict(loss_type="dr_grpo", max_completion_length=T, epsilon_high=0.28)
    up = torch.randn((), generator=torch.Generator().manual_seed(3))
    got_logp = []

    def fused_fn(h, w, b):
        if packed:
            out = fused_linear_grpo_loss(unpad_padded(h, cu), w, unpad_padded(targets, cu), None, adv,
                                         unpad_padded(mask, cu), bias=b, cu_seqlens=cu, return_logprobs=True, **kw)
        else:
            out = fused_linear_grpo_loss(h, w, targets, None, adv, mask, bias=b, return_logprobs=True, **kw)
        got_logp.append(out[2])
        return out[:2]

    def ref_fn(h, w, b):
        lp = linear_logprobs_ref(h, w, targets, bias=b)
        return grpo_loss_ref(lp, lp.detach(), adv, mask, **kw)

    got, _ = _fused_value_and_grads(fused_fn, (hidden, weight, bias), up)
    want, _ = _fused_value_and_grads(ref_fn, (hidden, weight, bias), up)
    for name, a, r in zip(("loss", "hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    logp = got_logp[0]
    assert logp.dtype == torch.float32 and not logp.requires_grad
    with torch.no_grad():
        want_logp = torch.where(mask, linear_logprobs_ref(hidden, weight, targets, bias=bias), 0.0)  # [B, T]
    torch.testing.assert_close(logp, unpad_padded(want_logp, cu) if packed else want_logp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_fused_linear_grpo_loss_rollout_is_on_policy(packed, mode):
    """On-policy (``old_logprobs=None``) with ``sampling_logprobs``: π_old is the detached ``logp`` of the same pass;
    loss, gradients and the sampling/ metrics of the fp32 reference given old = its own detached log-probs."""
    B, T, H, V, lengths = 4, 9, 16, 37, [9, 0, 5, 8]
    hidden, weight, bias, targets = _fused_inputs(B, T, H, V, torch.float32, seed=81)
    adv = torch.tensor([0.7, -1.2, 1.5, -0.4])
    mask = _lengths_to_mask(lengths, T)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    with torch.no_grad():
        samp = _sampling(linear_logprobs_ref(hidden, weight, targets, bias=bias), 82, spread=0.3)  # [B, T]
    kw = dict(loss_type="grpo", rollout_is=mode, rollout_is_cap=1.5, rollout_is_min=0.7)
    up = torch.randn((), generator=torch.Generator().manual_seed(83))
    metrics = []

    def fused_fn(h, w, b):
        if packed:
            out = fused_linear_grpo_loss(unpad_padded(h, cu), w, unpad_padded(targets, cu), None, adv,
                                         unpad_padded(mask, cu), bias=b, cu_seqlens=cu,
                                         sampling_logprobs=unpad_padded(samp, cu), **kw)
        else:
            out = fused_linear_grpo_loss(h, w, targets, None, adv, mask, bias=b, sampling_logprobs=samp, **kw)
        metrics.append(out[1])
        return out

    def ref_fn(h, w, b):
        lp = linear_logprobs_ref(h, w, targets, bias=b)
        out = grpo_loss_ref(lp, lp.detach(), adv, mask, sampling_logprobs=samp, **kw)
        metrics.append(out[1])
        return out

    got, _ = _fused_value_and_grads(fused_fn, (hidden, weight, bias), up)
    want, _ = _fused_value_and_grads(ref_fn, (hidden, weight, bias), up)
    for name, a, r in zip(("loss", "hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    m_got, m_want = metrics
    assert set(m_got) == set(m_want)
    for k in m_want:
        torch.testing.assert_close(m_got[k], m_want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert 0 < m_want["sampling/is_clipped_fraction"] < 1
    with torch.no_grad():  # on-policy: old = the policy's own log-probs
        assert_is_decisive(linear_logprobs_ref(hidden, weight, targets, bias=bias), samp, mask, mode, cap=1.5, low=0.7)


# ---- GPU tier (bench/gpu_check.sh): compiled kernels at realistic sizes ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", IS_LEVELS)
def test_gpu_matches_reference(dtype, level):
    logp, old, ref, adv, mask = (x.cuda() for x in _inputs(64, 3000, per_token_adv=True, seed=43))
    low = [x.to(dtype) for x in (logp, old, ref, adv)]
    up = torch.randn((), device="cuda")
    for loss_type in CLIPPED:
        kw = dict(old_logprobs=low[1], advantages=low[3], mask=mask, ref_logprobs=low[2], beta=0.04,
                  loss_type=loss_type, importance_sampling_level=level, dual_clip_c=3.0)
        l1, m1, g1 = _run(grpo_loss, low[0], up, **kw)
        l32, m32, g32 = _run(grpo_loss_ref, low[0], up, **kw)
        llo, _, glo = _run(grpo_loss_ref, low[0], up, upcast=False, **kw)
        reflow = (llo, glo) if dtype != torch.float32 else (None, None)
        _assert_close(l1, l32, reflow[0], atol_rel=1e-4, what=f"{loss_type} loss")
        _assert_close(g1, g32, reflow[1], atol_rel=1e-4, what=f"{loss_type} grad")
        for k in m32:
            _assert_close(m1[k], m32[k], atol_rel=1e-4, what=k)



@pytest.mark.gpu
@pytest.mark.parametrize("mode", IS_MODES)
def test_gpu_rollout_is(mode):
    """The compiled kernels with the rollout IS weight, packed, at a realistic length (fp32)."""
    lengths = [3000, 0, 1700, 2900, 45]
    (logp, old, ref, adv, mask, samp), cu = _packed_case(lengths, seed=85)
    up = torch.randn(())
    kw = dict(beta=0.04, loss_type="dapo", rollout_is=mode, rollout_is_cap=2.0, rollout_is_min=0.5)
    want = _run(grpo_loss_ref, logp, up, old_logprobs=old, advantages=adv, mask=mask, ref_logprobs=ref,
                sampling_logprobs=samp, **kw)
    packed = [unpad_padded(x, cu).cuda() for x in (logp, old, ref, mask, samp)]
    l2, m2, g2 = _run(grpo_loss, packed[0], up.cuda(), old_logprobs=packed[1], advantages=adv.cuda(),
                      mask=packed[3], ref_logprobs=packed[2], sampling_logprobs=packed[4], cu_seqlens=cu.cuda(), **kw)
    _compare((l2.cpu(), {k: v.cpu() for k, v in m2.items()}, pad_packed(g2.cpu(), cu)), want, f"gpu {mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_fused_linear_grpo_loss(packed):
    _check_fused_linear(packed, torch.bfloat16, 4, 512, 256, 32000, [512, 0, 300, 17], device="cuda")
