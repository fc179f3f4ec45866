"""The host side of multi-turn rollouts and stop strings (``_TurnSteps``, a mixin of ``fastgrpo.engine.engine._Run``):
what happens when a sample reaches the end of a turn, the turn handler's answers, and the stop-string match on the
decoded tail of a turn. The device step knows nothing of turns: a paused sample simply has no row, and a resumed
one is admitted like a new sample whose context is already (mostly) in its pages (``fastgrpo.engine.scheduler``).

A trajectory, in order: prompt, turn 1 (sampled), observation 1 (appended), turn 2, ... Its host state besides the
scheduler's is a ``_Traj``: every token after the prompt with its log-prob and loss-mask bit, how many tokens the
policy sampled (the offset of its random stream's index, so a turn's draws do not depend on what was appended), the
turns it sampled and its stop strings.

**Turn boundaries.** A turn ends at an eos/stop token (included), at the token that completes the first stop-string
match in its decoded text (included; tokens the device sampled past it before the host saw the match, at most
``sync_every - 1``, are trimmed and the pages that held only them are freed), or at its token limit. Without a
turn handler a boundary ends the completion ("stop", today's single-turn behaviour); with one the sample pauses
(pages kept) and ``turns.start(key, turn_ids, turn_text)`` is called. A limit ends the trajectory ("length") and the
handler is not called.

**Stop strings** are matched on the host, on what the device sampled since the last read: every ``sync_every``
steps the newest ``sync_every`` tokens of each running row come back with the stop flags (one transfer, only while
some running sample has stop strings). ``_first_stop`` finds the first token whose decoded tail (the
``W = longest stop string + 1`` tokens that end at it) contains a stop string: the same token as the first match in
the decoded text of the whole turn whenever every token decodes to at least one character and the decoding of a
token sequence is the concatenation of its tokens' (byte-level BPE, character-level tokenizers; a SentencePiece
leading space is one character of the first token of a window, outside the ``W - 1`` that matter). One decode of a
short window per running sample per read (27 µs for 24 ids with a ``PreTrainedTokenizerFast``, the tiny model's,
on a loaded 2-core host: ~7 ms per read at 256 rows, once per 8 decode steps on CUDA); a sample whose window does
not contain any stop string costs nothing more. If the stop string ends inside a token, the turn ends with that
token (its text may run past the match).

**Answers.** ``turns.ready(block=False)`` is polled every ``sync_every`` steps while samples wait on it, and
``ready(block=True)`` only when nothing decodes and nothing can be admitted. An answer with ``finish`` ends the
trajectory with that reason; one with ``append_ids`` on the ``max_turns``-th turn ends it with "max_turns"
(nothing appended); ``append_ids`` that leave no room for one more sampled token within the conversation budget
(``max_sequence_tokens``, or the model's context) end it with "length" (nothing appended); otherwise the tokens are
appended (log-prob 0, mask 0) and the sample is queued to resume with a turn limit of
``min(max_new_tokens, budget - conversation length)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastgrpo.engine.sampling import HANDLER_FINISH_REASONS, Completion, TurnResult


@dataclass(eq=False)
class _Traj:
    """One trajectory's tokens after the prompt and its turn state (host)."""

    stop_strings: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    """Finished turns and appended observations, in order."""
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    sampled: int = 0
    """Tokens the policy sampled in finished turns: the index of its random stream's next draw is this + the
    current turn's count."""
    turns: int = 0
    """Finished (sampled) turns."""
    seen: list[int] = field(default_factory=list)
    """The current turn's tokens checked for stop strings so far."""


def _first_stop(decode, turn_ids: list[int], checked: int, stop_strings: tuple[str, ...]) -> int | None:
    """Index of the first token of ``turn_ids[checked:]`` that completes a stop string in the decoded text (see the
    module docstring), or None."""
    w = max(map(len, stop_strings)) + 1  # tokens whose text a match completing at the last one can span
    text = decode(turn_ids[max(0, checked + 1 - w) :])
    if not any(s in text for s in stop_strings):
        return None
    for i in range(checked, len(turn_ids)):
        tail = decode(turn_ids[max(0, i + 1 - w) : i + 1])
        if any(s in tail for s in stop_strings):
            return i
    return None


