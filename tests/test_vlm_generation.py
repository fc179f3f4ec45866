"""The engine with images (issue 34) against Hugging Face: random tiny Qwen2.5-VL models (fp32, ``initializer_range``
0.3 so outputs vary), prompts of zero to two images of random sizes between text, under the differential harness's
schedules (``test_generation_fidelity``: refill, small KV budgets with preemption and recompute, ``sync_every`` in
{1, 3, 8}, page sizes, the CPU row cache or the pages).

- every returned log-prob equals HF's teacher-forced forward with the same ``pixel_values``, ``image_grid_thw`` and
  ``mm_token_type_ids`` within 1e-4 (the harness's rule: the two differ by summation order, ~1e-6 seen);
- greedy output equals HF ``generate`` (decode positions continue from the prompt's ``rope_deltas``);
- the same seed gives the same completions under another schedule;
- the vision tower runs once per prompt with images, however many samples, preemptions and recomputes.

The image token is always a stop token: HF's teacher-forced forward would take a generated ``<|image_pad|>`` for an
image placeholder (the engine's prefill does not see sampled tokens as images either; a recompute's are text).
"""

import functools

import numpy as np
import pytest
import torch
from checks import IndecisiveCase, assert_decisive, one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from PIL import Image
from test_generation import GREEDY_MARGIN, LOGPROB_ATOL, CheckedScheduler
from test_generation_fidelity import draw_schedules, engine_for

import fastgrpo.engine.loop as engine_loop
from fastgrpo.config import ModelConfig
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.models.loading import build_tiny_tokenizer
from fastgrpo.models.vlm import ImageInputs, add_vision_tokens, build_tiny_vlm, load_processor

MIN_PIXELS, MAX_PIXELS = 28 * 28, 84 * 84  # images of 1 to 9 tokens (2 x 2 patches of 14 px per token)


@functools.cache
def processor():
    tok = add_vision_tokens(build_tiny_tokenizer())
    return load_processor("tiny-vlm", tok, MIN_PIXELS, MAX_PIXELS)


@functools.cache
def tiny_vlm(seed: int):
    cfg = ModelConfig(path="tiny-vlm", tiny_hidden_size=32, tiny_num_heads=4, tiny_num_kv_heads=2,
                      tiny_intermediate_size=64, tiny_initializer_range=0.3)
    return build_tiny_vlm(cfg, processor().tokenizer, seed=seed).eval()


def vlm_prompts(specs, seed):
    """``specs``: per prompt the image count (0-2); each prompt is text, images and text in a random order, the images
    random RGB of 20-100 px a side. Returns the processor's outputs and the engine's ``(prompt ids, ImageInputs)``."""
    rng = np.random.default_rng(seed)
    proc = processor()
    outs = []
    for n_images in specs:
        images = [Image.fromarray(rng.integers(0, 256, (rng.integers(20, 100), rng.integers(20, 100), 3),
                                               dtype=np.uint8)) for _ in range(n_images)]
        words = ["".join(rng.choice(list("abcdefgh 0123"), size=rng.integers(1, 6))) for _ in range(n_images + 1)]
        parts = [{"type": "text", "text": words[0]}]
        for w in words[1:]:
            parts += [{"type": "image"}, {"type": "text", "text": w}]
        text = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)
        out = proc(text=[text], images=images or None, return_tensors="pt")
        outs.append(out)
    inputs = [(o["input_ids"][0].tolist(), ImageInputs(o["pixel_values"], o["image_grid_thw"])
               if "pixel_values" in o else None) for o in outs]
    return outs, inputs


def hf_kwargs(model, out, ids):
    kw = dict(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long())
    if "pixel_values" in out:
        kw.update(pixel_values=out["pixel_values"].to(ids.device), image_grid_thw=out["image_grid_thw"].to(ids.device))
    return kw


def hf_logprobs(model, out, prompt, completion, temperature):
    """Teacher-forced log-probs of ``completion`` (its last token is never an input: it may be the image token)."""
    ids = torch.tensor([prompt + completion[:-1]], device=model.device)
    with torch.no_grad():
        logits = model(**hf_kwargs(model, out, ids)).logits[0, len(prompt) - 1 :].float().cpu()  # [len(completion), V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def hf_greedy_vlm(model, out, prompt, max_new_tokens, stops):
    ids = torch.tensor([prompt], device=model.device)
    gen = model.generate(**hf_kwargs(model, out, ids), attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    top2 = torch.cat(gen.logits).float().topk(2, dim=-1).values
    assert_decisive("greedy top-1 - top-2 logit gap", top2[:, 0] - top2[:, 1], [0.0], GREEDY_MARGIN)
    return gen.sequences[0, len(prompt) :].tolist()


@st.composite
def vlm_cases(draw, max_prompts=3, max_samples=12):
    P = draw(st.integers(1, max_prompts))
    n = draw(st.integers(1, max(1, max_samples // P)))
    specs = draw(st.lists(st.integers(0, 2), min_size=P, max_size=P))
    greedy = draw(st.booleans())
    vocab = len(processor().tokenizer)
    image_id = processor().tokenizer.convert_tokens_to_ids("<|image_pad|>")
    stops = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6, unique=True))
    params = SamplingParams(
        n=n,
        temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_k=0 if greedy else draw(st.sampled_from([0, 5, 20])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.8])),
        max_new_tokens=draw(st.integers(1, 12)),
        stop_token_ids=tuple(sorted({*stops, image_id})),
        seed=draw(st.integers(0, 2**20)),
    )
    schedules = draw_schedules(draw, P * n)
    return draw(st.integers(0, 4)), draw(st.integers(0, 2**16)), specs, params, schedules


