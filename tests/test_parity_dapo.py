"""The dapo-qwen2.5-7b recipe against NeMo-RL's published DAPO recipe, knob by knob; its memory plan; and the
dapo-tiny demo (the same DAPO settings on the tiny task), whose run logs full batches.

Source: NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (Aug 2026), the DeepScaleR parity's commit:
examples/configs/recipes/llm/dapo-qwen2.5-7b.v2.yaml ("the DAPO example config" of docs/guides/dapo.md) over
examples/configs/grpo_math_1B.yaml. A value the recipe does not set is inherited, and the row cites the file it comes
from. The recipe has β = 0 (``loss_fn.reference_policy_kl_penalty: 0.0``): no KL option (estimator, weighting,
clamps) is in play, and no reference model is loaded. NeMo-RL options the recipe leaves off and fastgrpo does not
have: ``stop_properly_penalty_coef`` (null), ``advantage_clip_low/high`` (null), ``force_on_policy_ratio``,
``use_kl_in_reward``, ``use_cispo``, ``disable_ppo_ratio`` (false), ``positive_example_nll_weight`` (0),
``seq_logprob_error_threshold`` (null).

``PUBLISHED`` lists what must match; ``DEPARTURES`` lists what fastgrpo does differently, with fastgrpo's value
checked too, so that the table stays true.
"""

import json
from pathlib import Path

import pytest
import torch
from checks import assert_departure, assert_published
from test_train import train  # SMALL sizes, one torchrun

from fastgrpo.algorithms.advantages import ADV_EPS
from fastgrpo.config import load_config, stage_settings
from fastgrpo.metrics import read_jsonl
from fastgrpo.plan import memory_plan
from fastgrpo.shapes import model_shape

REPO = "NVIDIA-NeMo/RL@7ea279a"
BASE = "examples/configs/grpo_math_1B.yaml"
RECIPE = "examples/configs/recipes/llm/dapo-qwen2.5-7b.v2.yaml"
PROCESSOR = "nemo_rl/data/processors.py math_hf_data_processor"
# Qwen2.5-Math-7B's shape with the recipe's hf_config_overrides (max_position_embeddings 16384) applied
QWEN_7B = Path(__file__).resolve().parent / "data" / "qwen2.5-math-7b"

