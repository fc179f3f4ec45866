"""Vision-language training and data (issue 34) against independent references.

- M-RoPE positions written from the rule (``mrope_positions``) equal HF's ``get_rope_index`` over random image grids,
  text runs and sampled image tokens (which are text);
- the packed varlen forward with images and 3-D positions equals HF's per-sequence forward with ``pixel_values``,
  ``image_grid_thw`` (fp32 logits within ``c · eps32 · max|logit|``); the frozen tower gets no gradient and runs
  once per step (its output kept for the other passes), a trainable one gets its gradient;
- TRL's rows: a path, PIL image, bytes or ``{"bytes"}`` in ``image`` / ``images``, string or conversational prompts;
  a missing file, undecodable bytes and a count of image parts that differs from the images' fail at start-up naming
  the row and the field; a vision-language model type we cannot run is refused by name.
"""

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from checks import EPS32
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from test_vlm_generation import processor, tiny_vlm, vlm_prompts

from fastgrpo.algorithms.batch import Sample, make_microbatch
from fastgrpo.algorithms.forward import packed_forward
from fastgrpo.config import DataConfig, ModelConfig
from fastgrpo.data.images import vlm_prompt
from fastgrpo.data.prompts import build_dataset, read_rows
from fastgrpo.models.attention import enable_packed_attention
from fastgrpo.models.vlm import ImagePrompt, build_tiny_vlm, check_vision_model, mrope_positions, vision_tower


@settings(max_examples=25)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=3),
       st.integers(0, 3), st.integers(0, 3))
def test_mrope_positions_equal_hf_get_rope_index(pieces, tail, sampled):
    """``pieces``: (text tokens before, h', w') per image; then ``tail`` text tokens and ``sampled`` image tokens
    after the prompt (text). Images are separated by text, as the chat template's <|vision_start|> / <|vision_end|>
    always separate them (HF's grouping would take two adjacent images' tokens for one image)."""
    model = tiny_vlm(0)
    image_id, merge = model.config.image_token_id, 2
    ids, grids = [], []
    for text, h, w in pieces:
        ids += [7] * text + [image_id] * (h * w)
        grids.append([1, h * merge, w * merge])
    ids += [8] * tail
    grid = torch.tensor(grids)
    pos, delta = mrope_positions(ids + [image_id] * sampled, grid, image_id, merge, prompt_len=len(ids))
    want, want_delta = model.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == image_id).long(),
                                                  image_grid_thw=grid)
    assert torch.equal(pos[:, : len(ids)], want[:, 0]) and delta == int(want_delta)
    # sampled tokens continue as text from the prompt's largest position (HF's decode: cache index + rope_deltas)
    assert torch.equal(pos[:, len(ids) :], (torch.arange(len(ids), len(ids) + sampled) + delta).expand(3, -1))


def tiny_vlm_copy(seed: int):
    """A fresh tiny VLM (``tiny_vlm``'s sizes) a test may change, with the packed attention."""
    model = build_tiny_vlm(ModelConfig(path="tiny-vlm", tiny_hidden_size=32, tiny_num_heads=4, tiny_num_kv_heads=2,
                                       tiny_intermediate_size=64, tiny_initializer_range=0.3),
                           processor().tokenizer, seed=seed).eval()
    enable_packed_attention(model)
    return model


def image_prompt(model, out):
    """An ImagePrompt of a processed prompt (its images made again from the processor's outputs)."""
    from fastgrpo.models.vlm import ImageInputs

    ids = out["input_ids"][0].tolist()
    grid = out.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
    inputs = ImageInputs(out["pixel_values"], grid) if "pixel_values" in out else None
    return ImagePrompt(ids, lambda: inputs, grid, model.config.image_token_id, 2)


def hf_logits(model, out, seq):
    ids = torch.tensor([seq])
    kw = dict(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long())
    if "pixel_values" in out:
        kw.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    return model(**kw).logits[0].float()  # [L, V]


