"""LoRA on a vision-language policy (issue 34): the adapters go on the language model's projections only, never on
the vision tower (whose MLPs are named ``gate_proj`` / ``up_proj`` / ``down_proj`` too), and the engine's log-probs
with adapters equal Hugging Face's forward of the PEFT model with the same ``pixel_values`` (fp32, the harness's
1e-4: the two differ by summation order only); the ``vlm-tiny`` recipe with ``model.lora`` trains the adapters and
leaves the base and the tower as loaded.
"""

import json

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generation import LOGPROB_ATOL
from test_vlm_generation import hf_logprobs, processor, vlm_prompts

from fastgrpo.config import LORA_TARGETS, LoRAConfig, ModelConfig
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.models.lora import apply_lora, check_modules
from fastgrpo.models.vlm import build_tiny_vlm, text_config, vision_tower

peft = pytest.importorskip("peft")


def lora_vlm(seed: int, r: int):
    """A tiny random Qwen2.5-VL (fp32, initializer_range 0.3) with fastgrpo's default LoRA targets, B random (the
    adapters then change every output)."""
    cfg = ModelConfig(path="tiny-vlm", tiny_hidden_size=32, tiny_num_heads=4, tiny_num_kv_heads=2,
                      tiny_intermediate_size=64, tiny_initializer_range=0.3)
    model = apply_lora(build_tiny_vlm(cfg, processor().tokenizer, seed=seed), LoRAConfig(r=r, alpha=2.0 * r),
                       "tiny-vlm").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def test_lora_targets_the_language_model_only():
    model = lora_vlm(0, r=4)
    names = lora_layers(model)
    layers = text_config(model).num_hidden_layers
    assert not [n for n in names if n.startswith("model.visual.")]
    block = {t: "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for t in LORA_TARGETS}
    want = [f"model.language_model.layers.{i}.{block[t]}.{t}" for i in range(layers) for t in LORA_TARGETS]
    assert sorted(names) == sorted(want)
    assert not any(p.requires_grad for p in vision_tower(model).parameters())
    # an adapter made elsewhere that adapts the tower is refused by name
    tower_lora = peft.get_peft_model(build_tiny_vlm(ModelConfig(path="tiny-vlm"), processor().tokenizer),
                                     peft.LoraConfig(r=2, target_modules=["gate_proj"]))
    with pytest.raises(ValueError, match=r"LoRA layer .*model\.visual\.blocks\.0\.mlp\.gate_proj adapts the vision"):
        check_modules(tower_lora)


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1, max_size=3), st.integers(1, 4),
       st.sampled_from([1, 4]), st.integers(0, 2**16))
def test_engine_log_probs_with_adapters_equal_peft_forward(model_seed, specs, n, r, seed):
    model = lora_vlm(model_seed, r)
    outs, inputs = vlm_prompts(specs, seed)
    prompts, images = [p for p, _ in inputs], [im for _, im in inputs]
    image_id = model.config.image_token_id
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=6, seed=seed, stop_token_ids=(image_id,))
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=max(1, len(prompts) * n // 2))
    got = engine.generate(prompts, params, images=images)
    for out, prompt, comps in zip(outs, prompts, got):
        for c in comps:
            ref = hf_logprobs(model, out, prompt, c.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
    # not vacuous: without its adapters the model gives other log-probs for the same tokens
    from fastgrpo.models.lora import adapters_disabled

    c, out, prompt = got[0][0], outs[0], prompts[0]
    with adapters_disabled(model):
        base = hf_logprobs(model, out, prompt, c.token_ids, 1.0)
    assert (base - torch.tensor(c.logprobs)).abs().max() > 10 * LOGPROB_ATOL


def test_vlm_tiny_with_lora_trains_the_adapters_only(tmp_path):
    """The vlm-tiny recipe, shrunk, with model.lora: rollouts with images, the packed update with a KL to the base
    (the adapters disabled), a checkpoint: the adapters move, the language model's base and the tower do not, and the
    saved adapter names no module of the tower."""
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    cfg = load_config("vlm-tiny", None, [
        f"logging.output_dir={tmp_path}", "data.synthetic_train_size=16", "data.synthetic_eval_size=4",
        "sft.warmup_steps=0", "grpo.num_prompts_per_step=2", "grpo.num_generations=4", "grpo.beta=0.1",
        "grpo.mask_zero_std_groups=false", "train.max_steps=2", "train.lr=0.05", "checkpoint.every_steps=2",
        "eval.every_steps=0", "eval.at_start=false", "reward.num_workers=0", "model.lora.r=4",
        "reward.functions=[test_async_grpo:parity_reward]"])  # rewards that differ in a group
    trainer = Trainer(cfg)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    adapters = {n for n in before if ".lora_A." in n or ".lora_B." in n}
    assert moved and moved <= adapters and not [n for n in adapters if ".visual." in n]
    saved = json.loads(next(tmp_path.rglob("adapter_config.json")).read_text())
    assert saved["exclude_modules"] and saved["target_modules"]
