"""dpo_loss / fused_linear_dpo_loss against the fp32 torch reference (``dpo_loss_ref``, ``linear_logprobs_ref``).

Tolerance (flash-attn's rule, max over elements): ``|out − ref_fp32| ≤ 2·|ref_lowp − ref_fp32| + atol`` with
``ref_lowp`` the reference computed in the inputs' dtype; fp32 inputs leave ``atol = 1e-5·max(1, |ref|)`` (the same
fp32 ops, summed in another order). Every check uses a random upstream gradient on the loss.
"""

import itertools
import math

import pytest
import torch
from fastgrpo.kernels._utils import unpad_padded
from fastgrpo.kernels.dpo_loss import dpo_loss, fused_linear_dpo_loss
from fastgrpo.kernels.reference import dpo_loss_ref, linear_logprobs_ref

CASES = [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0)]


def _assert_close(got, ref32, reflow=None, *, atol_rel=1e-5, what=""):
    atol = atol_rel * max(1.0, ref32.abs().max().item())
    bound = atol if reflow is None else 2 * (reflow - ref32).abs().max().item() + atol
    err = (got.float() - ref32.float()).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g}"


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
    kw = dict(beta=0.3, loss_type=loss_type, label_smoothing=label_smoothing)
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
    ]


@pytest.mark.parametrize("name, kwargs", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_names_the_argument(name, kwargs):
    with pytest.raises(ValueError, match=name):
        dpo_loss(**kwargs)


# ---- fused_linear_dpo_loss: linear_logprobs_ref (fp32 logits) → masked sums → dpo_loss_ref ------------------------

@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_dpo_loss(packed, dtype):
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
    kw = dict(beta=0.2, loss_type="sigmoid", label_smoothing=0.05)

    def ref_fn(h, w, b, upcast=True):
        logp = linear_logprobs_ref(h, w, targets, bias=b, temperature=0.9, upcast=upcast)  # [2B, T]
        seq = (logp * mask).sum(-1)  # [2B]
        return dpo_loss_ref(seq[:2], seq[2:], ref_c, ref_r, upcast=upcast, **kw)

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
    atol_rel = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, r, lo in zip(("loss", "hidden", "weight", "bias"), got, want, low):
        _assert_close(a, r, lo, atol_rel=atol_rel, what=name)
    assert set(m_got) == set(m_want) | {"logps/chosen", "logps/rejected"}
    for k in m_want:
        _assert_close(m_got[k], m_want[k], atol_rel=1e-4 if dtype == torch.float32 else 2e-2, what=k)


def test_fused_linear_dpo_loss_bad_input():
    hidden, weight = torch.randn(3, 4, 8), torch.randn(11, 8)
    targets, mask = torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4)
    with pytest.raises(ValueError, match="hidden"):  # an odd number of sequences cannot be pairs
        fused_linear_dpo_loss(hidden, weight, targets, mask, torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        fused_linear_dpo_loss(hidden[:2], weight, targets[:2], mask[:2], torch.zeros(2), torch.zeros(1))
    with pytest.raises(ValueError, match="mask"):
        fused_linear_dpo_loss(hidden[:2], weight, targets[:2], mask[:2, :3], torch.zeros(1), torch.zeros(1))
