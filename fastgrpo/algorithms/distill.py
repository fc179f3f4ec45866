"""On-policy distillation (``algorithm: distill``): the student samples with the co-located engine exactly as in GRPO,
a frozen teacher with the same tokenizer reads the sampled sequences, and the loss pulls the student towards it.

Per completion token ``t`` of a sampled sequence (``h`` / ``g`` the student's / teacher's last hidden state there,
``T`` = ``rollout.temperature`` for both models, ``A`` the group advantages of GRPO from the rewards,
``w`` = ``distill.reward_weight``, ``V`` the tokenizer's real vocabulary)::

    full           loss = agg_t D(p_t, q_t) + [w > 0] · GRPO loss with advantages w·A        (GKD, Agarwal et al.)
                   D: TRL's generalized JSD with distill.beta, or NeMo-RL's mixed KL with distill.mixed_kl_weight,
                   exact over the V real tokens, from h, g and the two heads (fused_linear_distill_loss)
    sampled_token  A_t = w·A + logp_teacher(y_t) − logp_student(y_t)    in the clipped policy-gradient loss
                   (Thinking Machines' on-policy distillation, NeMo-RL's MOPD with one teacher)

``agg`` is the token aggregation of ``grpo.loss_type`` (``LOSS_REDUCTION``: dapo's global token mean for the default),
re-weighted over micro-batches and ranks as the GRPO loss is (``fastgrpo.algorithms.update``), so one and W processes
give the
same loss. In sampled-token mode ``logp_student`` is the engine's log-prob of the sampled token (the distribution it
was drawn from, as Thinking Machines' sampler log-probs) and ``logp_teacher`` the teacher's at the same temperature
(``masked_linear_logprobs`` on its hidden state, over its first V head rows); ``A_t`` is a constant, so on the first
optimizer step (ratio 1) the gradient is ``−∇ Σ_t A_t logp_student(y_t)``: descending it lowers the sampled-token
estimate of KL(student ‖ teacher). Both modes reach the teacher's distribution; full mode uses every token's whole
distribution (no estimator variance) at about twice the GRPO loss's vocabulary work for a teacher as wide as the
student (per kept token 14·V·H multiply-adds in the KL modes, 18·V·H for the JSD with its second pass, the teacher's
log-prob metric included, against 8·V·H; more for a wider teacher), sampled-token mode one log-prob per token from
the teacher (2·V·Ht) and the GRPO loss.

The teacher (``distill.teacher_path``: a Hugging Face directory, e.g. a fastgrpo checkpoint, or a fastgrpo run
directory) is loaded in the compute dtype ``model.dtype``, frozen, and runs the packed no-grad forward to its last
hidden state (``fastgrpo.algorithms.forward.packed_forward``): in full mode on each micro-batch right before the
student's forward, in sampled-token mode on the rollout's micro-batches before the update (every rank the same number of
forwards). Under ``train.strategy: fsdp2`` it is sharded like the student (each decoder layer, then the root) in its
own dtype (no fp32 masters: it never steps); otherwise every rank holds a full copy, as GRPO's KL reference.
A teacher whose tokenizer maps any token to another id than the student's, or has another size, is refused at
start-up (:func:`check_tokenizers`; NeMo-RL's ``check_vocab_equality`` compares the same, and also the configs'
``vocab_size``, which fastgrpo does not: Qwen2.5-7B pads its head to 152,064 rows, the 1.5B to 151,936, with one
tokenizer of 151,665 tokens). Head rows beyond the tokenizer are left out of both softmaxes of the divergence
and of the teacher's log-probs; the student's own log-probs (the engine's, the policy loss's) keep every row of its
head, as GRPO's do (a trained model gives padded rows a negligible mass).

Memory (per GPU, ``c`` bytes per element of the compute dtype, ``P_t`` the teacher's parameters; counted by
``fastgrpo.plan``): the teacher's weights ``c·P_t`` (fsdp2: ``c·P_t / W`` plus its root, gathered from its first
forward on, and two layers while it runs); a micro-batch of T tokens keeps the teacher's hidden state ``c·T·Ht``
through the student's backward (full mode: the kernel recomputes the teacher's logits from it); its forward's
working set is one layer's, freed before the student's forward starts. Sampled-token mode keeps instead one Python
float per completion token of the rollout on the host (``Sample.token_advantages``, ~32 bytes a token: 4 MB for 16
completions of 8K tokens). Nothing of size tokens × vocabulary is allocated in either mode.

Metrics (token means over the loss tokens): ``distill/divergence`` (full: the kernel's D, the configured
divergence; sampled-token: ``logp_student − logp_teacher``, the sampled-token estimate of KL(student ‖ teacher)),
``distill/teacher_logp`` and ``distill/student_logp`` (of the sampled tokens, the student's from the engine), and
GRPO's ``accuracy`` / ``eval/accuracy`` from the reward functions and the held-out prompts. A mixture-of-experts
student's loss also gets the router's load-balancing term in both modes, as GRPO's (``fastgrpo.algorithms.moe``;
TRL's GKDTrainer adds none), logged as ``moe/aux_loss``; an MoE teacher routes its own tokens.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import torch

from fastgrpo.algorithms.batch import Sample, make_microbatch
from fastgrpo.algorithms.context import AlgorithmContext
from fastgrpo.algorithms.forward import forward_packed, packed_forward
from fastgrpo.algorithms.grpo import GRPO
from fastgrpo.algorithms.prerequisites import RecipeRun
from fastgrpo.algorithms.update import PolicyUpdate
from fastgrpo.checkpoint import latest_checkpoint
from fastgrpo.config import Config, ModelConfig
from fastgrpo.distributed import all_reduce, wrap_model
from fastgrpo.kernels.distill_loss import fused_linear_distill_loss
from fastgrpo.kernels.linear_logprobs import masked_linear_logprobs
from fastgrpo.kernels.names import LOSS_REDUCTION
from fastgrpo.models.packing import plan_microbatches

DISTILL_METRICS = ("distill/divergence", "distill/teacher_logp", "distill/student_logp")


def teacher_dir(path: str) -> Path | None:
    """The teacher's model directory: ``path`` itself when it holds a ``config.json`` (a Hugging Face model or a
    fastgrpo checkpoint), else the latest complete checkpoint of the fastgrpo run directory ``path``, else None."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    return latest_checkpoint(p) if p.is_dir() else None


