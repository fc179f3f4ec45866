"""Mixed precision (fp32 master weights behind bf16 compute weights) and activation checkpointing, one process.

The torchrun cases (DDP 2 processes vs 1, FSDP2 vs DDP, both in bf16 and with checkpointing) are in test_grpo.py.
"""

import pytest
import torch
from torch import nn

from fastgrpo.algorithms.batch import Sample
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.algorithms.update import PolicyUpdate
from fastgrpo.checkpoint import load_checkpoint, save_checkpoint
from fastgrpo.config import load_config
from fastgrpo.distributed import init_distributed, wrap_model
from fastgrpo.models.loading import enable_activation_checkpointing, load_model
from fastgrpo.precision import MasterAdamW, accumulate, make_optimizer, train_mode

TINY = ["model.tiny_hidden_size=32", "model.tiny_intermediate_size=64", "rollout.max_new_tokens=8"]


def samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(5, 40, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(5, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(p, c, [-1.0] * len(c), float(torch.randn((), generator=g))))
    return out


def setup(dtype, lr, *extra):
    """The tiny model (Qwen2, initializer_range 0.02) in ``dtype``, wrapped, its optimizer, a PolicyUpdate."""
    cfg = load_config(overrides=[*TINY, f"model.dtype={dtype}", f"train.lr={lr}", *extra])
    state = init_distributed("cpu")
    model, _ = load_model(cfg.model, state.device)
    wrapped = wrap_model(model, state, "ddp", forward=packed_forward)
    opt = make_optimizer(wrapped, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return cfg, model, opt, PolicyUpdate(cfg, wrapped, opt, sched, None, state.device, 1)


def run(cfg, update, batch):
    return update.run(batch, beta=0.0, epsilon_high=None, max_new_tokens=cfg.rollout.max_new_tokens)


def test_bf16_updates_survive_at_a_small_learning_rate():
    """lr 2e-6 on weights of std 0.02: the step is ~1e-4 of a weight, under bf16's resolution 2^-8. With fp32
    masters > 99% of the master weights change in 10 steps and the bf16 weights are the masters rounded; plain
    AdamW on the bf16 weights (the check's negative control) keeps most of them as they were."""
    cfg, model, opt, update = setup("bfloat16", 2e-6, "train.sequences_per_optimizer_step=2")
    assert isinstance(opt, MasterAdamW)
    before = [m.detach().clone() for m in opt.masters]
    m = run(cfg, update, samples(20))  # 20 sequences, 2 per optimizer step: 10 steps
    assert m["optimizer_steps"] == 10
    changed = sum(int((m0 != m1).sum()) for m0, m1 in zip(before, opt.masters))
    total = sum(m0.numel() for m0 in before)
    assert changed / total > 0.99
    for p, master in zip(opt.model_params, opt.masters):
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(p, master.to(torch.bfloat16))
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")

    cfg, model, plain, update = setup("bfloat16", 2e-6, "train.sequences_per_optimizer_step=2")
    plain = torch.optim.AdamW(model.parameters(), lr=2e-6, weight_decay=0.01)
    update.optimizer = plain
    before = [p.detach().clone() for p in model.parameters()]
    run(cfg, update, samples(20))
    changed = sum(int((p0 != p1).sum()) for p0, p1 in zip(before, model.parameters()))
    assert changed / total < 0.5


def test_master_step_equals_fp32_adamw_on_the_summed_bf16_gradients():
    """Two micro-batches: MasterAdamW's masters equal torch AdamW run on fp32 copies with, as gradient, the fp32 sum
    of the two bf16 micro-batch gradients (bit for bit: the same fp32 operations)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    ref_model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    ref_model.load_state_dict(model.state_dict())
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    masters_ref = [p.detach().float().clone().requires_grad_() for p in ref_model.parameters()]
    ref_opt = torch.optim.AdamW(masters_ref, lr=1e-3, weight_decay=0.1)
    xs = [torch.randn(5, 8, dtype=torch.bfloat16) for _ in range(2)]
    for _ in range(3):
        opt.zero_grad()
        for i, x in enumerate(xs):
            with accumulate(model, opt, last=i == 1):
                model(x).float().square().mean().backward()
        opt.step()
        grads = [torch.zeros_like(m) for m in masters_ref]
        for x in xs:
            ref_model.zero_grad()
            ref_model(x).float().square().mean().backward()
            for g, p in zip(grads, ref_model.parameters()):
                g += p.grad.float()
        for m, g in zip(masters_ref, grads):
            m.grad = g
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), masters_ref):
                p.copy_(m)
        for a, b in zip(opt.masters, masters_ref):
            assert torch.equal(a, b)
        assert all(p.grad is None for p in model.parameters())  # folded into the masters' and freed


def test_float32_has_no_masters():
    cfg, model, opt, _ = setup("float32", 1e-3)
    assert type(opt) is torch.optim.AdamW
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_warmup_optimizer_shares_the_masters():
    _, model, opt, _ = setup("bfloat16", 1e-3)
    warm = make_optimizer(model, lr=1e-2, share_masters_with=opt)
    assert warm.masters is opt.masters and warm.state is not opt.state
    with pytest.raises(ValueError, match="masters"):
        MasterAdamW(list(model.parameters())[1:], masters=opt)


def test_resume_is_exact(tmp_path):
    """2 steps, save, 2 more; a fresh model resumed from the checkpoint takes the same 2 steps bit for bit. The
    safetensors hold bf16 (what HF loads), the trainer state the fp32 masters."""
    cfg, model, opt, update = setup("bfloat16", 1e-3, "train.sequences_per_optimizer_step=2")
    run(cfg, update, samples(4, seed=1))
    save_checkpoint(tmp_path, 2, model=update.model, optimizer=opt, scheduler=update.scheduler,
                    dtype=torch.bfloat16)
    run(cfg, update, samples(4, seed=2))
    cfg, model2, opt2, update2 = setup("bfloat16", 1e-3, "train.sequences_per_optimizer_step=2")
    load_checkpoint(tmp_path / "checkpoints" / "step_00000002", model=update2.model, optimizer=opt2,
                    scheduler=update2.scheduler)
    run(cfg, update2, samples(4, seed=2))
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}
    payload = torch.load(tmp_path / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=True)
    assert {v.dtype for v in payload["masters"].values()} == {torch.float32}


def test_activation_checkpointing_same_losses_and_gradients():
    """Packed forward + fused loss + backward with and without per-layer checkpointing: the same loss and
    gradients (fp32, rtol 1e-5: the recompute repeats the same ops). A forward pre-hook on a layer's MLP counts its
    calls (the recompute stops right after the last saved tensor, so a post-hook would miss it): with
    checkpointing in train mode each layer runs twice (forward + recompute), in eval mode or without grad once."""
    batch = samples(6, seed=3)
    results = []
    for ac in (False, True):
        cfg, model, opt, update = setup("float32", 1e-3, "train.max_grad_norm=0",
                                        "train.max_tokens_per_microbatch=24")
        if ac:
            enable_activation_checkpointing(model)
        model.eval()
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))
        before = [p.detach().clone() for p in model.parameters()]
        update.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        m = run(cfg, update, batch)
        results.append((m["loss"], [b - p.detach() for b, p in zip(before, model.parameters())], len(calls)))
        assert not model.training  # back to eval after the update
    (loss0, d0, calls0), (loss1, d1, calls1) = results
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for a, b in zip(d0, d1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert calls1 == 2 * calls0 > 0
    model.eval()
    x = torch.randint(5, 40, (1, 7))
    with train_mode(model):
        calls.clear()
        model(x).logits.sum().backward()
        assert len(calls) == 2
    calls.clear()
    model(x).logits.sum().backward()  # eval mode: HF checkpointing is off
    assert len(calls) == 1
