"""dpo_loss / fused_linear_dpo_loss against the fp32 torch reference (``dpo_loss_ref``, ``linear_logprobs_ref``).

Tolerance (flash-attn's rule, max over elements): ``|out − ref_fp32| ≤ 2·|ref_lowp − ref_fp32| + atol`` with
``ref_lowp`` the reference computed in the inputs' dtype; fp32 inputs leave ``atol = 1e-5·max(1, |ref|)`` (the same
fp32 ops, summed in another order). Every check uses a random upstream gradient on the loss.
"""

import itertools
import math

import pytest
import torch
from checks import assert_flash
from fastgrpo.kernels.dpo_loss import dpo_loss, fused_linear_dpo_loss
from fastgrpo.kernels.reference import dpo_loss_ref, linear_logprobs_ref
from fastgrpo.kernels.utils import unpad_padded

CASES = [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("ipo+lengths", 0.0), ("hinge", 0.0)]


def _assert_close(got, ref32, reflow=None, *, atol_rel=1e-5, atol_floor=1e-5, what=""):
    """flash-attn's rule with ``atol = max(atol_rel·|ref|, atol_floor)``; no low-precision reference for fp32."""
    atol = max(atol_rel * ref32.abs().max().item(), atol_floor)
    assert_flash(what, got, ref32, ref32 if reflow is None else reflow, atol)


def _logps(B, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(-torch.rand(B, generator=g) * 40).to(dtype) for _ in range(4)]  # sequence log-probs, [B] each


def _loss_and_grads(fn, pc, pr, rc, rr, up, **kw):
    pc, pr = (x.detach().clone().requires_grad_() for x in (pc, pr))
    loss, metrics = fn(pc, pr, rc, rr, **kw)
    (loss * up).backward()
    return [loss.detach().float(), pc.grad.float(), pr.grad.float()], metrics


@pytest.mark.parametrize("loss_type, label_smoothing", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(loss_type, label_smoothing, dtype):
    logps = _logps(13, dtype, seed=len(loss_type))
    up = torch.randn(())
    kw = dict(beta=0.3, loss_type=loss_type.removesuffix("+lengths"), label_smoothing=label_smoothing)
    if loss_type.endswith("+lengths"):  # token counts, one of them 0 (clamped to 1)
        g = torch.Generator().manual_seed(4)
        kw.update(chosen_lengths=torch.randint(0, 60, (13,), generator=g),
                  rejected_lengths=torch.randint(1, 60, (13,), generator=g))
    got, m_got = _loss_and_grads(dpo_loss, *logps, up, **kw)
    want, m_want = _loss_and_grads(dpo_loss_ref, *logps, up, **kw)
    low = _loss_and_grads(dpo_loss_ref, *logps, up, upcast=False, **kw)[0] if dtype != torch.float32 else [None] * 3
    for name, a, r, lo in zip(("loss", "d chosen", "d rejected"), got, want, low):
        _assert_close(a, r, lo, what=name)
    assert set(m_got) == set(m_want)
    for k in m_want:
        _assert_close(m_got[k], m_want[k], what=k)
        assert m_got[k].dim() == 0 and m_got[k].dtype == torch.float32 and not m_got[k].requires_grad


def test_closed_form():
    """One pair, β = 1: h = (0 − (−1)) − (0 − 0) = 1, so sigmoid = log(1 + e⁻¹), ipo = (1 − ½)², hinge = 0."""
    pc, pr, rc, rr = torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([0.0]), torch.tensor([0.0])
    expected = {"sigmoid": math.log1p(math.exp(-1.0)), "ipo": 0.25, "hinge": 0.0}
    for loss_type, value in expected.items():
        loss, metrics = dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type=loss_type)
        assert loss.item() == pytest.approx(value, rel=1e-6)
        want = {"rewards/chosen": 0.0, "rewards/rejected": -1.0, "rewards/accuracies": 1.0, "rewards/margins": 1.0}
        assert {k: v.item() for k, v in metrics.items()} == want


def test_ipo_with_lengths_is_trls_per_token_form():
    """TRL 1.16: ipo squares c/n_c − r/n_r − 1/(2β) with n clamped to ≥ 1. Pair 0: c = 2 over 2 tokens, r = 0 over
    0 tokens: (1 − ½)² = ¼; pair 1: c = 3 over 3, r = −1 over 4: (1 + ¼ − ½)² = 9/16; mean 13/32. The rewards
    metrics keep the summed log-ratios."""
    pc, rc = torch.tensor([-2.0, -3.0]), torch.tensor([-4.0, -6.0])
    pr, rr = torch.tensor([-3.0, -5.0]), torch.tensor([-3.0, -4.0])
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="ipo", chosen_lengths=torch.tensor([2, 3]),
                             rejected_lengths=torch.tensor([0, 4]))
    assert loss.item() == pytest.approx(13 / 32, rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(2.5) and metrics["rewards/rejected"].item() == -0.5
    unnormalised = dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="ipo")[0]  # (2 − ½)², (4 − ½)²: mean 29/4
    assert unnormalised.item() == pytest.approx(29 / 4, rel=1e-6)


