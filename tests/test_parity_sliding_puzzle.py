"""The sliding-puzzle-qwen2.5-1.5b recipe against NeMo-RL's published sliding-puzzle recipe, knob by knob; its boards
and game rules against NeMo-RL's; a game in Qwen2.5's chat template; its memory plan; and the recipe on the tiny
model through the engine.

Source: NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (Aug 2026), the DAPO and DeepScaleR
parities' commit: examples/configs/grpo_sliding_puzzle.yaml (last changed there by b93e399) over
examples/configs/grpo_math_1B.yaml; the boards and the prompt of examples/run_grpo_sliding_puzzle.py
(``generate_puzzle_datum``); the game of nemo_rl/environments/games/sliding_puzzle.py. A value the recipe does not
set is inherited, and the row cites the file it comes from.

Memory plan (``python -m fastgrpo.plan --recipe sliding-puzzle-qwen2.5-1.5b model.path=tests/data/qwen2.5-1.5b-instruct
--nproc 1 --gpu-memory-gib 80``): fits one 80 GiB GPU, as NeMo-RL runs it (``cluster.gpus_per_node 1``): training
peak 35.9 GiB, generation peak 72.6 GiB of 73.6 usable; the KV cache holds 523 sequences of 3072 tokens and the
recipe decodes all 512 trajectories of a step at once. On 8 GPUs: generation peak 34.2 GiB.

``PUBLISHED`` lists what must match; ``DEPARTURES`` lists what fastgrpo does differently, with fastgrpo's value
checked too, so that the table stays true.
"""

import collections
from pathlib import Path

import pytest
import torch
from checks import assert_departure, assert_published
from test_train import train  # SMALL sizes, one torchrun

from fastgrpo.config import load_config, stage_settings
from fastgrpo.data.puzzle_boards import optimal_moves, solved
from fastgrpo.data.synthetic import PUZZLE_PROMPT, synthetic_rows
from fastgrpo.environments.sliding_puzzle import SlidingPuzzle, parse_action
from fastgrpo.metrics import read_jsonl
from fastgrpo.plan import memory_plan
from fastgrpo.shapes import model_shape

REPO = "NVIDIA-NeMo/RL@7ea279a"
BASE = "examples/configs/grpo_math_1B.yaml"
RECIPE = "examples/configs/grpo_sliding_puzzle.yaml"
RUN = "examples/run_grpo_sliding_puzzle.py"
GAME = "nemo_rl/environments/games/sliding_puzzle.py"
# Qwen2.5-1.5B-Instruct's config.json (hidden 1536, 28 layers, 12 / 2 heads, tied embeddings, 32768 positions)
QWEN_15B = Path(__file__).resolve().parent / "data" / "qwen2.5-1.5b-instruct"

