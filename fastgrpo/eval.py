"""Evaluation: avg@k, pass@k, maj@k and cons@k of a model on a prompt dataset, sampled with the co-located engine.

For P prompts with k samples each and correctness ``c_pj`` (the built-in ``math`` reward: the last ``\\boxed{}``
equals the ground truth)::

    avg@k  = (1 / P·k) Σ_p Σ_j c_pj          pass@k = (1 / P) Σ_p max_j c_pj
    maj@k  = (1 / P) Σ_p c_{p, m(p)}         cons@k = (1 / P) Σ_p c_{p, s(p)}

maj@k (majority vote, self-consistency): ``a_pj`` is the answer the verifier extracts (``last_boxed``, the content
of the last complete ``\\boxed{}``); a completion with none (or an empty box, from which math-verify parses nothing)
does not vote. The answers are grouped as the verifier compares them: in order of appearance, an answer ``a`` joins
the first group whose first answer ``r`` it equals per the verifier (``math_score`` of ``\\boxed{a}`` against the
ground truth ``r``: ``fast_verdict``, else math-verify; so ``1/2``, ``0.5`` and ``\\frac{1}{2}`` are one answer),
else it opens a group. ``m(p)`` is the first completion of the group with the most votes; ties go to the group that
appeared first. A prompt with no answer at all counts 0.

cons@k is NeMo-RL's (``nemo_rl/evals/eval.py``, ``eval_cons_k``): the mean over the size-k subsets of the n
samples of whether the subset's most common extracted answer is correct, the answers compared as they were extracted
(exact strings, no verifier equivalence), "no answer" a candidate like any other (it scores 0), ties to the answer
seen first, and the answer's correctness that of the first completion that gave it. Here n = k, so the mean is over
one subset: ``s(p)`` is the first completion with the most common ``a_pj`` (None included). It differs from maj@k
in that spellings are not merged and a majority of unanswered completions counts 0 (NeMo-RL has no maj@k of its
own). maj@k and cons@k exist only with the math verifier: environment scores (``sample`` returning ``scores``)
come with no answers, and the result then leaves both out.

Launch (a checkpoint directory, or any local HF model; the data settings come from the recipe and overrides)::

    python -m fastgrpo.eval runs/tiny-.../checkpoints/step_00000060 --k 4
    python -m fastgrpo.eval /models/my-model --recipe deepscaler-1.5b data.eval_path=/data/aime24.jsonl --k 16

Under torchrun every rank scores its share of the prompts and the counts (maj@k's and cons@k's included) are summed.
``--samples DIR`` writes every sample (:func:`sample_row`: prompt, completion, extracted answer, score) to
``DIR/step_00000000.jsonl`` (a file per rank under torchrun), and the trainer's validation writes its own to
``<run dir>/rollouts/eval/step_<N>.jsonl`` with ``logging.log_rollouts``; ``python -m fastgrpo.rollouts DIR`` reads
either.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from fastgrpo.data.prompts import PromptDataset
from fastgrpo.distributed import all_reduce, get_rank, get_world_size
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.rewards import BOXED, last_boxed, math_reward, math_score


def extracted_answer(text: str) -> str | None:
    """The answer the math verifier reads from ``text``: its last complete ``\\boxed{}`` content, None when there is
    none or it is empty (blank)."""
    a = last_boxed(text)
    return a if a is not None and a.strip() else None


def _same_answer(first: str, other: str, timeout_s: float) -> bool:
    """``other`` equals ``first`` per the math verifier (``first`` in the ground truth's place); a verification that
    fails or times out says no."""
    if other == first:
        return True
    try:  # the math reward of a completion boxing ``other`` against the ground truth ``first``
        return math_score(f"{BOXED}{other}}}", first, timeout_s) == 1.0
    except Exception:  # noqa: BLE001 - like math_reward: a failed check is "not equal", never a stopped evaluation
        return False


def majority_index(answers: Sequence[str | None], timeout_s: float = 5.0) -> int | None:
    """maj@k's vote among one prompt's extracted ``answers`` (None: no vote): the index of the first completion of
    the biggest group of verifier-equal answers (groups formed in order of appearance, each answer joining the first
    group whose first answer it equals; ties to the group that appeared first), None when nobody answered."""
    firsts: list[int] = []
    votes: list[int] = []
    for j, a in enumerate(answers):
        if a is None:
            continue
        for g, f in enumerate(firsts):
            if _same_answer(answers[f], a, timeout_s):
                votes[g] += 1
                break
        else:
            firsts.append(j)
            votes.append(1)
    if not firsts:
        return None
    return firsts[max(range(len(votes)), key=votes.__getitem__)]  # max keeps the first of the tied


def consensus_index(answers: Sequence[str | None]) -> int:
    """cons@k's vote (NeMo-RL's ``eval_cons_k`` with n = k): the index of the first completion giving the most
    common extracted answer, compared as strings, None a candidate too, ties to the answer seen first."""
    counts = Counter(answers)  # insertion ordered; max returns the first maximal key
    top = max(counts, key=counts.__getitem__)
    return answers.index(top)


def sample_row(tokenizer, dataset: PromptDataset, index: int, j: int, completion, text: str, score: float) -> dict:
    """The eval sample log's row of completion ``j`` of dataset row ``index``: ``group`` (the prompt's index in the
    dataset), ``sample``, ``prompt`` and ``completion`` (decoded with the special tokens, as the rollout log has
    them), their token counts, ``finish_reason``, ``answer`` (the ground truth), ``extracted`` (the answer the
    verifier reads in ``text``, the completion without special tokens; None: none) and ``reward`` (``c_pj``)."""
    prompt = tokenizer.decode(dataset.prompt_ids[index], skip_special_tokens=False)
    return {"group": index, "sample": j, "prompt": prompt,
            "completion": tokenizer.decode(list(completion.token_ids), skip_special_tokens=False),
            "prompt_tokens": len(dataset.prompt_ids[index]), "completion_tokens": len(completion.token_ids),
            "finish_reason": completion.finish_reason, "answer": dataset.rows[index].get("answer"),
            "extracted": extracted_answer(text), "reward": score}


def write_eval_samples(directory: Path, step: int, rows: list[dict], rank: int, world_size: int, keep: int) -> Path:
    """``rows`` (:func:`sample_row`, ``step`` added to each) as ``directory/step_<step>.jsonl`` (``.rank<R>`` with
    several processes), written atomically, keeping the ``keep`` latest steps (0: all), as the rollout log does;
    ``python -m fastgrpo.rollouts <directory>`` reads them. Returns the file."""
    from fastgrpo.algorithms.rollout_log import prune, step_file_name, write_jsonl

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / step_file_name(step, rank, world_size)
    write_jsonl(path, [{"step": step, **r} for r in rows])
    prune(directory, keep, None if world_size == 1 else rank)
    return path


def evaluate(model, tokenizer, dataset: PromptDataset, params: SamplingParams, *, num_prompts: int = 0,
             engine: GenerationEngine | None = None, timeout_s: float = 5.0,
             model_device: str | None = None, sample=None, rows: list[dict] | None = None) -> dict[str, float]:
    """``{"avg@k", "pass@k", "maj@k", "cons@k", "response_length/mean", "num_prompts"}`` (k = ``params.n``; the
    module docstring has the formulas) over the first
    ``num_prompts`` prompts of ``dataset`` (0: all), this rank's share sampled here with ``params`` (this rank's
    seed: ``fastgrpo.algorithms.sampling.sampling_params`` builds them from the config) and the counts summed over
    ranks. ``engine``: a :class:`GenerationEngine` already built on ``model`` (one is built when None);
    ``model_device``: where the counts are reduced (default: the model's device).

    ``sample(indices, params) -> (completions [prompt][sample], trajectories that called a tool, scores)``:
    multi-turn sampling of the dataset rows ``indices`` (``fastgrpo.algorithms.grpo.GRPO.eval_sampler``) instead of the
    engine
    on ``dataset.prompt_ids``; the result then has ``tool_call_rate`` (trajectories with a tool call / P·k).
    ``scores`` (``[prompt][sample]``, or None for the math verifier): the environment's reward of each trajectory,
    which then stands for ``c_pj`` (a game's solve rate: avg@k its mean, pass@k the mean of each prompt's best);
    such scores come without answers to vote on, so the result then has no maj@k / cons@k.

    ``rows``: when given, one row per completion of this rank's share is appended to it (:func:`sample_row`)."""
    from fastgrpo.models.loading import eos_token_ids

    n = len(dataset) if num_prompts == 0 else min(num_prompts, len(dataset))
    k = params.n
    rank, world = get_rank(), get_world_size()
    mine = list(range(rank, n, world))
    if engine is None:
        engine = GenerationEngine(model, eos_token_ids=eos_token_ids(model, tokenizer))
    device = torch.device(model_device) if model_device else next(model.parameters()).device
    correct = first_correct = length = tool_trajectories = majority = consensus = verified = 0.0
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
        if env_scores is None:  # the math verifier: vote on the extracted answers
            verified = 1.0
            for p in range(len(mine)):
                group = [extracted_answer(t) for t in texts[p * k : (p + 1) * k]]
                m = majority_index(group, timeout_s)
                majority += 0.0 if m is None else float(scores[p, m])
                consensus += float(scores[p, consensus_index(group)])
        if rows is not None:
            for p, (i, group) in enumerate(zip(mine, outs)):
                rows += [sample_row(tokenizer, dataset, i, j, c, texts[p * k + j], float(scores[p, j]))
                         for j, c in enumerate(group)]
    totals = all_reduce(torch.tensor([correct, first_correct, length, tool_trajectories, majority, consensus,
                                      verified], dtype=torch.float64,
                                     device=device if device.type == "cuda" and world > 1 else "cpu")).tolist()
    out = {f"avg@{k}": totals[0] / (n * k), f"pass@{k}": totals[1] / n}
    if totals[6] > 0:  # some rank scored with the math verifier (all do: a rank without prompts adds 0)
        out[f"maj@{k}"], out[f"cons@{k}"] = totals[4] / n, totals[5] / n
    out |= {"response_length/mean": totals[2] / (n * k), "num_prompts": float(n)}
    if sample is not None:
        out["tool_call_rate"] = totals[3] / (n * k)
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    from fastgrpo.algorithms.sampling import sampling_params
    from fastgrpo.config import load_config, stage_settings
    from fastgrpo.data.prompts import load_datasets
    from fastgrpo.distributed import destroy, init_distributed, print0
    from fastgrpo.models.loading import load_model, set_cpu_threads

    parser = argparse.ArgumentParser(description="avg@k / pass@k / maj@k / cons@k of a model on the validation prompts")
    parser.add_argument("model", help="checkpoint directory (full, or a LoRA adapter: its base is loaded too) or "
                        "local Hugging Face model")
    parser.add_argument("--recipe", default=None, help="recipe whose data settings to use (default: tiny)")
    parser.add_argument("--config", default=None, help="YAML config file instead of a recipe")
    parser.add_argument("--k", type=int, default=None, help="samples per prompt (default: eval.k)")
    parser.add_argument("--samples", default=None, metavar="DIR",
                        help="write every sample (prompt, completion, extracted answer, score) to "
                        "DIR/step_00000000.jsonl (one file per rank under torchrun); read it with "
                        "python -m fastgrpo.rollouts DIR")
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
    rows = [] if args.samples else None
    result = evaluate(model, tokenizer, held_out, params, num_prompts=cfg.eval.num_prompts,
                      timeout_s=cfg.reward.timeout_s, rows=rows)
    if rows is not None:
        path = write_eval_samples(Path(args.samples), 0, rows, state.rank, state.world_size, keep=0)
        print0(f"samples: {path if state.world_size == 1 else path.parent}")
    print0(" ".join(f"{key}={value:.4f}" for key, value in result.items()))
    destroy()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