def test_sigmoid_label_smoothing_is_cdpo():
    """``label_smoothing = 0`` is TRL 1.16's sigmoid, −log σ(βh); ``ls > 0`` the conservative-DPO mixture
    −(1 − ls) log σ(βh) − ls log σ(−βh) (TRL's sigmoid ignores ls). One pair with βh = 1."""
    pc, pr, rc, rr = torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([0.0]), torch.tensor([0.0])
    trl = dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="sigmoid")[0]
    assert trl.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))), rel=1e-6)
    cdpo = dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="sigmoid", label_smoothing=0.1)[0]
    assert cdpo.item() == pytest.approx(0.9 * math.log1p(math.exp(-1.0)) + 0.1 * math.log1p(math.exp(1.0)), rel=1e-6)


def test_reference_logps_get_no_gradient():
    pc, pr, rc, rr = (x.requires_grad_() for x in _logps(5, torch.float32, seed=3))
    dpo_loss(pc, pr, rc, rr)[0].backward()
    assert rc.grad is None and rr.grad is None and pc.grad is not None and pr.grad is not None


def _bad_cases():
    pc, pr, rc, rr = _logps(4, torch.float32)
    base = dict(policy_chosen_logps=pc, policy_rejected_logps=pr, ref_chosen_logps=rc, ref_rejected_logps=rr)
    return [
        ("policy_chosen_logps", dict(base, policy_chosen_logps=pc[None])),
        ("policy_chosen_logps", dict(base, policy_chosen_logps=pc.long())),
        ("policy_chosen_logps", dict(base, policy_chosen_logps=pc[:0])),
        ("policy_rejected_logps", dict(base, policy_rejected_logps=pr[:3])),
        ("ref_chosen_logps", dict(base, ref_chosen_logps=[0.0] * 4)),
        ("ref_rejected_logps", dict(base, ref_rejected_logps=rr.half()[:2])),
        ("beta", dict(base, beta=0.0)),
        ("beta", dict(base, beta=float("inf"))),
        ("loss_type", dict(base, loss_type="kto")),
        ("label_smoothing", dict(base, label_smoothing=0.7)),
        ("chosen_lengths", dict(base, chosen_lengths=torch.ones(4))),
        ("chosen_lengths", dict(base, chosen_lengths=torch.ones(3), rejected_lengths=torch.ones(4))),
        ("rejected_lengths", dict(base, chosen_lengths=torch.ones(4), rejected_lengths=torch.ones(4).bool())),
    ]


