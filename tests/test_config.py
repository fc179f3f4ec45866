"""Config: recipes, typed overrides, validation errors that name the field, stages."""

import pytest
from fastgrpo.kernels.rollout_is import MODES

from fastgrpo.config import ROLLOUT_IS_MODES, Config, load_config, parse_override, recipe_names, stage_settings


def test_default_is_tiny_and_recipes_ship():
    cfg = load_config()
    assert cfg.name == "tiny" and cfg.model.path == "tiny" and cfg.data.path == "synthetic"
    assert {"tiny", "deepscaler-1.5b"} <= set(recipe_names())


def test_deepscaler_recipe_matches_the_published_settings():
    cfg = load_config("deepscaler-1.5b")
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations) == (128, 8)
    assert cfg.train.sequences_per_optimizer_step == 64
    assert cfg.train.lr == 2e-6 and cfg.grpo.loss_type == "dapo"
    assert (cfg.grpo.baseline, cfg.grpo.scale) == ("leave_one_out", "group")
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
    assert (cfg.eval.k, cfg.eval.every_steps) == (16, 10)
    assert cfg.train.max_steps == 240 + 290 + 50
    s8, s16, s24 = (stage_settings(cfg, step) for step in (0, 240, 530))
    assert [s["max_new_tokens"] for s in (s8, s16, s24)] == [8192, 16384, 24576]
    assert [s["beta"] for s in (s8, s16, s24)] == [0.0, 0.001, 1e-4]
    assert [s["lr"] for s in (s8, s16, s24)] == [2e-6, 2e-6, 5e-7]
    assert s8["epsilon_high"] == 0.2 and s16["epsilon_high"] == s24["epsilon_high"] == 0.28
    assert stage_settings(cfg, 239)["max_new_tokens"] == 8192


def test_overrides_are_typed():
    cfg = load_config(overrides=["grpo.beta=1", "train.sft_warmup_steps=0", "train.max_steps=7",
                                 "grpo.epsilon_high=null", "reward.functions=[math, format]",
                                 "logging.output_dir=runs/x",
                                 "stages=[{at_step: 2, max_new_tokens: 16, lr: 1e-4}]"])
    assert cfg.grpo.beta == 1.0 and isinstance(cfg.grpo.beta, float)
    assert cfg.train.max_steps == 7 and cfg.grpo.epsilon_high is None
    assert cfg.reward.functions == ["math", "format"] and cfg.logging.output_dir == "runs/x"
    assert stage_settings(cfg, 1)["max_new_tokens"] == cfg.rollout.max_new_tokens
    assert stage_settings(cfg, 2) == {"max_new_tokens": 16, "lr": 1e-4, "beta": 1.0, "epsilon_high": None}


@pytest.mark.parametrize("override, message", [
    ("grpo.epsilon_low=-1", "grpo.epsilon_low must be >= 0, got -1.0"),
    ("train.max_steps=abc", "train.max_steps must be an integer, got 'abc'"),
    ("train.max_steps=1.5", "train.max_steps must be an integer"),
    ("grpo.loss_type=ppo", "grpo.loss_type must be one of"),
    ("grpo.rollout_is=sequence", "grpo.rollout_is must be one of"),
    ("grpo.rollout_is_min=-0.5", "grpo.rollout_is_min must be >= 0, got -0.5"),
    ("grpo.rollout_is_cap=0", "grpo.rollout_is_cap must be > 0.0, got 0.0"),
    ("grpo.rollout_is_cap=.inf", "grpo.rollout_is_cap must be > 0.0, got inf"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("grpo.nope=1", "unknown config key(s) ['grpo.nope']"),
    ("nogroup.x=1", "unknown config key(s) ['nogroup']"),
    ("data.prompt_template=hello", "data.prompt_template must contain {prompt}"),
    ("reward.weights=[1, 2, 3]", "reward.weights must have one weight per function"),
    ("stages=[{at_step: 5, max_new_tokens: 8}, {at_step: 2, max_new_tokens: 8}]", "stages must have strictly"),
    ("stages=[{at_step: 0, max_new_tokens: 0}]", "stages[0].max_new_tokens must be >= 1"),
    ("stages=[{at_step: 0, max_new_tokens: 8}, {at_step: 2, max_new_tokens: 8, beta: -1}]",
     "stages[1].beta must be >= 0, got -1.0"),
    ("grpo.beta=0.01", "train.sft_warmup_steps must be 0 when grpo.beta or a stage's beta is > 0"),
    ("model.tiny_num_heads=3", "model.tiny_num_heads must be a multiple of model.tiny_num_kv_heads"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
    ("train.use_bool=true", "unknown config key(s) ['train.use_bool']"),
    ("logging.wandb=3", "logging.wandb must be true or false"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_bad_override_syntax_and_sources(tmp_path):
    with pytest.raises(ValueError, match="must look like group.field=value"):
        parse_override("grpo.beta")
    with pytest.raises(ValueError, match="--recipe 'nope' does not exist"):
        load_config("nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(config_file=str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="not both"):
        load_config("tiny", str(tmp_path / "x.yaml"))


def test_saved_yaml_loads_back_identically(tmp_path):
    cfg = load_config(overrides=["grpo.beta=0.5", "train.sft_warmup_steps=0",
                                 "stages=[{at_step: 3, max_new_tokens: 12, beta: 0.1}]"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(config_file=str(path))
    assert again == cfg and isinstance(again, Config)


def test_rollout_is_modes_are_the_kernels():
    """config.py keeps its own copy of the mode names (it imports nothing of fastgrpo): the kernels' list."""
    assert ROLLOUT_IS_MODES == MODES
    cfg = load_config(overrides=["grpo.rollout_is=sequence_mask", "grpo.rollout_is_cap=2", "grpo.rollout_is_min=0.5"])
    assert (cfg.grpo.rollout_is, cfg.grpo.rollout_is_cap, cfg.grpo.rollout_is_min) == ("sequence_mask", 2.0, 0.5)
