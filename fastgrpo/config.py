"""The trainer's configuration: one tree of dataclasses, YAML recipes, dotted command-line overrides.

A run is configured by a recipe (a YAML file shipped in ``fastgrpo/recipes/``, chosen with ``--recipe NAME``, or
any file given with ``--config FILE``) and then by ``group.field=value`` overrides, e.g.
``grpo.num_generations=16 train.lr=1e-5 stages=[]``. Values are parsed as YAML and checked against the field's
type; an unknown group or field is an error that names it. Every group validates itself at construction, so a bad
value fails at start-up with the field's dotted name in the message (``grpo.epsilon_low must be >= 0, got -1``).

``algorithm`` (grpo, dpo, sft, distill or rm) picks what one training step does. Groups: ``model``, ``data``,
``reward``, ``grpo``, ``reward_scaling``, ``reward_shaping``, ``dpo``, ``rm``, ``sft``, ``distill``, ``rollout``,
``train``, ``stages`` (a list), ``checkpoint``, ``logging``, ``eval``, ``numerics``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from fastgrpo.kernels.names import (
    CLIPPED_LOSS_TYPES,
    DPO_LOSS_TYPES,
    IS_LEVELS,
    KL_ESTIMATORS,
    KL_WEIGHTS,
    LOSS_TYPES,
    ROLLOUT_IS_MODES,
)

DEFAULT_RECIPE = "tiny"
DTYPES = ("float32", "bfloat16")
BASELINES = ("mean", "leave_one_out")
SCALINGS = ("group", "batch", "group_loo", "none")
STRATEGIES = ("ddp", "fsdp2", "none")
SYNTHETIC_TASKS = ("add", "sliding_puzzle", "squares")
ALGORITHMS = ("grpo", "dpo", "sft", "distill", "rm")
DISTILL_MODES = ("full", "sampled_token")
BUILTIN_ENVIRONMENTS = {"adder": "fastgrpo.environments.adder:AdderEnvironment",
                        "sliding_puzzle": "fastgrpo.environments.sliding_puzzle:SlidingPuzzle"}
BUILTIN_TOOLS = {"add": "fastgrpo.environments.adder:add", "run_python": "fastgrpo.environments.python_code:run_python"}
TRUNCATION = ("drop", "truncate")
# fields that moved to another group: the old dotted name → the new one
MOVED = {"train.sft_warmup_steps": "sft.warmup_steps", "train.sft_lr": "sft.lr",
         "train.sft_batch_size": "sft.batch_size", "train.sft_answer_noise": "sft.answer_noise",
         "grpo.dynamic_sampling": "grpo.mask_zero_std_groups"}
# why each moved field moved (the error message says it)
MOVED_WHY = {"train": "the sft group holds the settings of algorithm sft and of the warm-up",
             "grpo": "it only masked zero-std groups; grpo.use_dynamic_sampling is DAPO's, which generates more"}


def _fail(name: str, what: str, value) -> None:
    raise ValueError(f"{name} {what}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        _fail(name, f"must be one of {list(choices)}", value)


def _check_min(name: str, value, low, *, strict: bool = False) -> None:
    bad = value <= low if strict else value < low
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        _fail(name, f"must be {'>' if strict else '>='} {low}", value)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# module names the unmerged engine cannot adapt: the fused losses read the head's weight directly, and the embedding
# is a lookup (fastgrpo.models.lora)
LORA_REFUSED_TARGETS = ("lm_head", "embed_tokens")


@dataclass
class LoRAConfig:
    """LoRA adapters (PEFT's modules and files) on a frozen base: see fastgrpo/models/lora.py."""

    r: int = 16
    """Rank of every adapter."""
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / r) · B A, or (alpha / sqrt(r)) · B A with use_rslora."""
    dropout: float = 0.0
    """Dropout on the adapters' input in training forwards only (never in generation or no-grad forwards): with
    dropout > 0 the training forward is not the sampler's distribution and the on-policy ratio is not 1."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the linear modules to adapt (default: attention and MLP projections; a VLM's text model only)."""
    use_rslora: bool = False
    """rsLoRA's scaling alpha / sqrt(r) instead of alpha / r."""
    path: str = ""
    """An existing PEFT adapter directory to continue from (its adapter_config.json sets r, alpha, targets, rsLoRA,
    dropout; the fields above are then unused); empty: fresh adapters (B = 0: the policy starts as the base)."""

    def __post_init__(self):
        _check_min("model.lora.r", self.r, 1)
        _check_min("model.lora.alpha", self.alpha, 0, strict=True)
        if not 0 <= self.dropout < 1:
            _fail("model.lora.dropout", "must be in [0, 1)", self.dropout)
        if not self.target_modules:
            _fail("model.lora.target_modules", "must name at least one module", self.target_modules)
        refused = [t for t in self.target_modules if t.split(".")[-1] in LORA_REFUSED_TARGETS]
        if refused:
            _fail("model.lora.target_modules", "must not hold the LM head or the embeddings (the fused losses read "
                  "the head's weight directly; the engine does not merge adapters)", refused)
        if self.path and not Path(self.path).is_dir():
            _fail("model.lora.path", "must be a PEFT adapter directory", self.path)


@dataclass
class MoEConfig:
    """Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE): the router's load-balancing loss, router replay, and the tiny
    model as an MoE; nothing here acts on a dense model (see fastgrpo/models/moe.py)."""

    router_aux_loss_coef: float | None = None
    """Weight of the router's load-balancing loss added to the training loss of GRPO, SFT (the warm-up too), DPO and
    distillation (TRL's router_aux_loss_coef; 0 = off); null: the model config's (0.001 in Qwen3-MoE's, Qwen2-MoE's)."""
    router_replay: bool = False
    """Router replay (R3): the engine records every token's top-k experts per MoE layer, and the trainer's old-policy,
    reference and policy forwards route those tokens to those experts, the weights from the current router logits."""
    replay_gap: bool = False
    """With router_replay: also measure the engine-vs-trainer log-prob gap without replay, one no-grad forward more
    per micro-batch of a step's first optimizer step (moe/no_replay_logp_difference/{mean,max})."""
    freeze_router: bool = False
    """Keep every MoE layer's router weight fixed (NeMo-RL's Megatron freeze_moe_router); the experts still train."""
    tiny_num_experts: int = 0
    """Built-in tiny model: 0 = dense (Qwen2-shaped); > 0 = an MoE model with this many experts per MoE layer."""
    tiny_num_experts_per_tok: int = 2
    """Built-in tiny MoE: experts per token (top-k), their weights renormalised in a Qwen3-MoE (norm_topk_prob)."""
    tiny_moe_intermediate_size: int = 64
    """Built-in tiny MoE: one expert's MLP width."""
    tiny_decoder_sparse_step: int = 1
    """Built-in tiny MoE: layer i is an MoE layer when (i + 1) is a multiple of this (Qwen3-MoE's decoder_sparse_step)
    and i is not in tiny_mlp_only_layers; the others are dense MLP layers of model.tiny_intermediate_size."""
    tiny_mlp_only_layers: list[int] = field(default_factory=list)
    """Built-in tiny MoE: layers that keep a dense MLP (Qwen3-MoE's mlp_only_layers)."""
    tiny_shared_expert_intermediate_size: int = 0
    """Built-in tiny MoE: 0 = a Qwen3-MoE; > 0 = a Qwen2-MoE whose MoE layers add a shared expert of this width (its
    defaults: q/k/v biases, top-k weights not renormalised)."""

    def __post_init__(self):
        if self.router_aux_loss_coef is not None:
            _check_min("model.moe.router_aux_loss_coef", self.router_aux_loss_coef, 0)
        if self.replay_gap and not self.router_replay:
            _fail("model.moe.replay_gap", "needs model.moe.router_replay (the gap without replay is measured next "
                  "to the replayed one)", self.replay_gap)
        _check_min("model.moe.tiny_num_experts", self.tiny_num_experts, 0)
        for name in ("tiny_num_experts_per_tok", "tiny_moe_intermediate_size", "tiny_decoder_sparse_step"):
            _check_min(f"model.moe.{name}", getattr(self, name), 1)
        _check_min("model.moe.tiny_shared_expert_intermediate_size", self.tiny_shared_expert_intermediate_size, 0)
        if self.tiny_num_experts and self.tiny_num_experts_per_tok > self.tiny_num_experts:
            _fail("model.moe.tiny_num_experts_per_tok", f"must be <= model.moe.tiny_num_experts="
                  f"{self.tiny_num_experts}", self.tiny_num_experts_per_tok)


