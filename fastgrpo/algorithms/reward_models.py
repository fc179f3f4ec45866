"""Model rewards: sequence classifiers (``reward.models``) and generative judges (``reward.judges``), run on the GPU in
the trainer process, next to the policy.

Each reward model (a directory ``AutoModelForSequenceClassification`` loads with one label, e.g. an ``algorithm: rm``
checkpoint, or a fastgrpo run directory: its latest complete checkpoint) is loaded in the compute dtype
``model.dtype``, frozen (no grad, eval mode), and runs the padding-free packed forward of
:func:`fastgrpo.models.reward_model.packed_scores`: the completions of a step packed into micro-batches of at most
``train.max_tokens_per_microbatch`` tokens, one no-grad forward per micro-batch, the head on each sequence's pooled
token only. Under ``train.strategy: fsdp2`` it is sharded like the distillation teacher (each decoder layer, then the
root, in its own dtype: no fp32 masters); otherwise every rank holds a full copy, as GRPO's KL reference. Every rank
runs the same number of forwards per model (the global maximum of the micro-batch counts; a rank with fewer repeats
its last one), so FSDP2's gathers pair up. The reward models never run in the reward workers: those stay torch-free,
for Python functions.

What a reward model reads (``reward.models[].chat_template``): null, the policy's prompt and completion tokens as
they are when its tokenizer maps every token to the policy's ids (an ``rm`` model trained on this policy's data: the
very sequences it was trained on, ending with EOS when the completion finished), else their text (special tokens
kept) re-tokenised by its own tokenizer; ``"tokenizer"`` or a Jinja template, the messages
``[system: data.system_prompt (when set), user: the question through data.prompt_template, assistant: the completion]``
rendered by its tokenizer's chat template or by that template, then tokenised.

A completion's reward is the reward functions' weighted sum plus ``Σ_i weight_i · score_i`` over the models; each
model's raw scores are logged as ``reward/<name>/mean`` and in the rollout log's per-completion ``rewards``.

A generative judge (``reward.judges``: a Hugging Face causal LM) is loaded in the compute dtype, frozen, with a
generation engine of its own (:class:`fastgrpo.engine.GenerationEngine` on its weights, a full copy on every rank:
the engine reads whole weight tensors, so a judge is never sharded). Per completion it gets one user message,
``prompt_template`` formatted with the question and the completion's text (special tokens dropped), rendered by its
tokenizer's chat template (with the generation prompt) when it has one; it answers greedily (temperature 0, at most
``max_new_tokens``); the score is the last match of ``verdict_pattern`` in the answer (its group 1, else the whole
match) as a float. An answer without a match, or whose match is not a number, scores 0 and counts in
``reward/<name>/failures``.

Scheduling: the models and judges score a step's completions **after** generation, in one packed pass per model and
one generation call per judge (the engines and the models share the GPU and its stream; the reward workers'
functions keep scoring each group as the engine finishes it, in other processes). Scoring finished groups while the
engine decodes the rest (the issue's overlap) is not done: on one stream a model forward between two decode steps
would delay those steps by as much as it saves.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from fastgrpo.checkpoint import latest_checkpoint
from fastgrpo.config import Config, JudgeConfig, ModelConfig, RewardModelConfig
from fastgrpo.distributed import all_reduce, wrap_model
from fastgrpo.engine import GenerationEngine, SamplingParams
from fastgrpo.models.loading import eos_token_ids, load_model
from fastgrpo.models.packing import pack, plan_microbatches
from fastgrpo.models.reward_model import load_reward_model, packed_scores
from fastgrpo.rewards import RewardResult

JUDGE_SEED = 0  # greedy decoding draws nothing; the engine still takes a seed


def reward_model_dir(path: str) -> Path:
    """The model directory of ``reward.models[].path``: the path itself when it holds a ``config.json``, else the
    latest complete checkpoint of the fastgrpo run directory there."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    ckpt = latest_checkpoint(p) if p.is_dir() else None
    if ckpt is None:
        raise ValueError(f"reward.models: {path!r} holds no model (no config.json) and no complete fastgrpo "
                         "checkpoint")
    return ckpt


