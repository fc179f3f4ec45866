"""A vision-language policy under FSDP2 and with activation checkpointing (issue 34), against one process.

The same global batch of sequences with images (random tiny Qwen2.5-VL, fp32) goes through GRPO's packed update
(two optimizer steps per rollout, so the old log-probs' no-grad pass runs too, then SGD) on one process and split
over two under FSDP2. One rank's share has all the images and the other's none, so the vision tower runs on one
rank only: a tower sharded block by block would all-gather
in each of those calls and the ranks' collectives would not pair up. Checked:

- FSDP2 on 2 processes gives one process's loss and parameter change (the same fp32 gradients reduced in another
  order: rtol 1e-5 / 1e-4 as ``tests/test_grpo.py``'s FSDP2 test), with the tower frozen (the default) and trainable
  (and DDP with a trainable tower, which rank 1 never runs: a zero gradient keeps its buckets);
- the frozen tower stays replicated in the compute dtype under FSDP2 (plain tensors, no fp32 copy, no gradient);
- activation checkpointing gives the same loss and change as without (the same ops recomputed: fp32 rounding).

Two torchrun launches of ~20 s each: ``pytest -m slow tests/test_vlm_parallel.py``.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_grpo import run_update
from test_vlm_generation import MAX_PIXELS, MIN_PIXELS, processor, vlm_prompts
from test_vlm_training import image_prompt

from fastgrpo.algorithms.batch import Sample
from fastgrpo.config import load_config
from fastgrpo.distributed import init_distributed
from fastgrpo.models.vlm import vision_tower

VLM = ["model.path=tiny-vlm", "model.tiny_hidden_size=32", "model.tiny_intermediate_size=64",
       "model.tiny_initializer_range=0.3", f"model.vision.min_pixels={MIN_PIXELS}",
       f"model.vision.max_pixels={MAX_PIXELS}", "train.max_grad_norm=0", "rollout.max_new_tokens=8",
       "grpo.num_prompts_per_step=4", "grpo.num_generations=2", "train.sequences_per_optimizer_step=4",
       "train.max_tokens_per_microbatch=40"]
TRAINED = ["model.vision.train_vision_tower=true"]
CASES = {  # name: (strategy, overrides)
    "frozen": ("fsdp2", []), "frozen_ac": ("fsdp2", ["train.activation_checkpointing=true"]),
    "trained": ("fsdp2", TRAINED), "trained_ac": ("fsdp2", [*TRAINED, "train.activation_checkpointing=true"]),
    "trained_ddp": ("ddp", TRAINED),
}


def vlm_samples():
    """8 sequences of 4 prompts: prompt 0 (2 images) twice, prompts 1 and 3 (1 image) once, the text prompt 2 on
    every odd sequence, so that split over 2 ranks by stride rank 0 runs the vision tower and rank 1 never does.
    Images of 1-9 tokens, completions of 1-5 tokens, random advantages, one sequence not trained on."""
    outs, _ = vlm_prompts([2, 1, 0, 1], seed=11)
    image_id = processor().image_token_id
    g = torch.Generator().manual_seed(0)
    out = []
    for i, p in enumerate([0, 2, 1, 2, 3, 2, 0, 2]):
        prompt = image_prompt(SimpleNamespace(config=SimpleNamespace(image_token_id=image_id)), outs[p])
        c = torch.randint(5, 40, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(prompt, c, [-1.0] * len(c), float(torch.randn((), generator=g)), train=i != 5))
    return out


def _shares(state) -> dict:
    """One process's part: its share of the batch through each case's update (one process: no wrapping); the loss,
    the parameter change by name, and the tower's parameters' kind."""
    # rank 0 takes the sequences of even index, rank 1 the odd ones: each optimizer step's 4 sequences split 2 + 2
    mine = vlm_samples()[state.rank :: state.world_size]
    result = {}
    for case, (strategy, overrides) in CASES.items():
        cfg = load_config(overrides=[*VLM, *overrides])
        layer_calls = []  # the language model's attention calls (checkpointing: again in backward)
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda m, *_, calls=layer_calls: calls.append(1) if type(m).__name__ == "Qwen2_5_VLAttention" else None)
        try:
            metrics, delta, model, _ = run_update(cfg, mine, state, strategy=strategy, lr=0.1)
        finally:
            hook.remove()
        tower = list(vision_tower(model).parameters())
        result[case] = {"loss": metrics["loss"], "steps": metrics["optimizer_steps"], "delta": delta,
                        "tower_plain": all(type(p) is torch.nn.Parameter for p in tower),
                        "tower_grad": any(p.grad is not None for p in tower), "layer_calls": len(layer_calls)}
        del model
    return result


def _torchrun(nproc: int, out: Path, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_fsdp2_vlm_update_matches_one_process_and_checkpointing_changes_nothing(tmp_path):
    one = _torchrun(1, tmp_path / "one.pt", tmp_path)
    two = _torchrun(2, tmp_path / "two.pt", tmp_path)
    for case in CASES:
        a, b = one[case], two[case]
        assert a["steps"] == b["steps"] == 2, case
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), case
        for k in a["delta"]:
            torch.testing.assert_close(b["delta"][k], a["delta"][k], rtol=1e-4, atol=1e-6, msg=f"{case} {k}")
        if case.startswith("frozen"):  # replicated, compute dtype, untouched, no gradient
            assert two[case]["tower_plain"] and not two[case]["tower_grad"], case
            assert all(not a["delta"][k].any() for k in a["delta"] if k.startswith("model.visual.")), case
        else:
            assert any(a["delta"][k].abs().max() > 0 for k in a["delta"] if k.startswith("model.visual.")), case
    for res in (one, two):  # checkpointing recomputes the same ops: fp32 rounding apart at most
        for case in ("frozen", "trained"):
            plain, ac = res[case], res[f"{case}_ac"]
            assert ac["layer_calls"] > plain["layer_calls"], case  # the layers were recomputed
            assert ac["loss"] == pytest.approx(plain["loss"], rel=1e-6), case
            for k in plain["delta"]:
                torch.testing.assert_close(ac["delta"][k], plain["delta"][k], rtol=1e-5, atol=1e-7, msg=k)


def _worker(out: str) -> None:
    from fastgrpo.distributed import barrier, destroy

    state = init_distributed("cpu")
    torch.set_num_threads(1)
    result = _shares(state)
    if state.rank == 0:
        torch.save(result, out)
    barrier()  # no rank tears the process group down while another still uses it
    destroy()  # no wrapped model is referenced here any more: destroy() frees FSDP2's cycles, then the group


if __name__ == "__main__":
    _worker(sys.argv[1])
