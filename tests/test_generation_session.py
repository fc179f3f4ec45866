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
import inspect
import io
import itertools
from unittest import mock

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, settings
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
def cases(draw, staggered=False):
    """``staggered``: 20 tokens at most, 6 stop ids of 96, groups of 2 or more, batches of 2 prompts or more, 2 rows
    or more: the completions end at staggered times, so that updates find samples mid-way."""
    greedy = draw(st.booleans())
    n = draw(st.integers(2 if staggered else 1, 4))
    params = SamplingParams(
        n=n, temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0])),
        top_k=0 if greedy else draw(st.sampled_from([0, 20])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.8])),
        max_new_tokens=20 if staggered else draw(st.integers(1, 14)), seed=draw(st.integers(0, 2**20)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=6 if staggered else 1,
                                           max_size=6, unique=True))))
    batches = draw(st.lists(st.lists(st.integers(1, MAX_PROMPT), min_size=1 + staggered, max_size=3), min_size=1,
                            max_size=3))
    # the pool must hold one sequence: its pages (prompt + response, page size 4), a partial prompt page, the scratch
    fits = 4 * (-(-(MAX_PROMPT + params.max_new_tokens) // 4) + 3)
    return dict(params=params, batches=batches, arch=draw(st.sampled_from(["qwen2", "llama", "qwen3"])),
                max_batch_size=draw(st.integers(1 + staggered, 8)), budget=draw(st.sampled_from([fits, 2 * fits, 512])),
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
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.05 * p.abs().mean())


class RecordingScheduler(CheckedScheduler):
    """The checked scheduler, recording where each sample's K/V came from (the test sets ``version`` after each
    update): the version each prompt was last prefilled with, the one each fresh sample's prompt K/V (and its first
    token's hidden state) had at its admission, and the token counts at which a preempted (or restored) sample's K/V
    were recomputed. Class-level, so that a restored session's scheduler adds to the same records."""

    version, prefilled, prompt_version, rewrites = 0, {}, {}, {}

    @classmethod
    def reset(cls):
        cls.version, cls.prefilled, cls.prompt_version, cls.rewrites = 0, {}, {}, {}

    def admit(self, steps):
        out = super().admit(steps)
        cls = RecordingScheduler
        cls.prefilled.update({p: cls.version for p in out.prefill})
        cls.prompt_version.update({s.sample: cls.prefilled[s.prompt] for s in out.fresh})
        for s in out.recompute:
            cls.rewrites.setdefault(s.sample, []).append(s.generated)
        return out


def cached_forward(model, ids, cache=None):
    """Hugging Face's forward of ``ids`` after the K/V of ``cache`` (None: from position 0): ``(logits [T, V] fp32,
    the cache with theirs, the residual before the final norm at the last position)``."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5.2x
    seen = {}

    def keep(module, args, out):  # returns None: the output stays
        seen["h"] = args[0][0, -1]

    hook = model.model.norm.register_forward_hook(keep)
    try:
        out = model(torch.tensor([ids]), use_cache=True, **({key: cache} if cache is not None else {}))
    finally:
        hook.remove()
    return out.logits[0].float(), out[key], seen["h"]


def engine_logp(models, prompt, ids, versions, prompt_version, rewrites, temperature):
    """log p of each of ``ids`` (its ``versions``) as the engine samples them across weight updates, by Hugging Face
    forwards with a cache, ``models[v]`` the weights of version v. Token i's logits are version ``versions[i]``'s (its
    layers at the fed token i - 1, its norm and head) reading K/V that each position's writer left: the prompt's by
    ``prompt_version`` (its prefill, whose last hidden state also gives token 0 under version ``versions[0]``'s norm
    and head), token j's by ``versions[j + 1]`` (it is fed at the step that samples token j + 1), except that at each
    count c of ``rewrites`` the sample was recomputed: prompt + ids[:c - 1] prefilled again by ``versions[c]``. With
    every K/V recomputed at each update this is the teacher-forced forward under ``versions[i]``."""
    out = torch.empty(len(ids))
    starts = [0, *sorted(set(rewrites))]
    with torch.no_grad():
        for k, c in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else len(ids)
            if c == 0:
                _, cache, h = cached_forward(models[prompt_version], prompt)
                head = models[versions[0]]
                out[0] = torch.log_softmax(head.lm_head(head.model.norm(h)).float() / temperature, -1)[ids[0]]
                i = 1
            else:
                _, cache, _ = cached_forward(models[versions[c]], prompt + ids[: c - 1])
                i = c
            while i < end:  # a run of tokens of one version: one forward
                j = next((j for j in range(i, end) if versions[j] != versions[i]), end)
                logits, cache, _ = cached_forward(models[versions[i]], ids[i - 1 : j - 1], cache)
                out[i:j] = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids[i:j])[:, None])[:, 0]
                i = j
    return out


def saved_and_continued(session, add, first_groups: int):
    """A checkpoint's round trip: in ``session()``, ``add(s)`` queues the prompts, ``run(first_groups)``, then
    ``update(recompute_kv=True)`` (what a checkpoint follows in a run that recomputes; no weight change here) and
    the state through ``torch.save``; the rest runs in that session (the uninterrupted run) and in a fresh
    ``session()`` that loads the state. Returns ``(groups returned before, uninterrupted by key, restored by key)``."""
    with session() as a:
        add(a)
        done = a.run(first_groups)  # at least first_groups groups: several can end at one step
        a.update(recompute_kv=True)
        buf = io.BytesIO()
        torch.save(a.state_dict(), buf)
        want = dict(a.run(10**6))
    with session() as b:
        b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        got = dict(b.run(10**6))
    return done, want, got


def run_schedule(model, case, schedule, recompute, save):
    """The first batch, then per step of ``schedule`` (add the next batch?, run(k), save and restore into a new
    engine's session after the update?) and an update that moves the weights (``perturbed``), then the batches left.
    Returns the groups by key, the weights of every version (copies, kept only here), the prompts, each run's
    ``engine.last_stats`` and, after each update, ``(version, in_flight_tokens, keys returned so far)``."""
    batches, params = prompts_of(case), case["params"]
    got, prompts, models, stats, carried = {}, list(batches[0]), [copy.deepcopy(model)], [], []
    s = engine(model, case).session(params, max_prompt_tokens=MAX_PROMPT)
    s.add(batches.pop(0))
    try:
        for step, (add, k, restore) in enumerate(schedule):
            if add and batches:
                prompts += batches[0]
                s.add(batches.pop(0))
            got.update(s.run(k))
            stats.append(s.engine.last_stats)
            perturbed(model, params.seed + step)
            RecordingScheduler.version = s.update(recompute_kv=recompute)
            models.append(copy.deepcopy(model))
            carried.append((s.version, s.in_flight_tokens, set(got)))
            if save and restore:  # a checkpoint: through torch.save, into a fresh engine (a new process)
                buf = io.BytesIO()
                torch.save(s.state_dict(), buf)
                s.close()
                s = engine(model, case).session(params, max_prompt_tokens=MAX_PROMPT)
                s.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
                assert s.in_flight_tokens == carried[-1][1] and s.version == carried[-1][0]
        for batch in batches:
            prompts += batch
            s.add(batch)
        got.update(s.run(10**6))
        stats.append(s.engine.last_stats)
        assert s.in_flight == 0
    finally:
        s.close()
    return got, models, prompts, stats, carried


@given(cases(staggered=True), st.booleans(), st.lists(st.tuples(st.booleans(), st.integers(1, 2), st.booleans()),
                                                      min_size=2, max_size=5))
@settings(max_examples=10, deadline=None, derandomize=True)
def test_async_schedules_sample_each_token_from_its_version(case, recompute, schedule):
    """The fidelity harness's async schedules: prompts added at random times, ``run(k)`` of random sizes, an update
    that moves the weights after each, ``sync_every``, small KV budgets (preemption), rows below the samples,
    checkpoints (``state_dict`` into a fresh engine), K/V recomputed or kept. Every token's log-prob equals Hugging
    Face's under the weights of its version reading the K/V the engine's schedule left (:func:`engine_logp`); with
    ``recompute_kv`` every token is the teacher-forced forward's under its version (sampled from the weights of the
    moment), and a run restored after an update is bit for bit the run that was not interrupted (its runs' counts
    and peaks too). ``in_flight_tokens`` after each update counts the tokens sampled so far by the groups not
    returned yet: those of older versions among the groups returned later."""
    t = case["params"].temperature or 1.0
    RecordingScheduler.reset()
    with mock.patch.object(engine_loop, "Scheduler", RecordingScheduler):
        got, models, prompts, stats, carried = run_schedule(tiny_model(case["arch"], seed=9), case, schedule,
                                                            recompute, save=True)
    records = (dict(RecordingScheduler.prompt_version), dict(RecordingScheduler.rewrites))
    assert sorted(got) == list(range(len(prompts)))
    for version, count, returned in carried:  # the tokens sampled before that update by groups returned after it
        assert count == sum(x < version for key in set(got) - returned for c in got[key] for x in c.versions)
    n = case["params"].n
    for key, group in got.items():
        assert len(group) == n
        for j, c in enumerate(group):
            ids, v, sample = c.token_ids, c.versions, key * n + j
            assert v == sorted(v) and 0 <= v[0] and v[-1] < len(models)
            ref = engine_logp(models, prompts[key], ids, v, records[0][sample], records[1].get(sample, []), t)
            assert (torch.tensor(c.logprobs) - ref).abs().max() <= LOGPROB_ATOL, (key, j, v)
            if recompute:  # every K/V of the weights that sampled the token: the teacher-forced forward's
                for version in set(v):
                    at = [i for i, x in enumerate(v) if x == version]
                    want = teacher_forced_logp(models[version], prompts[key], ids, t)[at]
                    assert (torch.tensor(c.logprobs)[at] - want).abs().max() <= LOGPROB_ATOL
    if recompute and any(restore for *_, restore in schedule):
        again, _, _, stats_again, _ = run_schedule(tiny_model(case["arch"], seed=9), case, schedule, recompute,
                                                   save=False)
        assert stats == stats_again
        for key, group in got.items():
            for a, b in zip(group, again[key], strict=True):
                assert (a.token_ids, a.logprobs, a.versions, a.finish_reason) == (b.token_ids, b.logprobs,
                                                                                   b.versions, b.finish_reason)


@pytest.mark.gpu
def test_a_session_follows_weights_that_move_between_runs():
    """``moving_weights`` (FSDP2 gathers the weights afresh for each run): after each run every parameter moves to
    new storage, the old storage is zeroed, and the weights change (an update, K/V recomputed). Every token's log-prob
    is the teacher-forced forward's under its version: CUDA graphs replaying the old addresses would read zeros."""
    model = tiny_model("qwen2", seed=9).cuda()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=3, stop_token_ids=tuple(range(0, 96, 16)))
    prompts = random_prompts([5, 9, 3, 7, 11, 4, 8, 2])
    models, got = [copy.deepcopy(model)], {}
    eng = GenerationEngine(model, eos_token_ids=None, max_batch_size=8, max_total_tokens=4096)
    with eng.session(params, max_prompt_tokens=MAX_PROMPT, moving_weights=True) as s:
        s.add(prompts)
        while s.in_flight:
            got.update(s.run(1))
            with torch.no_grad():
                for p in model.parameters():
                    old = p.data
                    p.data = old.clone()
                    old.zero_()
            perturbed(model, len(models))
            s.update(recompute_kv=True)
            models.append(copy.deepcopy(model))
    assert sorted(got) == list(range(len(prompts))) and len(models) > 2
    for key, group in got.items():
        for c in group:
            for version in set(c.versions):
                at = [i for i, v in enumerate(c.versions) if v == version]
                want = teacher_forced_logp(models[version], prompts[key], c.token_ids)[at]
                assert (torch.tensor(c.logprobs, device=want.device)[at] - want).abs().max() <= LOGPROB_ATOL


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