class RewardModels:
    """The configured reward models of one run (module docstring): :meth:`score` a step's completions, :meth:`join`
    their scores into the reward functions' result."""

    def __init__(self, cfg: Config, state, tokenizer):
        self.cfg = cfg
        self.state = state
        self.policy_tokenizer = tokenizer
        self.names = cfg.reward.model_names()
        self.specs: list[RewardModelConfig] = list(cfg.reward.models)
        self.models, self.tokenizers, self.same_ids = [], [], []
        fsdp = cfg.train.strategy == "fsdp2" and state.world_size > 1
        for spec in self.specs:
            model, tok = load_reward_model(reward_model_dir(spec.path), cfg.model.dtype, state.device,
                                           trust_remote_code=cfg.model.trust_remote_code)
            mp = None
            if fsdp:
                from torch.distributed.fsdp import MixedPrecisionPolicy

                mp = MixedPrecisionPolicy()  # sharded in its own (compute) dtype: no masters for a frozen model
            self.models.append(wrap_model(model, state, "fsdp2" if fsdp else "none", forward=packed_scores,
                                          mp_policy=mp))
            self.tokenizers.append(tok)
            self.same_ids.append(tok.get_vocab() == tokenizer.get_vocab() and len(tok) == len(tokenizer))

    def _sequences(self, i: int, prompts: list[list[int]], completions: list[list[int]],
                   questions: list[str]) -> list[list[int]]:
        """Model ``i``'s token sequences of the completions (module docstring: what a reward model reads)."""
        spec, tok, ptok = self.specs[i], self.tokenizers[i], self.policy_tokenizer
        if spec.chat_template is None:
            if self.same_ids[i]:
                return [p + c for p, c in zip(prompts, completions)]
            texts = [ptok.decode(p + c) for p, c in zip(prompts, completions)]
            return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        d = self.cfg.data
        template = None if spec.chat_template == "tokenizer" else spec.chat_template
        out = []
        for q, c in zip(questions, completions):
            messages = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else []) + [
                {"role": "user", "content": d.prompt_template.format(prompt=q)},
                {"role": "assistant", "content": ptok.decode(c, skip_special_tokens=True)}]
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
            out.append(tok(text, add_special_tokens=False)["input_ids"])
        return out

    @torch.no_grad()
    def score(self, prompts: list[list[int]], completions: list[list[int]], questions: list[str]
              ) -> dict[str, list[float]]:
        """Each model's score of every completion (``prompts[j] + completions[j]``; ``questions[j]``: its question
        text, for the chat-template models): name -> one float per completion, in order."""
        out = {}
        max_tokens = self.cfg.train.max_tokens_per_microbatch
        coll = self.state.device if self.state.backend == "nccl" else torch.device("cpu")
        for i, (name, model) in enumerate(zip(self.names, self.models)):
            seqs = self._sequences(i, prompts, completions, questions)
            groups = plan_microbatches([len(s) for s in seqs], max_tokens) if seqs else []
            n_mb = int(all_reduce(torch.tensor([len(groups)], device=coll), "max").item())  # sync: the loop count
            scores_B = torch.zeros(len(seqs), device=self.state.device)
            for k in range(n_mb):
                # a rank without sequences runs a one-token stand-in, for FSDP2's gathers
                group = groups[min(k, len(groups) - 1)] if groups else None
                batch = pack([seqs[j] for j in group] if group else [[0]]).to(self.state.device)
                s_B = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)  # [B]
                if group is not None and k < len(groups):
                    scores_B[torch.tensor(group, device=s_B.device)] = s_B
            out[name] = scores_B.tolist()  # sync: the scores join the host-side rewards
        return out

    def join(self, result: RewardResult, scores: dict[str, list[float]]) -> RewardResult:
        """``result`` with the models' scores (:func:`join_scores`)."""
        return join_scores(result, scores, {n: s.weight for n, s in zip(self.names, self.specs)})


def join_scores(result: RewardResult, scores: dict[str, list[float]], weights: dict[str, float],
                faults: dict[str, dict[str, int]] | None = None) -> RewardResult:
    """``result`` (the reward functions') with more scores: name -> one raw score per completion, next to the
    functions' (and their fault counts), and ``Σ weight · score`` added to every completion's total."""
    total = list(result.total)
    for name, values in scores.items():
        total = [t + weights[name] * s for t, s in zip(total, values, strict=True)]
    return RewardResult(total=total, per_function={**result.per_function, **scores},
                        faults={**result.faults, **(faults or {})})


def parse_verdict(text: str, pattern: str) -> float | None:
    """The score in a judge's answer: the last match of ``pattern`` (group 1, else the whole match) as a finite
    float; None when nothing matches or the match is not a number."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    try:
        value = float(last.group(1) if last.re.groups else last.group(0))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class GenerativeJudges:
    """The configured generative judges of one run (module docstring): :meth:`score` the completions' texts."""

    def __init__(self, cfg: Config, state):
        self.cfg = cfg
        self.names = cfg.reward.judge_names()
        self.specs: list[JudgeConfig] = list(cfg.reward.judges)
        self.weights = {n: j.weight for n, j in zip(self.names, self.specs)}
        self.tokenizers, self.engines = [], []
        for spec in self.specs:
            mcfg = ModelConfig(path=spec.path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
            model, tok = load_model(mcfg, state.device, seed=cfg.train.seed)
            model.requires_grad_(False).eval()
            self.tokenizers.append(tok)
            self.engines.append(GenerationEngine(model, eos_token_ids=eos_token_ids(model, tok),
                                                 max_batch_size=cfg.rollout.max_batch_size, tokenizer=tok))

    def prompt_ids(self, i: int, question: str, completion: str) -> list[int]:
        """Judge ``i``'s prompt tokens for one completion's text (module docstring)."""
        tok = self.tokenizers[i]
        text = self.specs[i].prompt_template.format(question=question, completion=completion)
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def score(self, questions: list[str], completions: list[str]
              ) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
        """Each judge's score of every completion text (``questions[j]``: its question), and the failures counted per
        judge (``{"failures": n}``)."""
        scores, faults = {}, {}
        for i, (name, spec, engine) in enumerate(zip(self.names, self.specs, self.engines)):
            prompts = [self.prompt_ids(i, q, c) for q, c in zip(questions, completions)]
            params = SamplingParams(temperature=0.0, max_new_tokens=spec.max_new_tokens, seed=JUDGE_SEED)
            outs = engine.generate(prompts, params) if prompts else []
            verdicts = [parse_verdict(self.tokenizers[i].decode(group[0].token_ids, skip_special_tokens=True),
                                      spec.verdict_pattern) for group in outs]
            scores[name] = [0.0 if v is None else v for v in verdicts]
            faults[name] = {"failures": sum(v is None for v in verdicts)}
        return scores, faults
