"""Differential harness: the engine against Hugging Face over randomized schedules (issue 9).

Random tiny Qwen2 / Llama / Qwen3 models (fp32, ``initializer_range=0.3`` so outputs vary), random prompt
lengths, n up to 16, several stop ids with high stop rates, ``max_batch_size`` below the number of samples
(refill), small KV budgets (admission and preemption under memory pressure), ``sync_every`` in {1, 3, 8} (8 is the
CUDA setting, run here on CPU), page sizes, the CPU attention from the row cache or through the pages, top-k, top-p
and temperatures ≠ 1. For every drawn case:

- every returned log-prob equals a teacher-forced HF forward's within 1e-4 (fp32: the two differ by summation order
  only, ~1e-6 seen), and finish reasons and lengths follow the stop/length rules;
- greedy output equals HF ``generate`` (same stop ids);
- batch invariance: the same seed gives the same completions under another ``max_batch_size``, ``sync_every`` and
  budget. What is guaranteed: each sample draws from its own stream (a hash of seed, sample and token index), so
  its tokens depend on its own logits alone; those logits differ between schedules by fp32 rounding (~1e-6), so
  tokens are equal unless the draw falls that close to a boundary of the CDF (probability ~1e-6 per token, not seen
  in these cases). The log-probs agree within 1e-4.

Multi-turn schedules (issue 19): the same models with a scripted turn handler (``turn_script.ScriptedTurns``:
random observation lengths and ids, a random finish after some turns, random delays in ``ready`` polls, new stop
strings), stop tokens and stop strings over a character tokenizer (``turn_script.CharTokenizer``, tokens of one to
three letters: matches inside and across tokens), up to 5 turns, conversation budgets down to 24 tokens, small KV
budgets (paused samples evicted, running ones preempted mid-conversation), ``sync_every`` in {1, 3, 8} (stop
strings seen late and trimmed), top-k/top-p. For every drawn case, every trajectory:

- every sampled token's log-prob equals a teacher-forced HF forward over the whole sequence (prompt, turns and
  observations) within 1e-4, and every appended token's is 0;
- its pieces are what the handler saw and returned: each sampled turn is what ``start`` got (its text the
  tokenizer's decoding), each observation exactly the ``append_ids`` of the answer to the turn before it;
- ``loss_mask`` is 1 on exactly the sampled tokens, ``num_turns`` counts them;
- each turn ends at its first boundary (a reference scan: the first stop token or the first token whose prefix'
  decoded text contains a stop string in force), or, not at a boundary, at its limit ``min(max_new_tokens,
  budget - length)`` with reason "length"; the finish reason follows the contract's rules;
- the scheduler's invariants hold after every round (paused samples hold exactly the pages of their cached tokens:
  trimmed ones freed), and every page is free at the end;
- the same seed gives the same trajectories under another ``max_batch_size``, ``sync_every``, page size and budget
  (so another order of pauses, answers, evictions and preemptions).

The fast tier runs a few derandomized examples; ``-m slow`` runs a larger sweep.
"""

from unittest import mock

import pytest
import torch
from checks import IndecisiveCase, one_thread  # noqa: F401  (an autouse fixture)
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from test_generation import (
    ARCHS,
    LOGPROB_ATOL,
    MAX_POS,
    VOCAB,
    CheckedScheduler,
    assert_logprobs_match_hf,
    hf_greedy,
    random_prompts,
    teacher_forced_logp,
    tiny_model,
)
from turn_script import CharTokenizer, ScriptedTurns

import fastgrpo.engine.loop as engine_loop
from fastgrpo.engine.engine import GenerationEngine, SamplingParams


def draw_schedules(draw, samples: int) -> list[dict]:
    """Two engine schedules for one case of ``samples`` samples: batch size, sync interval, page size, spare pages
    (None: enough for every sample; small: preemption) and the CPU row cache or the pages."""
    return [
        dict(
            max_batch_size=draw(st.integers(1, samples)),
            sync_every=draw(st.sampled_from([1, 3, 8])),
            page_size=draw(st.sampled_from([1, 3, 16])),
            spare_pages=draw(st.sampled_from([None, 0, 1, 4])),
            row_cache=draw(st.booleans()),
        )
        for _ in range(2)
    ]


