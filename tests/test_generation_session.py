"""Generation sessions (fastgrpo.engine.session): sequences kept in flight across calls and weight updates.

- **Pausing changes nothing.** A session run in pieces (``run(k)`` for random k, with ``update()`` calls that change
  no weight in between) returns bit for bit the completions of the same session run at once, under random
  schedules: ``sync_every``, small KV budgets (preemption), ``max_batch_size`` below the samples, top-k/top-p, the
  CPU step's products on packed weight copies or plain (packs an update must drop).
- **Refill.** Prompts added between runs are sampled as the engine samples any prompt: every log-prob equals a
  teacher-forced Hugging Face forward's (the harness's tolerance, tests/test_generation.py), each group comes back
  once under the key ``add`` returned, the stop and length rules hold, every page is free at the end.
- **Weight updates.** The weights change in place between two runs. Every token records the version that sampled
  it. With ``recompute_kv=True`` a version-0 token's log-prob is the old model's teacher-forced one and a version-1
  token's the new model's over the whole sequence (every K/V was recomputed). Without it, a sample that was decoding
  at the update continues on the K/V the old weights wrote: its version-1 tokens match Hugging Face's new model
  reading the old model's cache of the prompt and the tokens before its last version-0 one.
"""

import copy
import dataclasses
import inspect
import itertools

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_generation import LOGPROB_ATOL, VOCAB, CheckedScheduler, random_prompts, teacher_forced_logp, tiny_model

import fastgrpo.engine.loop as engine_loop
from fastgrpo.engine.engine import GenerationEngine, SamplingParams

MAX_PROMPT = 12


@pytest.fixture(autouse=True)
def checked_scheduler(monkeypatch):
    """The scheduler's invariants asserted after every admission and growth round."""
    monkeypatch.setattr(engine_loop, "Scheduler", CheckedScheduler)
    CheckedScheduler.instances.clear()


def engine(model, case):
    return GenerationEngine(model, eos_token_ids=None, max_batch_size=case["max_batch_size"],
                            max_total_tokens=case["budget"], sync_every=case["sync_every"], page_size=4,
                            cpu_packed=case["cpu_packed"])


