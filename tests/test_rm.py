"""Reward-model training (fastgrpo/algorithms/rm.py) and the reward model's packed scoring
(fastgrpo/models/reward_model.py): the loss and metrics against TRL's formula (and TRL's own compute_loss when trl
imports), the packed score against Hugging Face's padded AutoModelForSequenceClassification forward, a short run
whose checkpoint AutoModelForSequenceClassification loads and scores identically."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checks import EPS32, assert_flash
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.algorithms.rm import reward_loss
from fastgrpo.config import ModelConfig, load_config
from fastgrpo.metrics import read_jsonl
from fastgrpo.models.loading import build_tiny_tokenizer
from fastgrpo.models.packing import pack
from fastgrpo.models.reward_model import build_reward_model, packed_scores, pooled_positions

SMALL = ["model.tiny_hidden_size=32", "model.tiny_intermediate_size=64", "data.synthetic_num_terms=2",
         "data.synthetic_eval_size=16", "data.max_length=24", "train.max_tokens_per_microbatch=64", "rm.batch_size=8",
         "logging.progress_bar=false", "train.num_threads=1", "eval.every_steps=0"]


def trl_formula(chosen, rejected, margin, coef):
    """TRL RewardTrainer.compute_loss's loss and metrics, written out in plain float64 torch."""
    c, r = chosen.double(), rejected.double()
    d = c - r - (margin.double() if margin is not None else 0.0)
    loss = -torch.nn.functional.logsigmoid(d).mean()
    if coef is not None:
        loss = loss + coef * ((c + r) ** 2).mean()
    both = torch.cat([c, r])
    return loss, {"accuracy": (c > r).double().mean(), "margin": (c - r).mean(), "rewards/chosen": c.mean(),
                  "rewards/rejected": r.mean(), "mean_reward": both.mean(), "min_reward": both.min(),
                  "max_reward": both.max()}


@given(b=st.integers(1, 9), scale=st.sampled_from([0.1, 1.0, 30.0]), with_margin=st.booleans(),
       coef=st.sampled_from([None, 0.0, 0.01, 1.0]), seed=st.integers(0, 2**16))
def test_loss_and_metrics_match_trl_formula(b, scale, with_margin, coef, seed):
    g = torch.Generator().manual_seed(seed)
    chosen, rejected = (torch.randn(b, generator=g) * scale for _ in range(2))
    margin = torch.rand(b, generator=g) * scale if with_margin else None
    loss, m = reward_loss(chosen, rejected, margin, coef)
    ref, ref_m = trl_formula(chosen, rejected, margin, coef)
    # fp32 inputs: the loss rounds at the scale of its terms (log σ of differences up to ~4·scale, and coef·(2 scale)²)
    tol = 16 * EPS32 * (1 + 4 * scale + (coef or 0) * 4 * scale**2)
    assert abs(loss.item() - ref.item()) <= tol
    for key, value in ref_m.items():
        assert abs(m[key].item() - value.item()) <= 16 * EPS32 * (1 + 4 * scale), key


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("coef", [None, 0.05])
def test_loss_equals_trl_compute_loss(with_margin, coef):
    """TRL's own RewardTrainer.compute_loss (unbound, on a stand-in trainer whose model returns the given rewards)."""
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(3)
    chosen, rejected = torch.randn(6, generator=g), torch.randn(6, generator=g)
    margin = torch.rand(6, generator=g) if with_margin else None
    logits = torch.cat([chosen, rejected])[:, None]  # [2B, 1]: the chosen rows, then the rejected (TRL's collator)

    def model(**inputs):
        return SimpleNamespace(logits=logits)

    model.training = True
    acc = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    stub = SimpleNamespace(model=model, args=SimpleNamespace(center_rewards_coefficient=coef), accelerator=acc,
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(12, 3, dtype=torch.long), "attention_mask": torch.ones(12, 3)}
    if with_margin:
        inputs["margin"] = margin
    trl_loss = trl.RewardTrainer.compute_loss(stub, model, inputs)
    loss, m = reward_loss(chosen, rejected, margin, coef)
    assert abs(loss.item() - trl_loss.item()) <= 8 * EPS32 * max(1.0, abs(trl_loss.item()))
    got = stub._metrics["train"]
    for ours, theirs in [("accuracy", "accuracy"), ("margin", "margin"), ("mean_reward", "mean_reward"),
                         ("min_reward", "min_reward"), ("max_reward", "max_reward")]:
        assert abs(m[ours].item() - got[theirs][0]) <= 8 * EPS32 * 4, ours


