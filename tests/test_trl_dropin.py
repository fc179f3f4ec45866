"""The README's drop-in example: fastgrpo's ``fused_linear_grpo_loss`` inside TRL's ``GRPOTrainer`` by subclassing.

The subclass is executed from the README itself (the ``python`` block after "<!-- trl-dropin -->"), so the example
and the test cannot drift apart. Two training steps on a tiny Qwen2 built from a config, with the built-in tokenizer
and a reward defined here; TRL generates with transformers (no vLLM) on CPU. On every micro-batch the subclass's
loss and gradients are compared with TRL 1.16's own ``_compute_loss`` on the same inputs (TRL's fused LM head:
an independent log-prob implementation), and the optimizer steps are checked to move the weights.
"""

import re
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")  # in the test extra (setup.py): present in CI
from datasets import Dataset  # noqa: E402  (trl's dependency)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastgrpo.config import ModelConfig  # noqa: E402
from fastgrpo.models.loading import build_tiny_model, build_tiny_tokenizer  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> dict:
    text = README.read_text()
    block = re.search(r"<!-- trl-dropin -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README.md has no python block after <!-- trl-dropin -->"
    namespace: dict = {}
    exec(compile(block.group(1), "README.md (trl-dropin)", "exec"), namespace)
    return namespace


def distinct_characters(completions, **kwargs):
    """A reward that varies within a group of random completions: the number of distinct characters."""
    return [float(len(set(c))) for c in completions]


KL = dict(beta=0.05)  # TRL loads a reference model (the initial weights): KL > 0 once the policy moves


@pytest.mark.parametrize("loss_type, accumulation, per_generation, iterations, extra", [
    ("dapo", 2, 4, 1, {}), ("bnpo", 1, 1, 2, {}), ("grpo", 1, 1, 1, {}), ("dr_grpo", 2, 2, 1, {}),
    # issue 22: the KL with TRL's flag both ways (off-policy: the weight r ≠ 1 changes value and gradient), the other
    # loss types and the off-policy sequence mask
    ("dapo", 2, 4, 1, dict(KL, use_bias_correction_kl=True)), ("bnpo", 1, 1, 2, dict(KL, use_bias_correction_kl=False)),
    ("cispo", 2, 4, 1, dict(KL, epsilon_high=5.0)), ("sapo", 1, 1, 2, dict(KL)),
    ("luspo", 1, 1, 2, dict(KL, importance_sampling_level="sequence")),
    # δ above fp32 rounding: the first iteration's KLs are rounding (~1e-8, either sign, computed by two code paths)
    # and δ = 0 would keep or drop them by chance; the second iteration's (the policy moved) are far above it, and
    # the mask drops sequences there (the loss is -0.51 masked against -0.17 unmasked on this case)
    ("grpo", 1, 1, 2, dict(off_policy_mask_threshold=1e-5)),
])
def test_fused_loss_in_trl_grpo_trainer(tmp_path, loss_type, accumulation, per_generation, iterations, extra):
    """dapo: TRL's normaliser over an accumulation window of 2 micro-batches of a generation batch that spans 4
    (``steps_per_generation``); ``iterations`` 2: the second optimizer step of a generation reuses its completions
    with TRL's old log-probs (ratio != 1). ``extra``: GRPOConfig settings over the defaults below."""
    torch.manual_seed(0)
    FusedGRPOTrainer = readme_example()["FusedGRPOTrainer"]
    seen = []

    class Checked(FusedGRPOTrainer):
        def _compute_loss(self, model, inputs):
            params = [p for p in model.parameters() if p.requires_grad]
            want = GRPOTrainer._compute_loss(self, model, inputs)
            want_grads = torch.autograd.grad(want, params)
            with torch.no_grad():  # the same loss with |A|: the size of the terms that cancel in the loss
                size = GRPOTrainer._compute_loss(self, model, inputs | {"advantages": inputs["advantages"].abs()})
            got = super()._compute_loss(model, inputs)
            got_grads = torch.autograd.grad(got, params, retain_graph=True)
            seen.append((got.detach(), want.detach(), got_grads, want_grads, "old_per_token_logps" in inputs,
                         size.abs().item()))
            return got

    tok = build_tiny_tokenizer()
    cfg = ModelConfig(tiny_hidden_size=32, tiny_num_layers=1, tiny_intermediate_size=64)
    model = build_tiny_model(cfg, tok, seed=0)
    if extra.get("beta"):  # TRL builds its reference model from the policy config's path: another initialisation
        build_tiny_model(cfg, tok, seed=1).save_pretrained(tmp_path / "reference")
        model.config._name_or_path = str(tmp_path / "reference")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    settings = dict(loss_type=loss_type, beta=0.0, use_bias_correction_kl=False, epsilon=0.2, epsilon_high=0.28)
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=accumulation,
        steps_per_generation=per_generation, num_generations=4, max_completion_length=8, num_iterations=iterations,
        max_steps=2, learning_rate=1e-2, **(settings | extra),
        temperature=1.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Checked(model=model, reward_funcs=distinct_characters, args=args, train_dataset=data,
                      processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2 * accumulation
    # TRL computes old log-probs when a generation batch feeds more than one optimizer step
    assert any(old for *_, old, _ in seen) == (iterations > 1 or per_generation > accumulation)
    for got, want, got_grads, want_grads, _, size in seen:
        # both fp32; they sum the same terms in another order (chunked vocabulary, per-token): ~1e-7 relative to the
        # terms, whose advantages cancel within a group (the loss can be 1e-2 of their size): rel 1e-5 of the terms
        assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-5 * size + 1e-7)
        scale = max(float(g.abs().max()) for g in want_grads)
        assert scale > 0
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    windows = [sum(s[0].item() for s in seen[i * accumulation : (i + 1) * accumulation]) for i in range(2)]
    assert logged == pytest.approx(windows, rel=1e-4, abs=1e-6)  # what TRL logs is the subclass's loss
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the optimizer stepped