@dataclass
class VisionConfig:
    """A vision-language policy's images (model.path "tiny-vlm" or a Qwen2.5-VL directory; fastgrpo/models/vlm.py)."""

    min_pixels: int = 3136
    """Fewest pixels of an image after the processor's resize (Qwen2.5-VL's default: 56 x 56)."""
    max_pixels: int = 1003520
    """Most pixels of an image after the processor's resize (Qwen2.5-VL's default: 28 x 28 x 1280)."""
    train_vision_tower: bool = False
    """Train the vision tower too (default: frozen, run without gradient; TRL and NeMo-RL train it: README)."""

    def __post_init__(self):
        _check_min("model.vision.min_pixels", self.min_pixels, 1)
        if self.max_pixels < self.min_pixels:
            _fail("model.vision.max_pixels", f"must be >= model.vision.min_pixels={self.min_pixels}", self.max_pixels)


@dataclass
class ModelConfig:
    """The policy: a local Hugging Face causal LM, or the built-in tiny model."""

    path: str = "tiny"
    """Local directory of a Hugging Face causal LM, or "tiny" for the built-in Qwen2-shaped demo model."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the checkpoint (off unless asked)."""
    tiny_hidden_size: int = 64
    """Built-in tiny model: hidden size."""
    tiny_num_layers: int = 2
    """Built-in tiny model: decoder layers."""
    tiny_num_heads: int = 4
    """Built-in tiny model: attention heads."""
    tiny_num_kv_heads: int = 2
    """Built-in tiny model: key/value heads (GQA)."""
    tiny_intermediate_size: int = 256
    """Built-in tiny model: MLP width."""
    tiny_initializer_range: float = 0.02
    """Built-in tiny model: std of its random weights (HF's initializer_range; the tied head's too)."""
    lora: LoRAConfig | None = None
    """LoRA adapters on the frozen base (null: full fine-tuning); a model.lora.<field>=... override turns it on."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts settings (router loss, router replay, the tiny model's experts); unused by dense models."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """A vision-language policy's image settings (ignored for a text model)."""

    def __post_init__(self):
        _check_choice("model.dtype", self.dtype, DTYPES)
        if not self.path:
            _fail("model.path", "must be a model directory or 'tiny'", self.path)
        for name in ("tiny_hidden_size", "tiny_num_layers", "tiny_num_heads", "tiny_num_kv_heads",
                     "tiny_intermediate_size"):
            _check_min(f"model.{name}", getattr(self, name), 1)
        _check_min("model.tiny_initializer_range", self.tiny_initializer_range, 0, strict=True)
        if self.tiny_num_heads % self.tiny_num_kv_heads:
            _fail("model.tiny_num_heads", f"must be a multiple of model.tiny_num_kv_heads={self.tiny_num_kv_heads}",
                  self.tiny_num_heads)
        if self.tiny_hidden_size % self.tiny_num_heads:
            _fail("model.tiny_hidden_size", f"must be a multiple of model.tiny_num_heads={self.tiny_num_heads}",
                  self.tiny_hidden_size)
        bad = [i for i in self.moe.tiny_mlp_only_layers if not 0 <= i < self.tiny_num_layers]
        if bad:
            _fail("model.moe.tiny_mlp_only_layers", f"must be layer indices in [0, {self.tiny_num_layers})", bad)


@dataclass
class DataConfig:
    """Training and validation prompts."""

    path: str = "synthetic"
    """"synthetic" (built-in task), a .jsonl / .parquet file, or a Hugging Face datasets name."""
    split: str = "train"
    """Split of a Hugging Face dataset."""
    eval_path: str = ""
    """Validation prompts (same formats); empty: the synthetic task's held-out split, or no validation."""
    eval_split: str = "test"
    """Split of a Hugging Face validation dataset."""
    prompt_field: str = "prompt"
    """Column holding the question text."""
    answer_field: str = "answer"
    """Column holding the ground-truth answer."""
    prompt_template: str = "{prompt}"
    """Python format string applied to the question ({prompt} is the question)."""
    system_prompt: str = ""
    """System message put before the question when the tokenizer has a chat template (empty: none)."""
    use_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    max_prompt_tokens: int = 1024
    """Longest prompt in tokens."""
    drop_long_prompts: bool = True
    """Drop (and count) prompts longer than max_prompt_tokens; false: raise an error instead."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (deterministic given train.seed)."""
    synthetic_task: str = "add"
    """Built-in task: "add" (sum of small numbers, answer in \\boxed{}), "sliding_puzzle" (boards for
    env.environment_factory sliding_puzzle, GRPO only) or "squares" (count the squares in an image: model.path
    tiny-vlm or another vision-language model)."""
    synthetic_num_terms: int = 2
    """Built-in task: numbers per question."""
    synthetic_max_value: int = 9
    """Built-in task: largest number in a question."""
    synthetic_eval_size: int = 200
    """Built-in task: held-out questions (never seen in training; sliding_puzzle: boards of other seeds)."""
    synthetic_train_size: int = 32000
    """sliding_puzzle task: training rows (one board each)."""
    puzzle_size: int = 5
    """sliding_puzzle task: largest board side; each row's is drawn from 2..puzzle_size (NeMo-RL's game_config.size)."""
    puzzle_shuffle_moves: int = 15
    """sliding_puzzle task: each row's shuffle moves are drawn from 1..this, an even draw plus one (NeMo-RL's)."""
    puzzle_max_moves: int = 50
    """sliding_puzzle task: moves per game, valid or not, before it ends unsolved (NeMo-RL's max_moves)."""
    max_length: int = 2048
    """DPO / SFT: longest sequence (prompt + response) in tokens; longer rows follow data.truncation."""
    truncation: str = "drop"
    """DPO / SFT rows over max_length: "drop" (skip and count) or "truncate" (keep the prompt and the first
    max_length - prompt tokens of each response; a pair whose truncated responses are equal is skipped)."""
    skip_bad_rows: bool = True
    """DPO / SFT: skip (and count) malformed rows; false: stop at start-up naming the first bad row and field."""

    def __post_init__(self):
        if not self.path:
            _fail("data.path", "must be 'synthetic', a .jsonl/.parquet file or a datasets name", self.path)
        _check_min("data.max_prompt_tokens", self.max_prompt_tokens, 1)
        if "{prompt}" not in self.prompt_template:
            _fail("data.prompt_template", "must contain {prompt}", self.prompt_template)
        _check_choice("data.synthetic_task", self.synthetic_task, SYNTHETIC_TASKS)
        _check_min("data.synthetic_num_terms", self.synthetic_num_terms, 2)
        _check_min("data.synthetic_max_value", self.synthetic_max_value, 1)
        _check_min("data.synthetic_eval_size", self.synthetic_eval_size, 1)
        _check_min("data.synthetic_train_size", self.synthetic_train_size, 1)
        _check_min("data.puzzle_size", self.puzzle_size, 2)
        _check_min("data.puzzle_shuffle_moves", self.puzzle_shuffle_moves, 1)
        _check_min("data.puzzle_max_moves", self.puzzle_max_moves, 1)
        _check_min("data.max_length", self.max_length, 2)
        _check_choice("data.truncation", self.truncation, TRUNCATION)


@dataclass
class RewardModelConfig:
    """One reward model of ``reward.models``: a sequence classifier with one label, scored on the GPU in the trainer
    process (fastgrpo.algorithms.reward_models)."""

    path: str = ""
    """Local directory that AutoModelForSequenceClassification loads (an algorithm rm checkpoint is one), or a
    fastgrpo run directory (its latest complete checkpoint)."""
    weight: float = 1.0
    """Weight of its score in the reward: total = sum of the functions' weighted scores + sum of weight x score."""
    chat_template: str | None = None
    """null: the model reads the policy's prompt and completion tokens as they are (re-tokenised as text when its
    tokenizer differs); "tokenizer": its own tokenizer's chat template over [user: the prompt column's question,
    assistant: the completion]; any other string: that Jinja template over the same messages."""
    name: str | None = None
    """Its metric name, reward/<name>/mean (null: "rm", or "rm<i>" when there are several)."""

    def __post_init__(self):
        if not self.path:
            _fail("reward.models[].path", "must name a reward model directory", self.path)
        if not Path(self.path).is_dir():
            _fail("reward.models[].path", "is not a directory (a reward model saved by AutoModelForSequence"
                  "Classification.save_pretrained, e.g. an algorithm rm checkpoint, or its run directory)", self.path)
        if not math.isfinite(self.weight):
            _fail("reward.models[].weight", "must be finite", self.weight)
        if self.name is not None and (not self.name or "/" in self.name):
            _fail("reward.models[].name", "must be a non-empty name without '/'", self.name)


