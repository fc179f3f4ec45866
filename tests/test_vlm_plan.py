"""The memory plan of a vision-language policy (issue 34) against closed forms written here from the config.

- Qwen2.5-VL-3B's vision tower has the parameter count of its config, summed by hand module by module;
- a frozen tower costs its compute-dtype weights on every GPU and no masters, AdamW state or gradients (the trained
  parameters are P - P_v), under DDP and FSDP2 and with LoRA; a trainable one trains like the rest;
- the images' bytes (kept pixel values and tower output, one tower pass, a trainable tower's saved activations,
  generation's kept output) equal the module docstring's formulas evaluated by hand;
- the trainer's optimizer keeps fp32 masters for exactly the parameters the plan counts as trained (a bf16 tiny VLM);
- an image's tokens after the 2 x 2 merge lie within ``image_token_range`` for random sizes and pixel bounds (the
  processor itself resizes), and reach both ends.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fastgrpo.config import load_config
from fastgrpo.models.vlm import image_token_range, tiny_image_processor
from fastgrpo.plan import main, memory_plan
from fastgrpo.shapes import model_shape

QWEN_VL_3B = str(Path(__file__).resolve().parent / "data" / "qwen2.5-vl-3b-instruct")
H, L, HV, IV, HEADS_V, DEPTH, OUT = 2048, 36, 1280, 3420, 16, 32, 2048  # the config's numbers
Q, E = 4, 3 * 2 * 14 * 14  # patches per image token (2 x 2 merge); pixel values per patch (RGB x 2 frames x 14²)


def tower_params_by_hand() -> int:
    block = 2 * HV + (HV * 3 * HV + 3 * HV) + (HV * HV + HV) + 2 * (HV * IV + IV) + (IV * HV + HV)
    merger = HV + (4 * HV * 4 * HV + 4 * HV) + (4 * HV * OUT + OUT)  # ln_q, mlp.0, mlp.2
    return E * HV + DEPTH * block + merger  # patch_embed (a bias-free conv), blocks, merger


def a_v(c: int) -> int:
    """What one tower block saves per patch for backward (the decoder layer's A with 16 heads of 80, no GQA)."""
    d = HV // HEADS_V
    return 2 * (4 * HV + 4 + 2 * c * HV) + c * 4 * HEADS_V * d + 4 * HEADS_V + 4 * c * IV


def cfg_3b(*overrides):
    return load_config("vlm-grpo-qwen2.5-vl-3b", None, [f"model.path={QWEN_VL_3B}", *overrides])


@pytest.fixture(scope="module")
def shape():
    return model_shape(cfg_3b())


def test_tower_parameters_match_the_config(shape):
    assert shape.vision.params == tower_params_by_hand() == 668_684_288
    assert (shape.params, shape.layers, shape.hidden, shape.vision.layers) == (3_754_622_976, L, H, DEPTH)


FROZEN = "model.vision.train_vision_tower=false"  # fastgrpo's default; the recipe trains it, as NeMo-RL


@pytest.mark.parametrize("strategy,nproc,extra", [
    ("fsdp2", 8, [FROZEN]), ("ddp", 8, [FROZEN]), ("fsdp2", 2, [FROZEN, "train.activation_checkpointing=true"]),
    ("fsdp2", 8, []), ("ddp", 4, ["train.activation_checkpointing=true"]), ("fsdp2", 8, ["model.lora.r=64"]),
])
def test_plan_bytes_match_the_closed_form(shape, strategy, nproc, extra):
    cfg = cfg_3b(f"train.strategy={strategy}", *extra)
    plan = memory_plan(cfg, nproc, 80, shape=shape)
    c, P, Pv, W = 2, shape.params, shape.vision.params, nproc
    lora = cfg.model.lora is not None
    frozen = lora or not cfg.model.vision.train_vision_tower
    p = L * 64 * (2 * (H + H) + 2 * (H + 256) + 3 * (H + 11008)) if lora else 0  # q, o; k, v; gate, up, down
    trained = p if lora else P - (Pv if frozen else 0)
    sharded = strategy == "fsdp2"
    assert plan.vision_tower == (c * Pv if frozen else 0)
    assert plan.weights == c * (P + p - (Pv if frozen else 0))
    assert (plan.masters, plan.optimizer) == ((4 * trained // W, 8 * trained // W) if sharded else (4 * trained,
                                                                                                 8 * trained))
    assert plan.gradients == (4 * trained // W if sharded else 4 * trained)
    if lora:
        assert plan.base_shard == c * (P - Pv) // W
    # images: v = max_prompt_tokens image tokens a prompt at most, S = 8 x 16 / W sequences of a rollout per GPU
    v, S, T = 1024, 128 // W, cfg.train.max_tokens_per_microbatch
    tower_pass = 4 * E * Q * v + Q * v * c * (3 * HV + 3 * HV + 3 * IV) + c * Q * v * HV + c * v * H
    saved = 0
    if not frozen:
        saved = Q * T * (DEPTH * c * HV + a_v(c) if cfg.train.activation_checkpointing else DEPTH * a_v(c))
    assert plan.vision_train == S * v * (4 * Q * E + (c * H if frozen else 0)) + tower_pass + saved
    assert plan.vision_generation == math.ceil(8 / W) * c * v * H + tower_pass
    assert plan.training_peak == (plan.static + plan.train_extra + plan.activations + plan.loss_workspace
                                  + plan.vision_train)


@pytest.mark.parametrize("nproc,gib,extra,fits", [
    (8, 80, [], True), (8, 141, [], True), (8, 80, [FROZEN], True), (8, 141, [FROZEN], True),
    (2, 80, [], False), (2, 80, ["train.activation_checkpointing=true"], True), (2, 80, [FROZEN], True),
])
def test_the_3b_recipe_verdicts(capsys, nproc, gib, extra, fits):
    """The README's figures: the recipe (its tower trained, as NeMo-RL) and with the tower frozen."""
    rc = main(["--recipe", "vlm-grpo-qwen2.5-vl-3b", f"model.path={QWEN_VL_3B}", "--nproc", str(nproc),
               "--gpu-memory-gib", str(gib), *extra])
    out = capsys.readouterr().out.splitlines()
    assert rc == (0 if fits else 1) and out[-1].startswith(f"{'fits' if fits else 'does not fit'}: {nproc} x {gib}")
    assert out[1].startswith("images: 4 to 1280 tokens each")
    assert any(line.strip().startswith("vision tower (frozen") for line in out) == bool(extra and extra[0] == FROZEN)


def test_masters_only_for_what_the_plan_trains():
    """A bf16 tiny VLM under the trainer's optimizer: fp32 masters for the language model, none for the frozen
    tower; the plan's master bytes are 4 x those parameters."""
    from fastgrpo.models.loading import load_model
    from fastgrpo.precision import MasterAdamW, make_optimizer

    cfg = load_config("vlm-tiny", None, ["model.dtype=bfloat16"])
    model, _ = load_model(cfg.model, torch.device("cpu"))
    opt = make_optimizer(model, lr=1e-3)
    assert isinstance(opt, MasterAdamW)
    tower = {id(p) for p in model.model.visual.parameters()}
    assert not any(id(p) in tower for p in opt.model_params)
    plan = memory_plan(cfg, 1, 80)
    assert plan.masters == 4 * sum(m.numel() for m in opt.masters) > 0
    assert plan.vision_tower == 2 * sum(p.numel() for p in model.model.visual.parameters())


@settings(max_examples=30, derandomize=True, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 8), st.integers(4, 40), st.floats(0.2, 5.0))
def test_image_tokens_lie_within_the_range(min_tokens, extra, scale_lo, size, aspect):
    """Random image sizes (aspect ratio 1:5 to 5:1) under random pixel bounds of at least 5 x 5 tokens apart from
    the smallest, the processor's resize: its token count lies in the range."""
    min_pixels, max_pixels = min_tokens * 784, (min_tokens + 25 + extra) * 784
    h = max(1, int(size * scale_lo * 7))
    w = max(1, int(h * aspect))
    proc = tiny_image_processor(min_pixels, max_pixels)
    grid = proc(images=[Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))], return_tensors="pt")["image_grid_thw"]
    tokens = int(grid.prod()) // 4
    lo, hi = image_token_range(min_pixels, max_pixels, 14, 2)
    assert lo <= tokens <= hi


def test_image_token_range_ends_are_reached():
    lo, hi = image_token_range(28 * 28 * 4, 28 * 28 * 36, 14, 2)
    proc = tiny_image_processor(28 * 28 * 4, 28 * 28 * 36)
    for side, want in ((10, lo), (168, hi), (1000, hi)):
        grid = proc(images=[Image.new("RGB", (side, side))], return_tensors="pt")["image_grid_thw"]
        assert int(grid.prod()) // 4 == want


def test_plan_runs_as_a_module_from_the_checkout_root():
    """``python -m fastgrpo.plan`` where the README runs it, the checkout's root: its kernels/ folder must not shadow
    the PyPI package ``kernels`` that transformers imports (transformers >= 5 installs it)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fastgrpo.plan", "--recipe", "vlm-tiny"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith("fits: 1 x 80 GiB"), proc.stderr[-2000:]