# (knob, NeMo-RL key, its value, where it is set, fastgrpo's value from the config)
PUBLISHED = [
    ("learning rate", "policy.optimizer.kwargs.lr", 1e-6, RECIPE, lambda c: c.train.lr),
    ("AdamW weight decay", "policy.optimizer.kwargs.weight_decay", 0.1, RECIPE, lambda c: c.train.weight_decay),
    ("AdamW betas", "policy.optimizer.kwargs.betas", (0.9, 0.999), BASE,
     lambda c: (c.train.adam_beta1, c.train.adam_beta2)),
    ("warm-up length, in GRPO steps", "policy.scheduler LinearLR total_iters (milestones [10])", 10, RECIPE,
     lambda c: c.train.warmup_steps),
    ("warm-up start factor", "policy.scheduler LinearLR start_factor", 1e-8, RECIPE,
     lambda c: c.train.warmup_start_factor),
    ("grad clip (global norm)", "policy.max_grad_norm", 1.0, BASE, lambda c: c.train.max_grad_norm),
    ("compute precision", "policy.precision", "bfloat16", BASE, lambda c: c.model.dtype),
    ("clip low (ratio >= 1 - eps)", "loss_fn.ratio_clip_min", 0.2, BASE, lambda c: c.grpo.epsilon_low),
    ("clip high (ratio <= 1 + eps)", "loss_fn.ratio_clip_max", 0.28, RECIPE, lambda c: c.grpo.epsilon_high),
    ("dual clip", "loss_fn.ratio_clip_c", 10.0, RECIPE, lambda c: c.grpo.dual_clip_c),
    ("KL coefficient beta", "loss_fn.reference_policy_kl_penalty", 0.0, RECIPE,
     lambda c: max([c.grpo.beta] + [s.beta or 0.0 for s in c.stages])),
    ("loss normalisation", "loss_fn.token_level_loss (mean over the step's tokens)", "dapo", BASE,
     lambda c: c.grpo.loss_type),
    ("importance ratio per token", "loss_fn.sequence_level_importance_ratios false", "token", BASE,
     lambda c: c.grpo.importance_sampling_level),
    ("no rollout IS correction", "loss_fn.use_importance_sampling_correction false", "none", BASE,
     lambda c: c.grpo.rollout_is),
    ("prompts per step (groups trained on)", "grpo.num_prompts_per_step", 512, RECIPE,
     lambda c: c.grpo.num_prompts_per_step),
    ("generations per prompt", "grpo.num_generations_per_prompt", 16, BASE, lambda c: c.grpo.num_generations),
    ("sequences per optimizer step", "policy.train_global_batch_size", 512, BASE,
     lambda c: c.train.sequences_per_optimizer_step),
    ("advantage baseline", "grpo.use_leave_one_out_baseline false", "mean", RECIPE, lambda c: c.grpo.baseline),
    ("advantage scale", "grpo.normalize_rewards true (the group's std)", "group", BASE, lambda c: c.grpo.scale),
    ("truncated completions keep their loss", "grpo.overlong_filtering false", False, BASE,
     lambda c: c.grpo.mask_truncated_completions),
    ("dynamic sampling", "grpo.use_dynamic_sampling", True, RECIPE, lambda c: c.grpo.use_dynamic_sampling),
    ("prompts per generation batch", "grpo.batch_multiplier x num_prompts_per_step", (3.0, 1536), RECIPE,
     lambda c: (c.grpo.batch_multiplier, c.grpo.prompts_per_gen_batch)),
    ("generation batches per step, at most", "grpo.dynamic_sampling_max_gen_batches", 10, BASE,
     lambda c: c.grpo.dynamic_sampling_max_gen_batches),
    ("reward scaling [0, 1] -> [-1, 1]", "grpo.reward_scaling.{enabled, source_min, source_max, target_min, "
     "target_max}", (True, 0.0, 1.0, -1.0, 1.0), f"{RECIPE}; {BASE}",
     lambda c: (c.reward_scaling.enabled, c.reward_scaling.source_min, c.reward_scaling.source_max,
                c.reward_scaling.target_min, c.reward_scaling.target_max)),
    ("overlong reward shaping", "grpo.reward_shaping.{enabled, overlong_buffer_length, overlong_buffer_penalty, "
     "max_response_length}", (True, 2048, 1.0, 14336), f"{RECIPE}; {BASE}",
     lambda c: (c.reward_shaping.enabled, c.reward_shaping.overlong_buffer_length,
                c.reward_shaping.overlong_buffer_penalty, c.reward_shaping.max_response_length)),
    ("sampling temperature / top-p / top-k", "policy.generation.{temperature, top_p, top_k: null}", (1.0, 1.0, 0),
     BASE, lambda c: (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)),
    ("prompt + response budget", "policy.max_total_sequence_length (vLLM max_model_len)", 16384, RECIPE,
     lambda c: c.rollout.max_sequence_tokens),
    ("response limit", "policy.generation.max_new_tokens", 16384, RECIPE, lambda c: c.rollout.max_new_tokens),
    ("prompt length bound", "data.max_input_seq_length", 2048, RECIPE, lambda c: c.data.max_prompt_tokens),
    ("the dataset's prompt in the chat template, no system prompt", "data.default.prompt_file null; "
     "system_prompt_file null; apply_chat_template(add_generation_prompt=True)", ("{prompt}", True, ""),
     f"{RECIPE}; {BASE}; {PROCESSOR}",
     lambda c: (c.data.prompt_template, c.data.use_chat_template, c.data.system_prompt)),
    ("GRPO steps", "grpo.max_num_steps", 10000, RECIPE, lambda c: c.train.max_steps),
    ("validation period (GRPO steps)", "grpo.val_period", 20, RECIPE, lambda c: c.eval.every_steps),
    ("validation prompts", "grpo.max_val_samples", 960, RECIPE, lambda c: c.eval.num_prompts),
    ("validation samples per prompt", "grpo.val_num_generations_per_prompt", 1, BASE, lambda c: c.eval.k),
    ("validation temperature / top-p", "policy.generation.val_temperature / val_top_p", (1.0, 1.0), BASE,
     lambda c: (c.eval.temperature, c.eval.top_p)),
    ("no validation at start / end", "grpo.val_at_start false, val_at_end false", (False, False), BASE,
     lambda c: (c.eval.at_start, c.eval.at_end)),
    ("checkpoint period (GRPO steps)", "checkpointing.save_period", 5, RECIPE, lambda c: c.checkpoint.every_steps),
    ("seed", "grpo.seed", 42, BASE, lambda c: c.train.seed),
]