@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       pad=st.sampled_from([None, 0, 1]))
def test_pooled_positions_are_hf_rule(lengths, seed, pad):
    """The packed pooling index equals HF's rule on the padded rows: the rightmost token != pad_token_id (argmax of
    index · mask: 0 when every token is padding), the last token without a pad id."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 3, (n,), generator=g) for n in lengths]  # ids 0..2: padding ids occur, runs of them too
    batch = pack(seqs)
    got = pooled_positions(batch.input_ids, batch.cu_seqlens, pad)
    starts = batch.cu_seqlens[:-1].long()
    for b, s in enumerate(seqs):
        if pad is None:
            want = len(s) - 1
        else:
            want = int((torch.arange(len(s)) * (s != pad)).argmax())
        assert int(got[b] - starts[b]) == want


def tiny_rm(tmp_path, seed=0):
    cfg = ModelConfig(path="tiny", tiny_hidden_size=32, tiny_intermediate_size=64, tiny_initializer_range=0.3)
    model, tok = build_reward_model(cfg, torch.device("cpu"), seed=seed)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return model, tok


def hf_padded_scores(path, seqs, pad_id, dtype):
    """AutoModelForSequenceClassification's padded forward (eager attention, right padding, attention mask)."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s)
        mask[b, : len(s)] = 1
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)  # [B]


def packed(model, seqs):
    b = pack(seqs)
    with torch.no_grad():
        return packed_scores(model, b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)


def score_floor(seqs, ref64):
    """What fp32 cannot resolve here: the scores' scale times eps, times the sums in a row (a layer's matmuls of H
    terms, the attention over the sequence, the head), with 64 for the layers' roundings compounding."""
    return 64 * EPS32 * max(1.0, ref64.abs().max().item()) * (1 + math.log2(max(len(s) for s in seqs)))