def check_tokenizers(student, teacher, student_name: str, teacher_name: str) -> None:
    """Refuse a teacher whose tokenizer differs from the student's: every token must have the same id in both
    (``get_vocab()``, added tokens included) and both must have the same size. The heads' row counts may differ."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a == b and len(student) == len(teacher):
        return
    ids_a, ids_b = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
    first = next((i for i in sorted(set(ids_a) | set(ids_b)) if ids_a.get(i) != ids_b.get(i)), None)
    where = (f"token id {first} is {ids_a.get(first)!r} for the student and {ids_b.get(first)!r} for the teacher"
             if first is not None else "the same token ids, but another size")
    raise ValueError(f"distill.teacher_path: the teacher's tokenizer ({teacher_name}, {len(teacher)} tokens) differs "
                     f"from the student's ({student_name}, {len(student)} tokens): {where}. Distillation compares the "
                     "two models' probabilities of the same token ids, so they must share one tokenizer")


def teacher_recipe_config(spec: str, *overrides: str) -> Config:
    """The config of ``distill.teacher_recipe`` ``spec``: a shipped recipe name, then ``group.field=value``
    overrides (shell-quoted when a value has spaces), then ``overrides``."""
    from fastgrpo.config import load_config

    recipe, *own = shlex.split(spec)
    return load_config(recipe, overrides=[*own, *overrides])


def teacher_trained(spec: str, path: str) -> bool:
    """``path`` holds a model, or the run of ``distill.teacher_recipe`` ``spec`` there reached its last step (a run
    interrupted earlier is resumed by the trainer's prerequisite run, never taken as the teacher)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return True
    ckpt = latest_checkpoint(p) if p.is_dir() else None
    return ckpt is not None and int(ckpt.name.split("_")[-1]) >= teacher_recipe_config(spec).train.max_steps


def teacher_prerequisites(cfg: Config) -> list[RecipeRun]:
    """``distill.teacher_recipe`` set and its run not complete at ``distill.teacher_path``: the trainer runs it
    before it builds :class:`Distill` (:mod:`fastgrpo.algorithms.prerequisites`)."""
    d = cfg.distill
    if not d.teacher_recipe or teacher_trained(d.teacher_recipe, d.teacher_path):
        return []
    return [RecipeRun(d.teacher_recipe, d.teacher_path, "distill.teacher_recipe")]


def load_teacher(cfg: Config, state, tokenizer):
    """``(teacher, vocab_size)``: the frozen teacher as a module whose call is ``packed_forward`` (FSDP2-sharded when
    the student is), and the real vocabulary both softmaxes use (the student's tokenizer size)."""
    from fastgrpo.models.loading import load_model

    d = cfg.distill
    path = teacher_dir(d.teacher_path)
    if path is None:
        raise ValueError(f"distill.teacher_path {d.teacher_path!r} holds no model (no config.json) and no complete "
                         "fastgrpo checkpoint" + ("" if d.teacher_recipe else
                                                  "; distill.teacher_recipe can train one there first"))
    mcfg = ModelConfig(path=str(path), dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    teacher, teacher_tok = load_model(mcfg, state.device, seed=cfg.train.seed)
    check_tokenizers(tokenizer, teacher_tok, cfg.model.path, str(path))
    teacher.requires_grad_(False).eval()
    vocab = len(tokenizer)
    rows = teacher.get_output_embeddings().weight.shape[0]
    if rows < vocab:
        raise ValueError(f"distill.teacher_path: the teacher's head has {rows} rows, fewer than the tokenizer's "
                         f"{vocab} tokens")
    mp = None
    if cfg.train.strategy == "fsdp2" and state.world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy()  # sharded in its own (compute) dtype: no fp32 masters for a frozen model
    strategy = "fsdp2" if mp is not None else "none"
    return wrap_model(teacher, state, strategy, forward=packed_forward, mp_policy=mp), vocab


@torch.no_grad()
def teacher_logprobs(teacher, mb, temperature: float, vocab_size: int) -> torch.Tensor:
    """``[N]`` the teacher's log-probs of ``mb``'s targets where ``mb.mask`` is nonzero (0 elsewhere), over its first
    ``vocab_size`` head rows (a contiguous view: no copy)."""
    hidden_NH, weight_VH, bias_V = forward_packed(teacher, mb)
    return masked_linear_logprobs(hidden_NH, weight_VH[:vocab_size], mb.targets, mb.mask != 0,
                                  bias=None if bias_V is None else bias_V[:vocab_size], temperature=temperature)


@torch.no_grad()
def sampled_token_advantages(teacher, samples: list[Sample], *, max_tokens: int, temperature: float,
                             vocab_size: int, device: torch.device, coll_device: torch.device) -> dict[str, float]:
    """Set ``token_advantages`` of every sample, ``logp_teacher − logp_student`` per completion token (0 at tokens
    without a loss), from the teacher's packed no-grad forwards over micro-batches of at most ``max_tokens`` tokens
    (packed as the update packs them); returns the ``distill/*`` token means of these samples.

    Every rank runs the same number of teacher forwards (an FSDP2 teacher gathers its weights in each): the global
    maximum of the micro-batch counts, a rank with fewer repeating its last one.
    """
    groups = plan_microbatches([len(s.tokens) for s in samples], max_tokens)
    mbs = [make_microbatch([samples[j] for j in g], device) for g in groups]  # as pack_microbatches packs
    n_mb = int(all_reduce(torch.tensor([len(mbs)], device=coll_device), "max").item())  # sync: the loop count
    sums = torch.zeros(4, dtype=torch.float64)  # Σ teacher logp, Σ student logp, Σ (student − teacher), count
    for i in range(n_mb):
        mb = mbs[min(i, len(mbs) - 1)]
        t_logp_N = teacher_logprobs(teacher, mb, temperature, vocab_size)
        if i >= len(mbs):
            continue
        keep_N = mb.mask != 0
        adv_N = torch.where(keep_N, t_logp_N - mb.sample_logprobs, 0.0)
        sums += torch.stack([t_logp_N[keep_N].sum(), mb.sample_logprobs[keep_N].sum(), -adv_N.sum(),
                             keep_N.sum()]).double().cpu()
        adv = adv_N.tolist()  # sync: the per-token advantages go back into the samples (host lists)
        offsets = mb.batch.cu_seqlens.tolist()
        for b, j in enumerate(groups[i]):
            s = samples[j]
            first = offsets[b] + len(s.prompt_ids) - 1  # the target at this position is completion token 0
            s.token_advantages = adv[first : first + len(s.completion_ids)]
    n = max(float(sums[3]), 1.0)
    return {"distill/teacher_logp": float(sums[0]) / n, "distill/student_logp": float(sums[1]) / n,
            "distill/divergence": float(sums[2]) / n}


def _masked_mean(x_N: torch.Tensor, mask_N: torch.Tensor) -> torch.Tensor:
    return (x_N * mask_N).sum() / mask_N.sum().clamp(min=1.0)


class DistillUpdate(PolicyUpdate):
    """Full mode's update: the teacher's forward, then the student's, then ``fused_linear_distill_loss`` (plus the
    GRPO loss on ``reward_weight``-scaled advantages when that is > 0), re-weighted as the GRPO loss."""

    def __init__(self, cfg: Config, model, optimizer, scheduler, teacher, vocab_size: int, device: torch.device,
                 world_size: int):
        super().__init__(cfg, model, optimizer, scheduler, None, device, world_size)
        self.teacher = teacher
        self.vocab_size = vocab_size
        self.uses_old_logprobs = cfg.distill.reward_weight > 0  # the divergence has no importance ratio

    def run(self, samples: list[Sample], **kwargs) -> dict[str, float]:
        out = super().run(samples, **kwargs)
        for key in DISTILL_METRICS:  # every rank reports the same keys (no loss token here: NaN)
            out.setdefault(key, math.nan)
        return out

    def _loss(self, mb, tokens: float, seqs: float, beta: float, epsilon_high: float | None, max_new_tokens: int,
              micro_batches: float = 1.0, weight: float = 1.0):
        """The divergence (and the GRPO loss) of one micro-batch, re-weighted; an MoE student's also gets the router's
        load-balancing term, one of ``micro_batches`` (none for a padding copy, ``weight`` 0), as GRPO's."""
        d, T, V = self.cfg.distill, self.cfg.rollout.temperature, self.vocab_size
        reduction = LOSS_REDUCTION[self.cfg.grpo.loss_type]
        with torch.no_grad():  # first: its working set is gone before the student's activations exist
            t_hidden_NH, t_weight_VH, t_bias_V = forward_packed(self.teacher, mb)
        routing = self._routing(mb, train=weight > 0)
        hidden_NH, weight_VH, bias_V = forward_packed(self.model, mb, routing)
        loss, m = fused_linear_distill_loss(
            hidden_NH, weight_VH, t_hidden_NH, t_weight_VH, mb.mask, beta=d.beta, mixed_kl_weight=d.mixed_kl_weight,
            temperature=T, student_bias=bias_V, teacher_bias=t_bias_V, cu_seqlens=mb.batch.cu_seqlens, vocab_size=V,
            loss_type=reduction, max_completion_length=max_new_tokens,
            num_items_in_batch=tokens if reduction == "dapo" else None)
        with torch.no_grad():
            t_logp_N = masked_linear_logprobs(t_hidden_NH, t_weight_VH[:V], mb.targets, mb.mask != 0,
                                              bias=None if t_bias_V is None else t_bias_V[:V], temperature=T)
        metrics = {"distill/divergence": m["divergence"], "distill/teacher_logp": _masked_mean(t_logp_N, mb.mask),
                   "distill/student_logp": _masked_mean(mb.sample_logprobs, mb.mask)}
        if d.reward_weight > 0:
            policy_loss, policy_metrics = self._policy_loss(mb, hidden_NH, weight_VH, bias_V, tokens, beta,
                                                            epsilon_high, max_new_tokens)
            loss = loss + policy_loss
            metrics.update(policy_metrics)
        loss = self._reweight(loss, mb, tokens, seqs)
        return (loss if self.moe is None else loss + self.moe.aux_term(routing, micro_batches)), metrics


class Distill(GRPO):
    """``algorithm: distill`` on ``train.py``'s loop: GRPO's rollout (sampling, rewards, advantages, validation), the
    teacher's signal, then :class:`DistillUpdate` (full) or GRPO's update on per-token advantages (sampled_token)."""

    progress = {"div": "distill/divergence", "acc": "accuracy"}
    prerequisites = staticmethod(teacher_prerequisites)

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        cfg, st = ctx.cfg, ctx.state
        self.teacher, self.vocab_size = load_teacher(cfg, st, ctx.tokenizer)
        if cfg.distill.mode == "full":
            self.update = DistillUpdate(cfg, ctx.wrapped, ctx.optimizer, ctx.scheduler, self.teacher,
                                        self.vocab_size, st.device, st.world_size)

    def rollout(self, indices: list[int], settings: dict) -> tuple[list[Sample], dict[str, float]]:
        """GRPO's rollout with the reward advantages scaled by ``distill.reward_weight`` and, in sampled-token mode,
        each completion token's ``logp_teacher − logp_student`` as its ``token_advantages``."""
        samples, m = super().rollout(indices, settings)
        for s in samples:
            s.advantage *= self.cfg.distill.reward_weight
        if self.cfg.distill.mode == "sampled_token":
            t = self.ctx
            with t.timer("teacher"):
                m.update(sampled_token_advantages(
                    self.teacher, samples, max_tokens=self.cfg.train.max_tokens_per_microbatch,
                    temperature=self.cfg.rollout.temperature, vocab_size=self.vocab_size, device=t.state.device,
                    coll_device=t.coll_device()))
        return samples, m
