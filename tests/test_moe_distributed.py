"""A Qwen3-MoE policy's update under FSDP2 (its fused expert parameters sharded with the rest of each decoder layer)
against DDP, 2 torchrun processes on CPU (gloo): router replay and the load-balancing loss on, micro-batch counts that
differ between the ranks, two optimizer steps per rollout (the old log-probs through the sharded model, replayed),
fp32 without and with activation checkpointing. Both reduce the same fp32 gradients in another order (all-reduce vs
reduce-scatter), ~1e-7 relative, which the second step may amplify a little: rtol 1e-5 on metrics, 1e-4 on weights
(tests/test_grpo.py's dense test takes the same)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_grpo import make_samples, run_update

from fastgrpo.algorithms.moe import METRICS
from fastgrpo.config import load_config

OVERRIDES = ["train.sequences_per_optimizer_step=8", "grpo.num_prompts_per_step=8", "grpo.num_generations=2",
             "train.max_tokens_per_microbatch=16", "model.moe.router_aux_loss_coef=0.05", "model.moe.replay_gap=false"]


def with_routing(samples, seed=0):
    """The samples with a random record (2 MoE layers of the moe-tiny recipe's 8 experts, top-2; E at the last)."""
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        n = len(s.tokens)
        ids = torch.stack([torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2)]) for _ in range(n)])
        ids[-1] = 8
        s.routing = ids.to(torch.uint8)
    return samples


@pytest.mark.slow
def test_fsdp2_moe_update_matches_ddp(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), str(tmp_path / "moe.pt")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = torch.load(tmp_path / "moe.pt")
    ddp = res["ddp"]
    assert ddp["metrics"]["optimizer_steps"] == 2 and res["counts"][0] != res["counts"][1]
    for case in ("fsdp2", "fsdp2_ac"):
        got = res[case]
        for key in ("loss", "grad_norm", *METRICS, "sampling/sampling_logp_difference/max"):
            assert got["metrics"][key] == pytest.approx(ddp["metrics"][key], rel=1e-5, abs=1e-7), (case, key)
        for k in ddp["delta"]:
            torch.testing.assert_close(got["delta"][k], ddp["delta"][k], rtol=1e-4, atol=1e-6)
    assert any("experts" in k and ddp["delta"][k].abs().max() > 0 for k in ddp["delta"])


# SFT and DPO on a tiny MoE policy with its load-balancing term, shrunk (2 steps, no evaluation)
AUX_RUN = ["model.moe.tiny_num_experts=4", "model.tiny_hidden_size=32", "model.tiny_intermediate_size=64",
           "model.moe.tiny_moe_intermediate_size=16", "model.moe.router_aux_loss_coef=0.5",
           "data.synthetic_num_terms=2", "data.synthetic_eval_size=8", "data.max_length=12",
           "sft.batch_size=8", "dpo.batch_size=8", "sft.warmup_steps=0",
           "train.max_steps=2", "eval.every_steps=0", "eval.at_start=false", "eval.at_end=false",
           "checkpoint.every_steps=0", "logging.progress_bar=false", "train.num_threads=1", "train.max_grad_norm=0"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, tokens", [("sft-tiny", 16), ("dpo-tiny", 24)])
def test_aux_loss_of_two_processes_equals_one(recipe, tokens, tmp_path):
    """SFT and DPO with the load-balancing term (``fastgrpo.algorithms.moe``): 2 torchrun processes (each half of every
    batch, DDP; the term a mean over the micro-batches of both ranks) log the same loss, ``moe/aux_loss`` and gradient
    norm as one process, fp32 sums in another order (rel 1e-5). A micro-batch holds one sequence (SFT: 10-11 tokens
    of 16) or one pair (DPO: 20-22 of 24), so both runs' micro-batches hold the same tokens: a micro-batch's aux is
    not a sum over its tokens (``E · Σ_e f_e P_e``), and other packings give other terms."""
    from fastgrpo.metrics import read_jsonl

    train = Path(__file__).resolve().parents[1] / "fastgrpo" / "train.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows = []
    for n in (1, 2):
        run = tmp_path / str(n)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(train),
               "--recipe", recipe, *AUX_RUN, f"train.max_tokens_per_microbatch={tokens}", f"logging.output_dir={run}"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows.append([r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r])
    assert len(rows[0]) == len(rows[1]) == 2
    for one, two in zip(*rows):
        for key in ("loss", "grad_norm", METRICS[0]):
            assert two[key] == pytest.approx(one[key], rel=1e-5), (one["step"], key)
        assert one[METRICS[0]] > 0


def _worker(out: str) -> None:
    from fastgrpo.algorithms.batch import pack_microbatches
    from fastgrpo.distributed import all_reduce, barrier, destroy, init_distributed

    state = init_distributed("cpu")
    torch.set_num_threads(1)
    samples = with_routing(make_samples(16))
    share = len(samples) // state.world_size
    mine = samples[state.rank * share : (state.rank + 1) * share]
    counts = torch.zeros(2, dtype=torch.long)
    counts[state.rank] = len(pack_microbatches(mine[:4], 16, state.device))
    result = {"counts": all_reduce(counts).tolist()}
    for case, extra in (("ddp", []), ("fsdp2", []), ("fsdp2_ac", ["train.activation_checkpointing=true"])):
        cfg = load_config("moe-tiny", overrides=[*OVERRIDES, *extra])
        metrics, delta = run_update(cfg, mine, state, strategy=case.split("_")[0], lr=0.1)[:2]
        result[case] = {"metrics": metrics, "delta": delta}
    if state.rank == 0:
        torch.save(result, out)
    barrier()
    destroy()


if __name__ == "__main__":
    _worker(sys.argv[1])
