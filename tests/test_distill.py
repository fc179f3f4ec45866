"""On-policy distillation (``algorithm: distill``): config validation, the teacher's tokenizer check, sampled-token
advantages against the teacher's and the student's HF forwards in fp32, the full-mode update against the unpacked
fp32 reference of the divergence (``distill_loss_ref``) on HF hidden states, the memory plan's teacher, and a short
end-to-end run that trains its own teacher first."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fastgrpo.kernels.reference import distill_loss_ref, grpo_loss_ref
from test_grpo import make_samples

from fastgrpo.algorithms.distill import DISTILL_METRICS, DistillUpdate, check_tokenizers, load_teacher, teacher_trained
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.config import load_config, stage_settings
from fastgrpo.distributed import init_distributed, wrap_model
from fastgrpo.metrics import read_jsonl
from fastgrpo.models.loading import build_tiny_tokenizer, load_model
from fastgrpo.plan import memory_plan
from fastgrpo.shapes import model_shape, teacher_shape

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
PAD_ROWS = 6  # the test teacher's head has this many rows beyond the tokenizer (as Qwen2.5-7B pads its head)
# the distill-tiny recipe made small: a random student, no warm-up, no evaluation, short completions
SMALL = ["distill.teacher_recipe=", "grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6",
         "sft.warmup_steps=0", "eval.at_start=false", "eval.at_end=false", "reward.num_workers=0",
         "train.num_threads=1", "train.max_grad_norm=0", "logging.progress_bar=false"]


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """A teacher of another shape than the student (hidden 48, one layer, untied head), with the tiny tokenizer and
    PAD_ROWS padded head rows; initializer_range 0.3 so that its distribution differs clearly from the student's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok) + PAD_ROWS, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, initializer_range=0.3, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("teacher")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def distill_config(teacher, *overrides):
    return load_config("distill-tiny", overrides=[f"distill.teacher_path={teacher}", *SMALL, *overrides])


def test_config_validation():
    def bad(match, *overrides, recipe="distill-tiny"):
        with pytest.raises(ValueError, match=match):
            load_config(recipe, overrides=list(overrides))

    cfg = load_config("distill-tiny")
    assert cfg.algorithm == "distill" and cfg.distill.mode == "full" and cfg.distill.reward_weight == 0
    bad("distill.teacher_path must name the teacher", "distill.teacher_path=")
    bad("distill.mode must be one of", "distill.mode=topk")
    bad(r"distill.beta must be in \[0, 1\]", "distill.beta=1.5")
    bad(r"distill.mixed_kl_weight must be in \[0, 1\]", "distill.beta=null", "distill.mixed_kl_weight=-0.1")
    bad("distill.beta must be set exactly when distill.mixed_kl_weight is not.*distill.beta=null",
        "distill.mixed_kl_weight=0.5")
    bad("distill.beta must be set exactly", "distill.beta=null")
    bad("distill.reward_weight must be >= 0", "distill.reward_weight=-1")
    bad("grpo.mask_zero_std_groups must be false with distill.reward_weight=0", "grpo.mask_zero_std_groups=true")
    bad("grpo.use_dynamic_sampling must be false with distill.reward_weight=0", "grpo.use_dynamic_sampling=true")
    bad("grpo.beta must be 0 with algorithm distill", "grpo.beta=0.01")
    bad("grpo.beta must be 0 with algorithm distill", "stages=[{at_step: 5, beta: 0.1}]")
    # one completion per prompt: pure distillation only (GRPO's group baseline needs two)
    assert load_config("distill-tiny", overrides=["grpo.num_generations=1"]).grpo.num_generations == 1
    bad("grpo.num_generations must be >= 2 with distill.reward_weight=0.5", "grpo.num_generations=1",
        "distill.reward_weight=0.5")
    bad(r"grpo.num_generations must be >= 2 \(the group baseline", "grpo.num_generations=1", recipe="tiny")
    mixed = load_config("distill-tiny", overrides=["distill.beta=null", "distill.mixed_kl_weight=0.25",
                                                   "distill.reward_weight=0.5", "grpo.mask_zero_std_groups=true"])
    assert (mixed.distill.beta, mixed.distill.mixed_kl_weight) == (None, 0.25)


class _Tokenizer:
    """Stands in for a tokenizer where only its token -> id map and size matter."""

    def __init__(self, vocab: dict, size: int | None = None):
        self.vocab, self.size = vocab, len(vocab) if size is None else size

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return self.size


