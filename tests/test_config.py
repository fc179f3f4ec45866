"""Config: recipes, typed overrides, validation errors that name the field, stages."""

import pytest

from fastgrpo.config import Config, load_config, parse_override, recipe_names, stage_settings


def test_default_is_tiny_and_recipes_ship():
    cfg = load_config()
    assert cfg.name == "tiny" and cfg.model.path == "tiny" and cfg.data.path == "synthetic"
    assert {"tiny", "deepscaler-1.5b"} <= set(recipe_names())


def test_overrides_are_typed():
    cfg = load_config(overrides=["grpo.beta=1", "sft.warmup_steps=0", "train.max_steps=7",
                                 "grpo.epsilon_high=null", "reward.functions=[math, format]",
                                 "logging.output_dir=runs/x",
                                 "stages=[{at_step: 2, max_new_tokens: 16, lr: 1e-4}]"])
    assert cfg.grpo.beta == 1.0 and isinstance(cfg.grpo.beta, float)
    assert cfg.train.max_steps == 7 and cfg.grpo.epsilon_high is None
    assert cfg.reward.functions == ["math", "format"] and cfg.logging.output_dir == "runs/x"
    assert stage_settings(cfg, 1)["max_new_tokens"] == cfg.rollout.max_new_tokens
    assert stage_settings(cfg, 2) == {"max_new_tokens": 16, "max_sequence_tokens": 0, "lr": 1e-4, "beta": 1.0,
                                      "epsilon_high": None, "warmup_factor": 1.0}


def test_stage_settings_warmup_and_sequence_budget():
    cfg = load_config(overrides=["train.warmup_steps=4", "train.warmup_start_factor=0.2",
                                 "rollout.max_sequence_tokens=2048",
                                 "stages=[{at_step: 3, max_new_tokens: 16, max_sequence_tokens: 4096},"
                                 " {at_step: 10, max_new_tokens: 32, restart_warmup: true}]"])
    factors = [stage_settings(cfg, s)["warmup_factor"] for s in range(16)]
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1, 1, 1, 0.2, 0.4, 0.6, 0.8, 1, 1])
    assert [stage_settings(cfg, s)["max_sequence_tokens"] for s in (0, 2, 3, 10)] == [2048, 2048, 4096, 4096]
    assert stage_settings(load_config(), 0)["warmup_factor"] == 1.0  # no warm-up


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
    ("grpo.beta=0.01", "sft.warmup_steps must be 0 when grpo.beta or a stage's beta is > 0"),
    ("model.tiny_num_heads=3", "model.tiny_num_heads must be a multiple of model.tiny_num_kv_heads"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
    ("train.use_bool=true", "unknown config key(s) ['train.use_bool']"),
    ("logging.wandb=3", "logging.wandb must be true or false"),
    ("grpo.scale=group_loo", "grpo.scale 'group_loo' needs grpo.baseline=leave_one_out"),
    ("train.warmup_start_factor=0", "train.warmup_start_factor must be in (0, 1]"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0 (GRPO steps, not optimizer steps), got -1"),
    ("rollout.max_sequence_tokens=32", "rollout.max_sequence_tokens must be 0 or > data.max_prompt_tokens=32"),
    ("stages=[{at_step: 0, max_new_tokens: 8, max_sequence_tokens: 20}]",
     "stages[0].max_sequence_tokens must be 0 or > data.max_prompt_tokens=32"),
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
    cfg = load_config(overrides=["grpo.beta=0.5", "sft.warmup_steps=0",
                                 "stages=[{at_step: 3, max_new_tokens: 12, beta: 0.1}]"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(config_file=str(path))
    assert again == cfg and isinstance(again, Config)


def test_rollout_is_settings_load():
    cfg = load_config(overrides=["grpo.rollout_is=sequence_mask", "grpo.rollout_is_cap=2", "grpo.rollout_is_min=0.5"])
    assert (cfg.grpo.rollout_is, cfg.grpo.rollout_is_cap, cfg.grpo.rollout_is_min) == ("sequence_mask", 2.0, 0.5)
