"""Stop strings and multi-turn rollouts in the GenerationEngine against independent references: the free-running
completion of the same seed scanned for the first match in its decoded text, Hugging Face greedy ``generate`` on
the conversation so far, a teacher-forced forward, and the contract's limits and finish reasons (issue 19). The
randomized schedules are in ``test_generation_fidelity.py``."""

from unittest import mock

import pytest
import torch
from checks import one_thread  # noqa: F401  (an autouse fixture)
from test_generation import (
    LOGPROB_ATOL,
    VOCAB,
    CheckedScheduler,
    hf_greedy,
    random_prompts,
    teacher_forced_logp,
    tiny_model,
)
from test_generation_fidelity import check_trajectory, first_boundary
from turn_script import CharTokenizer, ScriptedTurns

import fastgrpo.engine.loop as engine_loop
from fastgrpo.engine.engine import GenerationEngine, SamplingParams, TurnResult


class FixedTurns:
    """Answers every turn at the next poll with ``answer(key, turn)`` (a TurnResult); records what it saw."""

    def __init__(self, answer):
        self.answer, self.pending, self.log = answer, [], {}

    def start(self, key, turn_ids, turn_text):
        self.log.setdefault(key, []).append(list(turn_ids))
        self.pending.append((key, self.answer(key, len(self.log[key]))))

    def ready(self, block):
        out, self.pending = self.pending, []
        return out


@pytest.mark.parametrize("sync_every", [1, 3, 8])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_stop_strings_end_at_the_first_match_in_the_decoded_text(arch, sync_every):
    """Each completion is the free-running completion of the same seed (no stop strings) cut at the first token
    whose prefix' decoded text contains a stop string (a full decode of every prefix), "stop"; without a match it
    is the free-running one, "length". Tokens of one to three letters: matches end inside tokens and span them. With
    sync_every 3 and 8 the host sees most matches late: the tokens past them are trimmed, and the random stream of a
    sample is the same (the log-probs equal the free run's, and a teacher-forced forward's, within 1e-4)."""
    model = tiny_model(arch, seed=3)
    tok = CharTokenizer(VOCAB, seed=4)
    prompts = random_prompts([3, 8, 5, 11], seed=5)
    base = dict(n=6, max_new_tokens=24, seed=6, temperature=0.9, top_k=30)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=7, sync_every=sync_every, page_size=4,
                              tokenizer=tok)
    free = engine.generate(prompts, SamplingParams(**base))
    strings = ("abc", "dd", "cab")
    cut = engine.generate(prompts, SamplingParams(**base, stop_strings=strings))
    matched = 0
    for prompt, comps_f, comps_c in zip(prompts, free, cut):
        for f, c in zip(comps_f, comps_c):
            end = first_boundary(f.token_ids, set(), strings, tok.decode)
            want = f.token_ids if end is None else f.token_ids[: end + 1]
            assert c.token_ids == want and c.finish_reason == ("length" if end is None else "stop")
            assert c.loss_mask == [1] * len(want) and c.num_turns == 1
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(f.logprobs[: len(want)]),
                                       atol=LOGPROB_ATOL, rtol=0)  # another batch: rounding only
            matched += end is not None and end < len(f.token_ids) - 1
            ref = teacher_forced_logp(model, prompt, c.token_ids, 0.9)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
    assert matched >= 6  # cut short: the matches exercise the path


