"""The distill-qwen3-1.7b recipe against NeMo-RL's published on-policy distillation recipe, knob by knob.

Sources, NVIDIA-NeMo/RL, one commit per file (the newest stored version of each):
``examples/configs/distillation_math.yaml`` at 0352cb765e9c (the recipe), ``nemo_rl/algorithms/loss/loss_functions.py``
at 006907a95707 (``DistillationLossFn``: the per-token KL over the teacher's top-k, then ``masked_mean`` over
``global_valid_toks``), ``nemo_rl/algorithms/distillation.py`` at 00d4ba15282c (``DistillationConfig`` defaults,
``check_vocab_equality``).

``PUBLISHED`` lists what must match; ``DEPARTURES`` what fastgrpo does differently on purpose, with fastgrpo's value
checked too, so that the table stays true.
"""

from pathlib import Path

import pytest
from checks import assert_departure, assert_published
from fastgrpo.kernels.names import LOSS_REDUCTION

from fastgrpo.config import load_config, stage_settings
from fastgrpo.plan import memory_plan
from fastgrpo.shapes import model_shape, teacher_shape

REPO = "NVIDIA-NeMo/RL"
RECIPE = "examples/configs/distillation_math.yaml@0352cb7"
LOSS = "nemo_rl/algorithms/loss/loss_functions.py@006907a DistillationLossFn"
ALGO = "nemo_rl/algorithms/distillation.py@00d4ba1"
DATA = Path(__file__).resolve().parent / "data"
PATHS = [f"model.path={DATA / 'qwen3-1.7b-base'}", f"distill.teacher_path={DATA / 'qwen3-4b'}"]

# (knob, NeMo-RL key, its value, where it is set, fastgrpo's value from the config)
PUBLISHED = [
    ("student", "policy.model_name", "Qwen/Qwen3-1.7B-Base", RECIPE, lambda c: "Qwen/Qwen3-1.7B-Base"
     if c.model.path.endswith("Qwen3-1.7B-Base") else c.model.path),
    ("teacher", "teacher.model_name", "Qwen/Qwen3-4B", RECIPE, lambda c: "Qwen/Qwen3-4B"
     if c.distill.teacher_path.endswith("Qwen3-4B") else c.distill.teacher_path),
    ("divergence", "loss_fn.kl_type mixed, mixed_kl_weight 0.5 (on KL(teacher || student))", ("mixed", 0.5),
     f"{RECIPE}; {LOSS}", lambda c: ("mixed" if c.distill.beta is None else "jsd", c.distill.mixed_kl_weight)),
    ("full distribution per token (not the sampled token alone)", "DistillationLossFn: sum over the vocabulary",
     "full", LOSS, lambda c: c.distill.mode),
    ("no reward term", "the math environment's reward is logged, not trained on", 0.0, ALGO,
     lambda c: c.distill.reward_weight),
    ("token aggregation", "masked_mean(per_token_kl, mask, global_normalization_factor=global_valid_toks)", "dapo",
     LOSS, lambda c: LOSS_REDUCTION[c.grpo.loss_type]),
    ("prompts per step", "distillation.num_prompts_per_step", 128, RECIPE, lambda c: c.grpo.num_prompts_per_step),
    ("generations per prompt", "distillation.num_generations_per_prompt", 1, RECIPE,
     lambda c: c.grpo.num_generations),
    ("sequences per optimizer step", "policy.train_global_batch_size", 64, RECIPE,
     lambda c: c.train.sequences_per_optimizer_step),
    ("steps", "distillation.max_num_steps", 1000, RECIPE, lambda c: c.train.max_steps),
    ("learning rate", "policy.optimizer.kwargs.lr", 2e-5, RECIPE, lambda c: c.train.lr),
    ("weight decay", "policy.optimizer.kwargs.weight_decay", 0.01, RECIPE, lambda c: c.train.weight_decay),
    ("AdamW betas", "policy.optimizer.kwargs.betas", (0.9, 0.999), RECIPE,
     lambda c: (c.train.adam_beta1, c.train.adam_beta2)),
    ("warm-up", "policy.scheduler LinearLR start_factor 0.1 total_iters 10, then ConstantLR", (10, 0.1), RECIPE,
     lambda c: (c.train.warmup_steps, c.train.warmup_start_factor)),
    ("gradient clipping", "policy.max_grad_norm", 1.0, RECIPE, lambda c: c.train.max_grad_norm),
    ("compute dtype", "policy.precision", "bfloat16", RECIPE, lambda c: c.model.dtype),
    ("activation checkpointing", "policy.dtensor_cfg.activation_checkpointing", True, RECIPE,
     lambda c: c.train.activation_checkpointing),
    ("sampling temperature / top-p / top-k", "policy.generation.{temperature, top_p, top_k: null}", (1.0, 1.0, 0),
     RECIPE, lambda c: (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)),
    ("prompt + response budget", "policy.max_total_sequence_length (vLLM max_model_len)", 8192, RECIPE,
     lambda c: c.rollout.max_sequence_tokens),
    ("response limit", "policy.generation.max_new_tokens = max_total_sequence_length", 8192, RECIPE,
     lambda c: c.rollout.max_new_tokens),
    ("seed", "distillation.seed", 42, RECIPE, lambda c: c.train.seed),
    ("validation period", "distillation.val_period", 20, RECIPE, lambda c: c.eval.every_steps),
    ("validation samples per prompt", "data.validation.repeat (AIME2024)", 16, RECIPE, lambda c: c.eval.k),
    ("no validation at start / end", "distillation.val_at_start false, val_at_end false", (False, False), RECIPE,
     lambda c: (c.eval.at_start, c.eval.at_end)),
    ("checkpoint period", "checkpointing.save_period", 10, RECIPE, lambda c: c.checkpoint.every_steps),
    ("verifier", "env.math (math-verify on \\boxed{})", ["math"], RECIPE, lambda c: c.reward.functions),
    ("prompt", "data.default.prompt_file examples/prompts/cot.txt, in the chat template",
     ("Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{{}} tags.:\n"
      "{prompt}\n\nLet's think step-by-step", True), RECIPE,
     lambda c: (c.data.prompt_template, c.data.use_chat_template)),
]

