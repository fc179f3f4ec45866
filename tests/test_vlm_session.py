"""Generation sessions with images (issue 34; ``fastgrpo.engine.session``, ``fastgrpo.engine.vision``) against
Hugging Face: random tiny Qwen2.5-VL models (fp32), prompts of zero to two images added in batches between runs.

- Every log-prob equals HF's teacher-forced forward with the same ``pixel_values`` / ``image_grid_thw`` (the
  harness's 1e-4), under random schedules (small KV budgets: preemption and recompute, ``sync_every``, batch sizes);
  the tower runs once per prompt with images, however many samples and recomputes, and each group comes back once.
- After a weight update with ``recompute_kv=True`` (every weight moved, the tower's too) a version-1 token's log-prob
  is the new model's over the whole sequence: the recomputed prefill ran the new tower, not the kept output.
- Images are single-turn in a session as in ``generate``; a prompt whose images do not match its image tokens is
  refused and leaves the session as it was.
- ``grpo.async_grpo`` trains ``vlm-tiny`` (the data layer's prompts carry their images into the session).
"""

import copy
import json

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_generation import LOGPROB_ATOL
from test_generation_session import perturbed, saved_and_continued
from test_vlm_generation import hf_logprobs, processor, tiny_vlm, vlm_prompts

from fastgrpo.engine.engine import GenerationEngine, SamplingParams


def batches_of(specs: list[list[int]], seed: int):
    """Per batch the processor's outputs and the engine's (prompt ids, ImageInputs)."""
    return [vlm_prompts(spec, seed + b) for b, spec in enumerate(specs)]


def stops(model, extra):
    return tuple(sorted({model.config.image_token_id, *extra}))  # a sampled image token is always a stop


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 3), st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(1, 3), st.integers(1, 6), st.sampled_from([1, 3, 8]), st.sampled_from([None, 96, 4096]),
       st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(0, 2**16))
def test_session_with_images_matches_hf(model_seed, specs, n, batch, sync_every, budget, pieces, seed):
    model = tiny_vlm(model_seed)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=8, seed=seed, stop_token_ids=stops(model, [3, 40]))
    eng = GenerationEngine(model, eos_token_ids=[], max_batch_size=batch, max_total_tokens=budget,
                           sync_every=sync_every, page_size=4)
    batches = batches_of(specs, seed)
    outs = [o for b in batches for o in b[0]]
    prompts = [p for b in batches for p, _ in b[1]]
    got = {}
    with eng.session(params, max_prompt_tokens=max(map(len, prompts))) as s:
        for (_, inputs), k in zip(batches, pieces + [0] * len(batches)):
            s.add([p for p, _ in inputs], images=[im for _, im in inputs])
            got.update(s.run(k))
        got.update(s.run(10**6))
    assert sorted(got) == list(range(len(prompts)))
    assert eng.last_stats["vision_tower_calls"] == sum(o.get("pixel_values") is not None for o in outs)
    for key, group in got.items():
        assert len(group) == n
        for c in group:
            ref = hf_logprobs(model, outs[key], prompts[key], c.token_ids, 1.0)
            assert (torch.tensor(c.logprobs) - ref).abs().max() <= LOGPROB_ATOL


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 2))
def test_recompute_after_an_update_runs_the_new_tower(seed, first_groups):
    model = copy.deepcopy(tiny_vlm(seed % 4))
    # 16 stop ids: completions end at staggered times, so the update finds samples mid-completion
    extra = torch.randperm(100, generator=torch.Generator().manual_seed(seed))[:16].tolist()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=seed, stop_token_ids=stops(model, extra))
    outs, inputs = vlm_prompts([1, 2, 1], seed)
    prompts = [p for p, _ in inputs]
    eng = GenerationEngine(model, eos_token_ids=[], max_batch_size=9, page_size=4)
    with eng.session(params, max_prompt_tokens=max(map(len, prompts))) as s:
        s.add(prompts, images=[im for _, im in inputs])
        got = dict(s.run(first_groups))
        old = copy.deepcopy(model)
        perturbed(model, seed)  # the tower's weights too
        s.update(recompute_kv=True)
        got.update(s.run(10**6))
    straddling = 0
    for key, group in got.items():
        for c in group:
            b = c.versions.count(0)
            if b:
                ref = hf_logprobs(old, outs[key], prompts[key], c.token_ids[:b], 1.0)
                assert (torch.tensor(c.logprobs[:b]) - ref).abs().max() <= LOGPROB_ATOL
            if b < len(c.token_ids):
                straddling += b > 0
                ref = hf_logprobs(model, outs[key], prompts[key], c.token_ids, 1.0)[b:]
                assert (torch.tensor(c.logprobs[b:]) - ref).abs().max() <= LOGPROB_ATOL
    assume(straddling)  # a case where the update caught no sample mid-completion checks little