def test_packed_scores_match_hf_padded_forward(tmp_path):
    """fp32 packed scores against HF's padded forward, both against the fp64 padded forward (flash-attn's rule):
    sequences of varied lengths, some ending with EOS (= the pad token: HF pools the token before it), one made
    only of it."""
    model, tok = tiny_rm(tmp_path)
    pad = tok.pad_token_id
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (1, 7, 13, 30, 4, 19)]
    seqs[1] = seqs[1] + [pad]  # a response ending with EOS
    seqs[3] = seqs[3][:10] + [pad, pad] + seqs[3][10:] + [pad]  # EOS inside and at the end
    seqs.append([pad, pad])  # only padding: HF pools token 0
    got = packed(model, seqs)
    ref32 = hf_padded_scores(tmp_path, seqs, pad, torch.float32)
    ref64 = hf_padded_scores(tmp_path, seqs, pad, torch.float64)
    assert got.dtype == torch.float32 and got.shape == (len(seqs),)
    assert_flash("packed scores", got.double(), ref64, ref32.double(), score_floor(seqs, ref64))
    assert ref64.std() > 1e-3  # the head separates the sequences: the comparison is not between constants


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="rm.batch_size"):
        load_config("rm-tiny", overrides=["rm.batch_size=0"])
    with pytest.raises(ValueError, match="rm.center_rewards_coefficient"):
        load_config("rm-tiny", overrides=["rm.center_rewards_coefficient=-1"])
    with pytest.raises(ValueError, match="sft.warmup_steps"):
        load_config("rm-tiny", overrides=["sft.warmup_steps=10"])
    missing = tmp_path / "no_such_rm"
    with pytest.raises(ValueError, match=rf"reward.models\[0\].path .*{missing}"):
        load_config("tiny", overrides=[f"reward.models=[{{path: {missing}}}]"])
    with pytest.raises(ValueError, match="reward.functions"):
        load_config("tiny", overrides=["reward.functions=[]"])
    with pytest.raises(ValueError, match="reward.models"):
        load_config("tiny", overrides=[f"reward.models=[{{path: {tmp_path}, name: math}}]"])
    with pytest.raises(ValueError, match=rf"reward.judges\[0\].path .*{missing}"):
        load_config("tiny", overrides=[f"reward.judges=[{{path: {missing}}}]"])
    with pytest.raises(ValueError, match=r"reward.judges\[0\].prompt_template must contain \{completion\}"):
        load_config("tiny", overrides=[f"reward.judges=[{{path: {tmp_path}, prompt_template: 'Q: {{question}}'}}]"])
    with pytest.raises(ValueError, match=r"reward.judges\[0\].verdict_pattern"):
        load_config("tiny", overrides=[f"reward.judges=[{{path: {tmp_path}, verdict_pattern: '(\\d'}}]"])
    with pytest.raises(ValueError, match="reward.models"):
        load_config("tiny", overrides=[f"reward.judges=[{{path: {tmp_path}, name: rm}}]",
                                       f"reward.models=[{{path: {tmp_path}}}]"])
    cfg = load_config("tiny", overrides=["reward.functions=[]", f"reward.models=[{{path: {tmp_path}}}, "
                                                                 f"{{path: {tmp_path}, weight: 0.5}}]"])
    assert cfg.reward.model_names() == ["rm0", "rm1"] and cfg.reward.models[1].weight == 0.5


def test_short_run_saves_a_checkpoint_hf_loads_and_scores_identically(tmp_path):
    """A 40-step rm run: its metrics rows, then the final checkpoint loaded by AutoModelForSequenceClassification
    scores held-out pairs as the trained model's packed forward does (fp32, flash-attn's rule against fp64)."""
    from transformers import AutoModelForSequenceClassification

    from fastgrpo.trainer import Trainer

    cfg = load_config("rm-tiny", overrides=[*SMALL, f"logging.output_dir={tmp_path}", "train.max_steps=40",
                                           "checkpoint.every_steps=0", "rm.center_rewards_coefficient=0.01"])
    trainer = Trainer(cfg)
    assert trainer.engine is None
    result = trainer.fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval/preference_accuracy" in r]
    assert len(train_rows) == 40 and len(eval_rows) == 2  # at the start and at the end
    assert [result["start_accuracy"], result["end_accuracy"]] == [r["eval/preference_accuracy"] for r in eval_rows]
    for key in ("accuracy", "margin", "rewards/chosen", "rewards/rejected", "mean_reward", "min_reward",
                "max_reward", "grad_norm"):
        assert math.isfinite(train_rows[-1][key]), key
    r = train_rows[-1]
    assert r["min_reward"] <= r["rewards/rejected"] <= r["max_reward"]
    mid = (r["rewards/chosen"] + r["rewards/rejected"]) / 2
    assert abs(r["mean_reward"] - mid) <= 1e-5 * (1 + abs(r["max_reward"]))

    ckpt = tmp_path / "checkpoints" / "step_00000040"
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["architectures"] == ["Qwen2ForSequenceClassification"] and len(conf["id2label"]) == 1
    assert conf["pad_token_id"] == trainer.tokenizer.pad_token_id
    hf = AutoModelForSequenceClassification.from_pretrained(ckpt)
    assert hf.config.num_labels == 1
    pairs = trainer.algorithm.held_out.items[:6]
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    trained = trainer.model
    got = packed(trained, seqs)
    for name, ours in hf.state_dict().items():  # the same weights, bit for bit
        assert torch.equal(ours, trained.state_dict()[name]), name
    ref32 = hf_padded_scores(ckpt, seqs, hf.config.pad_token_id, torch.float32)
    ref64 = hf_padded_scores(ckpt, seqs, hf.config.pad_token_id, torch.float64)
    assert_flash("checkpoint scores", got.double(), ref64, ref32.double(), score_floor(seqs, ref64))