# (knob, NeMo-RL, fastgrpo's value from the config, why fastgrpo departs)
DEPARTURES = [
    ("verifier", "env.math.math_verify_impl dapo_math_verify: the last 'Answer:' line, Minerva-normalised "
     "(nemo_rl/environments/dapo_math_verifier.py)", lambda c: c.reward.functions == ["math"],
     "fastgrpo's math reward reads the last \\boxed{} (math-verify); DAPO-Math-17k's prompt asks for an 'Answer:' "
     "line, so a model that follows it scores 0 until an 'Answer:' verifier is given as reward.functions"),
    ("advantage epsilon", "1e-6, added where the group's std > 0 (nemo_rl/algorithms/advantage_estimator.py)",
     lambda c: c.grpo.scale == "group" and ADV_EPS == 1e-4,
     "fastgrpo's group scaling adds 1e-4 (TRL's value); every group kept has 16 rewards of +-1 with both present "
     "(std >= 0.5 before shaping), so the advantages differ by at most 2e-4 relative"),
    ("dynamic sampling's last batch", "raises once more than dynamic_sampling_max_gen_batches batches ran "
     "(its check num_gen_batches <= max comes before generating the next, nemo_rl/algorithms/grpo.py)",
     lambda c: c.grpo.dynamic_sampling_max_gen_batches == 10,
     "fastgrpo generates at most dynamic_sampling_max_gen_batches batches, then stops the run"),
    ("epochs", "grpo.max_num_epochs 1: the run ends after one pass over the training data if that comes first",
     lambda c: c.train.max_steps == 10000 and c.data.shuffle,
     "fastgrpo has no epoch limit: the sampler reshuffles and starts the next epoch until train.max_steps"),
    ("micro-batching", "train_micro_batch_size 1, logprob_batch_size 1, sequence_packing disabled",
     lambda c: c.train.max_tokens_per_microbatch == 16384,
     "fastgrpo packs sequences up to train.max_tokens_per_microbatch; the loss is normalised by the optimizer step's "
     "token count either way, so only memory and speed change"),
    ("parallelism and memory", "16 nodes x 8 GPUs, DTensor context parallel 4, vLLM tensor parallel 2",
     lambda c: c.train.strategy == "fsdp2" and c.train.activation_checkpointing and c.rollout.max_batch_size == 44,
     "fastgrpo shards masters, AdamW state and gradients (FSDP2), checkpoints activations per layer and decodes 44 "
     "sequences per GPU: python -m fastgrpo.plan gives fits 8 x 80 GiB (test_plan_fits below)"),
    ("context length", "policy.hf_config_overrides.max_position_embeddings 16384 (the model ships 4096)",
     lambda c: json.loads((QWEN_7B / "config.json").read_text())["max_position_embeddings"]
     >= c.rollout.max_sequence_tokens,
     "fastgrpo has no config override: set max_position_embeddings 16384 in the checkpoint's config.json (the "
     "engine refuses sequences past the model's positions)"),
    ("checkpoints kept", "checkpointing.keep_top_k 5 by val:accuracy", lambda c: c.checkpoint.keep_last == 5,
     "fastgrpo keeps the last 5"),
    ("prompts over the bound", "kept, cut to max_input_seq_length, with no loss (math_hf_data_processor)",
     lambda c: c.data.drop_long_prompts, "fastgrpo drops them and counts them at start-up"),
]


@pytest.fixture(scope="module")
def cfg():
    return load_config("dapo-qwen2.5-7b")


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_recipe_matches_nemo_rl(cfg, row):
    knob, key, value, source, get = row
    assert_published(get(cfg), knob, key, value, f"{REPO} {source}")


@pytest.mark.parametrize("row", DEPARTURES, ids=[r[0] for r in DEPARTURES])
def test_departures_are_what_the_table_says(cfg, row):
    assert_departure(cfg, row)