@st.composite
def cases(draw):
    greedy = draw(st.booleans())
    n = draw(st.integers(1, 4))
    params = SamplingParams(
        n=n, temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0])),
        top_k=0 if greedy else draw(st.sampled_from([0, 20])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.8])),
        max_new_tokens=draw(st.integers(1, 14)), seed=draw(st.integers(0, 2**20)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6, unique=True))))
    batches = draw(st.lists(st.lists(st.integers(1, MAX_PROMPT), min_size=1, max_size=3), min_size=1, max_size=3))
    # the pool must hold one sequence: its pages (prompt + response, page size 4), a partial prompt page, the scratch
    fits = 4 * (-(-(MAX_PROMPT + params.max_new_tokens) // 4) + 3)
    return dict(params=params, batches=batches, arch=draw(st.sampled_from(["qwen2", "llama", "qwen3"])),
                max_batch_size=draw(st.integers(1, 8)), budget=draw(st.sampled_from([fits, 2 * fits, 512])),
                sync_every=draw(st.sampled_from([1, 3, 8])), cpu_packed=draw(st.booleans()),
                pieces=draw(st.lists(st.integers(0, 3), min_size=1, max_size=6)))


def prompts_of(case):
    return [random_prompts(lengths, seed=7 + b) for b, lengths in enumerate(case["batches"])]


def run_at_once(model, case):
    with engine(model, case).session(case["params"], max_prompt_tokens=MAX_PROMPT) as s:
        for batch in prompts_of(case):
            s.add(batch)
        return dict(s.run(10**6))


@given(cases())
@settings(max_examples=8, deadline=None, derandomize=True)
def test_a_session_run_in_pieces_equals_one_run(case):
    model = tiny_model(case["arch"], seed=3)
    want = run_at_once(model, case)
    got, pieces = {}, itertools.cycle([*case["pieces"], 1])  # a 0 returns at once
    with engine(model, case).session(case["params"], max_prompt_tokens=MAX_PROMPT) as s:
        for batch in prompts_of(case):
            s.add(batch)
        while s.in_flight:
            for key, group in s.run(next(pieces)):
                assert key not in got
                got[key] = group
            s.update()  # no weight changed: the packs are rebuilt, the numbers stay
    assert sorted(got) == sorted(want) == list(range(sum(map(len, case["batches"]))))
    for key, group in want.items():
        for a, b in zip(group, got[key], strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.finish_reason == b.finish_reason
        assert all(set(c.versions) <= set(range(s.version + 1)) for c in got[key])
    for sched in CheckedScheduler.instances:
        assert len(sched.free) == sched.num_pages - 1  # every page is free once nothing is in flight


@given(cases())
@settings(max_examples=6, deadline=None, derandomize=True)
def test_prompts_added_between_runs_are_sampled_like_any_other(case):
    model = tiny_model(case["arch"], seed=5)
    params, batches = case["params"], prompts_of(case)
    got, prompts = {}, []
    with engine(model, case).session(params, max_prompt_tokens=MAX_PROMPT) as s:
        for batch, k in zip(batches, case["pieces"] * 3):
            keys = s.add(batch)
            assert keys == list(range(len(prompts), len(prompts) + len(batch)))
            prompts += batch
            got.update(s.run(k))
        got.update(s.run(10**6))
        assert s.in_flight == 0
    assert sorted(got) == list(range(len(prompts)))
    stops = set(params.stop_token_ids)
    for key, group in got.items():
        assert len(group) == params.n
        for c in group:
            ids = c.token_ids
            assert 1 <= len(ids) <= params.max_new_tokens and c.versions == [0] * len(ids)
            assert not stops & set(ids[:-1]) and (c.finish_reason == "stop") == (ids[-1] in stops)
            ref = teacher_forced_logp(model, prompts[key], ids, params.temperature or 1.0)
            assert (torch.tensor(c.logprobs) - ref).abs().max() <= LOGPROB_ATOL


def perturbed(model, seed):
    """``model``'s weights moved in place by a random step of 5% of their scale (an optimizer step's stand-in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.abs().mean())


def hf_after_update(old, new, prompt, ids, b):
    """log p of ``ids[b:]`` under ``new`` reading ``old``'s K/V of ``prompt + ids[:b-1]`` (what a sample decoding at
    the update keeps: the K/V of its last version-0 token are written when it is fed, after the update)."""
    head = torch.tensor([prompt + ids[: b - 1]])
    key = "cache" if "cache" in inspect.signature(new.forward).parameters else "past_key_values"  # transformers 5.2x
    with torch.no_grad():
        out = old(head, use_cache=True)
        logits = new(torch.tensor([ids[b - 1 :]]), **{key: out[key]}).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[b:])[:, None]).squeeze(1)


@given(cases(), st.booleans(), st.integers(1, 4), st.lists(st.integers(0, VOCAB - 1), min_size=12, max_size=12,
                                                        unique=True))
@settings(max_examples=8, deadline=None, derandomize=True)
def test_tokens_after_a_weight_update_are_sampled_with_the_new_weights(case, recompute, first_groups, stops):
    model = tiny_model(case["arch"], seed=9)
    # 12 stop ids of 96: completions end at staggered times, so the update finds samples mid-completion
    params = dataclasses.replace(case["params"], stop_token_ids=tuple(stops), max_new_tokens=14)
    prompts = [p for batch in prompts_of(case) for p in batch]
    if not recompute:
        case = {**case, "budget": 4096}  # no preemption: a sample keeps the K/V the old weights wrote
    eng = engine(model, case)
    with eng.session(params, max_prompt_tokens=MAX_PROMPT) as s:
        s.add(prompts)
        got = dict(s.run(first_groups))
        old = copy.deepcopy(model)
        perturbed(model, case["params"].seed)
        assert s.update(recompute_kv=recompute) == 1
        got.update(s.run(10**6))
    assert sorted(got) == list(range(len(prompts)))
    if not recompute:
        assert eng.last_stats["preemptions"] == 0
    straddling = [c for g in got.values() for c in g if 0 < c.versions.count(0) < len(c.token_ids)]
    assume(straddling)  # a case where the update caught no sample mid-completion checks little
    t = params.temperature or 1.0
    for key, group in got.items():
        for c in group:
            ids, b = c.token_ids, c.versions.count(0)
            assert c.versions == [0] * b + [1] * (len(ids) - b)  # the update splits each completion once
            if b:
                ref = teacher_forced_logp(old, prompts[key], ids[:b], t)
                assert (torch.tensor(c.logprobs[:b]) - ref).abs().max() <= LOGPROB_ATOL
            if b == len(ids) or (not recompute and b == 0):
                continue  # (not started at the update, no recompute: its prompt's K/V may be the old weights')
            if recompute:
                ref = teacher_forced_logp(model, prompts[key], ids, t)[b:]
            else:
                ref = hf_after_update(old, model, prompts[key], ids, b)
            assert (torch.tensor(c.logprobs[b:]) - ref).abs().max() <= LOGPROB_ATOL


def test_session_errors():
    model = tiny_model("qwen2")
    eng = GenerationEngine(model, eos_token_ids=None, max_total_tokens=256)
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        eng.session(params, max_prompt_tokens=0)
    s = eng.session(params, max_prompt_tokens=6)
    with pytest.raises(ValueError, match="do not fit the session"):
        s.add([list(range(1, 9))])
    with pytest.raises(ValueError, match="groups"):
        s.run(-1)
    assert s.run(3) == [] and s.in_flight == 0  # nothing added: nothing to wait for
    s.close()
    s.close()
    for call in (lambda: s.add([[1, 2]]), lambda: s.run(1), s.update):
        with pytest.raises(RuntimeError, match="after close"):
            call()


def test_a_run_reports_its_own_counts():
    """``engine.last_stats`` after ``run``: that call's decode steps and prefill tokens (they add up to the session's
    totals, which ``close`` leaves there), the session's peaks."""
    model = tiny_model("qwen2")
    eng = GenerationEngine(model, eos_token_ids=None, max_total_tokens=512, max_batch_size=4, page_size=4)
    params = SamplingParams(n=2, max_new_tokens=6, seed=0, stop_token_ids=tuple(range(0, 96, 9)))
    steps = prefill = 0
    with eng.session(params, max_prompt_tokens=8) as s:
        s.add(random_prompts([3, 8, 5, 2, 7]))
        while s.in_flight:
            s.run(1)
            steps, prefill = steps + eng.last_stats["decode_steps"], prefill + eng.last_stats["prefill_tokens"]
        peak = eng.last_stats["peak_running"]
    total = eng.last_stats  # after close: the session's
    assert (steps, prefill) == (total["decode_steps"], total["prefill_tokens"]) and prefill >= 3 + 8 + 5 + 2 + 7
    assert peak == total["peak_running"] <= 4