# (knob, NeMo-RL key, its value, where it is set, fastgrpo's value from the config)
PUBLISHED = [
    ("learning rate", "policy.optimizer.kwargs.lr", 5e-6, BASE, lambda c: c.train.lr),
    ("AdamW weight decay", "policy.optimizer.kwargs.weight_decay", 0.01, BASE, lambda c: c.train.weight_decay),
    ("AdamW betas", "policy.optimizer.kwargs.betas", (0.9, 0.999), BASE,
     lambda c: (c.train.adam_beta1, c.train.adam_beta2)),
    ("warm-up length, in GRPO steps", "policy.scheduler LinearLR total_iters (milestones [50])", 50, BASE,
     lambda c: c.train.warmup_steps),
    ("warm-up start factor", "policy.scheduler LinearLR start_factor", 0.1, BASE,
     lambda c: c.train.warmup_start_factor),
    ("grad clip (global norm)", "policy.max_grad_norm", 1.0, BASE, lambda c: c.train.max_grad_norm),
    ("compute precision", "policy.precision", "bfloat16", BASE, lambda c: c.model.dtype),
    ("clip low / high", "loss_fn.ratio_clip_min / ratio_clip_max", (0.2, 0.2), BASE,
     lambda c: (c.grpo.epsilon_low, c.grpo.epsilon_high)),
    ("dual clip", "loss_fn.ratio_clip_c", None, BASE, lambda c: c.grpo.dual_clip_c),
    ("KL coefficient beta", "loss_fn.reference_policy_kl_penalty", 0.01, BASE, lambda c: c.grpo.beta),
    ("KL estimator", "loss_fn.reference_policy_kl_type", "k3", BASE, lambda c: c.grpo.kl_estimator),
    ("KL clamps (input, output)", "loss_fn.kl_input_clamp_value / kl_output_clamp_value", (20.0, 10.0), BASE,
     lambda c: (c.grpo.kl_input_clamp, c.grpo.kl_output_clamp)),
    ("KL gradient: k3 times exp(logp - sg(logp))", "loss_fn.use_on_policy_kl_approximation false", "score", BASE,
     lambda c: c.grpo.kl_weight),
    ("loss normalisation", "loss_fn.token_level_loss (mean over the step's tokens)", "dapo", BASE,
     lambda c: c.grpo.loss_type),
    ("importance ratio per token", "loss_fn.sequence_level_importance_ratios false", "token", BASE,
     lambda c: c.grpo.importance_sampling_level),
    ("no rollout IS correction", "loss_fn.use_importance_sampling_correction false", "none", BASE,
     lambda c: c.grpo.rollout_is),
    ("prompts per step", "grpo.num_prompts_per_step", 32, RECIPE, lambda c: c.grpo.num_prompts_per_step),
    ("generations per prompt", "grpo.num_generations_per_prompt", 16, RECIPE, lambda c: c.grpo.num_generations),
    ("sequences per optimizer step", "policy.train_global_batch_size", 512, BASE,
     lambda c: c.train.sequences_per_optimizer_step),
    ("advantage baseline", "grpo.use_leave_one_out_baseline true", "leave_one_out", BASE, lambda c: c.grpo.baseline),
    ("advantage scale", "grpo.normalize_rewards true (leave-one-out std)", "group_loo", BASE, lambda c: c.grpo.scale),
    ("truncated trajectories keep their loss", "grpo.overlong_filtering false", False, BASE,
     lambda c: c.grpo.mask_truncated_completions),
    ("no dynamic sampling", "grpo.use_dynamic_sampling false", False, BASE, lambda c: c.grpo.use_dynamic_sampling),
    ("no reward scaling / shaping", "grpo.reward_scaling.enabled / reward_shaping.enabled false", (False, False),
     BASE, lambda c: (c.reward_scaling.enabled, c.reward_shaping.enabled)),
    ("GRPO steps", "grpo.max_num_steps", 10000, RECIPE, lambda c: c.train.max_steps),
    ("policy turns per trajectory", "grpo.max_rollout_turns", 50, RECIPE, lambda c: c.rollout.max_turns),
    ("conversation budget", "policy.max_total_sequence_length (vLLM max_model_len)", 3072, RECIPE,
     lambda c: c.rollout.max_sequence_tokens),
    ("response limit", "policy.generation.max_new_tokens (= max_total_sequence_length)", 3072, RECIPE,
     lambda c: c.rollout.max_new_tokens),
    ("sampling temperature / top-p / top-k", "policy.generation.{temperature, top_p, top_k}", (1.0, 0.999, 10000),
     RECIPE, lambda c: (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)),
    ("turn stop strings", "datum stop_strings ['</action>'], generation.stop_strings null", ("</action>",),
     f"{RUN}; {RECIPE}", lambda c: tuple(c.rollout.stop_strings) + SlidingPuzzle.stop_strings),
    ("largest board side", "env.sliding_puzzle_game.cfg.game_config.size", 5, RECIPE, lambda c: c.data.puzzle_size),
    ("most shuffle moves", "env.sliding_puzzle_game.cfg.game_config.shuffle_moves", 15, RECIPE,
     lambda c: c.data.puzzle_shuffle_moves),
    ("moves per game", "env.sliding_puzzle_game.cfg.max_moves", 50, RECIPE, lambda c: c.data.puzzle_max_moves),
    ("the game's reward alone", "task sliding_puzzle_game: the environment's reward, no other", (1.0, [0.0]),
     RUN, lambda c: (c.env.reward_weight, c.reward.weights)),
    ("no system prompt, chat template", "data.add_system_prompt false; apply_chat_template(add_generation_prompt)",
     ("", True), f"{RECIPE}; {RUN}", lambda c: (c.data.system_prompt, c.data.use_chat_template)),
    ("data order", "data.shuffle false (the boards are drawn as they come)", False, RECIPE,
     lambda c: c.data.shuffle),
    ("no validation at start / end", "grpo.val_at_start / val_at_end false", (False, False), BASE,
     lambda c: (c.eval.at_start, c.eval.at_end)),
    ("checkpoint period", "checkpointing.save_period", 10, RECIPE, lambda c: c.checkpoint.every_steps),
    ("seed", "grpo.seed", 42, BASE, lambda c: c.train.seed),
]

