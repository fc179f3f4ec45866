"""A text-step environment whose step returns a value outside its contract (issue 37, item 5), in real reward
workers: through EnvTurns as the engine drives it, and through ``GenerationEngine.generate`` on the tiny model.

The rule: the worker checks each step's return. Contents given as text parts (``[{"type": "text", "text": ...}]``)
are joined; anything else outside the contract (a content that is neither text nor text parts, a missing or
non-string role, no messages, an empty or non-string stop string, a bare string as stop strings, a reward that is not
a number, a tuple that is not four values) is counted as ``step/malformed`` and ends that trajectory with "error"
(reward 0), while the rest of the batch goes on exactly as it would without it. The environments are
``tests/hostile_steps.py``'s: ``Echo`` answers every turn with the text it received.
"""

import warnings
from collections import Counter

import pytest
from hostile_steps import MALFORMED, BareStopStrings, Echo, EmptyStopString
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_environments import Driver, runs, user_reply

from fastgrpo.config import ModelConfig, RewardConfig
from fastgrpo.engine.engine import GenerationEngine, SamplingParams
from fastgrpo.environments import EnvironmentPool, EnvTurns, environment_modules
from fastgrpo.environments.chat import ChatTemplate
from fastgrpo.models.loading import TINY_CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from fastgrpo.rewards.pool import RewardPool

TOKENIZER = build_tiny_tokenizer()
EOS, UNK = TOKENIZER.eos_token_id, TOKENIZER.unk_token_id
ROLE_TOKENS = {TOKENIZER.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|assistant|>")}
# "|>" completes inside the text of <|unk|> (a special token: in all_special_ids) and of the role tokens (added
# tokens the tokenizer does not list as special); every digit and vowel ends a turn too, so turns are short
PARAMS = SamplingParams(n=1, max_new_tokens=8, max_turns=4, seed=0, stop_strings=("|>", *"0123456789aeiou"))
ROWS = [{"prompt": p} for p in ("go", "play", "next", "more", "again", "last")]
# the faults the engine test runs (one rollout each): the item's list; MALFORMED's others run through EnvTurns alone
ENGINE_FAULTS = ("none_content", "no_content", "no_role", "role_not_a_string", "image_part", "empty_stop_string",
                 "bare_string_stop_strings")


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(RewardConfig(functions=["format"], timeout_s=1.0), 2, preload=environment_modules(Echo))
    yield p
    p.close()


def echo_turns(pool, rows, n=1, template=None):
    envs = EnvironmentPool(pool, Echo)
    return EnvTurns(envs, template or ChatTemplate(TOKENIZER), rows, n)


@pytest.mark.parametrize("fault", MALFORMED)
def test_a_malformed_step_ends_its_trajectory_with_an_error_and_the_others_go_on(pool, fault):
    """Its second step is malformed: counted once as step/malformed (with a warning saying what was wrong), the
    trajectory ends "error" with reward 0 (its first step's 0.25 included) and nothing appended; its neighbour goes
    on, both of its steps answered (the second's text parts joined)."""
    d = Driver(echo_turns(pool, [{"prompt": "p", "fault": fault, "at": 2}, {"prompt": "q"}]))
    assert TOKENIZER.decode(d.turn((0, 0), "ab").append_ids) == user_reply("saw ab")
    with pytest.warns(RuntimeWarning, match=r"step\(\) returned .*env/failures/step/malformed"):
        assert d.turn((0, 0), "cd").finish == "error"
    assert TOKENIZER.decode(d.turn((1, 0), "ef").append_ids) == user_reply("saw ef")
    r = d.turn((1, 0), "gh")  # the second step: text parts, joined
    assert TOKENIZER.decode(r.append_ids) == user_reply("saw gh") and r.finish is None
    res = d.turns.results()
    bad, good = res[(0, 0)], res[(1, 0)]
    assert (bad.finish, dict(bad.failures), bad.reward, bad.turns) == ("error", {"step/malformed": 1}, 0.0, 2)
    assert bad.messages[-1] == {"role": "assistant", "content": "cd"}  # no observation after the malformed step
    assert (good.finish, dict(good.failures), good.reward, good.turns) == (None, {}, 0.5, 2)
    assert good.messages[-2:] == [{"role": "assistant", "content": "gh"}, {"role": "user", "content": "saw gh"}]
    m = d.turns.metrics(d.completions({(1, 0): "length"}))
    assert m["env/failures/step/sum"] == 1 and m["env/finish/error"] == 0.5 and m["env/finish/length"] == 0.5


N_TRAJ = 4


@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, N_TRAJ - 1), st.sampled_from(MALFORMED), st.integers(1, 3)),
                max_size=2, unique_by=lambda h: h[0]),
       st.lists(st.integers(0, N_TRAJ - 1), min_size=N_TRAJ * 3, max_size=N_TRAJ * 3))
