"""DPO on the trainer's loop (fastgrpo/algorithms/dpo.py): the packed step against an unpacked fp32 reference, the
reference
log-probs (precomputed = on the fly), 2 processes = 1, exact resume."""

import json
import math
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import assert_decisive
from fastgrpo.kernels.reference import dpo_loss_ref

from fastgrpo.config import load_config
from fastgrpo.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "fastgrpo" / "train.py"
SMALL = ["model.tiny_hidden_size=32", "model.tiny_intermediate_size=64", "data.synthetic_num_terms=2",
         "data.synthetic_eval_size=16", "data.max_length=24", "train.max_tokens_per_microbatch=64", "dpo.batch_size=8",
         "sft.batch_size=8", "sft.warmup_steps=0", "eval.num_prompts=4", "eval.every_steps=0",
         "logging.progress_bar=false", "train.num_threads=1"]
TIMING = ("time", "time/", "tokens_per_second", "peak_memory_gib")


def trainer(tmp_path, *overrides):
    from fastgrpo.trainer import Trainer

    return Trainer(load_config("dpo-tiny", overrides=[*SMALL, f"logging.output_dir={tmp_path}", *overrides]))


def sgd(t):
    """Plain SGD at lr 1 instead of AdamW, so that a step's weight change is minus the gradient."""
    t.ctx.optimizer = torch.optim.SGD(t.wrapped.parameters(), lr=1.0)
    t.ctx.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0)


def seq_logp(model, prompt, response):
    """Σ log p(response | prompt): the sequence alone through the Hugging Face forward, fp32 log-softmax."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).sum()


@pytest.mark.parametrize("loss_type, average, sft_weight, smoothing",
                         [("sigmoid", False, 0.0, 0.0), ("sigmoid", True, 0.5, 0.1), ("ipo", False, 0.0, 0.0),
                          ("hinge", True, 0.0, 0.0)])
def test_packed_step_matches_unpacked_fp32_reference(tmp_path, loss_type, average, sft_weight, smoothing):
    """One DPO step over 8 pairs in several packed micro-batches (64-token budget) vs each sequence alone through
    the HF forward, fp32 log-softmax sums → (per-token average) → ``dpo_loss_ref`` (+ w·mean(−π_c)). The
    reference log-probs, precomputed by the trainer from the starting weights, are recomputed the same
    independent way. Loss, TRL metrics and gradients (the SGD weight change) must agree."""
    t = trainer(tmp_path, f"dpo.loss_type={loss_type}", f"dpo.average_logprobs={str(average).lower()}",
                f"dpo.sft_weight={sft_weight}", f"dpo.label_smoothing={smoothing}", "train.max_grad_norm=0",
                "dpo.beta=0.5")
    dpo, model = t.algorithm, t.model
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    dpo.begin()  # the reference: the starting weights
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the policy away from the reference
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    sgd(t)
    indices = [5, 17, 3, 40, 9, 25, 31, 77]
    m = dpo.step(indices, {})
    assert m["bad_steps"] == 0
    delta = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    assert len(dpo._microbatches([dpo.train_data.items[i] for i in indices], indices)) > 1

    pairs = [dpo.train_data.items[i] for i in indices]
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(start[k])
        ref = torch.stack([torch.stack([seq_logp(model, p.prompt_ids, p.chosen_ids),
                                        seq_logp(model, p.prompt_ids, p.rejected_ids)]) for p in pairs])  # [B, 2]
        for k, p in model.named_parameters():
            p.copy_(before[k])
    torch.testing.assert_close(dpo.ref_tables["train"][indices], ref, rtol=1e-5, atol=1e-5)
    model.zero_grad()
    pc = torch.stack([seq_logp(model, p.prompt_ids, p.chosen_ids) for p in pairs])
    pr = torch.stack([seq_logp(model, p.prompt_ids, p.rejected_ids) for p in pairs])
    n_c = torch.tensor([float(len(p.chosen_ids)) for p in pairs])
    n_r = torch.tensor([float(len(p.rejected_ids)) for p in pairs])
    rc, rr = ref[:, 0], ref[:, 1]
    lengths = {"chosen_lengths": n_c, "rejected_lengths": n_r}
    if average:
        pc, pr, rc, rr, lengths = pc / n_c, pr / n_r, rc / n_c, rr / n_r, {}
    # rewards/accuracies counts pairs with (π_c − ref_c) > (π_r − ref_r): the margins must exceed the ~1e-5 by
    # which the packed and the unpacked sums can differ, or the comparison below would be decided by rounding
    assert_decisive("reward margin", (pc - rc) - (pr - rr), [0.0], 1e-4)
    loss, metrics = dpo_loss_ref(pc, pr, rc, rr, beta=0.5, loss_type=loss_type, label_smoothing=smoothing,
                                 **lengths)
    loss = loss + sft_weight * -pc.mean()
    loss.backward()
    # fp32 on both sides, summed in other orders (packed chunks vs one sequence at a time): ~1e-6 relative
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    for k, v in metrics.items():
        assert m[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    assert m["logps/chosen"] == pytest.approx(pc.mean().item(), rel=1e-5)
    if sft_weight:
        assert m["nll_loss"] == pytest.approx(-pc.mean().item(), rel=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(delta[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")


def test_precomputed_reference_equals_on_the_fly(tmp_path):
    """After a 3-step warm-up (the reference is the warmed-up policy, not model.path), two DPO steps with the
    precomputed table and with a frozen reference model give the same metrics; the reference model's weights are
    the policy's as DPO started, kept in the run directory for a resume."""
    from fastgrpo.algorithms.dpo import REFERENCE_FILE

    rows = {}
    for pre in (True, False):
        run = tmp_path / str(pre)
        t = trainer(run, "sft.warmup_steps=3", "train.max_steps=2", "eval.at_start=false", "eval.at_end=false",
                    f"dpo.precompute_ref_logprobs={str(pre).lower()}", "checkpoint.every_steps=0")
        t.fit()
        rows[pre] = training_rows(run)
        if not pre:
            assert (run / REFERENCE_FILE).is_file()
            assert not any(p.requires_grad for p in t.algorithm.ref_forward.parameters())
    # the table is computed on the steps' own micro-batches by the loss's own path, and the reference model runs on
    # those micro-batches too: the same weights, layout and kernels, so the rows are equal bit for bit
    assert len(rows[True]) == 2 and rows[True] == rows[False]
    first = rows[True][0]  # policy = reference: every implicit reward is exactly 0
    assert [first[k] for k in (*REWARDS, "rewards/accuracies")] == [0.0] * 4