def test_tokenizer_check_compares_ids_not_sizes(teacher_path, tmp_path):
    a = _Tokenizer({"a": 0, "b": 1, "c": 2})
    check_tokenizers(a, _Tokenizer({"a": 0, "b": 1, "c": 2}), "s", "t")
    with pytest.raises(ValueError, match="teacher's tokenizer \\(T, 3 tokens\\) differs from the student's \\(S, 3 "
                                         "tokens\\): token id 1 is 'b' for the student and 'c' for the teacher"):
        check_tokenizers(a, _Tokenizer({"a": 0, "c": 1, "b": 2}), "S", "T")  # same size, other ids
    with pytest.raises(ValueError, match="token id 3 is None for the student and 'd' for the teacher"):
        check_tokenizers(a, _Tokenizer({"a": 0, "b": 1, "c": 2, "d": 3}), "S", "T")
    with pytest.raises(ValueError, match="the same token ids, but another size"):
        check_tokenizers(a, _Tokenizer({"a": 0, "b": 1, "c": 2}, size=4), "S", "T")

    # at start-up: a saved teacher whose tokenizer has one more token is refused, naming both models
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other-teacher"
    AutoModelForCausalLM.from_pretrained(teacher_path).save_pretrained(other)
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<|extra|>"])
    tok.save_pretrained(other)
    state = init_distributed("cpu")
    student_tok = build_tiny_tokenizer()
    with pytest.raises(ValueError, match=rf"teacher's tokenizer \({other}, {len(student_tok) + 1} tokens\) differs "
                                         rf"from the student's \(tiny, {len(student_tok)} tokens\)"):
        load_teacher(distill_config(other), state, student_tok)
    # the padded head is accepted: both softmaxes use the tokenizer's tokens only
    teacher, vocab = load_teacher(distill_config(teacher_path), state, student_tok)
    assert vocab == len(student_tok) and teacher.module.get_output_embeddings().weight.shape[0] == vocab + PAD_ROWS
    assert not any(p.requires_grad for p in teacher.parameters())
    with pytest.raises(ValueError, match="holds no model"):
        load_teacher(distill_config(tmp_path / "nothing"), state, student_tok)


def completion_logprobs(model, samples, temperature, vocab_size):
    """Each sequence alone through the HF forward in fp32: log-probs of the completion tokens at ``temperature``
    over the first ``vocab_size`` logits (lists, one per sample)."""
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0, len(s.prompt_ids) - 1 : -1, :vocab_size].float()
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])
            out.append(lp[:, 0])
    return out