def test_greedy_turns_continue_the_conversation_with_its_kv_kept():
    """Greedy, every turn answered with a few tokens: each sampled turn is HF greedy ``generate`` on prompt +
    everything before it (same stop ids), each observation the handler's tokens, and with a pool that holds
    everything nothing is prefilled twice: prefill tokens = the prompts + per resume the appended tokens and the one
    sampled token whose K/V were not cached (the KV stays across turns); re_prefill_tokens counts what prefilling
    each resumed turn's whole conversation would have cost."""
    model = tiny_model("qwen3", seed=1)
    prompts = random_prompts([4, 9, 6], seed=2)
    free = [hf_greedy(model, p, 10, None) for p in prompts]
    stops = sorted({free[0][3], free[1][2], free[2][5]})

    def answer(key, turn):
        return TurnResult([(7 * key[0] + 3 * turn + i) % VOCAB for i in range(2 + turn)])

    turns = FixedTurns(answer)
    engine = GenerationEngine(model, eos_token_ids=stops, max_batch_size=8, sync_every=3, page_size=4,
                              tokenizer=CharTokenizer(VOCAB))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, max_turns=3)
    out = engine.generate(prompts, params, turns=turns)
    appended = conversations = 0
    for p, (prompt, comps) in enumerate(zip(prompts, out)):
        for j, c in enumerate(comps):
            pos, turn = 0, 0
            while pos < len(c.token_ids):
                turn += 1
                want = hf_greedy(model, prompt + c.token_ids[:pos], 10, stops)
                assert c.token_ids[pos : pos + len(want)] == want and set(c.loss_mask[pos : pos + len(want)]) == {1}
                pos += len(want)
                if want[-1] in stops and turn < 3:
                    app = answer((p, j), turn).append_ids
                    assert c.token_ids[pos : pos + len(app)] == app and c.loss_mask[pos : pos + len(app)] == [0] * len(
                        app
                    )
                    pos += len(app)
                    appended += len(app) + 1
                    conversations += len(prompt) + pos
            assert c.num_turns == turn and turns.log[(p, j)] == [
                c.token_ids[i : i + k] for i, k in _runs(c.loss_mask)
            ][: len(turns.log[(p, j)])]
            assert c.finish_reason == ("max_turns" if turn == 3 and c.token_ids[-1] in stops else "length")
    assert appended > 0
    stats = engine.last_stats
    assert stats["preemptions"] == stats["evictions"] == 0
    assert stats["resume_prefill_tokens"] == appended
    assert stats["prefill_tokens"] == sum(map(len, prompts)) + appended
    assert stats["re_prefill_tokens"] == conversations  # the whole conversation at every resumed turn


def _runs(mask):
    """(start, length) of each run of 1s in ``mask``."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i - start))
            start = None
    return out


@pytest.mark.parametrize("top", [dict(), dict(top_k=12, top_p=0.9)], ids=["T1", "topk-topp"])
def test_preemption_and_eviction_mid_conversation_do_not_change_the_trajectories(top):
    """A pool of a few conversations' worth of pages for 24 samples: paused samples are evicted (recomputed from all
    their tokens when they resume) and running ones preempted mid-conversation. The trajectories equal those of a
    pool that holds everything (same seed), log-probs within 1e-4 and equal to a teacher-forced forward's; the
    scheduler's invariants hold every round and every page is free at the end."""
    model = tiny_model("llama", seed=2)
    prompts = random_prompts([5, 10, 3, 7], seed=3)
    tok = CharTokenizer(VOCAB, seed=1)
    params = SamplingParams(n=6, max_new_tokens=8, max_turns=4, max_sequence_tokens=48, seed=4,
                            stop_token_ids=tuple(range(0, VOCAB, 6)), **top)
    script = dict(seed=5, vocab=VOCAB, max_obs=6, finish_prob=0.1, max_delay=4)
    big = GenerationEngine(model, eos_token_ids=[], max_batch_size=24, page_size=4, tokenizer=tok)
    want = big.generate(prompts, params, turns=ScriptedTurns(**script))
    assert big.last_stats["evictions"] == big.last_stats["preemptions"] == 0 and big.last_stats["peak_paused"] > 4
    CheckedScheduler.instances.clear()
    small = GenerationEngine(model, eos_token_ids=[], max_batch_size=24, page_size=4, max_total_tokens=4 * 17,
                             sync_every=3, tokenizer=tok)
    with mock.patch.object(engine_loop, "Scheduler", CheckedScheduler):
        got = small.generate(prompts, params, turns=ScriptedTurns(**script))
    stats = small.last_stats
    assert stats["evictions"] > 0 and stats["preemptions"] > 0
    assert CheckedScheduler.instances[0].used_pages == 0
    multi = 0
    for prompt, comps_w, comps_g in zip(prompts, want, got):
        for w, g in zip(comps_w, comps_g):
            assert (g.token_ids, g.loss_mask, g.finish_reason, g.num_turns) == (
                w.token_ids, w.loss_mask, w.finish_reason, w.num_turns)  # fmt: skip
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=LOGPROB_ATOL, rtol=0)
            sampled = torch.tensor(g.loss_mask, dtype=torch.bool)
            ref = teacher_forced_logp(model, prompt, g.token_ids)
            torch.testing.assert_close(torch.tensor(g.logprobs)[sampled], ref[sampled], atol=LOGPROB_ATOL, rtol=0)
            multi += g.num_turns > 1
    assert multi >= 6


