"""The grpo-qwen3-30b-a3b recipe against NeMo-RL's published Qwen3-30B-A3B GRPO recipe with router replay, knob by
knob; its memory plan on 8 x 80 GiB and 8 x 141 GiB; and the plan's MoE figures against the closed forms.

Source: NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (Aug 2026):
examples/configs/recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron-cp2-r3.yaml (last changed in af207e8b; the example
recipe of docs/guides/router-replay.md) over examples/configs/grpo_math_qwen30ba3b_megatron.yaml, then
examples/configs/grpo_math_1B_megatron.yaml, then examples/configs/grpo_math_1B.yaml. A value the recipe does not set
is inherited, and the row cites the file it comes from. The model's shape: Qwen3-30B-A3B's config.json
(tests/data/qwen3-30b-a3b).

``PUBLISHED`` lists what must match; ``DEPARTURES`` what fastgrpo does differently, with its value checked too.
"""

from pathlib import Path

import pytest
from checks import assert_departure, assert_published

from fastgrpo.config import load_config
from fastgrpo.plan import memory_plan
from fastgrpo.shapes import model_shape

REPO = "NVIDIA-NeMo/RL@7ea279a"
RECIPE = "examples/configs/recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron-cp2-r3.yaml"
QWEN30 = "examples/configs/grpo_math_qwen30ba3b_megatron.yaml"
MEGATRON = "examples/configs/grpo_math_1B_megatron.yaml"
BASE = "examples/configs/grpo_math_1B.yaml"
MODEL = Path(__file__).resolve().parent / "data" / "qwen3-30b-a3b"

# (knob, NeMo-RL key, its value, where it is set, fastgrpo's value from the config)
PUBLISHED = [
    ("router replay (R3)", "policy.router_replay.enabled", True, RECIPE, lambda c: c.model.moe.router_replay),
    ("no load-balancing loss", "policy.megatron_cfg.moe_router_load_balancing_type none", 0.0, MEGATRON,
     lambda c: c.model.moe.router_aux_loss_coef),
    ("router frozen", "policy.megatron_cfg.freeze_moe_router", True, MEGATRON, lambda c: c.model.moe.freeze_router),
    ("compute precision", "policy.precision", "bfloat16", QWEN30, lambda c: c.model.dtype),
    ("learning rate", "policy.megatron_cfg.optimizer.lr", 3e-7, QWEN30, lambda c: c.train.lr),
    ("warm-up: start lr / lr, GRPO steps", "policy.megatron_cfg.scheduler.lr_warmup_init 3e-8, lr_warmup_iters",
     (0.1, 13), QWEN30, lambda c: (c.train.warmup_start_factor, c.train.warmup_steps)),
    ("Adam weight decay, betas", "policy.megatron_cfg.optimizer.{weight_decay, adam_beta1, adam_beta2}",
     (0.01, 0.9, 0.999), f"{QWEN30}; {MEGATRON}",
     lambda c: (c.train.weight_decay, c.train.adam_beta1, c.train.adam_beta2)),
    ("grad clip (global norm)", "policy.max_grad_norm", 1.0, MEGATRON, lambda c: c.train.max_grad_norm),
    ("prompts per step", "grpo.num_prompts_per_step", 16, RECIPE, lambda c: c.grpo.num_prompts_per_step),
    ("generations per prompt", "grpo.num_generations_per_prompt", 8, RECIPE, lambda c: c.grpo.num_generations),
    ("sequences per optimizer step", "policy.train_global_batch_size", 128, RECIPE,
     lambda c: c.train.sequences_per_optimizer_step),
    ("advantage baseline and scale", "grpo.use_leave_one_out_baseline true, normalize_rewards true",
     ("leave_one_out", "group_loo"), MEGATRON, lambda c: (c.grpo.baseline, c.grpo.scale)),
    ("clip low / high", "loss_fn.ratio_clip_min / ratio_clip_max", (0.2, 0.2), MEGATRON,
     lambda c: (c.grpo.epsilon_low, c.grpo.epsilon_high)),
    ("loss normalisation", "loss_fn.token_level_loss", "dapo", MEGATRON, lambda c: c.grpo.loss_type),
    ("no rollout IS correction", "loss_fn.use_importance_sampling_correction false", "none", MEGATRON,
     lambda c: c.grpo.rollout_is),
    ("KL estimator and clamps (unused at beta 0)", "loss_fn.reference_policy_kl_type k3, kl_input_clamp_value, "
     "kl_output_clamp_value", ("k3", 20.0, 10.0), BASE,
     lambda c: (c.grpo.kl_estimator, c.grpo.kl_input_clamp, c.grpo.kl_output_clamp)),
    ("response limit", "policy.generation.max_new_tokens", 2048, RECIPE, lambda c: c.rollout.max_new_tokens),
    ("prompt + response budget", "policy.generation.vllm_cfg.max_model_len", 4096, RECIPE,
     lambda c: c.rollout.max_sequence_tokens),
    ("prompt length bound", "data.max_input_seq_length", 2048, RECIPE, lambda c: c.data.max_prompt_tokens),
    ("sampling temperature / top-p / top-k", "policy.generation.{temperature, top_p, top_k: null}", (1.0, 1.0, 0),
     QWEN30, lambda c: (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)),
    ("data", "data.train.dataset_name OpenMathInstruct-2 (nvidia/OpenMathInstruct-2, split train_1M, problem -> "
     "expected_answer)", ("nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer"), BASE,
     lambda c: (c.data.path, c.data.split, c.data.prompt_field, c.data.answer_field)),
    ("prompt", "data.default.prompt_file examples/prompts/cot.txt", "Think step-by-step to solve the following "
     "problem. Output your answer inside of \\\\boxed{{}} tags.:\n{prompt}\n\nLet's think step-by-step", BASE,
     lambda c: c.data.prompt_template),
    ("seed", "grpo.seed", 42, BASE, lambda c: c.train.seed),
]