def test_packed_forward_with_images_equals_hf_per_sequence():
    model = tiny_vlm(2)
    enable_packed_attention(model)
    outs, _ = vlm_prompts([2, 0, 1, 1], seed=4)
    g = torch.Generator().manual_seed(0)
    samples, sources = [], []
    for i, out in enumerate(outs):
        prompt = image_prompt(model, out)
        for _ in range(2 if i == 2 else 1):  # two samples of one prompt share its images
            completion = torch.randint(0, 100, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            completion[-1] = model.config.image_token_id  # a sampled image token is text (HF: never an input here)
            samples.append(Sample(prompt, completion, [0.0] * len(completion), 1.0))
            sources.append(out)
    mb = make_microbatch(samples, torch.device("cpu"))
    assert len(mb.vision.pixel_values) == 3  # the distinct image sets: the shared prompt's once
    with torch.no_grad():
        hidden_NH, weight_VH, _ = packed_forward(model, mb.batch.input_ids, mb.batch.position_ids,
                                                 mb.batch.cu_seqlens, mb.batch.max_seqlen, vision=mb.vision)
        got = (hidden_NH @ weight_VH.t()).split(mb.batch.lengths)
        for s, out, logits in zip(samples, sources, got):
            want = hf_logits(model, out, s.tokens[:-1])  # [L - 1, V]
            bound = 64 * EPS32 * want.abs().max().item()  # fp32, summation order only
            assert (logits[:-1] - want).abs().max().item() <= bound


def test_frozen_tower_runs_once_and_gets_no_gradient():
    model = tiny_vlm(3)
    enable_packed_attention(model)
    outs, _ = vlm_prompts([1, 1], seed=5)
    samples = [Sample(image_prompt(model, o), [5, 6, 7], [0.0] * 3, 1.0) for o in outs]
    calls = []
    handle = vision_tower(model).register_forward_hook(lambda *a: calls.append(1))
    try:
        for train in (False, True):
            vision_tower(model).requires_grad_(train)
            model.zero_grad(set_to_none=True)
            mb = make_microbatch(samples, torch.device("cpu"))
            calls.clear()
            for _ in range(3):  # the old-policy, reference and policy passes of one step
                hidden, weight, _ = packed_forward(model, mb.batch.input_ids, mb.batch.position_ids,
                                                   mb.batch.cu_seqlens, mb.batch.max_seqlen, vision=mb.vision)
                (hidden @ weight.t()).logsumexp(-1).sum().backward()
            tower_grads = [p.grad for p in vision_tower(model).parameters()]
            lm_grads = [p.grad for p in model.model.language_model.parameters()]
            assert all(gr is not None for gr in lm_grads)
            if train:  # every pass runs it, with its gradient
                assert len(calls) == 3 * len(outs) and all(gr is not None and gr.abs().sum() > 0 for gr in tower_grads)
            else:
                assert len(calls) == len(outs) and all(gr is None for gr in tower_grads)
    finally:
        handle.remove()
        vision_tower(model).requires_grad_(False)


def test_a_reference_copy_runs_its_own_tower():
    """GRPO's reference model (a frozen copy, beta > 0) runs its pass before the policy's: its tower's output is kept
    for its own later passes, never handed to the policy's tower. A trainable policy tower runs with its gradient
    after the reference's pass; a frozen one runs once too, on its own weights (here perturbed from the copy's)."""
    import copy

    policy = tiny_vlm_copy(4)
    ref = copy.deepcopy(policy).requires_grad_(False)
    outs, _ = vlm_prompts([1, 2], seed=6)
    samples = [Sample(image_prompt(policy, o), [5, 6], [0.0] * 2, 1.0) for o in outs]
    with torch.no_grad():
        for p in vision_tower(policy).parameters():
            p.add_(0.1 * torch.randn_like(p))
    for train in (True, False):
        vision_tower(policy).requires_grad_(train)
        policy.zero_grad(set_to_none=True)
        mb = make_microbatch(samples, torch.device("cpu"))
        ref_calls, policy_calls = [], []
        hooks = [vision_tower(ref).register_forward_hook(lambda *a, c=ref_calls: c.append(1)),
                 vision_tower(policy).register_forward_hook(lambda *a, c=policy_calls: c.append(1))]
        try:
            hidden = {}
            for name, m in (("ref", ref), ("policy", policy), ("policy_again", policy)):
                with torch.enable_grad() if name == "policy" else torch.no_grad():
                    hidden[name], weight, _ = packed_forward(m, mb.batch.input_ids, mb.batch.position_ids,
                                                             mb.batch.cu_seqlens, mb.batch.max_seqlen,
                                                             vision=mb.vision)
        finally:
            for h in hooks:
                h.remove()
        hidden["policy"].sum().backward()
        grads = [p.grad for p in vision_tower(policy).parameters()]
        assert len(ref_calls) == 2  # two image sets, once
        assert len(policy_calls) == (4 if train else 2)  # trainable: every pass; frozen: once, then its own output
        assert all(g is not None and g.abs().sum() > 0 for g in grads) if train else all(g is None for g in grads)
        assert not torch.equal(hidden["ref"], hidden["policy"].detach())  # the policy's own (perturbed) tower


# ---------------------------------------------------------------- data


def png_bytes(seed, size=(40, 30)):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def tok_with_processor():
    proc = processor()
    tok = proc.tokenizer
    tok.processor = proc
    return tok


def test_trl_rows_render_with_their_images(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(0))
    rows = [
        {"prompt": "count", "image": "a.png", "answer": "1"},  # a relative path: the data file's folder
        {"prompt": "count", "image": Image.open(io.BytesIO(png_bytes(1))), "answer": "2"},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}, {"type": "image"}]}],
         "images": [png_bytes(2), {"bytes": png_bytes(3)}], "answer": "3"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("")
    ds = build_dataset(rows, tok_with_processor(), DataConfig(path=str(path)), str(path))
    image_id = processor().image_token_id
    for ids, n in zip(ds.prompt_ids, (1, 1, 2)):
        assert isinstance(ids, ImagePrompt) and ids.grid_thw.shape[0] == n
        assert ids.count(image_id) == int((ids.grid_thw.prod(-1) // 4).sum())
        assert ids.images.pixel_values.shape[0] == int(ids.grid_thw.prod(-1).sum())
    text = processor().tokenizer.decode(ds.prompt_ids[2])
    assert text.index("x") < text.index("<|image_pad|>")  # the conversation's own order
    assert processor().tokenizer.decode(ds.prompt_ids[0]).startswith("<|user|><|vision_start|>")  # TRL: images first
    assert "image" not in ds.columns([0]) and "images" not in ds.columns([2])


@pytest.mark.parametrize("row,message", [
    ({"prompt": "q", "image": "missing.png", "answer": "1"}, r"row 0 field 'image': image file .*missing.png.* does "
                                                            "not exist"),
    ({"prompt": "q", "image": b"not an image", "answer": "1"}, "row 0 field 'image': its bytes cannot be decoded"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}]}], "images": [], "answer": "1"},
     r"row 0 field 'prompt' \(data.prompt_field\) has 1 image parts"),
])
def test_bad_image_rows_fail_at_start_up_naming_row_and_field(tmp_path, row, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({k: v for k, v in row.items() if not isinstance(v, bytes)}) + "\n")
    rows = [row] if any(isinstance(v, bytes) for v in row.values()) else read_rows(str(path), "train", DataConfig())
    with pytest.raises(ValueError, match=message):
        build_dataset(rows, tok_with_processor(), DataConfig(path=str(path)), str(path))