def test_hostile_steps_mixed_into_a_batch_are_counted_exactly(pool, hostile, order):
    """Up to two hostile trajectories among four (their fault kind and step drawn), turns interleaved in a drawn
    order: each hostile one ends "error" at its faulty step, counted once; every other step is answered."""
    faults = {h: (kind, at) for h, kind, at in hostile}
    rows = [{"prompt": "p", **({"fault": faults[t][0], "at": faults[t][1]} if t in faults else {})}
            for t in range(N_TRAJ)]
    d = Driver(echo_turns(pool, rows))
    steps, ended = Counter(), set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in order:
            if t in ended:
                continue
            steps[t] += 1
            r = d.turn((t, 0), "x" * steps[t])
            if t in faults and steps[t] == faults[t][1]:
                assert r.finish == "error"
                ended.add(t)
            else:
                assert r.finish is None and TOKENIZER.decode(r.append_ids) == user_reply("saw " + "x" * steps[t])
    assert sum(issubclass(w.category, RuntimeWarning) for w in caught) == len(ended)
    res = d.turns.results()
    for t in range(N_TRAJ):
        bad = t in ended
        assert dict(res[(t, 0)].failures) == ({"step/malformed": 1} if bad else {})
        assert res[(t, 0)].finish == ("error" if bad else None)
        assert res[(t, 0)].reward == (0.0 if bad else 0.25 * steps[t]) and res[(t, 0)].turns == steps[t]


def test_a_role_the_template_refuses_ends_the_trajectory_as_a_template_failure(pool):
    """Well formed, but the chat template raises on it (a jinja2 TemplateError, as templates that check roles do):
    counted as "template", the trajectory ends "error", the neighbour goes on."""
    import copy

    tok = copy.deepcopy(TOKENIZER)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'narrator' %}{{ raise_exception('no narrators') }}"
                         "{% endif %}{% endfor %}" + TINY_CHAT_TEMPLATE)
    d = Driver(echo_turns(pool, [{"prompt": "p", "fault": "narrator"}, {"prompt": "q"}], template=ChatTemplate(tok)))
    assert d.turn((0, 0), "ab").finish == "error"
    assert TOKENIZER.decode(d.turn((1, 0), "cd").append_ids) == user_reply("saw cd")
    res = d.turns.results()
    assert (res[(0, 0)].finish, dict(res[(0, 0)].failures), res[(0, 0)].reward) == ("error", {"template": 1}, 0.0)
    assert (res[(1, 0)].finish, dict(res[(1, 0)].failures)) == (None, {})


@pytest.mark.parametrize("cls", [BareStopStrings, EmptyStopString])
def test_a_text_step_class_with_bad_stop_strings_is_refused_at_start_up(pool, cls):
    with pytest.raises(ValueError, match=r"stop_strings must be a list or tuple of non-empty strings"):
        EnvironmentPool(pool, cls)


def test_a_stop_string_completed_inside_a_special_tokens_text(pool):
    """The turn's last token, when it is one of the tokenizer's special tokens (all_special_ids: EOS, <|unk|> here),
    is the turn's end marker whatever ended the turn there: the environment gets the text before it, the transcript
    has no trace of it, the sampled ids keep it and the template's whole end of turn follows it. Any other token in
    whose text a stop string completed (an added token such as <|user|> or <tool_call>, a plain one) is text. The
    engine's side (the sampled ids keep the token, with its log-prob and mask 1) is the engine test's below."""
    d = Driver(echo_turns(pool, [{"prompt": "p"}]))
    key = (0, 0)
    r = d.turn(key, "ab<|unk|>", eos=False)  # as if the stop string "|>" ended the turn in <|unk|>
    assert TOKENIZER.decode(r.append_ids) == user_reply("saw ab", eos=False)  # <|endoftext|><|user|>...
    r = d.turn(key, "cd<|user|>", eos=False)
    assert TOKENIZER.decode(r.append_ids) == user_reply("saw cd<|user|>", eos=False)
    r = d.turn(key, "e<tool_call>", eos=False)
    assert TOKENIZER.decode(r.append_ids) == user_reply("saw e<tool_call>", eos=False)
    assert TOKENIZER.decode(d.turn(key, "f").append_ids) == user_reply("saw f")  # EOS: not content either
    contents = [m["content"] for m in d.turns.results()[key].messages if m["role"] == "assistant"]
    assert contents == ["ab", "cd<|user|>", "e<tool_call>", "f"]