@pytest.mark.parametrize("name, kwargs", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_names_the_argument(name, kwargs):
    with pytest.raises(ValueError, match=name):
        dpo_loss(**kwargs)


# ---- fused_linear_dpo_loss: linear_logprobs_ref (fp32 logits) → masked sums → dpo_loss_ref ------------------------

@pytest.mark.parametrize("loss_type, label_smoothing", [("sigmoid", 0.05), ("ipo", 0.0)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_dpo_loss(packed, dtype, loss_type, label_smoothing):
    """ipo: the completion lengths come from the mask (TRL's ``completion_mask.sum(1)``)."""
    B2, T, H, V = 4, 9, 20, 53  # 2 pairs: sequences 0, 1 chosen; 2, 3 rejected
    g = torch.Generator().manual_seed(53)
    hidden = torch.randn(B2, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    targets = torch.randint(0, V, (B2, T), generator=g)
    lengths = [9, 4, 0, 7]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # [2B, T]
    mask[0, :2] = False  # prompt positions inside the first sequence
    ref_c, ref_r = -torch.rand(2, generator=g) * 20, -torch.rand(2, generator=g) * 20
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    up = torch.randn(())
    kw = dict(beta=0.2, loss_type=loss_type, label_smoothing=label_smoothing)

    def ref_fn(h, w, b, upcast=True):
        logp = linear_logprobs_ref(h, w, targets, bias=b, temperature=0.9, upcast=upcast)  # [2B, T]
        seq = (logp * mask).sum(-1)  # [2B]
        n = mask.sum(-1)  # [2B]
        return dpo_loss_ref(seq[:2], seq[2:], ref_c, ref_r, upcast=upcast, chosen_lengths=n[:2],
                            rejected_lengths=n[2:], **kw)

    def fused_fn(h, w, b):
        if packed:
            return fused_linear_dpo_loss(unpad_padded(h, cu), w, unpad_padded(targets, cu), unpad_padded(mask, cu),
                                         ref_c, ref_r, bias=b, temperature=0.9, cu_seqlens=cu, **kw)
        return fused_linear_dpo_loss(h, w, targets.masked_fill(~mask, -100), mask, ref_c, ref_r, bias=b,
                                     temperature=0.9, **kw)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (hidden, weight, bias)]
        loss, metrics = fn(*leaves)
        (loss * up).backward()
        return [loss.detach().float(), *(x.grad.float() for x in leaves)], metrics

    got, m_got = run(fused_fn)
    want, m_want = run(ref_fn)
    low = run(lambda h, w, b: ref_fn(h, w, b, upcast=False))[0] if dtype != torch.float32 else [None] * 4
    # bf16: the grads are rounded to bf16 at the end (one ulp, 2⁻⁸, of the largest value); the metrics are fp32 sums
    atol_rel, atol_floor = (1e-5, 1e-5) if dtype == torch.float32 else (2**-8, 1e-6)
    for name, a, r, lo in zip(("loss", "hidden", "weight", "bias"), got, want, low):
        _assert_close(a, r, lo, atol_rel=atol_rel, atol_floor=atol_floor, what=name)
    assert set(m_got) == set(m_want) | {"logps/chosen", "logps/rejected"}
    for k in m_want:
        _assert_close(m_got[k], m_want[k], atol_rel=1e-5, what=k)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("average, sft_weight", [(True, 0.0), (False, 0.5), (True, 0.7)])
def test_fused_linear_dpo_loss_average_nll_and_logps(loss_type, average, sft_weight):
    """``average_logprobs`` divides policy and reference sums by the mask's lengths (≥ 1; a sequence with no
    completion token keeps its sum, 0); ``sft_weight`` adds w·mean(−π_c); ``return_logps`` gives the summed
    sequence log-probs. Reference: fp32 ``linear_logprobs_ref`` → masked sums → the same arithmetic by hand →
    ``dpo_loss_ref``; packed input, random upstream gradient."""
    lengths = [6, 3, 5, 4, 0, 7]  # 3 pairs: sequences 0-2 chosen, 3-5 rejected
    N, H, V = sum(lengths), 12, 37
    g = torch.Generator().manual_seed(7 + len(loss_type))
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    targets = torch.randint(0, V, (N,), generator=g)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(6), torch.tensor(lengths))
    mask = torch.rand(N, generator=g) < 0.8
    ref_c, ref_r = -torch.rand(3, generator=g) * 9, -torch.rand(3, generator=g) * 9
    up = torch.randn(())
    kw = dict(beta=0.4, loss_type=loss_type)

    def ref_fn(h, w):
        logp = linear_logprobs_ref(h, w, targets) * mask  # [N]
        sums = torch.zeros(6).index_add(0, seq, logp)  # [2B]
        n = torch.zeros(6).index_add(0, seq, mask.float())  # [2B]
        pol, ref = sums, torch.cat([ref_c, ref_r])
        if average:
            pol, ref = pol / n.clamp(min=1), ref / n.clamp(min=1)
        lens = {} if average else dict(chosen_lengths=n[:3], rejected_lengths=n[3:])
        loss, metrics = dpo_loss_ref(pol[:3], pol[3:], ref[:3], ref[3:], **lens, **kw)
        return loss + sft_weight * -pol[:3].mean(), metrics, sums.detach()

    def fused_fn(h, w):
        return fused_linear_dpo_loss(h, w, targets, mask, ref_c, ref_r, cu_seqlens=cu, average_logprobs=average,
                                     sft_weight=sft_weight, return_logps=True, **kw)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, metrics, logps = fn(h, w)
        (loss * up).backward()
        return [loss.detach(), h.grad, w.grad, logps], metrics

    got, m_got = run(fused_fn)
    want, m_want = run(ref_fn)
    for name, a, r in zip(("loss", "hidden", "weight", "logps"), got, want):
        _assert_close(a, r, what=name)
    for k in m_want:
        _assert_close(m_got[k], m_want[k], what=k)
    assert ("nll_loss" in m_got) == (sft_weight > 0)
    with pytest.raises(ValueError, match="sft_weight"):
        fused_linear_dpo_loss(hidden, weight, targets, mask, ref_c, ref_r, cu_seqlens=cu, sft_weight=-1.0)


def test_fused_linear_dpo_loss_bad_input():
    hidden, weight = torch.randn(3, 4, 8), torch.randn(11, 8)
    targets, mask = torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4)
    with pytest.raises(ValueError, match="hidden"):  # an odd number of sequences cannot be pairs
        fused_linear_dpo_loss(hidden, weight, targets, mask, torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        fused_linear_dpo_loss(hidden[:2], weight, targets[:2], mask[:2], torch.zeros(2), torch.zeros(1))
    with pytest.raises(ValueError, match="mask"):
        fused_linear_dpo_loss(hidden[:2], weight, targets[:2], mask[:2, :3], torch.zeros(1), torch.zeros(1))