# (knob, NeMo-RL, fastgrpo's value from the config, why fastgrpo departs)
DEPARTURES = [
    ("observations", f"appended as raw text after the turn's '</action>', no chat template ({REPO} "
     "nemo_rl/experience/rollouts.py run_multi_turn_rollout: tokenizer(env_obs_content))",
     lambda c: c.rollout.stop_strings == [] and c.data.use_chat_template,
     "fastgrpo sends each observation as a user message: the template's end of turn, the user turn and the "
     "generation prompt are prefilled after the stop string (the tokens a chat model was trained on)"),
    ("game texts", f"NeMo-RL's welcome, rules and bordered board ({RUN} prompt_instructions; {GAME} render)",
     lambda c: c.data.path == "synthetic", "fastgrpo's reset states the same rules and actions (up / down / left / "
     "right, slide r c) in its own words with a plain grid, after PUZZLE_PROMPT; the rules, rewards and stop string "
     "are NeMo-RL's (test_game_rules_are_nemo_rls)"),
    ("view and malformed turns", f"'view' shows the board without a move; a turn without <action> gets an error and "
     f"the board, and counts no move ({GAME} process_turn, which returns no new metadata for it)",
     lambda c: c.data.puzzle_max_moves == c.rollout.max_turns == 50,
     "fastgrpo has no 'view' (the board follows every move) and a turn without an action costs a move; with 50 "
     "turns at most, both end a game by its 50th turn unless NeMo-RL's model spends turns on view"),
    ("board supply", f"a fresh board per prompt from the process's random module, an endless dataset ({RUN} "
     "IterablePuzzleDataset)", lambda c: c.data.synthetic_train_size == 32000,
     "fastgrpo draws 32000 boards (1000 steps' worth) with fixed seeds, so that a run and its resume see the same "
     "ones; after 1000 steps they come round again"),
    ("validation", "val_period 10 on 256 boards, checkpoints ranked by val_reward (keep_top_k 3)",
     lambda c: (c.eval.every_steps, c.eval.num_prompts, c.data.synthetic_eval_size, c.checkpoint.keep_last)
     == (10, 256, 256, 3),
     "fastgrpo validates every 10 steps on the 256 held-out boards (eval/accuracy: the game's solve rate, one "
     "trajectory per board) but keeps the last 3 checkpoints, not the 3 best by validation reward"),
    ("reward function", "none but the environment", lambda c: c.reward.functions == ["format"],
     "fastgrpo requires one reward function: format, weighted 0"),
    ("parallelism and memory", "1 GPU (cluster.gpus_per_node 1), DTensor cpu_offload, activation checkpointing, "
     "sequence parallel; vLLM gpu_memory_utilization 0.6", lambda c: c.train.strategy == "ddp"
     and c.train.activation_checkpointing and c.rollout.max_batch_size == 512,
     "fastgrpo keeps everything on the GPU (no offload) and checkpoints activations per layer: the plan fits one "
     "80 GiB GPU with all 512 trajectories decoding at once (test_plan_fits)"),
    ("micro-batching", "sequence_packing train_mb_tokens 3072 x 4", lambda c: c.train.max_tokens_per_microbatch
     == 12288, "the same token budget per packed micro-batch"),
]


@pytest.fixture(scope="module")
def cfg():
    return load_config("sliding-puzzle-qwen2.5-1.5b")


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_recipe_matches_nemo_rl(cfg, row):
    knob, key, value, source, get = row
    assert_published(get(cfg), knob, key, value, f"{REPO} {source}")


@pytest.mark.parametrize("row", DEPARTURES, ids=[r[0] for r in DEPARTURES])
def test_departures_are_what_the_table_says(cfg, row):
    assert_departure(cfg, row)