DEFAULT_JUDGE_TEMPLATE = ("Question: {question}\nAnswer: {completion}\nIs the answer correct? Reply with a score from "
                          "0 to 10.")


@dataclass
class JudgeConfig:
    """One generative judge of ``reward.judges``: a causal LM that reads each completion and writes a verdict, sampled
    greedily by its own engine in the trainer process (fastgrpo.algorithms.reward_models)."""

    path: str = ""
    """Local directory of the judge, a Hugging Face causal LM with its tokenizer."""
    weight: float = 1.0
    """Weight of its verdict's score in the reward."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message: {question} (the prompt column's question) and {completion} (the completion's text);
    rendered by the judge tokenizer's chat template when it has one."""
    verdict_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """Regular expression over the judge's reply: the score is its last match (group 1, else the whole match) as a
    float; no match scores 0 and counts in reward/<name>/failures."""
    max_new_tokens: int = 32
    """Longest verdict in tokens."""
    name: str | None = None
    """Its metric name (null: "judge", or "judge<i>" when there are several)."""

    def __post_init__(self):
        import re

        if not self.path or not Path(self.path).is_dir():
            _fail("reward.judges[].path", "must be a directory holding a Hugging Face causal LM", self.path)
        if not math.isfinite(self.weight):
            _fail("reward.judges[].weight", "must be finite", self.weight)
        if "{completion}" not in self.prompt_template:
            _fail("reward.judges[].prompt_template", "must contain {completion}", self.prompt_template)
        try:
            self.prompt_template.format(question="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            _fail("reward.judges[].prompt_template", f"must format with question and completion only ({e!r})",
                  self.prompt_template)
        try:
            re.compile(self.verdict_pattern)
        except re.error as e:
            _fail("reward.judges[].verdict_pattern", f"must be a regular expression ({e})", self.verdict_pattern)
        _check_min("reward.judges[].max_new_tokens", self.max_new_tokens, 1)
        if self.name is not None and (not self.name or "/" in self.name):
            _fail("reward.judges[].name", "must be a non-empty name without '/'", self.name)


@dataclass
class RewardConfig:
    """Reward functions ``f(prompts, completions, **columns) -> list[float]`` and reward models, with weights."""

    functions: list[str] = field(default_factory=lambda: ["math"])
    """Built-in names ("math", "format") or "module:function" for your own ([]: reward models only)."""
    weights: list[float] = field(default_factory=list)
    """One weight per function (empty: all 1.0); the reward is the weighted sum."""
    timeout_s: float = 5.0
    """Seconds one completion's score may take alone: a reward call (up to 4 completions) gets timeout_s in all, and
    when it fails as a whole its completions are scored again one per call, timeout_s each (the math built-in times
    each completion itself); past it the completion scores 0 and counts in reward/<name>/timeouts."""
    num_workers: int | None = None
    """Reward worker processes per rank, scoring while generation runs (None: the CPU cores the trainer leaves
    free, divided among the node's ranks, at least 1; 0: score in the training process after generation)."""
    worker_init: str = ""
    """"module:function" called once in each reward worker before scoring (a sandbox, a verifier client); empty:
    none. With num_workers=0 it is called once in the training process."""
    models: list[RewardModelConfig] = field(default_factory=list)
    """Reward models, e.g. [{path: runs/rm-tiny, weight: 1.0}]: sequence classifiers scored in the trainer process
    (compute dtype, packed, frozen, FSDP2-sharded like the reference) after generation."""
    judges: list[JudgeConfig] = field(default_factory=list)
    """Generative judges, e.g. [{path: /models/judge, weight: 0.1}]: causal LMs prompted with each completion, their
    greedy verdicts parsed into scores, in the trainer process after generation."""

    def model_names(self) -> list[str]:
        """The reward models' metric names (``reward/<name>/mean``)."""
        if len(self.models) == 1:
            return [self.models[0].name or "rm"]
        return [m.name or f"rm{i}" for i, m in enumerate(self.models)]

    def judge_names(self) -> list[str]:
        """The generative judges' metric names (``reward/<name>/mean``, ``reward/<name>/failures``)."""
        if len(self.judges) == 1:
            return [self.judges[0].name or "judge"]
        return [j.name or f"judge{i}" for i, j in enumerate(self.judges)]

    def __post_init__(self):
        if not self.functions and not self.models and not self.judges:
            _fail("reward.functions", "must name at least one reward function when reward.models and reward.judges "
                  "are empty", self.functions)
        if self.weights and len(self.weights) != len(self.functions):
            _fail("reward.weights", f"must have one weight per function ({len(self.functions)})", self.weights)
        if any(not math.isfinite(w) for w in self.weights):
            _fail("reward.weights", "must be finite", self.weights)
        _check_min("reward.timeout_s", self.timeout_s, 0, strict=True)
        if self.num_workers is not None:
            _check_min("reward.num_workers", self.num_workers, 0)
        if self.worker_init and ":" not in self.worker_init:
            _fail("reward.worker_init", "must be 'module:function' or empty", self.worker_init)
        metric_names = [f if ":" not in f else f.split(":")[-1] for f in self.functions]
        if len(set(metric_names)) != len(metric_names):
            _fail("reward.functions", "must have distinct function names (they name the reward/<name>/ metrics)",
                  self.functions)
        names = metric_names + self.model_names() + self.judge_names()
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            _fail("reward.models", f"and reward.judges must have names distinct from each other and from the "
                  f"functions' ({clash} twice; they name the reward/<name>/ metrics)",
                  [m.name for m in self.models] + [j.name for j in self.judges])


@dataclass
class AsyncGRPOConfig:
    """Asynchronous GRPO on the co-located engine (NeMo-RL's grpo.async_grpo; fastgrpo.algorithms.async_rollout):
    generation that never drains. The engine keeps sequences in flight across optimizer steps (a generation
    session), each step trains the num_prompts_per_step groups added first and not trained yet (in order, waiting
    for them), and the free rows are refilled with the step's new prompts."""

    enabled: bool = False
    """Turn it on (needs grpo.rollout_is: the tokens of an older policy are corrected by importance sampling)."""
    max_trajectory_age_steps: int = 1
    """Most optimizer steps between the oldest token of a trained group and the policy it trains (>= 1); a group
    older than that is dropped and counted (async/dropped_stale), never trained. It also sizes the buffer: a rank
    keeps (max_trajectory_age_steps + 1) x its share of num_prompts_per_step groups in flight, so that each trains
    in order within the bound."""
    in_flight_weight_updates: bool = True
    """Sequences in flight continue on the updated weights (NeMo-RL's name). Always true here: the engine reads the
    trainer's own tensors, so there are no older weights to continue on."""
    recompute_kv_cache_after_weight_updates: bool = False
    """After each update, recompute the in-flight sequences' K/V on the new weights (one prefill of prompt + tokens
    each); false keeps the K/V the older weights wrote, as NeMo-RL allows."""

    def __post_init__(self):
        _check_min("grpo.async_grpo.max_trajectory_age_steps", self.max_trajectory_age_steps, 1)
        if not self.in_flight_weight_updates:
            _fail("grpo.async_grpo.in_flight_weight_updates", "must be true: the co-located engine reads the trainer's "
                  "weights, so in-flight sequences always continue on the updated ones", False)


