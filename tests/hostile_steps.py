"""Text-step environments for tests/test_env_validation.py, importable by the reward workers (module level).

``Echo`` answers each turn with the text it received: as a string on odd steps, as a user message of two text parts
on even ones. A row with ``fault`` (a key of :data:`ANSWERS`) makes its step number ``at`` return that value instead;
the faults of :data:`MALFORMED` break the step contract, ``narrator`` is well formed but has a role that some chat
templates refuse. (No torch here: the workers import this module.)
"""

from fastgrpo.environments.core import TextStepEnvironment

ANSWERS = {
    "none_content": ([{"role": "user", "content": None}], 0.5, False, None),
    "no_content": ([{"role": "user"}], 0.5, False, None),
    "no_role": ([{"content": "x"}], 0.5, False, None),
    "role_not_a_string": ([{"role": 3, "content": "x"}], 0.5, False, None),
    "image_part": ([{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "url": "x.png"}]}],
                   0.5, False, None),
    "text_part_not_a_string": ([{"role": "user", "content": [{"type": "text", "text": 5}]}], 0.5, False, None),
    "not_a_message": (["x"], 0.5, False, None),
    "no_messages": ([], 0.5, False, None),
    "empty_stop_string": ("ok", 0.5, False, [""]),
    "bare_string_stop_strings": ("ok", 0.5, False, "ab"),
    "stop_string_not_a_string": ("ok", 0.5, False, [3]),
    "reward_not_a_number": ("ok", "high", False, None),
    "three_values": ("ok", 0.5, False),
    "narrator": ([{"role": "narrator", "content": "x"}], 0.5, False, None),
}
MALFORMED = tuple(k for k in ANSWERS if k != "narrator")


class Echo(TextStepEnvironment):
    def reset(self, fault=None, at=1, **row):
        return None, {"steps": 0, "fault": fault, "at": at}

    def step(self, turn_text, state):
        state["steps"] += 1
        if state["fault"] is not None and state["steps"] == state["at"]:
            return ANSWERS[state["fault"]]
        if state["steps"] % 2:
            return f"saw {turn_text}", 0.25, False, None
        parts = [{"type": "text", "text": "saw "}, {"type": "text", "text": turn_text}]
        return [{"role": "user", "content": parts}], 0.25, False, None


class BareStopStrings(Echo):
    stop_strings = "ab"


class EmptyStopString(Echo):
    stop_strings = ("", "x")