def test_sampled_token_advantages_match_hf_forwards(teacher_path, tmp_path):
    """Sampled-token mode: after the rollout (the real engine, rollout.temperature 0.7), every completion token's
    ``token_advantages`` is logp_teacher − logp_student of the sampled token, both from each sequence's own HF
    forward in fp32 (the teacher's over the tokenizer's rows, not its padded head), the scalar advantage is the
    reward advantage times distill.reward_weight, and the micro-batch the update packs carries their sum."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.algorithms.batch import make_microbatch
    from fastgrpo.algorithms.grpo import GRPO
    from fastgrpo.trainer import Trainer

    w = 0.5
    cfg = distill_config(teacher_path, "distill.mode=sampled_token", f"distill.reward_weight={w}",
                         "rollout.temperature=0.7", f"logging.output_dir={tmp_path / 'run'}",
                         "train.max_tokens_per_microbatch=40")  # several teacher micro-batches
    trainer = Trainer(cfg)
    indices, settings = trainer.sampler.next(4), stage_settings(cfg, 0)
    try:
        samples, m = trainer.algorithm.rollout(indices, settings)
        plain, _ = GRPO.rollout(trainer.algorithm, indices, settings)  # the same step's seeds: the same samples
    finally:
        trainer.close()
    assert [s.completion_ids for s in samples] == [s.completion_ids for s in plain]
    V = len(trainer.tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).float()
    lt = completion_logprobs(teacher, samples, 0.7, V)
    ls = completion_logprobs(trainer.model, samples, 0.7, V)
    # the student's side is the engine's log-prob, equal to the teacher-forced forward to fp32 rounding:
    # measured |diff| <= 1.5e-6 here on log-probs down to -17 nats (fp32 ulp at 16: 1.9e-6); 2e-5 leaves > 10x
    for s, t_lp, s_lp in zip(samples, lt, ls):
        torch.testing.assert_close(torch.tensor(s.token_advantages), t_lp - s_lp, rtol=0, atol=2e-5)
    assert [s.advantage for s in samples] == [w * s.advantage for s in plain]
    all_t, all_s = torch.cat(lt), torch.cat(ls)
    assert m["distill/divergence"] == pytest.approx(float((all_s - all_t).mean()), abs=2e-5)
    assert m["distill/teacher_logp"] == pytest.approx(float(all_t.mean()), abs=2e-5)
    mb = make_microbatch(samples, torch.device("cpu"))
    assert mb.per_token_advantages
    keep = mb.mask != 0
    expected = torch.cat([s.advantage + torch.tensor(s.token_advantages) for s in samples])
    torch.testing.assert_close(mb.advantages[keep], expected, rtol=0, atol=1e-6)


def hf_hidden(model, samples):
    """Each sequence alone through the HF forward: the last hidden state at the positions that predict the
    completion tokens, ``[B, T, H]`` right-padded, and the loss mask ``[B, T]``."""
    T = max(len(s.completion_ids) for s in samples)
    hidden, mask = [], torch.zeros(len(samples), T)
    for b, s in enumerate(samples):
        out = model(torch.tensor([s.tokens]), output_hidden_states=True)
        h = out.hidden_states[-1][0, len(s.prompt_ids) - 1 : -1]  # [C, H], after the final norm
        hidden.append(torch.nn.functional.pad(h, (0, 0, 0, T - len(h))))
        mask[b, : len(h)] = float(s.train)
    return torch.stack(hidden), mask


@pytest.mark.parametrize("loss_type, divergence, reward_weight, temperature", [
    ("dapo", ["distill.beta=1"], 0.0, 1.0),
    ("grpo", ["distill.beta=null", "distill.mixed_kl_weight=0.3"], 0.0, 0.7),
    ("bnpo", ["distill.beta=0.5"], 0.7, 0.7),
])
def test_full_mode_update_matches_unpacked_reference(teacher_path, loss_type, divergence, reward_weight,
                                                     temperature):
    """Full mode through the trainer's update (packed micro-batches, the loss re-weighted across them, one SGD step of
    lr 1, so the weight change is minus the gradient) against ``distill_loss_ref`` on each sequence's own HF hidden
    states in fp32, with the teacher's padded head rows left out (vocab_size), plus the GRPO loss's reference on
    reward_weight-scaled advantages when that is > 0; both models' distributions (and the policy loss's log-probs)
    at rollout.temperature."""
    state = init_distributed("cpu")
    cfg = distill_config(teacher_path, f"grpo.loss_type={loss_type}", *divergence,
                         f"distill.reward_weight={reward_weight}", "train.max_tokens_per_microbatch=24",
                         "rollout.max_new_tokens=8", f"rollout.temperature={temperature}")
    model, tok = load_model(cfg.model, state.device, seed=0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    teacher, V = load_teacher(cfg, state, tok)
    wrapped = wrap_model(model, state, "ddp", forward=packed_forward)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    samples = make_samples()
    for s in samples:  # the algorithm scales the reward advantages before the update (Distill.rollout)
        s.advantage *= reward_weight
    metrics = DistillUpdate(cfg, wrapped, opt, sched, teacher, V, state.device, 1).run(
        samples, beta=0.0, epsilon_high=cfg.grpo.epsilon_high, max_new_tokens=8)
    assert metrics["optimizer_steps"] == 1
    delta = {k: before[k] - v.detach() for k, v in model.named_parameters()}

    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(before[k])
        ht, _ = hf_hidden(teacher.module, samples)
    model.zero_grad()
    hs, mask = hf_hidden(model, samples)
    ws, wt = model.get_output_embeddings().weight, teacher.module.get_output_embeddings().weight
    d = cfg.distill
    ref_loss, ref_m = distill_loss_ref(hs, ws, ht, wt, mask, beta=d.beta, mixed_kl_weight=d.mixed_kl_weight,
                                       temperature=temperature, vocab_size=V, loss_type=loss_type,
                                       max_completion_length=8)
    if reward_weight:
        logits = hs @ ws.t() / temperature  # the policy loss keeps every row of the student's head (here: no padding)
        targets = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.completion_ids) for s in samples], True)
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        adv = torch.tensor([s.advantage for s in samples])
        policy_loss, _ = grpo_loss_ref(logp, logp.detach(), adv, mask, loss_type=loss_type, epsilon_high=0.28,
                                       max_completion_length=8)
        ref_loss = ref_loss + policy_loss
    ref_loss.backward()
    # fp32 on both sides summed in other orders (packed chunks vs padded rows, the kernel's streamed vocabulary vs
    # the materialised softmax): ~1e-6 relative; the weight change (lr 1) is a difference of weights of size ~1
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    assert metrics["distill/divergence"] == pytest.approx(float(ref_m["divergence"]), rel=1e-5, abs=1e-7)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_plan_counts_the_teacher():
    """The teacher's weights per GPU (a full copy under ddp; shards + its root + two layers under fsdp2) and, in
    full mode, its hidden state of one micro-batch; the NeMo-RL recipe (Qwen3-4B teaching Qwen3-1.7B-Base) fits
    8 x 80 GiB as shipped."""
    paths = [f"model.path={DATA / 'qwen3-1.7b-base'}", f"distill.teacher_path={DATA / 'qwen3-4b'}"]
    cfg = load_config("distill-qwen3-1.7b", overrides=paths)
    s, t = model_shape(cfg), teacher_shape(cfg)
    assert (s.params, s.layers, s.hidden, t.layers, t.hidden, t.vocab) == (1_720_574_976, 28, 2048, 36, 2560, 151936)
    # by hand: embedding V·h + L·(attention h·(n_q + 2·n_kv)·d + n_q·d·h, MLP 3·h·I, norms 2·h + 2·d) + final norm h
    # 1.7B: 151936·2048 + 28·(2048·(16 + 16)·128 + 2048·2048 + 3·2048·6144 + 4096 + 256) + 2048 = 1,720,574,976
    # 4B:   151936·2560 + 36·(2560·(32 + 16)·128 + 4096·2560 + 3·2560·9728 + 5120 + 256) + 2560 = 4,022,468,096
    assert t.params == 4_022_468_096  # Qwen3-4B, tied embeddings
    plan = memory_plan(cfg, 8, 80, shape=s, teacher=t)
    assert plan.fits, plan.verdict()
    root = t.params - t.layers * t.layer_params
    assert plan.teacher == 2 * (t.params // 8 + root + 2 * t.layer_params)
    assert plan.teacher_hidden == 2 * plan.tokens * 2560
    ddp = memory_plan(load_config("distill-qwen3-1.7b", overrides=[*paths, "train.strategy=ddp",
                                                                   "distill.mode=sampled_token"]), 8, 80,
                      shape=s, teacher=t)
    assert ddp.teacher == 2 * t.params and ddp.teacher_hidden == 0
    grpo = memory_plan(load_config("distill-qwen3-1.7b", overrides=[*paths, "algorithm=grpo",
                                                                    "grpo.num_generations=2"]), 8, 80, shape=s)
    assert grpo.teacher == 0 and plan.static - grpo.static == plan.teacher  # generation keeps the teacher too
    assert plan.training_peak - grpo.training_peak == plan.teacher + plan.teacher_hidden
    # before the tiny teacher exists, its recipe's model is planned
    tiny = load_config("distill-tiny", overrides=["distill.teacher_path=/nonexistent"])
    assert teacher_shape(tiny) == model_shape(load_config("tiny"))


@pytest.mark.slow  # 14 s: a whole teacher recipe run first
def test_end_to_end_distill_run_trains_its_teacher_first(tmp_path, capsys):
    """``torchrun fastgrpo/train.py --recipe distill-tiny`` (made small): the teacher recipe runs first into
    distill.teacher_path, then the distillation steps log the distill/ metrics; a second run (sampled-token mode,
    one completion per prompt; the entry point's main in this process, a torchrun start-up saved) finds the teacher
    and does not train it again."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    teacher = tmp_path / "teacher"
    spec = ("tiny train.max_steps=1 sft.warmup_steps=2 sft.batch_size=8 grpo.num_prompts_per_step=2 "
            "grpo.num_generations=2 rollout.max_new_tokens=4 eval.at_start=false eval.at_end=false "
            "logging.progress_bar=false train.num_threads=1 reward.num_workers=0")

    def args(out, *overrides):
        return ["--recipe", "distill-tiny", *SMALL, "train.max_steps=2", f"distill.teacher_path={teacher}",
                f"distill.teacher_recipe={spec}", "eval.at_end=true", "eval.num_prompts=4",
                f"logging.output_dir={out}", *overrides]

    def run(out, *overrides):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               str(REPO / "fastgrpo" / "train.py"), *args(out, *overrides)]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return proc.stdout

    out = run(tmp_path / "run")
    assert f"training the teacher (--recipe {spec}) into {teacher}" in out
    assert (teacher / "checkpoints" / "step_00000001" / "config.json").is_file()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "eval/accuracy" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"distill/divergence", "distill/teacher_logp", "distill/student_logp", "accuracy", "loss"} <= set(r)
        assert r["distill/divergence"] > 0 and r["distill/teacher_logp"] < 0
    # the second run in this process (the entry point's main, no torchrun start-up): it must find the teacher
    from fastgrpo.train import main

    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        main(args(tmp_path / "run2", "distill.mode=sampled_token", "grpo.num_generations=1"))
    finally:
        torch.set_num_threads(threads)  # train.num_threads=1 set it for this process
    again = capsys.readouterr().out
    assert "done: 2 DISTILL steps" in again
    assert "training the teacher" not in again
    assert not teacher_trained(spec.replace("train.max_steps=1", "train.max_steps=2"), str(teacher))  # would resume
    rows = [r for r in read_jsonl(tmp_path / "run2" / "metrics.jsonl") if "eval/accuracy" not in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["optimizer_steps/max"] == 1 for r in rows)
    assert all(math.isfinite(r["distill/divergence"]) and r["distill/teacher_logp"] < 0 for r in rows)