def test_lr_at_every_step_matches_nemo_rl_scheduler(cfg):
    """NeMo-RL's BASE scheduler (LinearLR 0.1 -> 1 over 50 iterations, then ConstantLR, milestone 50), stepped once
    per GRPO step, against fastgrpo's lr at each of the first 80 steps."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-6)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=50),
        torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=10_000_000_000)], milestones=[50])
    for step in range(80):
        s = stage_settings(cfg, step)
        assert s["lr"] * s["warmup_factor"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9), step
        opt.step()
        sched.step()


def test_boards_are_drawn_as_nemo_rl_draws_them(cfg):
    """generate_puzzle_datum's draw: size ~ randint(2, 5); shuffle ~ randint(1, 15), an even draw plus one, so
    P(1) = 1/15 and P(k) = 2/15 for odd k in 3..15. The 32000 training rows' frequencies are within 5 binomial
    standard deviations of those (a false failure has odds below 1e-6 per cell); every board is unsolved, one
    walk away from the solved board, so its optimum is odd and at most its shuffle moves (the board graph is
    bipartite)."""
    train, held_out = synthetic_rows(cfg.data)
    assert len(train) == 32000 and len(held_out) == 256
    assert {r["seed"] for r in train}.isdisjoint(r["seed"] for r in held_out)
    n = len(train)
    expected = {("size", s): 1 / 4 for s in range(2, 6)}
    expected |= {("shuffle_moves", k): (1 if k == 1 else 2) / 15 for k in range(1, 16, 2)}
    got = collections.Counter()
    for r in train:
        got[("size", r["size"])] += 1
        got[("shuffle_moves", r["shuffle_moves"])] += 1
    assert set(got) == set(expected)
    for cell, p in expected.items():
        assert abs(got[cell] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5, (cell, got[cell], n * p)
    env = SlidingPuzzle()
    for r in train[:200] + held_out[:50]:
        assert r["prompt"] == PUZZLE_PROMPT and (r["min_moves"], r["max_moves"], r["backtrack"]) == (1, 50, True)
        _, state = env.reset(**r)
        d = optimal_moves(tuple(state["grid"]), r["size"], r["shuffle_moves"])
        assert d is not None and d % 2 == 1 and d <= r["shuffle_moves"], r


def nemo_slide(grid, size: int, r: int, c: int) -> tuple[int, ...]:
    """NeMo-RL's move (its SlidingPuzzleGameLogic.step): the tile at (r, c), 0-based, takes the empty cell's place."""
    g = list(grid)
    e = g.index(0)
    g[e], g[r * size + c] = g[r * size + c], 0
    return tuple(g)


def test_game_rules_are_nemo_rls():
    """NeMo-RL's rules, stated independently: 'up' slides the tile below the empty cell up (down: the tile above,
    left: the tile to its right, right: the tile to its left), 'slide r c' the 1-based tile at (r, c); the last
    <action> of the turn counts, case-insensitively; an invalid move scores 0 and ends nothing; the solving move
    scores 1.0 and ends the game."""
    assert parse_action("<action>left</action> then <ACTION> Up </ACTION>") == "up"
    env = SlidingPuzzle()
    offsets = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}  # NeMo-RL's step()
    for seed in range(8):
        row = {"seed": seed, "size": 3, "shuffle_moves": 1, "min_moves": 1, "backtrack": True}
        _, state = env.reset(**row)
        grid = tuple(state["grid"])
        er, ec = divmod(grid.index(0), 3)
        legal = {a: (er + dr, ec + dc) for a, (dr, dc) in offsets.items() if 0 <= er + dr < 3 and 0 <= ec + dc < 3}
        illegal = next(a for a in offsets if a not in legal)
        assert env.step(f"<action>{illegal}</action>", state)[1:3] == (0.0, False) and tuple(state["grid"]) == grid
        winning = [a for a, (r, c) in legal.items() if nemo_slide(grid, 3, r, c) == solved(3)]
        assert len(winning) == 1  # one shuffle move from solved: exactly one move undoes it
        for a, (r, c) in legal.items():  # each direction, and the same move as 'slide r c', move as NeMo-RL's do
            for text in (f"<action>{a.upper()}</action>", f"I think so. <action>slide {r + 1} {c + 1}</action>"):
                _, s = env.reset(**row)
                _, reward, done, _ = env.step(text, s)
                assert tuple(s["grid"]) == nemo_slide(grid, 3, r, c)
                assert (reward, done) == ((1.0, True) if a == winning[0] else (0.0, False)), (seed, text)


@pytest.mark.parametrize("nproc", [1, 8])
def test_plan_fits(nproc):
    """Qwen2.5-1.5B-Instruct's shape (1.54B parameters, tied embeddings): the recipe as shipped fits 80 GiB GPUs;
    on one, the KV cache holds 523 sequences of 3072 tokens, the recipe decodes 512 (all of a step's trajectories);
    at 3200 tokens it holds fewer than 512 and the verdict names the cure. β = 0.01 loads the reference model."""
    cfg = load_config("sliding-puzzle-qwen2.5-1.5b", overrides=[f"model.path={QWEN_15B}"])
    s = model_shape(cfg)
    assert (s.params, s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.vocab) == (
        1_543_714_304, 28, 1536, 12, 2, 128, 151936)
    plan = memory_plan(cfg, nproc, 80, shape=s)
    assert plan.fits and plan.reference > 0 and plan.batch == 512 // nproc, plan.verdict()  # a step, per GPU
    if nproc == 1:
        wider = memory_plan(load_config("sliding-puzzle-qwen2.5-1.5b", overrides=[
            f"model.path={QWEN_15B}", "rollout.max_sequence_tokens=3200"]), 1, 80, shape=s)
        assert not wider.fits and "rollout.max_batch_size<=" in wider.verdict(), wider.verdict()


def test_bad_puzzle_settings_fail_at_start_up():
    with pytest.raises(ValueError, match="data.synthetic_task"):
        load_config(overrides=["data.synthetic_task=sliding_puzzle"])
    with pytest.raises(ValueError, match="sft.warmup_steps"):
        load_config("sliding-puzzle-qwen2.5-1.5b", overrides=["sft.warmup_steps=5"])
    with pytest.raises(ValueError, match="data.puzzle_size"):
        load_config("sliding-puzzle-qwen2.5-1.5b", overrides=["data.puzzle_size=1"])


def test_recipe_runs_through_the_engine_on_the_tiny_model(tmp_path):
    """The recipe with the tiny model and small sizes, 2 GRPO steps through torchrun, the engine, the chat template
    and the reward workers: 2x2 boards of at most 3 shuffle moves, 2 moves per game. The untrained model rarely
    writes '</action>', so vowels end its turns too (rollout.stop_strings): each turn it wrote is a move without
    an action, the observation is prefilled and decoding resumes; a game ends at its second move ("env_done")."""
    run_dir = tmp_path / "run"
    train(tmp_path, run_dir, "--recipe", "sliding-puzzle-qwen2.5-1.5b", "model.path=tiny", "model.dtype=float32",
          "sft.warmup_steps=0", "train.max_steps=2", "checkpoint.every_steps=0", "data.synthetic_train_size=64",
          "data.synthetic_eval_size=8", "data.puzzle_size=2", "data.puzzle_shuffle_moves=3",
          "data.puzzle_max_moves=2", "grpo.num_prompts_per_step=2", "grpo.num_generations=4",
          "rollout.max_new_tokens=8", "rollout.max_sequence_tokens=600", "rollout.max_turns=3",
          "rollout.max_batch_size=8", "rollout.stop_strings=[a,e,o]", "train.sequences_per_optimizer_step=8",
          "train.max_tokens_per_microbatch=4096")
    steps = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "env/turns_mean" in r]
    assert len(steps) == 2
    assert max(r["env/turns/max"] for r in steps) == 2  # puzzle_max_moves 2 ends every game by its second turn
    assert any(r["env/finish/env_done"] > 0 for r in steps)
    assert all(r["generation/resume_prefill_tokens/sum"] > 0 for r in steps)
    assert all(r["env/failures/reset/sum"] == 0 and r["env/failures/step/sum"] == 0 for r in steps)


def test_a_game_in_qwen25s_template_is_its_rendering():
    """A recipe row played to the end in Qwen2.5's published chat template (a local BPE tokenizer carrying it): the
    template passes the prefix check, and prompt + each turn (stopped at '</action>') + each observation's suffix
    decode to exactly the template's rendering of the whole conversation; the BFS-optimal play scores 1.0."""
    from chat_tokenizers import qwen25
    from test_environments import optimal_actions

    from fastgrpo.data.prompts import prompt_messages
    from fastgrpo.environments.chat import ChatTemplate

    cfg = load_config("sliding-puzzle-qwen2.5-1.5b")
    row = next(r for r in synthetic_rows(cfg.data)[0] if r["size"] == 3 and r["shuffle_moves"] >= 5)
    template, env = ChatTemplate(qwen25()), SlidingPuzzle()
    assert "replaced" not in template.name  # Qwen2.5's own template is prefix-preserving
    text, state = env.reset(**row)
    messages = prompt_messages(row["prompt"], cfg.data)
    messages[-1]["content"] += text
    ids = template.prompt_ids(messages)
    actions = optimal_actions(tuple(state["grid"]), 3)
    assert len(actions) == 3  # this row's board (15 shuffle moves, seed 263): three turns, two observations
    for k, a in enumerate(actions):
        turn = f"The empty cell must move. <action>{a}</action>"
        ids += template.ids(turn)
        messages.append({"role": "assistant", "content": turn})
        obs, reward, done, _ = env.step(turn, state)
        assert (reward, done) == ((1.0, True) if k == len(actions) - 1 else (0.0, False))
        if not done:
            ids += template.suffix_ids(messages, [{"role": "user", "content": obs}])
            messages.append({"role": "user", "content": obs})
    tok = template.tok
    assert tok.decode(ids) == template.render(messages, False).removesuffix(template.end_of_turn)