@st.composite
def cases(draw, max_prompts=4, max_samples=32):
    """One randomized schedule: model, prompts, sampling parameters and two engine settings to compare."""
    P = draw(st.integers(1, max_prompts))
    n = draw(st.integers(1, min(16, max_samples // P)))
    lengths = draw(st.lists(st.integers(1, 12), min_size=P, max_size=P))
    greedy = draw(st.booleans())
    params = SamplingParams(
        n=n,
        temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_k=0 if greedy else draw(st.sampled_from([0, 5, 20])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.8])),
        max_new_tokens=draw(st.integers(1, 16)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=8, unique=True))),
        seed=draw(st.integers(0, 2**20)),
    )
    schedules = draw_schedules(draw, P * n)
    return draw(st.sampled_from(sorted(ARCHS))), draw(st.integers(0, 2**16)), lengths, params, schedules


def engine_for(model, params, prompts, max_batch_size, sync_every, page_size, spare_pages, row_cache, **engine):
    """``spare_pages``: None = the default budget; k = the fewest pages that hold the longest sequence, plus k (small:
    admission waits for pages and running samples get preempted). ``row_cache``: the CPU decode attention from the
    row cache (refreshed from the pages) or through the pages at every step. ``engine``: more engine arguments."""
    longest = max(len(p) for p in prompts) + params.max_new_tokens
    total = None if spare_pages is None else (-(-longest // page_size) + 2 + spare_pages) * page_size
    return GenerationEngine(
        model, eos_token_ids=[], max_batch_size=max_batch_size, max_total_tokens=total, sync_every=sync_every,
        page_size=page_size, row_cache=row_cache, **engine,
    )


def check_case(arch, seed, lengths, params, schedules, adapt=None, guard=None, pair_guard=None):
    """``adapt(model, seed)``: the model the engine and Hugging Face run instead of the plain tiny one (LoRA).
    ``guard(model, prompt, completion)``: called on every completion before the comparisons (a mixture-of-experts
    model's near ties of its router: ``hypothesis.reject``); ``pair_guard(model, prompt, (prompt index, sample index),
    a, b)`` on the two schedules' completions of a sample before they are compared (a draw that rounding decides).
    Returns the model, prompts and both runs' completions."""
    model = tiny_model(arch, seed=seed % 5)
    model = model if adapt is None else adapt(model, seed)
    prompts = random_prompts(lengths, seed=seed)
    stops = set(params.stop_token_ids)
    runs = [engine_for(model, params, prompts, **s).generate(prompts, params) for s in schedules]
    temperature = params.temperature or 1.0
    for prompt, comps in zip(prompts, runs[0]):
        assert len(comps) == params.n
        for c in comps:
            if guard is not None:
                guard(model, prompt, c)
            assert 1 <= len(c.token_ids) <= params.max_new_tokens and len(c.logprobs) == len(c.token_ids)
            assert not stops & set(c.token_ids[:-1])
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stops
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == params.max_new_tokens
                assert c.token_ids[-1] not in stops
            assert_logprobs_match_hf(model, prompt, c.token_ids, c.logprobs, temperature)
        if params.greedy:
            try:
                want = hf_greedy(model, prompt, params.max_new_tokens, sorted(stops))
            except IndecisiveCase:  # a near tie: rounding would decide the comparison, the case must change
                reject()
            assert all(c.token_ids == want for c in comps)
    for p, (prompt, comps_a, comps_b) in enumerate(zip(prompts, *runs)):  # batch invariance
        for j, (a, b) in enumerate(zip(comps_a, comps_b)):
            if pair_guard is not None:
                pair_guard(model, prompt, (p, j), a, b)
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_ATOL, rtol=0)
    return model, prompts, runs


@settings(max_examples=8)
@given(cases())
def test_engine_matches_hf_under_random_schedules(case):
    check_case(*case)


@pytest.mark.slow
@settings(max_examples=80)
@given(cases(max_prompts=6, max_samples=64))
def test_engine_matches_hf_under_random_schedules_sweep(case):
    check_case(*case)


# ---------------------------------------------------------------- multi-turn schedules


def first_boundary(turn, stops, stop_strings, decode):
    """Reference scan: index of the first token of ``turn`` that is a stop token or completes a stop string in the
    decoded text of the turn so far (a full decode of every prefix), or None."""
    for i, t in enumerate(turn):
        if t in stops or any(s in decode(turn[: i + 1]) for s in stop_strings):
            return i
    return None


@st.composite
def turn_cases(draw, max_prompts=3, max_samples=12):
    """One randomized multi-turn schedule: model, prompts, sampling parameters, the handler's script and two engine
    settings to compare."""
    P = draw(st.integers(1, max_prompts))
    n = draw(st.integers(1, max(1, max_samples // P)))
    lengths = draw(st.lists(st.integers(1, 12), min_size=P, max_size=P))
    greedy = draw(st.booleans())
    strings = st.text("abcd", min_size=2, max_size=3)
    params = SamplingParams(
        n=n,
        temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_k=0 if greedy else draw(st.sampled_from([0, 5, 20])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.8])),
        max_new_tokens=draw(st.integers(1, 16)),
        # 8-24 of the 96 ids: most turns end at a boundary, after a few tokens
        stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=24, unique=True))),
        stop_strings=tuple(draw(st.lists(strings, max_size=2))),
        max_turns=draw(st.integers(1, 5)),
        max_sequence_tokens=draw(st.sampled_from([None, 24, 40])),
        seed=draw(st.integers(0, 2**20)),
    )
    script = dict(
        seed=draw(st.integers(0, 2**16)),
        max_obs=draw(st.sampled_from([0, 3, 8])),
        finish_prob=draw(st.sampled_from([0.0, 0.2, 0.5])),
        max_delay=draw(st.sampled_from([0, 2, 6])),
        stop_strings=tuple(tuple(draw(st.lists(strings, max_size=2))) for _ in range(2)),
    )
    schedules = draw_schedules(draw, P * n)
    return draw(st.sampled_from(sorted(ARCHS))), draw(st.integers(0, 2**16)), lengths, params, script, schedules