# (knob, NeMo-RL, fastgrpo's value from the config, why fastgrpo departs)
DEPARTURES = [
    ("vocabulary of the divergence", "distillation.topk_logits_k 64, loss_fn.zero_outside_topk false: the KL over "
     "the teacher's 64 most likely tokens only", lambda c: c.distill.mode == "full" and c.distill.beta is None,
     "fastgrpo's fused_linear_distill_loss streams both models' full softmaxes over the vocabulary tiles: the exact "
     "divergence over every real token, at the memory of one hidden state each (no [tokens, vocab] logits, no "
     "top-k truncation of the teacher)"),
    ("tokenizer check", "check_vocab_equality: equal get_vocab(), len(tokenizer) and config vocab_size",
     lambda c: _tokenizer_check_is_by_ids(),
     "fastgrpo checks the first two and not the heads' row counts (Qwen2.5-7B pads its head to 152,064 rows, the "
     "1.5B to 151,936, one tokenizer); rows beyond the tokenizer enter neither softmax (a teacher with a padded head: "
     "tests/test_distill.py)"),
    ("prompt length bound", "data.max_input_seq_length = max_total_sequence_length 8192", lambda c:
     c.data.max_prompt_tokens == 1024 and c.data.drop_long_prompts,
     "fastgrpo drops (and counts) prompts over 1024 tokens (DeepScaleR's are far shorter), as deepscaler-1.5b"),
    ("micro-batching", "dynamic_batching train_mb_tokens 8192 (one sequence's budget), sequence_packing disabled",
     lambda c: c.train.max_tokens_per_microbatch == 16384,
     "fastgrpo packs sequences up to 16384 tokens per forward; the loss is normalised by the optimizer step's token "
     "count either way, so only memory and speed change"),
    ("parallelism", "DTensor tensor parallel 2 x context parallel 2 (student), 4 x 2 (teacher), vLLM generation",
     lambda c: c.train.strategy == "fsdp2" and c.rollout.max_batch_size == 16,
     "fastgrpo shards student and teacher with FSDP2 and samples with its co-located engine (16 sequences per GPU: "
     "the whole rollout); test_plan_fits_8x80 below gives the plan's verdict"),
    ("checkpoints kept", "checkpointing.keep_top_k 3 by val:accuracy", lambda c: c.checkpoint.keep_last == 3,
     "fastgrpo keeps the last 3"),
    ("epochs", "distillation.max_num_epochs 10", lambda c: c.train.max_steps == 1000 and c.data.shuffle,
     "fastgrpo has no epoch limit: 1000 steps x 128 prompts are ~3.2 passes over DeepScaleR's 40K problems"),
    ("validation prompts", "distillation.max_val_samples 512, val_batch_size 64", lambda c: c.eval.num_prompts == 0,
     "fastgrpo validates on every prompt of data.eval_path (AIME 2024: 30)"),
]


def _tokenizer_check_is_by_ids() -> bool:
    """check_tokenizers accepts the same tokenizer and refuses one with one more token."""
    from fastgrpo.algorithms.distill import check_tokenizers
    from fastgrpo.models.loading import build_tiny_tokenizer

    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    check_tokenizers(a, b, "student", "teacher")
    b.add_tokens(["<|extra|>"])
    try:
        check_tokenizers(a, b, "student", "teacher")
    except ValueError:
        return True
    return False


@pytest.fixture(scope="module")
def cfg():
    return load_config("distill-qwen3-1.7b", overrides=["model.path=/models/Qwen3-1.7B-Base",
                                                        "distill.teacher_path=/models/Qwen3-4B"])


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_recipe_matches_nemo_rl(cfg, row):
    knob, key, value, source, get = row
    assert_published(get(cfg), knob, key, value, f"{REPO} {source}")


@pytest.mark.parametrize("row", DEPARTURES, ids=[r[0] for r in DEPARTURES])
def test_departures_are_what_the_table_says(cfg, row):
    assert_departure(cfg, row)


def test_lr_warms_up_as_nemo_rl_scheduler(cfg):
    """LinearLR(start_factor 0.1, total_iters 10) stepped once per step, then constant: 2e-6 at step 0, 2e-5 from
    step 10 on."""
    lrs = [(lambda s: s["lr"] * s["warmup_factor"])(stage_settings(cfg, step)) for step in range(12)]
    expected = [2e-5 * (0.1 + 0.9 * min(step, 10) / 10) for step in range(12)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_plan_fits_8x80():
    """Qwen3-1.7B-Base (1.72B parameters) learning from Qwen3-4B (4.02B) as shipped: fits 8 x 80 GiB; the teacher
    costs 2.0 GiB per GPU under FSDP2 (its shards, its gathered 0.78 GB embedding and two layers)."""
    cfg = load_config("distill-qwen3-1.7b", overrides=PATHS)
    plan = memory_plan(cfg, 8, 80, shape=model_shape(cfg), teacher=teacher_shape(cfg))
    assert plan.fits, plan.verdict()
    assert plan.batch == 16 and plan.kv_sequences >= 16
    assert 1.9 < plan.teacher / 2**30 < 2.1
    assert plan.training_peak / 2**30 < 20 and plan.generation_peak / 2**30 < 25