def test_limits_and_finish_reasons():
    """The contract's rules, one prompt per rule: the handler's finish reasons; append_ids on the max_turns-th turn
    end with "max_turns" and nothing appended; an observation that leaves no room for one more sampled token within
    max_sequence_tokens ends with "length", nothing appended; a turn that reaches max_new_tokens without a boundary
    ends with "length" and the handler is not called for it. ``on_group_done`` fires once per prompt."""
    model = tiny_model("qwen2")
    prompts = random_prompts([4, 4, 4, 4, 4], seed=7)
    stops = tuple(range(0, VOCAB, 2))  # half the vocabulary: turns end after a token or two

    def answer(key, turn):
        p = key[0]
        if p < 3:
            return TurnResult([5], finish=("stop", "env_done", "error")[p]) if turn == 2 else TurnResult([1, 3])
        if p == 3:
            return TurnResult([1, 3, 5])  # until max_turns
        return TurnResult([1] * (30 if turn == 2 else 1))  # the second observation does not fit

    turns = FixedTurns(answer)
    engine = GenerationEngine(model, eos_token_ids=[], tokenizer=CharTokenizer(VOCAB))
    params = SamplingParams(n=3, max_new_tokens=20, max_turns=3, max_sequence_tokens=32, stop_token_ids=stops, seed=1)
    groups, overflows = [], 0
    out = engine.generate(prompts, params, turns=turns, on_group_done=lambda p, comps: groups.append(p))
    assert sorted(groups) == list(range(5))
    for p, comps in enumerate(out):
        for j, c in enumerate(comps):
            log = turns.log.get((p, j), [])
            ended = len(log) == c.num_turns  # the last turn ended at a boundary: the handler was called on it
            if not ended:
                assert c.finish_reason == "length" and c.token_ids[-1] not in stops
                continue
            assert c.token_ids[-len(log[-1]) :] == log[-1], "something was appended after the last turn"
            if p < 3:
                assert c.num_turns == 2 and c.finish_reason == ("stop", "env_done", "error")[p]
            elif p == 3:
                assert c.num_turns == 3 and c.finish_reason == "max_turns"
            else:
                assert c.num_turns == 2 and c.finish_reason == "length" and 4 + len(c.token_ids) + 30 + 1 > 32
                overflows += 1
    reasons = {c.finish_reason for comps in out for c in comps}
    assert {"stop", "env_done", "error", "max_turns"} <= reasons and overflows > 0


def test_single_turn_with_a_handler_and_the_first_turn_of_a_conversation():
    """The random stream counts sampled tokens only: a conversation's first turn is the single-turn completion of
    the same seed, and with ``max_turns=1`` a handler that answers with an observation ends it with "max_turns"."""
    model = tiny_model("qwen3", seed=4)
    prompts = random_prompts([6, 3], seed=8)
    stops = tuple(range(0, VOCAB, 5))
    tok = CharTokenizer(VOCAB)
    engine = GenerationEngine(model, eos_token_ids=[], tokenizer=tok)
    base = dict(n=4, max_new_tokens=12, stop_token_ids=stops, seed=9)
    single = engine.generate(prompts, SamplingParams(**base))
    def observe():
        return FixedTurns(lambda key, turn: TurnResult([2]))

    multi = engine.generate(prompts, SamplingParams(**base, max_turns=3), turns=observe())
    one = engine.generate(prompts, SamplingParams(**base), turns=observe())
    for comps_s, comps_m, comps_1 in zip(single, multi, one):
        for s, m, o in zip(comps_s, comps_m, comps_1):
            assert m.token_ids[: len(s.token_ids)] == s.token_ids
            torch.testing.assert_close(torch.tensor(m.logprobs[: len(s.logprobs)]), torch.tensor(s.logprobs),
                                       atol=LOGPROB_ATOL, rtol=0)
            assert o.token_ids == s.token_ids
            assert o.finish_reason == ("max_turns" if s.finish_reason == "stop" else "length")