@dataclass
class GRPOConfig:
    """The algorithm: group size, advantages, the clipped surrogate loss."""

    num_prompts_per_step: int = 32
    """Prompts per rollout (all ranks together; each rank takes its share)."""
    num_generations: int = 8
    """Completions per prompt (the group size G; >= 2, or 1 for pure distillation)."""
    loss_type: str = "dapo"
    """Loss: grpo, bnpo, dr_grpo, dapo, luspo (clipped surrogate, by normalisation), sapo, cispo (TRL) or
    cispo_clamp (NeMo-RL's use_cispo) (see fastgrpo.kernels.grpo_loss)."""
    baseline: str = "mean"
    """Group baseline: "mean" or "leave_one_out" (mean of the other G-1 rewards)."""
    scale: str = "group"
    """Divide advantages by the reward std of the group, the batch, "group_loo" (NeMo-RL's: the std of the other
    G-1 rewards, no division where it is 0; needs baseline leave_one_out), or "none"."""
    beta: float = 0.0
    """KL coefficient against the frozen reference model (0: no reference model is loaded)."""
    epsilon_low: float = 0.2
    """Lower clip range: ratios below 1 - epsilon_low are clipped."""
    epsilon_high: float | None = None
    """Upper clip range (None: epsilon_low); DAPO's clip-higher uses 0.28."""
    delta: float | None = None
    """Two-sided clipping bound on the ratio (None: off)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None: off)."""
    importance_sampling_level: str = "token"
    """Importance ratio per "token" or per "sequence" (GSPO)."""
    kl_estimator: str = "k3"
    """KL estimator of the beta term: k1, k2 or k3 (NeMo-RL's reference_policy_kl_type)."""
    kl_weight: str = "ratio"
    """Factor on the per-token KL: ratio (TRL's default use_bias_correction_kl), none (plain k3), score (NeMo-RL's
    exp(logp - sg(logp))) or sampling_ratio (NeMo-RL's use_on_policy_kl_approximation)."""
    kl_input_clamp: float | None = None
    """Clamp of ref - logp before the KL estimator, gradient stopped where it fires (NeMo-RL: 20; None: off)."""
    kl_output_clamp: float | None = None
    """Clamp of the weighted per-token KL, gradient stopped where it fires (NeMo-RL: 10; None: off)."""
    sapo_temperature_pos: float = 1.0
    """SAPO's temperature for positive advantages (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """SAPO's temperature for negative advantages (TRL's default)."""
    off_policy_mask_threshold: float | None = None
    """TRL's off-policy sequence mask: no policy loss for a negative-advantage completion whose mean engine-minus-
    policy log-prob exceeds this (None: off)."""
    mask_truncated_completions: bool = False
    """Completions cut at max_new_tokens get no loss."""
    mask_zero_std_groups: bool = False
    """Give no loss to groups whose rewards are all equal (before reward_shaping): the batch keeps them, and shrinks
    by them (use_dynamic_sampling generates more instead, and leaves no such group to mask)."""
    use_dynamic_sampling: bool = False
    """DAPO's dynamic sampling (NeMo-RL's use_dynamic_sampling): drop groups whose rewards are all equal (before
    reward_shaping) and generate further batches until num_prompts_per_step groups remain, counted over all ranks;
    the surplus is cut (fastgrpo.algorithms.grpo)."""
    batch_multiplier: float = 1.0
    """Dynamic sampling: each generation batch holds int(batch_multiplier x num_prompts_per_step) prompts (>= 1;
    1 without use_dynamic_sampling, as NeMo-RL's)."""
    dynamic_sampling_max_gen_batches: int = 10
    """Dynamic sampling: generation batches one step may use; a step still short of num_prompts_per_step groups with
    signal after them stops the run."""
    rollout_is: str = "none"
    """Rollout importance-sampling correction against the engine's log-probs (TRL's vllm_importance_sampling_mode):
    none, token_truncate (= NeMo-RL tis), token_mask (= icepop), sequence_truncate, sequence_mask or NeMo-RL's
    seq-mask-tis (fastgrpo/kernels/rollout_is.py)."""
    rollout_is_cap: float = 3.0
    """Upper bound of the rollout IS ratio: truncated to it, or masked above it."""
    rollout_is_min: float = 0.0
    """Lower bound of the rollout IS ratio: truncated to it, or masked below it (0: none)."""
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    """Asynchronous GRPO: generation across optimizer steps, in-flight weight updates, a staleness bound."""

    def __post_init__(self):
        _check_min("grpo.num_prompts_per_step", self.num_prompts_per_step, 1)
        _check_min("grpo.num_generations", self.num_generations, 1)  # >= 2 unless pure distillation (Config)
        _check_choice("grpo.loss_type", self.loss_type, LOSS_TYPES)
        _check_choice("grpo.baseline", self.baseline, BASELINES)
        _check_choice("grpo.scale", self.scale, SCALINGS)
        if self.scale == "group_loo" and self.baseline != "leave_one_out":
            _fail("grpo.scale", "'group_loo' needs grpo.baseline=leave_one_out (it is the std of the other G-1 "
                  f"rewards, the leave-one-out baseline's own spread); grpo.baseline is {self.baseline!r}", self.scale)
        _check_choice("grpo.importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        _check_min("grpo.beta", self.beta, 0)
        _check_min("grpo.epsilon_low", self.epsilon_low, 0)
        if self.epsilon_high is not None:
            _check_min("grpo.epsilon_high", self.epsilon_high, 0)
        if self.delta is not None:
            _check_min("grpo.delta", self.delta, 1, strict=True)
        if self.dual_clip_c is not None:
            _check_min("grpo.dual_clip_c", self.dual_clip_c, 1, strict=True)
        for name in ("delta", "dual_clip_c"):
            if getattr(self, name) is not None and self.loss_type not in CLIPPED_LOSS_TYPES:
                _fail(f"grpo.{name}", f"applies to the clipped loss types {list(CLIPPED_LOSS_TYPES)} only, not "
                      f"grpo.loss_type={self.loss_type!r}", getattr(self, name))
        if self.loss_type.startswith("cispo") and self.importance_sampling_level != "token":
            _fail("grpo.importance_sampling_level", f"must be 'token' for grpo.loss_type={self.loss_type!r}",
                  self.importance_sampling_level)
        _check_choice("grpo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("grpo.kl_weight", self.kl_weight, KL_WEIGHTS)
        for name in ("kl_input_clamp", "kl_output_clamp"):
            if getattr(self, name) is not None:
                _check_min(f"grpo.{name}", getattr(self, name), 0, strict=True)
        _check_min("grpo.sapo_temperature_pos", self.sapo_temperature_pos, 0, strict=True)
        _check_min("grpo.sapo_temperature_neg", self.sapo_temperature_neg, 0, strict=True)
        if self.off_policy_mask_threshold is not None and not math.isfinite(self.off_policy_mask_threshold):
            _fail("grpo.off_policy_mask_threshold", "must be finite", self.off_policy_mask_threshold)
        _check_choice("grpo.rollout_is", self.rollout_is, ROLLOUT_IS_MODES)
        _check_min("grpo.rollout_is_min", self.rollout_is_min, 0)
        _check_min("grpo.rollout_is_cap", self.rollout_is_cap, self.rollout_is_min, strict=True)
        _check_min("grpo.batch_multiplier", self.batch_multiplier, 1)
        if self.batch_multiplier != 1 and not self.use_dynamic_sampling:
            _fail("grpo.batch_multiplier", "must be 1 unless grpo.use_dynamic_sampling is true", self.batch_multiplier)
        _check_min("grpo.dynamic_sampling_max_gen_batches", self.dynamic_sampling_max_gen_batches, 1)

    @property
    def prompts_per_gen_batch(self) -> int:
        """Prompts of one generation batch, all ranks together: num_prompts_per_step, times batch_multiplier (rounded
        down, as NeMo-RL's int()) with dynamic sampling."""
        if not self.use_dynamic_sampling:
            return self.num_prompts_per_step
        return int(self.num_prompts_per_step * self.batch_multiplier)


@dataclass
class RewardScalingConfig:
    """NeMo-RL's reward_scaling: each reward clamped to [source_min, source_max], then mapped linearly onto
    [target_min, target_max] (before reward_shaping)."""

    enabled: bool = False
    """Rescale the rewards."""
    source_min: float = 0.0
    """Lower end of the rewards' range (smaller rewards are clamped to it)."""
    source_max: float = 1.0
    """Upper end of the rewards' range (larger rewards are clamped to it)."""
    target_min: float = 0.0
    """What source_min becomes."""
    target_max: float = 1.0
    """What source_max becomes."""

    def __post_init__(self):
        for name in ("source_min", "source_max", "target_min", "target_max"):
            if not math.isfinite(getattr(self, name)):
                _fail(f"reward_scaling.{name}", "must be finite", getattr(self, name))
        if self.source_max <= self.source_min:
            _fail("reward_scaling.source_max", f"must be > reward_scaling.source_min={self.source_min}",
                  self.source_max)


@dataclass
class RewardShapingConfig:
    """DAPO's overlong reward shaping (NeMo-RL's reward_shaping): a completion of L tokens gets
    min(-(L - (max_response_length - overlong_buffer_length)) / overlong_buffer_length * overlong_buffer_penalty, 0)
    added to its reward (fastgrpo.algorithms.grpo.overlong_penalty)."""

    enabled: bool = False
    """Add the overlong penalty to the rewards."""
    overlong_buffer_length: int = 128
    """Tokens before max_response_length over which the penalty grows from 0 to overlong_buffer_penalty."""
    overlong_buffer_penalty: float = 1.0
    """Penalty at max_response_length tokens (it keeps growing at the same slope past it)."""
    max_response_length: int = 0
    """Completion length at which the penalty reaches overlong_buffer_penalty (0: the stage's
    rollout.max_new_tokens)."""

    def __post_init__(self):
        _check_min("reward_shaping.overlong_buffer_length", self.overlong_buffer_length, 1)
        _check_min("reward_shaping.overlong_buffer_penalty", self.overlong_buffer_penalty, 0)
        _check_min("reward_shaping.max_response_length", self.max_response_length, 0)
        if self.max_response_length and self.overlong_buffer_length > self.max_response_length:
            _fail("reward_shaping.overlong_buffer_length", f"must be <= reward_shaping.max_response_length="
                  f"{self.max_response_length}", self.overlong_buffer_length)


@dataclass
class RolloutConfig:
    """Sampling with the co-located generation engine."""

    temperature: float = 1.0
    """Sampling temperature (the training forward uses the same one for its log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    max_new_tokens: int = 256
    """Longest completion (stages may raise it)."""
    max_batch_size: int = 256
    """Sequences the engine decodes at once."""
    max_total_tokens: int = 0
    """KV-cache budget in tokens (0: the engine's default)."""
    max_sequence_tokens: int = 0
    """Longest prompt + completion (0: no such bound): a completion ends at min(max_new_tokens,
    max_sequence_tokens - prompt length) tokens, as NeMo-RL's max_total_sequence_length (vLLM's max_model_len).
    Multi-turn: the whole conversation (prompt, every turn and every observation)."""
    max_turns: int = 1
    """Policy turns per trajectory (> 1 needs an ``env``); max_new_tokens is then the limit of one turn."""
    stop_strings: list[str] = field(default_factory=list)
    """Texts that end a turn (matched on the decoded tail), besides EOS; a text-step environment adds its own."""

    def __post_init__(self):
        _check_min("rollout.temperature", self.temperature, 0, strict=True)
        _check_min("rollout.max_turns", self.max_turns, 1)
        if any(not s for s in self.stop_strings):
            _fail("rollout.stop_strings", "must not hold an empty string", self.stop_strings)
        if not 0 < self.top_p <= 1:
            _fail("rollout.top_p", "must be in (0, 1]", self.top_p)
        _check_min("rollout.top_k", self.top_k, 0)
        _check_min("rollout.max_new_tokens", self.max_new_tokens, 1)
        _check_min("rollout.max_batch_size", self.max_batch_size, 1)
        _check_min("rollout.max_total_tokens", self.max_total_tokens, 0)
        _check_min("rollout.max_sequence_tokens", self.max_sequence_tokens, 0)


@dataclass
class TrainConfig:
    """Optimisation and devices."""

    max_steps: int = 100
    """Training steps (GRPO: one rollout each; DPO / SFT: one optimizer step on dpo.batch_size / sft.batch_size
    rows each)."""
    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in GRPO steps (one per rollout, as NeMo-RL steps its scheduler; not optimizer
    steps): the lr factor goes from warmup_start_factor at step 0 to 1 at step warmup_steps, then stays 1."""
    warmup_start_factor: float = 0.1
    """Learning-rate factor at the first warm-up step (torch LinearLR's start_factor), in (0, 1]."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    sequences_per_optimizer_step: int = 0
    """Sequences per optimizer step, all ranks together (0: the whole rollout, one step per rollout)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed forward/backward."""
    max_bad_steps: int = 3
    """Abort (after saving a checkpoint) when this many optimizer steps in a row have a non-finite loss."""
    seed: int = 0
    """Seed of the model initialisation, data order and sampling."""
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    strategy: str = "ddp"
    """Data parallelism across torchrun processes: ddp, fsdp2 or none."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory, ~1 more forward)."""
    num_threads: int = 0
    """CPU threads per process (0: cores / processes)."""

    def __post_init__(self):
        _check_min("train.max_steps", self.max_steps, 0)
        _check_min("train.lr", self.lr, 0, strict=True)
        _check_min("train.weight_decay", self.weight_decay, 0)
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                _fail(f"train.{name}", "must be in [0, 1)", v)
        if self.warmup_steps < 0:
            _fail("train.warmup_steps", "must be >= 0 (GRPO steps, not optimizer steps)", self.warmup_steps)
        if not 0 < self.warmup_start_factor <= 1:
            _fail("train.warmup_start_factor", "must be in (0, 1]", self.warmup_start_factor)
        _check_min("train.max_grad_norm", self.max_grad_norm, 0)
        _check_min("train.sequences_per_optimizer_step", self.sequences_per_optimizer_step, 0)
        _check_min("train.max_tokens_per_microbatch", self.max_tokens_per_microbatch, 1)
        _check_min("train.max_bad_steps", self.max_bad_steps, 1)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            _fail("train.device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        _check_choice("train.strategy", self.strategy, STRATEGIES)
        _check_min("train.num_threads", self.num_threads, 0)


@dataclass
class DPOConfig:
    """Direct preference optimisation (``algorithm: dpo``; see fastgrpo.algorithms.dpo and
    fastgrpo.kernels.dpo_loss)."""

    batch_size: int = 64
    """Preference pairs per optimizer step, all ranks together (each pair is two sequences)."""
    beta: float = 0.1
    """β: the strength of the implicit KL constraint to the reference (NeMo-RL's reference_policy_kl_penalty)."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo or hinge."""
    label_smoothing: float = 0.0
    """sigmoid only: conservative DPO, the probability that a pair's labels are flipped (0 to 0.5)."""
    sft_weight: float = 0.0
    """Weight of an NLL term on the chosen responses (NeMo-RL's sft_loss_weight, TRL's "sft" loss term)."""
    average_logprobs: bool = False
    """Per-token average instead of summed sequence log-probs (NeMo-RL's preference_average_log_probs)."""
    precompute_ref_logprobs: bool = True
    """Compute the reference log-probs of every pair once as DPO starts, kept with the run's checkpoints; false: a
    frozen copy of the starting policy computes them every step."""

    def __post_init__(self):
        _check_min("dpo.batch_size", self.batch_size, 1)
        _check_min("dpo.beta", self.beta, 0, strict=True)
        _check_choice("dpo.loss_type", self.loss_type, DPO_LOSS_TYPES)
        if not 0 <= self.label_smoothing <= 0.5:
            _fail("dpo.label_smoothing", "must be in [0, 0.5]", self.label_smoothing)
        if self.label_smoothing and self.loss_type != "sigmoid":
            _fail("dpo.label_smoothing", "applies to loss_type sigmoid only", self.label_smoothing)
        _check_min("dpo.sft_weight", self.sft_weight, 0)


@dataclass
class RMConfig:
    """Reward-model training (``algorithm: rm``, fastgrpo.algorithms.rm): Bradley-Terry on preference pairs, TRL
    RewardTrainer's loss."""

    batch_size: int = 64
    """Preference pairs per optimizer step, all ranks together (each pair is two sequences)."""
    center_rewards_coefficient: float | None = None
    """TRL's center_rewards_coefficient: adds coef x mean((r_chosen + r_rejected)^2) to the loss (null: no term)."""

    def __post_init__(self):
        _check_min("rm.batch_size", self.batch_size, 1)
        if self.center_rewards_coefficient is not None:
            _check_min("rm.center_rewards_coefficient", self.center_rewards_coefficient, 0)


@dataclass
class SFTConfig:
    """Supervised fine-tuning: ``algorithm: sft``, and the supervised warm-up before GRPO or DPO."""

    batch_size: int = 64
    """Sequences per SFT step and per warm-up step, all ranks together."""
    warmup_steps: int = 0
    """GRPO / DPO: supervised warm-up steps on the data's reference responses before the first step (0: none)."""
    lr: float = 1e-3
    """Learning rate of the warm-up (its own AdamW; algorithm sft trains with train.lr)."""
    answer_noise: float = 0.0
    """Warm-up: probability that an example's response is replaced by a random row's (teaches the format, not
    the task)."""
    warmup_format: str = "answer"
    """GRPO warm-up demonstrations: "answer" (the answer in \\boxed{}) or "tool_calls" (the built-in addition task
    solved by calling the ``add`` tool, whole conversations through the chat template: the tool-tiny recipe)."""

    def __post_init__(self):
        _check_choice("sft.warmup_format", self.warmup_format, ("answer", "tool_calls"))
        _check_min("sft.batch_size", self.batch_size, 1)
        _check_min("sft.warmup_steps", self.warmup_steps, 0)
        _check_min("sft.lr", self.lr, 0, strict=True)
        if not 0 <= self.answer_noise <= 1:
            _fail("sft.answer_noise", "must be in [0, 1]", self.answer_noise)


@dataclass
class DistillConfig:
    """On-policy distillation (``algorithm: distill``, fastgrpo.algorithms.distill): the student samples as in GRPO, a
    frozen
    teacher with the student's tokenizer scores the sampled tokens, and the loss pulls the student towards it."""

    teacher_path: str = ""
    """Local directory of the teacher: a Hugging Face causal LM (a fastgrpo checkpoint is one), or a fastgrpo run
    directory (its latest complete checkpoint)."""
    teacher_recipe: str = ""
    """Shipped recipe (then optional group.field=value overrides) that trains the teacher first, with teacher_path as
    its logging.output_dir, unless teacher_path holds a model or that run's last step (an interrupted run resumes;
    empty: the teacher must exist)."""
    mode: str = "full"
    """"full": the exact full-vocabulary divergence per token (fused_linear_distill_loss, GKD); "sampled_token": the
    per-token advantage logp_teacher(y_t) - logp_student(y_t) in the clipped policy-gradient loss (on-policy
    distillation as Thinking Machines', NeMo-RL's MOPD with one teacher)."""
    beta: float | None = 0.5
    """Full mode: TRL's generalized JSD coefficient in [0, 1] (0: KL(teacher || student), 1: KL(student || teacher);
    TRL GKD's default 0.5). None when mixed_kl_weight is set."""
    mixed_kl_weight: float | None = None
    """Full mode, instead of beta: NeMo-RL's kl_type mixed, w KL(teacher || student) + (1 - w) KL(student || teacher)
    (w = 1: its kl_type forward, w = 0: reverse)."""
    reward_weight: float = 0.0
    """Weight of the reward advantages (GRPO's, from the reward functions) added to the distillation signal
    (0: pure distillation; the rewards are still scored, for the accuracy metrics)."""

    def __post_init__(self):
        _check_choice("distill.mode", self.mode, DISTILL_MODES)
        if (self.beta is None) == (self.mixed_kl_weight is None):
            _fail("distill.beta", "must be set exactly when distill.mixed_kl_weight is not (one divergence: TRL's "
                  f"generalized JSD or NeMo-RL's mixed KL; distill.mixed_kl_weight is {self.mixed_kl_weight!r}, "
                  "and distill.beta=null selects it)", self.beta)
        for name in ("beta", "mixed_kl_weight"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                _fail(f"distill.{name}", "must be in [0, 1]", value)
        _check_min("distill.reward_weight", self.reward_weight, 0)


@dataclass
class EnvConfig:
    """Multi-turn rollouts (``rollout.max_turns`` > 1): the environment or tools the policy acts with, run in the
    reward worker processes (``fastgrpo.environments``)."""

    environment_factory: str = ""
    """TRL's ``environment_factory`` or a ``TextStepEnvironment`` class: a built-in ("adder", "sliding_puzzle") or
    "module:Class"; empty: none."""
    environments: dict[str, str] = field(default_factory=dict)
    """A factory per name, chosen per row by its ``environment`` column (TRL's dict of factories); instead of
    environment_factory."""
    tools: list[str] = field(default_factory=list)
    """Tool functions (TRL's ``tools=[...]``): built-ins ("add", "run_python") or "module:function"."""
    reward_weight: float = 1.0
    """Weight of the environment's reward (``get_reward()`` or the sum of step rewards) in the trajectory's reward,
    added to the weighted reward functions scored on the final transcript."""
    timeout_s: float = 0.0
    """Seconds one tool call or environment step may take (0: reward.timeout_s)."""
    max_observation_chars: int = 16384
    """A tool result or observation is cut to this many characters (counted in env/truncated)."""
    max_tool_calls_per_turn: int = 8
    """Tool calls of one turn beyond this are not run (each answered with an error)."""

    @property
    def enabled(self) -> bool:
        return bool(self.environment_factory or self.environments or self.tools)

    def __post_init__(self):
        if self.environment_factory and self.environments:
            _fail("env.environments", "must be empty when env.environment_factory is set", self.environments)
        for name, spec in [("env.environment_factory", self.environment_factory),
                           *[(f"env.environments.{k}", v) for k, v in self.environments.items()]]:
            if spec and spec not in BUILTIN_ENVIRONMENTS and ":" not in spec:
                _fail(name, f"must be a built-in ({sorted(BUILTIN_ENVIRONMENTS)}) or 'module:Class'", spec)
        for i, spec in enumerate(self.tools):
            if spec not in BUILTIN_TOOLS and ":" not in spec:
                _fail(f"env.tools[{i}]", f"must be a built-in ({sorted(BUILTIN_TOOLS)}) or 'module:function'", spec)
        if not math.isfinite(self.reward_weight):
            _fail("env.reward_weight", "must be finite", self.reward_weight)
        _check_min("env.timeout_s", self.timeout_s, 0)
        _check_min("env.max_observation_chars", self.max_observation_chars, 1)
        _check_min("env.max_tool_calls_per_turn", self.max_tool_calls_per_turn, 1)


@dataclass
class StageConfig:
    """From GRPO step ``at_step`` on: a new maximum response length, and optionally lr / beta / epsilon_high /
    prompt + response budget, a warm-up that starts again, a fresh optimizer state and a new KL reference."""

    at_step: int = 0
    """First GRPO step of the stage."""
    max_new_tokens: int = 256
    """rollout.max_new_tokens from this step on."""
    lr: float | None = None
    """train.lr from this step on (None: unchanged)."""
    beta: float | None = None
    """grpo.beta from this step on (None: unchanged)."""
    epsilon_high: float | None = None
    """grpo.epsilon_high from this step on (None: unchanged)."""
    max_sequence_tokens: int | None = None
    """rollout.max_sequence_tokens from this step on (None: unchanged; 0: no bound)."""
    restart_warmup: bool = False
    """Run the train.warmup_steps warm-up again from at_step, as a new run started from the previous stage's
    weights does (NeMo-RL's DeepScaleR stages are separate runs)."""
    reset_optimizer: bool = False
    """Clear AdamW's moments and step counts at at_step, as a new run's fresh optimizer."""
    reset_reference: bool = False
    """Make the KL reference model the policy's weights at at_step, as a new run's reference is its starting weights
    (saved once as <run dir>/reference/step_N.pt, ~2 bytes per parameter in bf16, for a resumed run)."""

    def __post_init__(self):
        _check_min("stages[].at_step", self.at_step, 0)
        _check_min("stages[].max_new_tokens", self.max_new_tokens, 1)
        if self.lr is not None:
            _check_min("stages[].lr", self.lr, 0, strict=True)
        if self.beta is not None:
            _check_min("stages[].beta", self.beta, 0)
        if self.epsilon_high is not None:
            _check_min("stages[].epsilon_high", self.epsilon_high, 0)
        if self.max_sequence_tokens is not None:
            _check_min("stages[].max_sequence_tokens", self.max_sequence_tokens, 0)


@dataclass
class CheckpointConfig:
    """Checkpoints: HF-format weights plus trainer state, under ``<run dir>/checkpoints``."""

    every_steps: int = 50
    """Save every this many GRPO steps (0: only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept on disk."""
    resume: str = "auto"
    """"auto" (continue from the latest checkpoint in the run directory, if any), "never", or a checkpoint path."""
    save_final: bool = True
    """Save a checkpoint when training ends."""

    def __post_init__(self):
        _check_min("checkpoint.every_steps", self.every_steps, 0)
        _check_min("checkpoint.keep_last", self.keep_last, 1)
        if not self.resume:
            _fail("checkpoint.resume", "must be 'auto', 'never' or a checkpoint path", self.resume)


@dataclass
class LoggingConfig:
    """Where the run writes, and what it logs to."""

    output_dir: str = ""
    """Run directory (empty: runs/<recipe>-<date>-<time>); metrics.jsonl, config.yaml, plots and checkpoints."""
    tensorboard: bool = False
    """Also log to TensorBoard (when installed)."""
    wandb: bool = False
    """Also log to Weights & Biases (when installed)."""
    wandb_project: str = "fastgrpo"
    """W&B project name."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    log_rollouts: bool = True
    """Write each GRPO step's completions to <run dir>/rollouts/step_<N>.jsonl (N: the step of metrics.jsonl, 8 digits;
    several processes: each writes step_<N>.rank<R>.jsonl), one JSON object per completion of the step's batch: texts,
    token counts, finish reason, each reward function's score, the reward, the advantage, whether it is trained on
    (python -m fastgrpo.rollouts reads them); and each validation's samples to rollouts/eval/step_<N>.jsonl (N: the
    completed steps, as its metrics row has it)."""
    rollouts_keep: int = 100
    """Step files of rollouts/ kept per process, the oldest steps deleted first (0: keep all)."""
    completions_to_print: int = 0
    """Print this many of each GRPO step's completions on rank 0 as a table (0: none)."""
    completions_to_log: int = 16
    """With logging.tensorboard or logging.wandb on: the first this many of each GRPO step's completions on rank 0 (the
    rollout log's rows) go there as a table, "rollouts" (a wandb.Table; TensorBoard text); 0: none."""

    def __post_init__(self):
        _check_min("logging.rollouts_keep", self.rollouts_keep, 0)
        _check_min("logging.completions_to_print", self.completions_to_print, 0)
        _check_min("logging.completions_to_log", self.completions_to_log, 0)


@dataclass
class EvalConfig:
    """Validation: avg@k and pass@k on the held-out prompts."""

    every_steps: int = 0
    """Validate every this many GRPO steps (0: only at the start and the end)."""
    k: int = 1
    """Samples per prompt (avg@k, pass@k)."""
    temperature: float = 1.0
    """Sampling temperature of validation (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass of validation."""
    max_new_tokens: int = 0
    """Longest validation completion (0: the stage's max_new_tokens); the stage's max_sequence_tokens also bounds it."""
    num_prompts: int = 0
    """Validation prompts used (0: all)."""
    at_start: bool = True
    """Validate before the first GRPO step."""
    at_end: bool = True
    """Validate after the last GRPO step."""

    def __post_init__(self):
        _check_min("eval.every_steps", self.every_steps, 0)
        _check_min("eval.k", self.k, 1)
        _check_min("eval.temperature", self.temperature, 0)
        if not 0 < self.top_p <= 1:
            _fail("eval.top_p", "must be in (0, 1]", self.top_p)
        _check_min("eval.max_new_tokens", self.max_new_tokens, 0)
        _check_min("eval.num_prompts", self.num_prompts, 0)


@dataclass
class NumericsConfig:
    """How the generation engine and the trainer compute (the README's "True on-policy numerics")."""

    batch_invariant: bool = False
    """Batch-invariant ops in the engine and the trainer's forward: each sampled token's log-prob equals the trainer's
    packed forward's bit for bit, so the first optimizer step of a rollout takes the engine's log-probs as its old ones
    (no separate forward) and sampling/sampling_logp_difference/max is exactly 0 (CPU, dense Llama/Qwen2/Qwen3)."""


@dataclass
class Config:
    """The whole run."""

    name: str = "tiny"
    """Run name (the recipe's name by default); used in the run directory's name."""
    algorithm: str = "grpo"
    """What a training step does: grpo (rollout and policy update), dpo (preference pairs), sft, distill (GRPO's
    rollout, a teacher's loss), or rm (a reward model on preference pairs)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stages: list[StageConfig] = field(default_factory=list)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)

    def __post_init__(self):
        _check_choice("algorithm", self.algorithm, ALGORITHMS)
        steps = [s.at_step for s in self.stages]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            _fail("stages", "must have strictly increasing at_step values", steps)
        budgets = [("rollout.max_sequence_tokens", self.rollout.max_sequence_tokens)] + [
            (f"stages[{i}].max_sequence_tokens", s.max_sequence_tokens) for i, s in enumerate(self.stages)]
        for name, budget in budgets:
            if budget and budget <= self.data.max_prompt_tokens:
                _fail(name, f"must be 0 or > data.max_prompt_tokens={self.data.max_prompt_tokens} (room for a "
                      "response after the longest prompt)", budget)
        betas = [self.grpo.beta] + [s.beta for s in self.stages if s.beta is not None]
        if self.algorithm == "grpo" and self.sft.warmup_steps and max(betas) > 0:
            # GRPO's reference model is model.path's weights as loaded, not the warmed-up policy GRPO starts from
            _fail("sft.warmup_steps", "must be 0 when grpo.beta or a stage's beta is > 0 (the KL reference "
                  "would be the weights before the warm-up)", self.sft.warmup_steps)
        # sequences of data.max_length that must fit together
        seqs = {"dpo": 2, "rm": 2, "sft": 1}.get(self.algorithm, 0)
        if seqs * self.data.max_length > self.train.max_tokens_per_microbatch:
            _fail("train.max_tokens_per_microbatch", f"must hold {seqs} sequence(s) of data.max_length="
                  f"{self.data.max_length} tokens (algorithm {self.algorithm})", self.train.max_tokens_per_microbatch)
        shaping = self.reward_shaping
        if shaping.enabled and not shaping.max_response_length:
            limits = [self.rollout.max_new_tokens] + [s.max_new_tokens for s in self.stages]
            if shaping.overlong_buffer_length > min(limits):
                _fail("reward_shaping.overlong_buffer_length", f"must be <= the shortest max_new_tokens {min(limits)} "
                      "(reward_shaping.max_response_length is 0: the stage's rollout.max_new_tokens)",
                      shaping.overlong_buffer_length)
        if self.algorithm == "distill":
            self._check_distill()
        elif self.grpo.num_generations < 2:
            _fail("grpo.num_generations", "must be >= 2 (the group baseline; 1 only for algorithm distill with "
                  "distill.reward_weight=0)", self.grpo.num_generations)
        if self.grpo.async_grpo.enabled:
            self._check_async()
        if self.rollout.max_turns > 1 and not self.env.enabled:
            _fail("rollout.max_turns", "must be 1 without an environment (env.environment_factory, "
                  "env.environments or env.tools)", self.rollout.max_turns)
        if self.env.enabled and self.algorithm != "grpo":
            field_set = next(f for f in ("environment_factory", "environments", "tools") if getattr(self.env, f))
            _fail(f"env.{field_set}", f"is for algorithm grpo (multi-turn rollouts), not {self.algorithm}",
                  getattr(self.env, field_set))
        if self.data.path == "synthetic" and self.data.synthetic_task == "sliding_puzzle":
            if self.env.environment_factory != "sliding_puzzle":
                _fail("data.synthetic_task", "sliding_puzzle rows are boards: env.environment_factory must be "
                      "sliding_puzzle", self.data.synthetic_task)
            if self.sft.warmup_steps:
                _fail("sft.warmup_steps", "must be 0 with data.synthetic_task sliding_puzzle (no demonstrations)",
                      self.sft.warmup_steps)
        if self.env.enabled and self.reward.num_workers == 0:
            _fail("reward.num_workers", "must not be 0 with an env: environments run in the reward workers", 0)
        if self.sft.warmup_format == "tool_calls" and "add" not in self.env.tools:
            _fail("sft.warmup_format", "tool_calls demonstrates the 'add' tool: env.tools must include 'add'",
                  self.sft.warmup_format)
        if self.model.lora is not None:
            if self.algorithm == "dpo" and self.sft.warmup_steps:
                _fail("sft.warmup_steps", "must be 0 with model.lora and algorithm dpo (the reference is the base "
                      "with the adapters disabled, not the warmed-up policy)", self.sft.warmup_steps)
            for i, s in enumerate(self.stages):
                if s.reset_reference:
                    _fail(f"stages[{i}].reset_reference", "must be false with model.lora (the reference is the "
                          "base with the adapters disabled, not a copy)", s.reset_reference)
        if self.algorithm == "rm":
            if self.sft.warmup_steps:
                _fail("sft.warmup_steps", "must be 0 with algorithm rm (a reward model has no LM head to warm up)",
                      self.sft.warmup_steps)
            if self.model.lora is not None:
                _fail("model.lora", "must be null with algorithm rm (the reward model trains in full)",
                      "set")
        if self.model.moe.router_replay and self.algorithm != "grpo":
            _fail("model.moe.router_replay", f"is for algorithm grpo (its rollouts record the routing), not "
                  f"{self.algorithm}", True)
        if self.algorithm == "sft" and self.sft.warmup_steps:
            _fail("sft.warmup_steps", "must be 0 with algorithm sft (the warm-up precedes grpo or dpo)",
                  self.sft.warmup_steps)
        if self.numerics.batch_invariant:
            self._check_batch_invariant()

    def _check_async(self) -> None:
        """What grpo.async_grpo needs of the other groups (fastgrpo.algorithms.async_rollout)."""
        checks = [
            ("algorithm", self.algorithm, self.algorithm != "grpo", "must be grpo with grpo.async_grpo.enabled"),
            ("grpo.rollout_is", self.grpo.rollout_is, self.grpo.rollout_is == "none", "must correct the older "
             "policies' tokens (e.g. token_truncate, NeMo-RL's tis) with grpo.async_grpo.enabled"),
            ("reward.models", "set", self.grpo.use_dynamic_sampling and bool(self.reward.models or self.reward.judges),
             "and reward.judges are not supported with async GRPO and grpo.use_dynamic_sampling (a group's signal is "
             "decided when it finishes, before the model rewards score the step's groups)")]
        for name, value, bad, message in checks:
            if bad:
                _fail(name, message, value)

    def _check_distill(self) -> None:
        """What ``algorithm: distill`` needs of the other groups (fastgrpo.algorithms.distill)."""
        d, g = self.distill, self.grpo
        if not d.teacher_path:
            _fail("distill.teacher_path", "must name the teacher's directory with algorithm distill", d.teacher_path)
        if d.reward_weight == 0:
            for name in ("mask_zero_std_groups", "use_dynamic_sampling"):
                if getattr(g, name):
                    _fail(f"grpo.{name}", "must be false with distill.reward_weight=0 (a group whose rewards tie "
                          "still carries the teacher's signal)", getattr(g, name))
        elif g.num_generations < 2:
            _fail("grpo.num_generations", f"must be >= 2 with distill.reward_weight={d.reward_weight} (the reward "
                  "advantages' group baseline)", g.num_generations)
        betas = [g.beta] + [s.beta for s in self.stages if s.beta is not None]
        if max(betas) > 0:  # the teacher is the anchor; a KL reference would be a third model
            _fail("grpo.beta", "must be 0 with algorithm distill (as must every stage's beta)", max(betas))

    def _check_batch_invariant(self) -> None:
        """What numerics.batch_invariant needs of the other groups (fastgrpo.models.batch_invariant refuses the rest
        at start-up: the device, the architecture, the attention)."""
        checks = [
            ("algorithm", self.algorithm, self.algorithm not in ("grpo", "distill"), "must be grpo or distill with "
             "numerics.batch_invariant (it makes the sampler's log-probs the trainer's)"),
            ("model.lora.dropout", self.model.lora and self.model.lora.dropout,
             bool(self.model.lora and self.model.lora.dropout), "must be 0 with numerics.batch_invariant (the "
             "trainer's forward would not be the sampler's)")]
        for name, value, bad, message in checks:
            if bad:
                _fail(name, message, value)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------- building from dicts


def _coerce(value, tp, name: str):
    """Check ``value`` against the annotation ``tp`` (ints widen to floats); build nested dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            _fail(name, "must be a list", value)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_coerce(v, item_tp, f"{name}[{i}]"))
            except ValueError as e:  # an item's __post_init__ says "stages[].beta": name the item
                raise ValueError(str(e).replace(f"{name}[].", f"{name}[{i}].")) from None
        return out
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            _fail(name, "must be a mapping", value)
        return {_coerce(k, key_tp, f"{name} key"): _coerce(v, value_tp, f"{name}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            _fail(name, "must be a mapping of fields", value)
        return _build(tp, value, name)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(name, "must be true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(name, "must be an integer", value)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                _fail(name, "must be a number", value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(name, "must be a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(name, "must be a string", value)
        return value
    raise TypeError(f"unsupported config type {tp} for {name}")


def _build(cls, values: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    moved = [(f"{prefix}.{k}", MOVED[f"{prefix}.{k}"]) for k in unknown if f"{prefix}.{k}" in MOVED]
    if moved:
        raise ValueError("; ".join(f"{old} is now {new}" for old, new in moved) + f" ({MOVED_WHY[prefix]})")
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(f"unknown config key(s) {[where + k for k in unknown]}; "
                         f"{prefix or 'the config'} has {sorted(names)}")
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_names() -> list[str]:
    """Names of the recipes shipped in ``fastgrpo/recipes``."""
    root = resources.files("fastgrpo") / "recipes"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def read_recipe(name: str) -> dict:
    """The raw YAML mapping of a shipped recipe."""
    path = resources.files("fastgrpo") / "recipes" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"--recipe {name!r} does not exist; shipped recipes: {recipe_names()}")
    return yaml.safe_load(path.read_text()) or {}


def _read_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path!r} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a YAML mapping of config groups")
    return data


def parse_override(text: str) -> dict:
    """``"grpo.beta=0.01"`` → ``{"grpo": {"beta": 0.01}}`` (the value is parsed as YAML)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like group.field=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: cannot parse the value ({e})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(recipe: str | None = None, config_file: str | None = None, overrides: list[str] = ()) -> Config:
    """Recipe (or file) → overrides → validated :class:`Config`. ``recipe`` defaults to ``tiny``."""
    if recipe is not None and config_file is not None:
        raise ValueError("give --recipe or --config, not both")
    if config_file is not None:
        data = _read_file(config_file)
        data.setdefault("name", Path(config_file).stem)
    else:
        name = recipe or DEFAULT_RECIPE
        data = read_recipe(name)
        data.setdefault("name", name)
    for text in overrides:
        data = _merge(data, parse_override(text))
    return _build(Config, data, "")


def stage_settings(cfg: Config, step: int) -> dict:
    """The settings in force at (0-based) GRPO step ``step``: ``max_new_tokens``, ``max_sequence_tokens``, ``lr``,
    ``beta``, ``epsilon_high``, and ``warmup_factor``. Stages apply in order from their ``at_step`` on; an override a
    stage leaves unset (None) keeps the previous stage's value (or the base config's).

    The learning rate of the step is ``lr * warmup_factor``, with the linear warm-up (torch LinearLR's closed form,
    counted in GRPO steps from the start of the run or of the last stage with ``restart_warmup``)::

        warmup_factor = f + (1 - f) * min(step - start, W) / W

    with f = train.warmup_start_factor and W = train.warmup_steps (1 when W = 0).
    """
    out = {"max_new_tokens": cfg.rollout.max_new_tokens, "max_sequence_tokens": cfg.rollout.max_sequence_tokens,
           "lr": cfg.train.lr, "beta": cfg.grpo.beta, "epsilon_high": cfg.grpo.epsilon_high}
    start = 0
    for s in cfg.stages:
        if s.at_step > step:
            break
        out["max_new_tokens"] = s.max_new_tokens
        for key in ("max_sequence_tokens", "lr", "beta", "epsilon_high"):
            if getattr(s, key) is not None:
                out[key] = getattr(s, key)
        if s.restart_warmup:
            start = s.at_step
    W, f = cfg.train.warmup_steps, cfg.train.warmup_start_factor
    out["warmup_factor"] = f + (1 - f) * min(step - start, W) / W if W else 1.0
    return out