# ---------------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def engine():
    model = build_tiny_model(ModelConfig(), TOKENIZER, seed=0)
    return GenerationEngine(model, eos_token_ids=EOS, tokenizer=TOKENIZER, max_batch_size=8)


def rollout(engine, pool, rows):
    turns = echo_turns(pool, rows)
    completions = engine.generate(turns.prompt_ids(), PARAMS, turns=turns)
    return [group[0] for group in completions], turns.results()


@pytest.fixture(scope="module")
def benign(engine, pool):
    return rollout(engine, pool, ROWS)


def sampled_and_appended(completion):
    parts = runs(completion)
    return [ids for m, ids in parts if m], [ids for m, ids in parts if not m]


def test_the_engine_rollout_gives_the_environment_each_turn_as_the_rule_says(benign):
    """Every observation the engine appended is the template's suffix for "saw <the turn's text>", where the text
    is the sampled turn less its last token when that token is special (EOS, <|unk|>): the environment received
    exactly that, a string on odd steps and text parts joined on even ones. The batch met each kind of end."""
    completions, trajs = benign
    ends = Counter()
    for i, (c, t) in enumerate(zip(completions, trajs.values())):
        sampled, appended = sampled_and_appended(c)
        assert t.turns >= 1 and len(appended) == min(t.turns, PARAMS.max_turns - 1), i
        for k, ids in enumerate(appended):
            last = sampled[k][-1]
            ends["eos" if last == EOS else "unk" if last == UNK else "role" if last in ROLE_TOKENS else "text"] += 1
            text = TOKENIZER.decode(sampled[k][:-1] if last in (EOS, UNK) else sampled[k])
            assert TOKENIZER.decode(ids) == user_reply("saw " + text, eos=last == EOS), (i, k)
            assert t.messages[1 + 2 * k] == {"role": "assistant", "content": text}
        assert (t.failures, t.finish, t.reward) == ({}, None, 0.25 * t.turns)
    assert ends["unk"] and ends["role"] and ends["eos"] and ends["text"], ends


@pytest.mark.parametrize("fault", ENGINE_FAULTS)
def test_one_malformed_environment_in_an_engine_rollout_ends_only_its_trajectory(engine, pool, benign, fault):
    """One trajectory of the batch (which one, and at which step, varies with the fault) returns a malformed step:
    it ends "error" there, its tokens being the benign run's up to that turn, counted as step/malformed with
    reward 0; every other trajectory is token for token, and in its conversation, what it is without it."""
    completions, trajs = benign
    i = ENGINE_FAULTS.index(fault)
    h = i % len(ROWS)
    at = 1 + i % trajs[(h, 0)].turns
    rows = [dict(r) for r in ROWS]
    rows[h].update(fault=fault, at=at)
    with pytest.warns(RuntimeWarning, match="malformed"):
        got, got_trajs = rollout(engine, pool, rows)
    for j, (c, t) in enumerate(zip(got, got_trajs.values())):
        want, want_t = completions[j], trajs[(j, 0)]
        if j != h:
            assert (c.token_ids, c.loss_mask, c.finish_reason, c.num_turns) == (
                want.token_ids, want.loss_mask, want.finish_reason, want.num_turns), j
            assert (t.messages, t.failures, t.finish, t.reward, t.turns) == (
                want_t.messages, want_t.failures, want_t.finish, want_t.reward, want_t.turns), j
            continue
        head = sum(len(ids) for _, ids in runs(want)[:2 * at - 1])  # turns 1..at and the observations between
        assert (c.token_ids, c.loss_mask) == (want.token_ids[:head], want.loss_mask[:head])
        assert (c.finish_reason, c.num_turns) == ("error", at)
        assert (t.finish, dict(t.failures), t.reward, t.turns) == ("error", {"step/malformed": 1}, 0.0, at)
        assert t.messages == want_t.messages[:2 * at]  # the prompt, then up to its last turn

