"""Scripted multi-turn pieces for the engine's tests and bench: a turn handler deterministic from a seed and a
character tokenizer for tiny random models."""

from __future__ import annotations

import random

from fastgrpo.engine.engine import TurnResult

HANDLER_FINISHES = ("stop", "env_done", "error")


class ScriptedTurns:
    """A turn handler whose answers depend only on (seed, sample key, turn index): random observation lengths and
    ids, a random finish after some turns, and a random number of ``ready`` polls before each answer appears (so
    samples resume in an order that depends on the schedule, while their contents do not).

    ``log[key]``: one ``(turn_ids, turn_text, result)`` per turn it was started on."""

    def __init__(self, seed: int, vocab: int, *, max_obs: int = 6, finish_prob: float = 0.2, max_delay: int = 3,
                 stop_strings: tuple[tuple[str, ...], ...] = ()):
        self.seed, self.vocab, self.max_obs = seed, vocab, max_obs
        self.finish_prob, self.max_delay, self.stop_strings = finish_prob, max_delay, stop_strings
        self.log: dict[tuple[int, int], list] = {}
        self.pending: dict[tuple[int, int], list] = {}  # key -> [polls left, result]
        self.blocking_calls = 0

    def start(self, key, turn_ids, turn_text) -> None:
        assert key not in self.pending, f"{key} started twice without an answer"
        turn = len(self.log.get(key, []))
        rng = random.Random(f"{self.seed}/{key[0]}/{key[1]}/{turn}")
        if rng.random() < self.finish_prob:
            result = TurnResult([], finish=rng.choice(HANDLER_FINISHES))
        else:
            ids = [rng.randrange(self.vocab) for _ in range(rng.randint(0, self.max_obs))]
            stops = rng.choice(self.stop_strings) if self.stop_strings and rng.random() < 0.5 else None
            result = TurnResult(ids, stop_strings=stops)
        self.pending[key] = [rng.randint(0, self.max_delay), result]
        self.log.setdefault(key, []).append((list(turn_ids), turn_text, result))

    def ready(self, block: bool):
        for entry in self.pending.values():
            entry[0] -= 1
        out = [key for key, (left, _) in self.pending.items() if left < 0]
        if block:
            self.blocking_calls += 1
            if not out:  # the soonest answer (ties: the first started), so a blocking call returns one
                out = [min(self.pending, key=lambda k: self.pending[k][0])]
        return [(key, self.pending.pop(key)[1]) for key in out]


class CharTokenizer:
    """``decode`` only: token id ``i`` is a string of one to three letters of a small alphabet (so that stop strings
    match often, across tokens and inside them)."""

    def __init__(self, vocab: int, seed: int = 0, alphabet: str = "abcd"):
        rng = random.Random(seed)
        self.pieces = ["".join(rng.choice(alphabet) for _ in range(rng.choice([1, 1, 2, 3]))) for _ in range(vocab)]

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)