class NoTurns:  # a turn handler (refused with images before it is asked anything)
    def start(self, key, turn_ids, turn_text):
        raise AssertionError("not reached")

    def ready(self):
        return []


def test_session_image_errors_change_nothing():
    model = tiny_vlm(0)
    _, inputs = vlm_prompts([1, 0], seed=1)
    prompts, images = [p for p, _ in inputs], [im for _, im in inputs]
    eng = GenerationEngine(model, eos_token_ids=[], max_batch_size=4, tokenizer=processor().tokenizer)
    params = SamplingParams(n=2, max_new_tokens=3, seed=0, stop_token_ids=stops(model, []))
    with eng.session(params, max_prompt_tokens=64, turns=NoTurns()) as s:
        with pytest.raises(ValueError, match="images are single-turn"):
            s.add(prompts, images=images)
    with eng.session(params, max_prompt_tokens=64) as s:
        with pytest.raises(ValueError, match="prompt 1 has 0 image tokens but its images make"):
            s.add(prompts, images=[images[0], images[0]])
        assert s.add(prompts, images=images) == [0, 1]  # the refused add left no trace
        assert sorted(k for k, _ in s.run(10**6)) == [0, 1]


def test_async_grpo_trains_vlm_tiny(tmp_path):
    from fastgrpo.config import load_config
    from fastgrpo.trainer import Trainer

    cfg = load_config("vlm-tiny", None, [
        f"logging.output_dir={tmp_path}", "data.synthetic_train_size=16", "data.synthetic_eval_size=4",
        "sft.warmup_steps=0", "grpo.num_prompts_per_step=2", "grpo.num_generations=4", "train.max_steps=3",
        "grpo.mask_zero_std_groups=false", "eval.at_start=false", "eval.every_steps=0", "checkpoint.every_steps=0",
        "reward.num_workers=0", "grpo.async_grpo.enabled=true", "grpo.rollout_is=token_truncate",
        "reward.functions=[test_async_grpo:parity_reward]"])  # rewards that differ in a group
    trainer = Trainer(cfg)
    lm0 = [p.detach().clone() for p in trainer.model.model.language_model.parameters()]
    trainer.fit()
    assert any(not torch.equal(a, b) for a, b in zip(lm0, trainer.model.model.language_model.parameters()))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in rows) == 3


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 2**16), st.integers(0, 2), st.sampled_from([2, 9]))
def test_a_restored_session_keeps_its_images(seed, first_groups, batch):
    """A checkpoint of a session with images (``state_dict`` after ``update(recompute_kv=True)``, through
    ``torch.save``) restored into a fresh session continues bit for bit as the saved one: the unfinished groups'
    images travel with it (their tower output recomputed), the finished groups' are freed."""
    model = tiny_vlm(seed % 4)
    extra = torch.randperm(100, generator=torch.Generator().manual_seed(seed))[:16].tolist()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=seed, stop_token_ids=stops(model, extra))
    _, inputs = vlm_prompts([1, 0, 2], seed)
    prompts = [p for p, _ in inputs]

    def session():
        eng = GenerationEngine(model, eos_token_ids=[], max_batch_size=batch, page_size=4)
        return eng.session(params, max_prompt_tokens=max(map(len, prompts)))

    done, want, got = saved_and_continued(session, lambda s: s.add(prompts, images=[im for _, im in inputs]),
                                          first_groups)
    assert sorted(got) == sorted(want) and len(got) == len(prompts) - len(done)
    for key in want:
        assert [c.token_ids for c in got[key]] == [c.token_ids for c in want[key]]
        assert [c.logprobs for c in got[key]] == [c.logprobs for c in want[key]]