FIRST_STEP = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from test_dpo import trainer, training_rows
from pathlib import Path
out = []
for i, overrides in enumerate(json.loads(sys.argv[2])):
    run = Path(sys.argv[3]) / str(i)
    trainer(run, "train.max_steps=1", "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=0",
            *overrides).fit()
    out.append(training_rows(run)[0])
print(json.dumps(out))
"""


def test_first_step_rewards_are_exactly_zero(tmp_path):
    """At the first DPO step the policy is the reference: every implicit reward is exactly 0 (so is the accuracy),
    for random batch sizes, micro-batch budgets, warm-ups and seeds. Run under the Triton interpreter with numpy's
    OpenBLAS forced to its Haswell kernels (those of an AVX2 machine without AVX-512, e.g. AMD EPYC), whose
    ``tl.dot`` rounds a row differently when it moves within a block: a reference table packed in another layout
    than the step's gave one pair a reward of −2.4e-8 and an accuracy of 0.125 there."""
    rng = random.Random(24)
    cases = [[f"dpo.batch_size={rng.choice([2, 4, 8, 16])}", f"sft.warmup_steps={rng.choice([0, 1])}",
              f"train.max_tokens_per_microbatch={rng.choice([48, 64, 96, 200])}", f"train.seed={rng.randrange(100)}"]
             for _ in range(4)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    if platform.machine() == "x86_64" and " avx2 " in Path("/proc/cpuinfo").read_text():
        env["OPENBLAS_CORETYPE"] = "Haswell"
    proc = subprocess.run([sys.executable, "-c", FIRST_STEP, str(REPO / "tests"), json.dumps(cases), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, row in zip(cases, rows, strict=True):
        assert [row[k] for k in (*REWARDS, "rewards/accuracies")] == [0.0] * 4, case


def training_rows(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_jsonl(run_dir / "metrics.jsonl")
            if "loss" in r]


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
BETA = load_config("dpo-tiny").dpo.beta


def assert_same_rows(a, b, rel):
    """Rows of two runs that sum in other orders (other processes, packing): equal to ``rel``.

    An implicit reward is β·(π − ref), a difference of two sums that each agree to ``rel``: it agrees to
    ``rel·β·(|π| + |ref|)``, ≈ ``2·rel·β·|logps|`` (the policy is near the reference), however small the reward.
    ``rewards/accuracies`` is a share of pairs whose margin is above 0: at the first step every margin is exactly 0
    in both runs (the reference is the policy, bit for bit), later a margin can be within rounding of 0 and flip
    one pair, so it is compared at the first step only (its value against a reference: the packed-step test)."""
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for i, (ra, rb) in enumerate(zip(a, b)):
        assert ra.keys() == rb.keys()
        logps = max(abs(ra["logps/chosen"]), abs(ra["logps/rejected"]))
        diff = {}
        for k in ra:
            if k == "rewards/accuracies" and i:
                continue
            abs_tol = 2 * rel * BETA * logps if k in REWARDS else 1e-7
            if not (ra[k] == rb[k] or math.isclose(ra[k], rb[k], rel_tol=rel, abs_tol=abs_tol)):
                diff[k] = (ra[k], rb[k])
        assert not diff, f"step {ra['step']}: {diff}"
    assert [a[0][k] for k in (*REWARDS, "rewards/accuracies")] == [b[0][k] for k in (*REWARDS, "rewards/accuracies")
                                                                   ] == [0.0] * 4


RUN = ["sft.warmup_steps=2", "checkpoint.every_steps=2", "eval.at_start=false"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """dpo-tiny shrunk, a 2-step warm-up, 4 DPO steps in this process: the run the others must reproduce."""
    run = tmp_path_factory.mktemp("dpo") / "one"
    trainer(run, *RUN, "train.max_steps=4").fit()
    return run


def test_two_processes_equal_one(one_process, tmp_path):
    """torchrun with 2 processes (each half of every batch, DDP): the same rows as one process (fp32 sums in
    another order: rel 1e-5); the end-of-run validation logs the DPO and avg@k metrics."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN),
           "--recipe", "dpo-tiny", *SMALL, *RUN, "train.max_steps=4", f"logging.output_dir={run}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "reference log-probs of 100 pairs computed" in proc.stdout and "done: 4 DPO steps" in proc.stdout
    assert_same_rows(training_rows(one_process), training_rows(run), rel=1e-5)
    rows = read_jsonl(run / "metrics.jsonl")
    assert {"eval/loss", "eval/preference_accuracy", "eval/accuracy"} <= set(rows[-1])
    assert {"loss", "grad_norm", "lr", "tokens", "tokens_per_second", "rewards/chosen", "rewards/rejected",
            "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss"} <= set(rows[0])


def test_resume_is_exact(one_process, tmp_path, capsys):
    """2 steps, then a new trainer resumes to 4: the reference table comes from the checkpoint (neither the
    warm-up nor the reference forwards run again), and the rows equal the uninterrupted run's."""
    trainer(tmp_path, *RUN, "train.max_steps=2").fit()
    capsys.readouterr()
    resumed = trainer(tmp_path, *RUN, "train.max_steps=4")
    resumed.fit()
    out = capsys.readouterr().out
    assert "resumed from" in out and "reference log-probs" not in out and "warm-up" not in out
    assert_same_rows(training_rows(one_process), training_rows(tmp_path), rel=1e-6)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="train.sft_warmup_steps is now sft.warmup_steps"):
        load_config("dpo-tiny", overrides=["train.sft_warmup_steps=3"])
    with pytest.raises(ValueError, match="algorithm must be one of"):
        load_config(overrides=["algorithm=ppo"])
    with pytest.raises(ValueError, match="dpo.loss_type must be one of"):
        load_config("dpo-tiny", overrides=["dpo.loss_type=kto"])
    with pytest.raises(ValueError, match="dpo.label_smoothing applies to loss_type sigmoid only"):
        load_config("dpo-tiny", overrides=["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"])
    with pytest.raises(ValueError, match="train.max_tokens_per_microbatch must hold 2 sequence"):
        load_config("dpo-tiny", overrides=["data.max_length=3000"])
    with pytest.raises(ValueError, match="sft.warmup_steps must be 0 with algorithm sft"):
        load_config("sft-tiny", overrides=["sft.warmup_steps=5"])
    from fastgrpo.algorithms.dpo import DPO

    with pytest.raises(ValueError, match=r"dpo.batch_size=6 must be a multiple of the number of processes \(4\)"):
        DPO.check_world_size(load_config("dpo-tiny", overrides=["dpo.batch_size=6"]), 4)


def test_recipes_use_nemo_rl_published_defaults():
    dpo, sft = load_config("dpo-1.5b"), load_config("sft-1.5b")
    assert (dpo.algorithm, dpo.dpo.beta, dpo.dpo.sft_weight, dpo.dpo.average_logprobs) == ("dpo", 0.05, 0.0, False)
    assert (dpo.dpo.batch_size, dpo.data.max_length, dpo.train.lr, dpo.train.weight_decay) == (128, 1024, 5e-6, 0.1)
    assert (dpo.train.adam_beta2, dpo.train.warmup_steps, dpo.train.max_steps, dpo.eval.every_steps) == (
        0.98, 20, 150, 25)
    assert (sft.algorithm, sft.sft.batch_size, sft.data.max_length, sft.train.lr, sft.train.max_steps) == (
        "sft", 32, 1024, 5e-6, 60)
    assert dpo.model.dtype == sft.model.dtype == "bfloat16"


def test_on_the_fly_reference_without_warmup_is_model_path(tmp_path):
    """No warm-up: the on-the-fly reference is model.path as loaded (here the tiny model's seeded weights), so the
    first step's implicit rewards are 0; no reference file is written."""
    from fastgrpo.algorithms.dpo import REFERENCE_FILE

    t = trainer(tmp_path, "dpo.precompute_ref_logprobs=false", "dpo.sft_weight=0")
    t.algorithm.begin()
    m = t.algorithm.step(list(range(8)), {})
    assert m["rewards/chosen"] == pytest.approx(0.0, abs=1e-6) and m["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert m["loss"] == pytest.approx(math.log(2), rel=1e-5)  # the sigmoid loss at h = 0: −log σ(0)
    assert not (tmp_path / REFERENCE_FILE).exists()