class _TurnSteps:
    """Turn ends, handler answers and stop strings for ``_Run`` (its attributes: sched, params, trajs, turns, ...)."""

    def _stop_matches(self, window: list[list[int]]) -> dict:
        """Read the rows' newest tokens (``window[row]``: the last ``sync_every`` ids up to its count) into their
        trajectories; returns ``{seq: tokens it keeps}`` for the rows whose turn completed a stop string."""
        decode = self.e.tokenizer.decode
        cut = {}
        for row, seq in enumerate(self.sched.rows):
            traj = self.trajs[seq.sample]
            if not traj.stop_strings:
                continue
            new = seq.generated - len(traj.seen)  # at most sync_every tokens since the last read
            if new <= 0:
                continue
            if new > len(window[row]):
                raise RuntimeError(f"sample {seq.sample}: {new} tokens since the last stop-string check, at most "
                                   f"{len(window[row])} expected")
            checked = len(traj.seen)
            traj.seen += window[row][len(window[row]) - new :]
            i = _first_stop(decode, traj.seen, checked, traj.stop_strings)
            if i is not None:
                cut[seq] = i + 1
                del traj.seen[i + 1 :]
        return cut

    def _end_turn(self, seq, boundary: bool) -> None:
        """``seq`` (harvested, its turn's tokens read and trimmed) ended its turn: finish it, or pause it and start
        its handler."""
        traj = self.trajs[seq.sample]
        turn_ids = seq.tokens
        traj.ids += turn_ids
        traj.logprobs += seq.logprobs
        traj.mask += [1] * len(turn_ids)
        traj.sampled += len(turn_ids)
        traj.turns += 1
        traj.seen = []
        seq.tokens, seq.logprobs = [], []
        if not boundary:
            self._finish(seq, "length")
        elif self.turns is None:
            self._finish(seq, "stop")
        else:
            self.row_owner[seq.row] = None  # its row cache is stale when it comes back (appended tokens)
            self.sched.pause(seq)
            key = (seq.prompt, seq.sample % self.params.n)
            self.awaiting[key] = seq
            self.turns.start(key, list(turn_ids), self.e.tokenizer.decode(turn_ids))

    def _finish(self, seq, reason: str) -> None:
        traj = self.trajs.pop(seq.sample)
        p, n = seq.prompt, self.params.n
        self.results[p][seq.sample % n] = Completion(traj.ids, traj.logprobs, reason, traj.mask, traj.turns)
        self.sched.finish(seq)
        self.unfinished[p] -= 1
        if self.unfinished[p] == 0 and self.on_group_done is not None:
            self.on_group_done(p, self.results[p])

    def _poll_turns(self) -> None:
        """Take the handler's answers: blocking only when nothing decodes and nothing waits for admission."""
        sched = self.sched
        idle = not sched.rows and not sched.waiting and not sched.resuming
        got = self.turns.ready(block=idle)
        if idle and not got:
            raise RuntimeError(f"turns.ready(block=True) returned no result while {len(self.awaiting)} samples wait")
        for key, result in got:
            self._take_result(key, result)

    def _take_result(self, key, result: TurnResult) -> None:
        seq = self.awaiting.pop(tuple(key), None)
        if seq is None:
            raise ValueError(f"turns.ready returned a result for {key!r}, which is not waiting for one")
        if not isinstance(result, TurnResult):
            raise ValueError(f"turns.ready must return TurnResult answers, got {type(result).__name__} for {key}")
        traj = self.trajs[seq.sample]
        if result.finish is not None:
            if result.finish not in HANDLER_FINISH_REASONS:
                raise ValueError(f"TurnResult.finish for {key} must be one of {HANDLER_FINISH_REASONS} or None, "
                                 f"got {result.finish!r}")
            self._finish(seq, result.finish)
            return
        if traj.turns >= self.params.max_turns:
            self._finish(seq, "max_turns")
            return
        ids = list(result.append_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.e.vocab_size for t in ids):
            raise ValueError(f"TurnResult.append_ids for {key} must be token ids in [0, {self.e.vocab_size})")
        total = seq.prompt_len + len(traj.ids) + len(ids)
        if total + 1 > self.max_context:  # no room for one more sampled token
            self._finish(seq, "length")
            return
        if result.stop_strings is not None:
            strings = tuple(result.stop_strings)
            if not all(isinstance(s, str) and s for s in strings):
                raise ValueError(f"TurnResult.stop_strings for {key} must be non-empty strings, got {strings!r}")
            traj.stop_strings = strings
            self.watch_stops = self.watch_stops or bool(strings)
        traj.ids += ids
        traj.logprobs += [0.0] * len(ids)
        traj.mask += [0] * len(ids)
        self.stats["re_prefill_tokens"] += total  # what prefilling the whole conversation again would cost
        self.sched.resume(seq, len(ids), min(self.params.max_new_tokens, self.max_context - total))