def run_turns(model, tokenizer, prompts, params, script, max_batch_size, sync_every, page_size, spare_pages,
              row_cache, **engine_args):
    """One multi-turn call under a schedule (``spare_pages`` as in :func:`engine_for`, over the conversation budget)
    with the scheduler's invariants checked every round; returns (completions, handler, engine). ``engine_args``:
    more engine arguments."""
    budget = min(params.max_sequence_tokens or MAX_POS, MAX_POS)
    total = None if spare_pages is None else (-(-budget // page_size) + 2 + spare_pages) * page_size
    engine = GenerationEngine(
        model, eos_token_ids=[], max_batch_size=max_batch_size, max_total_tokens=total, sync_every=sync_every,
        page_size=page_size, row_cache=row_cache, tokenizer=tokenizer, **engine_args,
    )  # fmt: skip
    turns = ScriptedTurns(vocab=VOCAB, **script)
    CheckedScheduler.instances.clear()
    with mock.patch.object(engine_loop, "Scheduler", CheckedScheduler):
        out = engine.generate(prompts, params, turns=turns)
    [sched] = CheckedScheduler.instances
    assert sched.used_pages == 0 and not any(sched.refs)
    return out, turns, engine


def check_trajectory(c, prompt, key, params, turns, tokenizer):
    """The pieces of one trajectory against what the handler saw and returned, and the contract's rules."""
    budget = min(params.max_sequence_tokens or MAX_POS, MAX_POS)
    stops, strings = set(params.stop_token_ids), params.stop_strings
    log = turns.log.get(key, [])
    assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask)
    pos, sampled = 0, 0
    for t, (turn_ids, text, result) in enumerate(log):  # the turns that ended at a boundary
        assert 1 <= len(turn_ids) <= params.max_new_tokens and text == tokenizer.decode(turn_ids)
        assert c.token_ids[pos : pos + len(turn_ids)] == turn_ids and set(c.loss_mask[pos : pos + len(turn_ids)]) == {1}
        assert first_boundary(turn_ids, stops, strings, tokenizer.decode) == len(turn_ids) - 1
        pos += len(turn_ids)
        sampled += 1
        if t == len(log) - 1 and pos == len(c.token_ids):  # it ended the trajectory
            if result.finish is not None:
                assert c.finish_reason == result.finish
            elif sampled == params.max_turns:
                assert c.finish_reason == "max_turns"
            else:  # the observation did not fit
                assert c.finish_reason == "length" and len(prompt) + pos + len(result.append_ids) + 1 > budget
            break
        assert result.finish is None and sampled < params.max_turns
        app = list(result.append_ids)
        assert c.token_ids[pos : pos + len(app)] == app, "the appended tokens are not the handler's"
        assert c.loss_mask[pos : pos + len(app)] == [0] * len(app) and c.logprobs[pos : pos + len(app)] == [0.0] * len(
            app
        )
        pos += len(app)
        strings = strings if result.stop_strings is None else result.stop_strings
    else:  # the last turn reached its limit without a boundary
        rest = c.token_ids[pos:]
        limit = min(params.max_new_tokens, budget - len(prompt) - pos)
        assert c.finish_reason == "length" and len(rest) == limit and set(c.loss_mask[pos:]) == {1}
        assert first_boundary(rest, stops, strings, tokenizer.decode) is None
        sampled += 1
    assert c.num_turns == sampled


def check_turn_case(arch, seed, lengths, params, script, schedules, guard=None, pair_guard=None):
    """As :func:`check_case` (``guard``, ``pair_guard`` too), multi-turn; returns the model, prompts and both runs'
    completions."""
    model = tiny_model(arch, seed=seed % 5)
    tokenizer = CharTokenizer(VOCAB, seed=seed)
    prompts = random_prompts(lengths, seed=seed)
    runs = [run_turns(model, tokenizer, prompts, params, script, **s) for s in schedules]
    temperature = params.temperature or 1.0
    for out, turns, _ in runs:
        for p, (prompt, comps) in enumerate(zip(prompts, out)):
            for j, c in enumerate(comps):
                if guard is not None:
                    guard(model, prompt, c)
                check_trajectory(c, prompt, (p, j), params, turns, tokenizer)
                ref = teacher_forced_logp(model, prompt, c.token_ids, temperature)
                sampled = torch.tensor(c.loss_mask, dtype=torch.bool)
                torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], ref[sampled], atol=LOGPROB_ATOL, rtol=0)
    (out_a, _, _), (out_b, _, _) = runs
    for p, (prompt, comps_a, comps_b) in enumerate(zip(prompts, out_a, out_b)):  # schedule invariance
        for j, (a, b) in enumerate(zip(comps_a, comps_b)):
            if pair_guard is not None:
                pair_guard(model, prompt, (p, j), a, b)
            assert (a.token_ids, a.loss_mask, a.finish_reason, a.num_turns) == (
                b.token_ids, b.loss_mask, b.finish_reason, b.num_turns)  # fmt: skip
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_ATOL, rtol=0)
    return model, prompts, [out for out, _, _ in runs]


@settings(max_examples=6)
@given(turn_cases())
def test_multi_turn_matches_hf_under_random_schedules(case):
    check_turn_case(*case)


@pytest.mark.slow
@settings(max_examples=60)
@given(turn_cases(max_prompts=5, max_samples=32))
def test_multi_turn_matches_hf_under_random_schedules_sweep(case):
    check_turn_case(*case)