def test_margin_column_is_read_and_shifts_the_loss(tmp_path):
    """TRL's optional margin column: read per pair (0 without it), a bad value skips the row as "bad margin"; the
    loss subtracts it inside the log-sigmoid."""
    from transformers import AutoTokenizer

    from fastgrpo.data.responses import load_response_datasets

    model, tok = tiny_rm(tmp_path)
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.5}, {"prompt": "1+2=", "chosen": "3",
                                                                               "rejected": "4"},
            {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": "big"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("rm-tiny", overrides=[f"data.path={path}"]).data
    train, _, _ = load_response_datasets(cfg, AutoTokenizer.from_pretrained(tmp_path), "dpo")
    assert [p.margin for p in train.items] == [1.5, 0.0] and train.skipped == {"bad margin": 1}
    chosen, rejected = torch.tensor([0.5, 0.0]), torch.tensor([0.0, 0.0])
    loss, _ = reward_loss(chosen, rejected, torch.tensor([1.5, 0.0]))
    want = (math.log1p(math.exp(1.0)) + math.log(2.0)) / 2  # −log σ(0.5 − 1.5), −log σ(0)
    assert abs(loss.item() - want) <= 8 * EPS32


# ---------------------------------------------------------------------------------------------- reward.models in GRPO


def reward_models(tmp_path, *overrides):
    from fastgrpo.algorithms.reward_models import RewardModels
    from fastgrpo.distributed import init_distributed

    model, tok = tiny_rm(tmp_path / "rm")
    cfg = load_config("tiny", overrides=[f"reward.models=[{{path: {tmp_path / 'rm'}, weight: 0.5}}]", *overrides])
    return RewardModels(cfg, init_distributed("cpu"), tok), tok


def test_reward_models_score_as_hf_padded_forward_and_join(tmp_path):
    """RewardModels.score over several packed micro-batches (a 40-token budget) equals HF's padded forward of each
    prompt + completion (fp32, flash-attn's rule against fp64), in order; join adds weight · score to the functions'
    totals and logs the raw scores under the model's name."""
    from fastgrpo.rewards import RewardResult

    rms, tok = reward_models(tmp_path, "train.max_tokens_per_microbatch=40")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (9, 3, 14, 9, 6)]
    completions = [torch.randint(5, len(tok), (n,), generator=g).tolist() + [tok.eos_token_id] for n in (2, 20, 5,
                                                                                                        11, 1)]
    scores = rms.score(prompts, completions, ["q"] * 5)
    assert list(scores) == ["rm"]
    seqs = [p + c for p, c in zip(prompts, completions)]
    ref32 = hf_padded_scores(tmp_path / "rm", seqs, tok.pad_token_id, torch.float32)
    ref64 = hf_padded_scores(tmp_path / "rm", seqs, tok.pad_token_id, torch.float64)
    assert_flash("reward model scores", torch.tensor(scores["rm"], dtype=torch.float64), ref64, ref32.double(),
                 score_floor(seqs, ref64))
    joined = rms.join(RewardResult(total=[1.0] * 5, per_function={"math": [1.0] * 5}), scores)
    assert joined.total == [1.0 + 0.5 * s for s in scores["rm"]]
    assert joined.per_function == {"math": [1.0] * 5, "rm": scores["rm"]}


