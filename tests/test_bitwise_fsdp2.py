"""``numerics.batch_invariant`` under ``train.strategy=fsdp2``: two processes (gloo, CPU) of ``fastgrpo/train.py``.

FSDP2 shards each parameter into a ``DTensor``; the engine reads the weights gathered for its call (a
``full_weights`` block), the training forward gathers them layer by layer. Both are the same values (a gather copies),
so the mode's promise holds unchanged: the engine's log-prob of every sampled token is the trainer's, bit for bit.
The weights' grids are kept for a generation call and made at each training product (``keep_weight_grids`` skips the
shards). The gate ``sampling/sampling_logp_difference/max`` must be exactly 0.0 at every step (weights that moved
between steps included). The slow tier: a run with the mode off logs a non-zero difference (the gate is live under
fsdp2), and the first step's rows under fsdp2 equal DDP's (the same samples and the same loss: both forwards are the
invariant ones on the same weights).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastgrpo.metrics import read_jsonl

TRAIN = Path(__file__).resolve().parents[1] / "fastgrpo" / "train.py"
RUN = ["grpo.num_prompts_per_step=4", "grpo.num_generations=4", "rollout.max_new_tokens=6", "sft.warmup_steps=0",
       "grpo.mask_zero_std_groups=false", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
       "checkpoint.every_steps=0", "checkpoint.save_final=false", "logging.progress_bar=false",
       "logging.completions_to_print=0", "train.num_threads=1", "train.max_steps=3",
       "reward.functions=[test_async_grpo:parity_reward]"]  # the untrained model's groups differ: the weights move
GATE = "sampling/sampling_logp_difference/max"


def run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """Two processes of the tiny recipe with ``overrides``; the metrics rows of its GRPO steps."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN), *RUN,
           f"logging.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if GATE in r]
    assert len(rows) == 3
    return rows


def test_fsdp2_engine_logprobs_equal_the_trainers(tmp_path):
    """bf16 weights gathered from fp32 masters, a KL reference model (its forward makes its grids per product) and
    activation checkpointing (the recompute on the mode's ops): the gate is 0.0 at each of 3 steps, the weights
    moving between them (a gradient at each step, a KL from the reference after the first)."""
    on = run(tmp_path, "on", "numerics.batch_invariant=true", "train.strategy=fsdp2", "model.dtype=bfloat16",
             "grpo.beta=0.04", "train.activation_checkpointing=true")
    assert [r[GATE] for r in on] == [0.0, 0.0, 0.0]
    assert all(r["grad_norm"] > 0 for r in on) and all(r["kl"] > 0 for r in on[1:])  # the weights moved


@pytest.mark.slow
def test_fsdp2_gate_is_live_with_the_mode_off(tmp_path):
    """The control: fsdp2 with the mode off (fp32) logs a difference above 0 (fp32 rounding between the engine's and
    the trainer's paths), so the 0.0 above is the mode's doing, not a gate that reads 0 under fsdp2."""
    off = run(tmp_path, "off", "train.strategy=fsdp2")
    assert max(r[GATE] for r in off) > 0.0 and all(math.isfinite(r[GATE]) for r in off)


@pytest.mark.slow
def test_fsdp2_first_step_equals_ddp(tmp_path):
    """The mode on under fsdp2 and under ddp (fp32): the first step samples the same tokens with the same weights, so
    its rewards, log-prob gate and loss are the same numbers; the gate is 0.0 at every step of both."""
    rows = {s: run(tmp_path, s, "numerics.batch_invariant=true", f"train.strategy={s}") for s in ("fsdp2", "ddp")}
    for key in ("reward/mean", "loss", GATE, "response_length/mean"):
        assert rows["fsdp2"][0][key] == rows["ddp"][0][key], key
    assert all(r[GATE] == 0.0 for s in rows for r in rows[s])
