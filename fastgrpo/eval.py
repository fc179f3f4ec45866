"""Evaluation: avg@k and pass@k of a model on a prompt dataset, sampled with the co-located generation engine.

For P prompts with k samples each and correctness ``c_pj`` (the built-in ``math`` reward: the last ``\\boxed{}``
equals the ground truth)::

    avg@k  = (1 / P·k) Σ_p Σ_j c_pj          pass@k = (1 / P) Σ_p max_j c_pj

Launch (a checkpoint directory, or any local HF model; the data settings come from the recipe and overrides)::

    python -m fastgrpo.eval runs/tiny-.../checkpoints/step_00000060 --k 4
    python -m fastgrpo.eval /models/my-model --recipe deepscaler-1.5b data.eval_path=/data/aime24.jsonl --k 16

Under torchrun every rank scores its share of the prompts and the counts are summed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from fastgrpo.data.prompts import PromptDataset
from fastgrpo.distributed import all_reduce, get_rank, get_world_size
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.rewards import math_reward


def evaluate(model, tokenizer, dataset: PromptDataset, params: SamplingParams, *, num_prompts: int = 0,
             engine: GenerationEngine | None = None, timeout_s: float = 5.0,
             model_device: str | None = None, sample=None) -> dict[str, float]:
    """``{"avg@k", "pass@k", "response_length/mean", "num_prompts"}`` (k = ``params.n``) over the first
    ``num_prompts`` prompts of ``dataset`` (0: all), this rank's share sampled here with ``params`` (this rank's
    seed: ``fastgrpo.algorithms.sampling.sampling_params`` builds them from the config) and the counts summed over
    ranks. ``engine``: a :class:`GenerationEngine` already built on ``model`` (one is built when None);
    ``model_device``: where the counts are reduced (default: the model's device).

    ``sample(indices, params) -> (completions [prompt][sample], trajectories that called a tool, scores)``:
    multi-turn sampling of the dataset rows ``indices`` (``fastgrpo.algorithms.grpo.GRPO.eval_sampler``) instead of the
    engine
    on ``dataset.prompt_ids``; the result then has ``tool_call_rate`` (trajectories with a tool call / P·k).
    ``scores`` (``[prompt][sample]``, or None for the math verifier): the environment's reward of each trajectory,
    which then stands for ``c_pj`` (a game's solve rate: avg@k its mean, pass@k the mean of each prompt's best)."""
    from fastgrpo.models.loading import eos_token_ids

    n = len(dataset) if num_prompts == 0 else min(num_prompts, len(dataset))
    k = params.n
    rank, world = get_rank(), get_world_size()
    mine = list(range(rank, n, world))
    if engine is None:
        engine = GenerationEngine(model, eos_token_ids=eos_token_ids(model, tokenizer))
    device = torch.device(model_device) if model_device else next(model.parameters()).device
    correct = first_correct = length = tool_trajectories = 0.0
    if mine:
        env_scores = None
        if sample is None:
            outs = engine.generate([dataset.prompt_ids[i] for i in mine], params)
        else:
            outs, tool_trajectories, env_scores = sample(mine, params)
        texts, answers = [], []
        for i, group in zip(mine, outs):
            for c in group:
                texts.append(tokenizer.decode(c.token_ids, skip_special_tokens=True))
                answers.append(dataset.rows[i]["answer"])
                length += len(c.token_ids)
        if env_scores is None:
            scores = torch.tensor([s == 1.0 for s in math_reward([""] * len(texts), texts, answers,
                                                                 timeout_s=timeout_s)], dtype=torch.float64)
        else:
            scores = torch.tensor(env_scores, dtype=torch.float64)
        scores = scores.view(len(mine), k)
        correct = float(scores.sum())
        first_correct = float(scores.max(1).values.sum())
    totals = all_reduce(torch.tensor([correct, first_correct, length, tool_trajectories], dtype=torch.float64,
                                     device=device if device.type == "cuda" and world > 1 else "cpu")).tolist()
    out = {f"avg@{k}": totals[0] / (n * k), f"pass@{k}": totals[1] / n,
           "response_length/mean": totals[2] / (n * k), "num_prompts": float(n)}
    if sample is not None:
        out["tool_call_rate"] = totals[3] / (n * k)
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    from fastgrpo.algorithms.sampling import sampling_params
    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.data.prompts import load_datasets
    from fastgrpo.distributed import destroy, init_distributed, print0
    from fastgrpo.models.loading import load_model, set_cpu_threads

    parser = argparse.ArgumentParser(description="avg@k / pass@k of a model on the validation prompts")
    parser.add_argument("model", help="checkpoint directory (full, or a LoRA adapter: its base is loaded too) or "
                        "local Hugging Face model")
    parser.add_argument("--recipe", default=None, help="recipe whose data settings to use (default: tiny)")
    parser.add_argument("--config", default=None, help="YAML config file instead of a recipe")
    parser.add_argument("--k", type=int, default=None, help="samples per prompt (default: eval.k)")
    parser.add_argument("overrides", nargs="*", help="group.field=value overrides")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.recipe, args.config, [*args.overrides, f"model.path={args.model}"])
    state = init_distributed(cfg.train.device)
    if state.device.type == "cpu":
        set_cpu_threads(cfg.train.num_threads, state.world_size)
    model, tokenizer = load_model(cfg.model, state.device)
    _, held_out = load_datasets(cfg.data, tokenizer)
    if held_out is None:
        raise ValueError("no validation prompts: set data.eval_path (or use data.path=synthetic)")
    k = args.k or cfg.eval.k
    params = sampling_params(cfg, stage_settings(cfg, 0), n=k, seed=cfg.train.seed * 1000 + state.rank,
                             validation=True)
    result = evaluate(model, tokenizer, held_out, params, num_prompts=cfg.eval.num_prompts,
                      timeout_s=cfg.reward.timeout_s)
    print0(" ".join(f"{key}={value:.4f}" for key, value in result.items()))
    destroy()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