# (knob, NeMo-RL, fastgrpo's value from the config, why fastgrpo departs)
DEPARTURES = [
    ("KL coefficient beta", "loss_fn.reference_policy_kl_penalty 0.01 (grpo_math_1B_megatron.yaml)",
     lambda c: c.grpo.beta == 0.0,
     "GRPO's KL reference is a whole frozen bf16 copy per GPU (57 GiB), which leaves no KV cache on 8 x 141 GiB"),
    ("parallelism", "8 nodes x 8 GPUs: Megatron TP 4, PP 2, CP 2, EP 4; vLLM EP 4",
     lambda c: c.train.strategy == "fsdp2" and c.train.activation_checkpointing,
     "one node of 8 GPUs: FSDP2 shards every parameter (the experts like the rest, no expert parallelism), the "
     "co-located engine reads the gathered weights"),
    ("micro-batching", "sequence packing, logprob_batch_size 1",
     lambda c: c.train.max_tokens_per_microbatch == 65536,
     "a rank's 16 sequences in one packed micro-batch: FSDP2 reduce-scatters the gradients in the backward instead of "
     "accumulating 30.5B fp32 gradients unsharded"),
    ("router dtype", "policy.megatron_cfg.moe_router_dtype fp64", lambda c: c.model.dtype == "bfloat16",
     "transformers' Qwen3-MoE router: logits in bf16, softmax in fp32 (the engine and the trainer alike; with replay "
     "the trainer's experts are the engine's whatever the logits' rounding)"),
    ("validation", "grpo.val_period 1000000 (never), a 5% split of the training data", lambda c: not (
        c.eval.every_steps or c.eval.at_start or c.eval.at_end), "no validation either"),
]


@pytest.fixture(scope="module")
def cfg():
    return load_config("grpo-qwen3-30b-a3b")


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_recipe_matches_nemo_rl(cfg, row):
    knob, key, value, source, get = row
    assert_published(get(cfg), knob, key, value, f"{REPO} {source}")


@pytest.mark.parametrize("row", DEPARTURES, ids=[r[0] for r in DEPARTURES])
def test_departures_are_what_the_table_says(cfg, row):
    assert_departure(cfg, row)


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_config("grpo-qwen3-30b-a3b", overrides=[f"model.path={MODEL}"]))


def test_the_plan_knows_qwen3_30b_a3b(shape):
    """Parameters, active parameters per token and the MoE shape against Qwen3-30B-A3B's closed forms."""
    H, L, E, K, I, V, q, kv = 2048, 48, 128, 8, 768, 151936, 32 * 128, 4 * 128
    attn = H * (q + 2 * kv) + q * H + 2 * 128  # q, k, v, o; q_norm, k_norm
    layer = attn + 2 * H + E * H + E * 3 * H * I  # the two RMSNorms, the router, the experts
    assert shape.params == L * layer + 2 * V * H + H  # untied embedding and head, the final norm
    assert shape.active_params == shape.params - L * (E - K) * 3 * H * I
    m = shape.moe
    assert (m.experts, m.top_k, m.intermediate, m.layers, m.norm_topk_prob) == (E, K, I, L, True)
    assert m.replay_bytes_per_token() == L * K  # uint8 ids: 384 B per token


@pytest.mark.parametrize("gib,lora,fits", [(141, False, True), (80, False, False), (80, True, True)])
def test_plan_on_8_gpus(shape, gib, lora, fits):
    """Full fine-tuning fits 8 x 141 GiB (the KV cache holds 41 sequences of 4096 tokens, the batch is 16), not 8 x 80
    GiB (the gathered bf16 weights, 57 GiB, and the sharded fp32 masters, AdamW state and gradients, 57 GiB, exceed
    its 73.6 usable); with LoRA r=64 on the attention projections it fits 8 x 80 GiB."""
    extra = ["model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "model.lora.r=64"] if lora else []
    cfg = load_config("grpo-qwen3-30b-a3b", overrides=[f"model.path={MODEL}", *extra])
    plan = memory_plan(cfg, 8, gib, shape=shape)
    assert plan.fits == fits, plan.verdict()
    assert plan.reference == 0 and plan.batch == 16
    if fits:
        assert plan.kv_sequences >= plan.batch
    else:
        assert plan.kv_sequences == 0 and plan.generation_base > plan.usable