def test_lr_at_every_step_matches_nemo_rl_scheduler(cfg):
    """NeMo-RL's scheduler as the recipe builds it (LinearLR 1e-8 -> 1 over 10 iterations, then ConstantLR,
    SequentialLR milestone 10), stepped once per GRPO step, against fastgrpo's lr at each of the first 40 steps."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-8, end_factor=1.0, total_iters=10),
        torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=10_000_000_000)], milestones=[10])
    for step in range(40):
        s = stage_settings(cfg, step)
        assert s["lr"] * s["warmup_factor"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-20), step
        opt.step()
        sched.step()


@pytest.mark.parametrize("gib", [80, 141])
def test_plan_fits(gib):
    """Qwen2.5-Math-7B's shape (7.6B parameters): the recipe as shipped fits 8 x 80 GiB and 8 x 141 GiB; the
    KV cache bounds the decoding batch on 80 GiB (49 sequences of 16384 tokens, the recipe decodes 44). The plan's
    generation batch is dynamic sampling's: 3 x 512 prompts, 3072 sequences per GPU."""
    cfg = load_config("dapo-qwen2.5-7b", overrides=[f"model.path={QWEN_7B}"])
    s = model_shape(cfg)
    assert (s.params, s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.vocab) == (
        7_615_616_512, 28, 3584, 28, 4, 128, 152064)
    plan = memory_plan(cfg, 8, gib, shape=s)
    assert plan.fits and plan.reference == 0 and plan.batch == 44, plan.verdict()
    if gib == 80:
        wider = memory_plan(load_config("dapo-qwen2.5-7b", overrides=[f"model.path={QWEN_7B}",
                                                                       "rollout.max_batch_size=64"]), 8, 80, shape=s)
        assert not wider.fits and "rollout.max_batch_size<=49" in wider.verdict()
    small = load_config("dapo-qwen2.5-7b", overrides=[f"model.path={QWEN_7B}", "grpo.num_prompts_per_step=8",
                                                      "rollout.max_batch_size=1000"])
    assert memory_plan(small, 8, gib, shape=s).batch == 3 * 8 * 16 // 8  # a generation batch of 24 prompts


DAPO_KEYS = {"grpo.dual_clip_c", "grpo.use_dynamic_sampling", "grpo.batch_multiplier", "grpo.mask_zero_std_groups",
             "reward_scaling.enabled", "reward_scaling.target_min", "reward_shaping.enabled",
             "reward_shaping.overlong_buffer_length"}


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_dapo_tiny_is_tiny_with_the_dapo_settings():
    """dapo-tiny differs from tiny only in its name and the DAPO settings, which are dapo-qwen2.5-7b's (the
    overlong buffer scaled to the 8-token responses, dynamic sampling's multiplier to 32 prompts)."""
    tiny, dapo, big = (flat(load_config(r).to_dict()) for r in ("tiny", "dapo-tiny", "dapo-qwen2.5-7b"))
    assert {k for k in tiny if tiny[k] != dapo[k]} == DAPO_KEYS | {"name"}
    same = ("grpo.loss_type", "grpo.epsilon_low", "grpo.epsilon_high", "grpo.dual_clip_c", "grpo.beta",
            "grpo.use_dynamic_sampling", "grpo.baseline", "grpo.scale", "reward_scaling.enabled",
            "reward_scaling.target_min", "reward_shaping.enabled", "reward_shaping.overlong_buffer_penalty")
    assert {k: dapo[k] for k in same} == {k: big[k] for k in same}


@pytest.mark.slow  # 15 s: dynamic sampling's full batches stay in the default tier (test_train, 2 processes)
def test_dapo_tiny_run_logs_full_batches(tmp_path):
    """A short dapo-tiny run (4 prompts per step, 1.5 x 4 per generation batch, after 150 steps of the recipe's
    supervised warm-up, so that some groups score alike and some not): every step trains on exactly 4 groups,
    however many batches it took (2 processes: tests/test_train.py)."""
    run = tmp_path / "run"
    train(tmp_path, run, "--recipe", "dapo-tiny", "train.max_steps=3", "sft.warmup_steps=150", "sft.batch_size=64",
          "grpo.batch_multiplier=1.5", "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=0")
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "dynamic_sampling/groups" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["dynamic_sampling/groups"] == 4 and 1 <= r["dynamic_sampling/num_gen_batches"] <= 10
        batches = r["dynamic_sampling/num_gen_batches"]
        # every generated group is trained on, dropped (no signal) or discarded (surplus): 6 per batch
        assert 4 + r["dynamic_sampling/dropped_groups"] + r["dynamic_sampling/discarded_valid_samples"] / 4 == (
            6 * batches)
        assert r["reward_shaping/penalty_mean"] <= 0