@pytest.mark.slow  # two torchrun processes, ~40 s on 2 busy cores
def test_fsdp2_teacher_matches_ddp(teacher_path, tmp_path):
    """2 processes, full mode, micro-batch counts that differ between ranks: the teacher sharded by FSDP2 (each rank
    holds half of every parameter) gives the replicated teacher's (DDP's) losses, divergence and weight change;
    the two reduce the same fp32 gradients in another order (all-reduce vs reduce-scatter), ~1e-7 relative."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "fsdp.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), str(out), str(teacher_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = torch.load(out)
    assert res["counts"][0] != res["counts"][1]
    assert res["fsdp2"]["sharded"] and not res["ddp"]["sharded"]
    ddp, fsdp = res["ddp"]["metrics"], res["fsdp2"]["metrics"]
    for key in ("loss", "grad_norm", *DISTILL_METRICS):
        assert fsdp[key] == pytest.approx(ddp[key], rel=1e-5, abs=1e-7), key
    for k, d in res["ddp"]["delta"].items():
        torch.testing.assert_close(res["fsdp2"]["delta"][k], d, rtol=1e-4, atol=1e-6)
    # sampled-token mode: the sharded teacher's per-token advantages are the replicated one's (same fp32 forwards,
    # the gathered weights equal bit for bit)
    for a, b in zip(res["ddp"]["token_advantages"], res["fsdp2"]["token_advantages"]):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-6)
    assert res["fsdp2"]["sampled"] == pytest.approx(res["ddp"]["sampled"], abs=1e-6)


def _fsdp_worker(out: str, teacher: str) -> None:
    """torchrun entry of test_fsdp2_teacher_matches_ddp: each rank's share under DDP and under FSDP2."""
    import copy

    from fastgrpo.algorithms.batch import pack_microbatches
    from fastgrpo.algorithms.distill import sampled_token_advantages
    from fastgrpo.distributed import all_reduce, barrier, destroy, fsdp_root

    state = init_distributed("cpu")
    torch.set_num_threads(1)
    samples = make_samples(16)
    for s in samples:
        s.advantage = 0.0
    mine = samples[state.rank * 8 : (state.rank + 1) * 8]
    counts = torch.zeros(2, dtype=torch.long)
    counts[state.rank] = len(pack_microbatches(mine, 20, state.device))
    result = {"counts": all_reduce(counts).tolist()}
    for strategy in ("ddp", "fsdp2"):
        cfg = distill_config(teacher, f"train.strategy={strategy}", "train.max_tokens_per_microbatch=20",
                             "distill.beta=1", "grpo.num_prompts_per_step=8", "grpo.num_generations=2")
        model, tok = load_model(cfg.model, state.device, seed=0)
        teacher_model, V = load_teacher(cfg, state, tok)
        wrapped = wrap_model(model, state, strategy, forward=packed_forward)
        before = {k: full(v) for k, v in model.named_parameters()}
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        metrics = DistillUpdate(cfg, wrapped, opt, sched, teacher_model, V, state.device, state.world_size).run(
            mine, beta=0.0, epsilon_high=None, max_new_tokens=8)
        result[strategy] = {"metrics": metrics, "sharded": fsdp_root(teacher_model) is not None,
                            "delta": {k: before[k] - full(v) for k, v in model.named_parameters()}}
        copies = copy.deepcopy(mine)
        sampled = sampled_token_advantages(teacher_model, copies, max_tokens=12, temperature=0.8, vocab_size=V,
                                           device=state.device, coll_device=state.device)  # 6 vs 7 micro-batches
        result[strategy].update(sampled=sampled, token_advantages=[c.token_advantages for c in copies])
        del wrapped, teacher_model, opt
    if state.rank == 0:
        torch.save(result, out)
    barrier()
    destroy()


def full(t):
    """A parameter's full value (FSDP2 shards parameters as DTensors)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


if __name__ == "__main__":
    _fsdp_worker(sys.argv[1], sys.argv[2])