def test_vlm_prompt_keeps_images_through_prefix_and_concatenation():
    proc = processor()
    row = {"prompt": "q", "image": png_bytes(5), "answer": "1"}
    p = vlm_prompt(row, 0, proc, DataConfig(), "src", None)
    seq = p + [proc.image_token_id, 9]
    assert isinstance(seq, ImagePrompt) and seq.prompt_len == len(p) and isinstance(seq[: len(p)], ImagePrompt)
    assert torch.equal(seq.image_rows(), p.image_rows())


def test_unsupported_vision_model_type_is_refused_by_name():
    with pytest.raises(ValueError, match="vision-language model type 'llava' is not supported"):
        check_vision_model(SimpleNamespace(model_type="llava", vision_config=object()))
    check_vision_model(SimpleNamespace(model_type="qwen2", vision_config=None))


def test_vlm_tiny_recipe_trains_end_to_end(tmp_path):
    """The vlm-tiny recipe, shrunk: warm-up, rollouts with images, the packed update, validation, a checkpoint; the
    policy's language model moves and the frozen tower does not; the checkpoint loads back into a fresh model."""
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    cfg = load_config("vlm-tiny", None, [
        f"logging.output_dir={tmp_path}", "data.synthetic_train_size=16", "data.synthetic_eval_size=4",
        "sft.warmup_steps=2", "sft.batch_size=4", "grpo.num_prompts_per_step=2", "grpo.num_generations=2",
        "train.max_steps=2", "checkpoint.every_steps=2", "eval.every_steps=2", "reward.num_workers=0"])
    trainer = Trainer(cfg)
    tower0 = [p.detach().clone() for p in vision_tower(trainer.model).parameters()]
    lm0 = [p.detach().clone() for p in trainer.model.model.language_model.parameters()]
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(tower0, vision_tower(trainer.model).parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(lm0, trainer.model.model.language_model.parameters()))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in r for r in rows) and any("loss" in r for r in rows)
    # the checkpoint resumes: save_pretrained wrote Qwen2.5-VL's original names (visual.*, model.*), mapped back
    from fastgrpo.checkpoint import latest_checkpoint, load_checkpoint
    from fastgrpo.models.loading import load_model

    fresh, _ = load_model(cfg.model, torch.device("cpu"), seed=1)
    load_checkpoint(latest_checkpoint(tmp_path), model=fresh, restore_rng=False)
    want = trainer.model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in fresh.state_dict().items())