def test_chat_template_reward_model_reads_the_rendered_conversation(tmp_path):
    """chat_template "tokenizer": the reward model reads [user: question, assistant: completion] rendered by its
    tokenizer's template (the tiny one: <|user|>q<|assistant|>a<|endoftext|>), not the policy's tokens."""
    rms, tok = reward_models(tmp_path)
    rms.specs[0] = dataclasses.replace(rms.specs[0], chat_template="tokenizer")
    completion = tok("\\boxed{12}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    (seq,) = rms._sequences(0, [[7, 8, 9]], [completion], ["4+8="])
    assert seq == tok("<|user|>4+8=<|assistant|>\\boxed{12}<|endoftext|>", add_special_tokens=False)["input_ids"]


def grpo_rm_overrides(rm_dir, run):
    return ["reward.functions=[]", f"reward.models=[{{path: {rm_dir}, weight: 2.0}}]", "grpo.num_prompts_per_step=4",
            "grpo.num_generations=4", "rollout.max_new_tokens=6", "sft.warmup_steps=0", "eval.num_prompts=8",
            "eval.every_steps=0", "checkpoint.every_steps=0", "logging.progress_bar=false", "train.num_threads=1",
            "train.max_steps=2", "logging.log_rollouts=true", "grpo.mask_zero_std_groups=false",
            f"logging.output_dir={run}"]


def check_logged_scores(tmp_path, run, files):
    """The rollout log's per-completion reward-model scores against HF's padded forward of the logged text, the step's
    reward/rm/mean against their mean, and each reward against 2 · score."""
    from transformers import AutoModelForSequenceClassification

    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and "reward/rm/mean" in rows[0] and not any(
        k.startswith("reward/rm/") and k != "reward/rm/mean" for k in rows[0])
    logged = [r for f in files for r in read_jsonl(run / "rollouts" / f)]
    assert len(logged) == 16
    policy_tok = build_tiny_tokenizer()  # the tiny policy's: the text the log shows, back to the sampled ids
    seqs = [policy_tok(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"] for r in logged]
    got = torch.tensor([r["rewards"]["rm"] for r in logged], dtype=torch.float64)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    ref32 = hf_padded_scores(tmp_path / "rm", seqs, hf.config.pad_token_id, torch.float32)
    ref64 = hf_padded_scores(tmp_path / "rm", seqs, hf.config.pad_token_id, torch.float64)
    assert_flash("logged scores", got, ref64, ref32.double(), score_floor(seqs, ref64))
    assert abs(rows[0]["reward/rm/mean"] - got.mean().item()) <= 1e-6 * (1 + got.abs().max().item())
    assert all(abs(r["reward"] - 2.0 * r["rewards"]["rm"]) <= 1e-6 * (1 + abs(r["reward"])) for r in logged)


def test_grpo_with_a_reward_model_as_its_only_reward(tmp_path):
    """A 2-step GRPO run with reward.functions=[] and one reward model (weight 2): :func:`check_logged_scores`."""
    from fastgrpo.trainer import Trainer

    tiny_rm(tmp_path / "rm")
    Trainer(load_config("tiny", overrides=grpo_rm_overrides(tmp_path / "rm", tmp_path / "run"))).fit()
    check_logged_scores(tmp_path, tmp_path / "run", ["step_00000001.jsonl"])


@pytest.mark.slow
def test_grpo_with_an_fsdp2_sharded_reward_model(tmp_path):
    """The same run on 2 processes with train.strategy=fsdp2: the reward model sharded over them scores each rank's
    completions as HF's unsharded model does."""
    tiny_rm(tmp_path / "rm")
    train = Path(__file__).resolve().parents[1] / "fastgrpo" / "train.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(train),
           "--recipe", "tiny", *grpo_rm_overrides(tmp_path / "rm", tmp_path / "run"), "train.strategy=fsdp2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    check_logged_scores(tmp_path, tmp_path / "run", [f"step_00000001.rank{r}.jsonl" for r in (0, 1)])


def test_memory_plan_counts_the_reward_models(tmp_path):
    """fastgrpo.plan: each reward model's weights (its parameters counted on the loaded model, in the compute dtype)
    join the static part, and the scoring peak holds one packed pass over a micro-batch."""
    from transformers import AutoModelForSequenceClassification

    from fastgrpo.plan import memory_plan

    tiny_rm(tmp_path / "rm")
    params = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").parameters())
    base = load_config("tiny", overrides=["model.dtype=bfloat16"])
    with_rm = load_config("tiny", overrides=["model.dtype=bfloat16", f"reward.models=[{{path: {tmp_path / 'rm'}}}, "
                                                                     f"{{path: {tmp_path / 'rm'}}}]"])
    a, b = memory_plan(base, 1, 80.0), memory_plan(with_rm, 1, 80.0)
    assert b.reward_models == 2 * 2 * params and b.static - a.static == b.reward_models
    assert a.reward_pass == 0 and b.reward_pass > 0 and b.scoring_peak == b.static + b.weights + b.reward_pass
    assert any("reward models" in line for line in b.lines())


# ---------------------------------------------------------------------------------------------- processes and resume

RM_RUN = [*SMALL, "train.max_steps=4", "checkpoint.every_steps=2", "rm.center_rewards_coefficient=0.01"]
CONTINUOUS = ("loss", "margin", "rewards/chosen", "rewards/rejected", "mean_reward", "min_reward", "max_reward",
              "grad_norm", "tokens")


def rm_rows(run_dir):
    """The training rows' continuous metrics (``accuracy`` thresholds margins that rounding may move across 0: it is
    checked against the reference formula above)."""
    return [{k: r[k] for k in ("step", *CONTINUOUS)} for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def assert_close_rows(a, b, rel):
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        diff = {k: (ra[k], rb[k]) for k in ra if not math.isclose(ra[k], rb[k], rel_tol=rel, abs_tol=1e-6)}
        assert not diff, f"step {ra['step']}: {diff}"


@pytest.fixture(scope="module")
def rm_one_process(tmp_path_factory):
    from fastgrpo.trainer import Trainer

    run = tmp_path_factory.mktemp("rm") / "one"
    Trainer(load_config("rm-tiny", overrides=[*RM_RUN, f"logging.output_dir={run}"])).fit()
    return run


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_equal_one(rm_one_process, tmp_path, strategy):
    """torchrun with 2 processes (each half of every batch of pairs): the rows of one process (fp32 sums in another
    order: rel 1e-5), under DDP and FSDP2."""
    train = Path(__file__).resolve().parents[1] / "fastgrpo" / "train.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(train),
           "--recipe", "rm-tiny", *RM_RUN, f"train.strategy={strategy}", f"logging.output_dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_close_rows(rm_rows(rm_one_process), rm_rows(run), rel=1e-5)
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(run / "checkpoints" / "step_00000004")  # gathered shards
    assert hf.config.num_labels == 1 and hf.score.weight.shape == (1, 32)


def test_resume_is_exact(rm_one_process, tmp_path, capsys):
    """2 steps, then a new trainer resumes from the step-2 checkpoint to 4: the rows of the uninterrupted run."""
    from fastgrpo.trainer import Trainer

    Trainer(load_config("rm-tiny", overrides=[*RM_RUN, "train.max_steps=2", f"logging.output_dir={tmp_path}"])).fit()
    Trainer(load_config("rm-tiny", overrides=[*RM_RUN, f"logging.output_dir={tmp_path}"])).fit()
    assert "resumed from" in capsys.readouterr().out
    assert_close_rows(rm_rows(rm_one_process), rm_rows(tmp_path), rel=1e-6)


# ---------------------------------------------------------------------------------------------- generative judges


@pytest.mark.parametrize("text, pattern, want", [
    ("7", r"(-?\d+(?:\.\d+)?)", 7.0), ("first 3, then 8.5", r"(-?\d+(?:\.\d+)?)", 8.5),
    ("score: -2", r"(-?\d+(?:\.\d+)?)", -2.0), ("no digits", r"(-?\d+(?:\.\d+)?)", None),
    ("verdict yes", r"(yes|no)", None), ("a 4 b", r"\d", 4.0), ("x=inf", r"=(\w+)", None)])
def test_parse_verdict(text, pattern, want):
    from fastgrpo.algorithms.reward_models import parse_verdict

    assert parse_verdict(text, pattern) == want


def tiny_judge(path):
    from fastgrpo.models.loading import build_tiny_model

    tok = build_tiny_tokenizer()
    model = build_tiny_model(ModelConfig(tiny_hidden_size=32, tiny_intermediate_size=64, tiny_initializer_range=0.3),
                             tok, seed=5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def test_judge_scores_are_hf_greedy_verdicts(tmp_path):
    """A judge's scores: its prompt rendered by its chat template (the tiny one: <|user|>...<|assistant|>), HF's
    greedy generate of it, the last match of the verdict pattern; failures count the answers without a number."""
    from transformers import AutoTokenizer

    from fastgrpo.algorithms.reward_models import GenerativeJudges
    from fastgrpo.distributed import init_distributed

    model, _ = tiny_judge(tmp_path / "judge")
    tok = AutoTokenizer.from_pretrained(tmp_path / "judge")  # the judge's own tokenizer, as loaded from its directory
    cfg = load_config("tiny", overrides=[f"reward.judges=[{{path: {tmp_path / 'judge'}, max_new_tokens: 16, "
                                         "verdict_pattern: '(\\d)', prompt_template: '{question} {completion}?'}]"])
    judges = GenerativeJudges(cfg, init_distributed("cpu"))
    questions = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    completions = [f"{a + b + (a % 2)}" for a in range(4) for b in range(4)]
    scores, faults = judges.score(questions, completions)
    want = []
    for q, c in zip(questions, completions):
        ids = tok(f"<|user|>{q} {c}?<|assistant|>", add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        digits = [ch for ch in answer if ch in "0123456789"]
        want.append(float(digits[-1]) if digits else None)
    assert scores["judge"] == [0.0 if w is None else w for w in want]
    assert faults == {"judge": {"failures": sum(w is None for w in want)}}
    assert 0 < faults["judge"]["failures"] < len(want)  # both outcomes occur: the comparison covers each


def test_grpo_with_a_judge_as_its_only_reward(tmp_path):
    """A 2-step GRPO run whose only reward is a judge (weight 0.5): its scores in the rollout log, reward/judge/mean
    their mean, reward/judge/failures its unparsed verdicts (summed over the step), the reward 0.5 · score; the
    memory plan holds its weights."""
    from fastgrpo.plan import memory_plan
    from fastgrpo.trainer import Trainer

    judge, _ = tiny_judge(tmp_path / "judge")
    run = tmp_path / "run"
    over = [o for o in grpo_rm_overrides(tmp_path, run) if not o.startswith("reward.models")]
    judges = f"reward.judges=[{{path: {tmp_path / 'judge'}, weight: 0.5, max_new_tokens: 8, verdict_pattern: '(\\d)'}}]"
    cfg = load_config("tiny", overrides=[*over, judges])
    Trainer(cfg).fit()
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    logged = read_jsonl(run / "rollouts" / "step_00000001.jsonl")
    scores = [r["rewards"]["judge"] for r in logged]
    assert len(logged) == 16 and rows[0]["reward/judge/mean"] == pytest.approx(sum(scores) / 16, abs=1e-9)
    assert 0 <= rows[0]["reward/judge/failures"] <= 16 and all(s == int(s) and 0 <= s <= 9 for s in scores)
    assert all(r["reward"] == pytest.approx(0.5 * r["rewards"]["judge"], abs=1e-9) for r in logged)
    plan, base = memory_plan(cfg, 1, 80.0), memory_plan(load_config("tiny"), 1, 80.0)
    assert plan.reward_models == 4 * sum(p.numel() for p in judge.parameters()) == plan.static - base.static