@pytest.mark.parametrize("sync_every", [1, 8])
def test_the_random_stream_counts_sampled_tokens_across_turns(sync_every):
    """Turns that end at stop tokens, answered with nothing to append: the conversation is the free-running
    completion of the same seed without stop tokens, token for token, to the budget. Each draw is keyed by the
    count of tokens the sample sampled before it (in all its turns; here no token is appended), so the turns
    continue one stream, as one completion would (a per-turn index would repeat the first turn's draws)."""
    model = tiny_model("qwen2", seed=5)
    prompts = random_prompts([5, 5, 5], seed=9)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4, sync_every=sync_every,
                              tokenizer=CharTokenizer(VOCAB))
    free = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=30, seed=2))
    params = SamplingParams(n=3, max_new_tokens=30, max_sequence_tokens=35, max_turns=100, seed=2,
                            stop_token_ids=tuple(range(0, VOCAB, 7)))
    out = engine.generate(prompts, params, turns=FixedTurns(lambda key, turn: TurnResult([])))
    for comps_f, comps_m in zip(free, out):
        for f, m in zip(comps_f, comps_m):
            assert m.token_ids == f.token_ids and m.finish_reason == "length" and m.loss_mask == [1] * 30
    assert max(c.num_turns for comps in out for c in comps) > 3


class BadTurns(FixedTurns):
    def __init__(self, result=None, key=None, empty=False):
        super().__init__(lambda k, t: result)
        self.key, self.empty = key, empty

    def ready(self, block):
        if self.empty:
            return []
        return [(self.key or k, r) for k, r in super().ready(block)]


@pytest.mark.parametrize(
    "engine_kwargs,params,turns,match",
    [
        ({}, dict(max_turns=2), None, r"max_turns=2 needs a turn handler"),
        ({"tokenizer": None}, dict(stop_strings=("ab",)), None, r"stop_strings needs the engine's tokenizer"),
        ({"tokenizer": None}, dict(max_turns=2), FixedTurns(None), r"turn handler .* needs the engine's tokenizer"),
        ({}, dict(max_turns=2), BadTurns(TurnResult([], finish="done")), r"TurnResult.finish for \(0, 0\) must be"),
        ({}, dict(max_turns=2), BadTurns(TurnResult([VOCAB])), r"append_ids for \(0, 0\) must be token ids"),
        ({}, dict(max_turns=2), BadTurns(TurnResult([1]), key=(5, 5)), r"result for \(5, 5\), which is not waiting"),
        ({}, dict(max_turns=2), BadTurns(empty=True), r"ready\(block=True\) returned no result"),
        ({}, dict(max_turns=2), BadTurns([1]), r"must return TurnResult answers"),
        ({}, dict(max_turns=2), object(), r"turns must have start"),
    ],
)
def test_bad_multi_turn_input_raises(engine_kwargs, params, turns, match):
    kwargs = {"tokenizer": CharTokenizer(VOCAB), **engine_kwargs}
    engine = GenerationEngine(tiny_model("qwen2"), eos_token_ids=list(range(VOCAB)), **kwargs)  # every turn ends
    with pytest.raises(RuntimeError if "block=True" in match else ValueError, match=match):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, **params), turns=turns)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stop_strings": "ab"}, "stop_strings must be a tuple"),
        ({"stop_strings": ("",)}, "stop_strings must be non-empty strings"),
        ({"stop_strings": (3,)}, "stop_strings must be non-empty strings"),
        ({"max_turns": 0}, "max_turns must"),
    ],
)
def test_bad_turn_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="tokenizer must have a decode"):
        GenerationEngine(tiny_model("qwen2"), eos_token_ids=[0], tokenizer=object())


@pytest.mark.gpu
def test_multi_turn_on_the_cuda_path():
    """The CUDA path (CUDA-graph decode, the paged kernel, compiled elementwise ops, flags and tokens read every 8
    steps: stop strings seen late and trimmed) with a scripted handler: each trajectory's pieces are what the handler
    saw and returned, and the sampled log-probs equal a teacher-forced forward's (fp32)."""
    model = tiny_model("qwen3").cuda()
    prompts = random_prompts([5, 11, 3], seed=4)
    tok = CharTokenizer(VOCAB, seed=2)
    params = SamplingParams(n=4, max_new_tokens=12, max_turns=3, max_sequence_tokens=48, seed=3,
                            stop_token_ids=tuple(range(0, VOCAB, 9)), stop_strings=("abc", "dd"))
    turns = ScriptedTurns(seed=1, vocab=VOCAB, max_obs=6, max_delay=2)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=8, tokenizer=tok)
    out = engine.generate(prompts, params, turns=turns)
    assert engine.last_stats["resume_prefill_tokens"] > 0
    for p, (prompt, comps) in enumerate(zip(prompts, out)):
        for j, c in enumerate(comps):
            check_trajectory(c, prompt, (p, j), params, turns, tok)
            ref = teacher_forced_logp(model, prompt, c.token_ids).cpu()
            sampled = torch.tensor(c.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], ref[sampled], atol=LOGPROB_ATOL, rtol=0)