def run_checked(model, prompts, images, params, schedule):
    engine = engine_for(model, params, prompts, **schedule)
    CheckedScheduler.instances.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_loop, "Scheduler", CheckedScheduler)
        out = engine.generate(prompts, params, images=images)
    [sched] = CheckedScheduler.instances
    assert sched.used_pages == 0
    return out, engine.last_stats


def check_vlm_case(model_seed, seed, specs, params, schedules):
    model = tiny_vlm(model_seed)
    outs, inputs = vlm_prompts(specs, seed)
    prompts, images = [p for p, _ in inputs], [im for _, im in inputs]
    runs = [run_checked(model, prompts, images, params, s) for s in schedules]
    stops = set(params.stop_token_ids)
    temperature = params.temperature or 1.0
    for out, prompt, comps in zip(outs, prompts, runs[0][0]):
        for c in comps:
            assert 1 <= len(c.token_ids) <= params.max_new_tokens and not stops & set(c.token_ids[:-1])
            ref = hf_logprobs(model, out, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
        if params.greedy:
            try:
                want = hf_greedy_vlm(model, out, prompt, params.max_new_tokens, sorted(stops))
            except IndecisiveCase:
                reject()
            assert all(c.token_ids == want for c in comps)
    with_images = sum(im is not None for im in images)
    for _, stats in runs:  # once per prompt, whatever the preemptions (recomputes read the kept embeddings)
        assert stats["vision_tower_calls"] == with_images
    for comps_a, comps_b in zip(runs[0][0], runs[1][0]):  # schedule invariance
        for a, b in zip(comps_a, comps_b):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_ATOL, rtol=0)


@settings(max_examples=6)
@given(vlm_cases())
def test_vlm_engine_matches_hf_under_random_schedules(case):
    check_vlm_case(*case)


@pytest.mark.slow
@settings(max_examples=60)
@given(vlm_cases(max_prompts=5, max_samples=32))
def test_vlm_engine_matches_hf_under_random_schedules_sweep(case):
    check_vlm_case(*case)


def test_preempted_samples_recompute_with_images():
    """A pool that holds one sequence at a time: samples are preempted and recomputed (prompt with its images + their
    tokens), log-probs still HF's, and the tower still ran once per prompt."""
    model = tiny_vlm(1)
    outs, inputs = vlm_prompts([2, 1], seed=3)
    prompts, images = [p for p, _ in inputs], [im for _, im in inputs]
    image_id = model.config.image_token_id
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=(image_id,))
    out, stats = run_checked(model, prompts, images, params, dict(max_batch_size=8, sync_every=1, page_size=4,
                                                                   spare_pages=0, row_cache=False))
    assert stats["preemptions"] > 0 and stats["vision_tower_calls"] == 2
    for o, prompt, comps in zip(outs, prompts, out):
        for c in comps:
            torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(model, o, prompt, c.token_ids, 1.0),
                                       atol=LOGPROB_ATOL, rtol=0)


def check_device_path(model, seed: int):
    """Greedy equals HF ``generate`` with the images, sampled log-probs equal HF's teacher-forced forward (fp32), the
    tower once per prompt: the engine on ``model``'s device with its defaults there."""
    outs, inputs = vlm_prompts([1, 2, 0, 1], seed=seed)
    prompts, images = [p for p, _ in inputs], [im for _, im in inputs]
    stops = (model.config.image_token_id,)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=8)
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=16, stop_token_ids=stops),
                             images=images)
    assert engine.last_stats["vision_tower_calls"] == 3
    for o, p, comps in zip(outs, prompts, greedy):
        want = hf_greedy_vlm(model, o, p, 16, list(stops))
        assert all(c.token_ids == want for c in comps)
    sampled = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=seed,
                                                      stop_token_ids=stops), images=images)
    for o, p, comps in zip(outs, prompts, sampled):
        for c in comps:
            torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(model, o, p, c.token_ids, 1.0),
                                       atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.gpu
def test_cuda_graph_decode_with_images_matches_hf():
    """The CUDA path: the tower and the M-RoPE prefill on the GPU, compiled elementwise ops, the decode step captured
    in CUDA graphs with each row's ``rope_delta`` read inside them (fp32, TF32 off)."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    check_device_path(copy.deepcopy(tiny_vlm(1)).cuda(), seed=2)


def test_image_inputs_are_checked():
    model = tiny_vlm(0)
    _, inputs = vlm_prompts([1, 0], seed=0)
    prompts, images = [p for p, _ in inputs], [im for _, im in inputs]
    engine = GenerationEngine(model, eos_token_ids=[])
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 has 0 image tokens but its images make"):
        engine.generate(prompts, params, images=[images[0], images[0]])
    with pytest.raises(ValueError, match="images has 1 entries for 2 prompts"):
        engine.generate(prompts, params, images=images[:1])
    with pytest.raises(ValueError, match="images need a vision-language model"):
        from test_generation import tiny_model

        GenerationEngine(tiny_model("qwen2"), eos_token_ids=[]).generate([[1, 2]], params, images=[None])
